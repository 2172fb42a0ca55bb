"""`eval --precision`: auto (bf16 only on a CPU with native bf16), fp32 or bf16, which is CPU only; what ran
is recorded in eval.json and a bf16 score is said in eval.md; scores near fp32."""

import json

import pytest
import torch
from test_eval_fixtures import tiny_model  # noqa: F401 (fixture)

from pipeline.cli import main
from pipeline.errors import ConfigError
from pipeline.evaluate.run import Config


def test_bf16_is_cpu_only_and_threads_positive():
    with pytest.raises(ConfigError, match="CPU autocast"):
        Config(model="m", precision="bf16", device="cuda")
    with pytest.raises(ConfigError, match="--threads"):
        Config(model="m", threads=0)
    with pytest.raises(ConfigError, match="--precision"):
        Config(model="m", precision="fp16")
    assert Config(model="m").precision == "auto"  # the default: the CPU decides (pipeline/precision.py)


@pytest.mark.parametrize(("native", "ran"), [(True, "bf16"), (False, "fp32")])
def test_auto_records_what_this_cpu_ran(tiny_model, tmp_path, monkeypatch, native, ran):  # noqa: F811
    from pipeline import precision

    monkeypatch.setattr(precision, "cpu_bf16", lambda *a, **k: precision.CpuBf16(native, "test"))
    threads, out = torch.get_num_threads(), tmp_path / "auto"
    args = ["eval", str(tiny_model), "--suite", "[sts]", "--sets", "[PAWSX]", "--max_pairs", "50"]
    try:
        assert main([*args, "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    assert (result["config"]["precision"], result["model"]["precision"]) == ("auto", ran)
    said = "Encoded under bf16 autocast on the CPU (`--precision auto`)" in (out / "eval.md").read_text()
    assert said == (ran == "bf16")


def test_bf16_eval_is_recorded_and_close_to_fp32(tiny_model, tmp_path):  # noqa: F811
    scores, threads = {}, torch.get_num_threads()
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        args = ["eval", str(tiny_model), "--suite", "[sts]", "--sets", "[STS-B, PAWSX]", "--max_pairs", "300"]
        try:
            assert main([*args, "--precision", precision, "--threads", "1", "--out", str(out)]) == 0
        finally:
            torch.set_num_threads(threads)  # --threads is process-wide
        result = json.loads((out / "eval.json").read_text(encoding="utf-8"))
        assert result["model"]["precision"] == result["config"]["precision"] == precision
        said = "--precision bf16" in (out / "eval.md").read_text(encoding="utf-8")
        assert said == (precision == "bf16")
        scores[precision] = result["sts"]["model"]
    for name in ("STS-B", "PAWSX"):
        assert scores["bf16"][name] == pytest.approx(scores["fp32"][name], abs=1.0)  # a random tiny model
