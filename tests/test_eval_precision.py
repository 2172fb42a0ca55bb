"""`eval --precision bf16`: CPU only, recorded in eval.json and said in eval.md; scores near fp32."""

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
    assert Config(model="m").precision == "fp32"  # the default: fp32 unless asked


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
