"""benchmarks/gpu_step.py end to end on CPU: ``prepare`` on the bundled corpus with a tiny model built here
(the stages' own commands), then ``run --smoke``; its JSON has every section, each a measurement or a
recorded reason, never a crash. And benchmarks/loader_rates.py on the same folder. A smoke test, not a
figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _scripts import benchmark_module
from _tiny_models import build_char_encoder

from pipeline.resources import sample_sentences

PREFIX = "问："


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu_step")
    tiny = build_char_encoder(
        root / "tiny", sample_sentences(3000) + [PREFIX], 32, 64, 160, 0, max_length=128, prefix=PREFIX
    )
    with benchmark_module("gpu_step") as gpu_step:
        argv = ["prepare", "--out", str(root / "data"), "--model", str(tiny), "--student", str(tiny)]
        assert gpu_step.main([*argv, "--lines", "120", "120", "--lengths", "24", "32"]) == 0
    return root / "data"


def test_prepare_writes_the_folder_to_carry(prepared):
    for name in ("teacher", "tok_student", "tok_e5"):
        assert (prepared / name / "manifest.json").is_file()
    for name in ("student", "e5-small"):
        folder = prepared / "models" / name
        assert (folder / "config.json").is_file() and not (folder / "model.safetensors").exists()
    tokenizer = json.loads((prepared / "tok_e5" / "manifest.json").read_text())["tokenizer"]
    assert tokenizer["max_length"] == 32


def test_smoke_run_records_every_section(prepared, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the script sets it, as training does
    out = tmp_path / "smoke.json"
    argv = ["run", "--smoke", "--data", str(prepared), "--out", str(out), "--batches", "8",
            "--detail_batch", "8", "--workers", "1", "--warmup", "1", "--steps", "2", "--profile_steps", "1",
            "--sync_steps", "2", "--loader_workers", "0", "1", "--loader_batch", "16",
            "--loader_repeats", "1", "--compile", "default", "--unpadded", "--budget_s", "120"]  # fmt: skip
    with benchmark_module("gpu_step") as gpu_step:
        assert gpu_step.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["smoke"] and result["nominal_bf16_tflops"] is None
    sections = result["sections"]
    gemm = sections["gemm"]["by_tokens"]
    assert set(gemm) == {str(8 * 24), str(8 * 32)}  # batch x each max_length (smoke: no other widths)
    assert {"qkv", "attention_out", "ffn_up", "ffn_down", "layer_mix"} <= set(gemm[str(8 * 24)])
    cells = sections["loader"]["cells"]
    assert [c["workers"] for c in cells] == [0, 1, 0, 1]  # on the fly, then stored ids
    assert all(c["sequences_per_s"] > 0 and c["teacher"] for c in cells)
    for model, length in (("student", 24), ("e5-small", 32)):
        step = sections[f"step/{model}/b8"]
        assert "error" not in step, step
        assert step["max_length"] == length and step["loader_workers"] == 1 and step["steps"] == 2
        assert step["sequences"] == 2 * 8 and step["sequences_per_s"] > 0
        assert 0 < step["real_over_padded_tokens"] <= 1
        assert step["tflops_padded"] >= step["tflops_real"] > 0
        assert "random" in step["weights"] and step["gemm_tokens"]["measured_nearest"] in (8 * 24, 8 * 32)
        assert step["profile"]["aten_ops_per_step"] > 0
        assert "needs CUDA" in step["sync_debug"]["skipped"]
        for label in ("compile=default", "unpadded"):  # recorded either way: measured or not available
            record = sections[f"{label}/{model}/b8"]
            assert "sequences_per_s" in record or "not available" in record.get("skipped", ""), record


def test_loader_rates_on_the_prepared_folder(prepared, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    out = tmp_path / "loader.json"
    with benchmark_module("loader_rates") as loader_rates:
        argv = ["--data", str(prepared), "--batch", "16", "--workers", "0", "2", "--repeats", "1"]
        assert loader_rates.main([*argv, "--out", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 2 * 2 * 2 * 2  # input x workers x pin x teacher
    for c in cells:
        if c["pin_memory"]:
            assert c["error"].startswith("not available")
        else:
            assert c["sequences_per_s"] > 0 and c["pretokenized"] == (c["input"] == "pad stored ids")
    assert "| pad stored ids | 2 | False | True |" in capsys.readouterr().out
