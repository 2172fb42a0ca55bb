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


def test_smoke_run_records_every_section(prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the script sets it, as training does
    out = tmp_path / "smoke.json"
    argv = ["run", "--smoke", "--data", str(prepared), "--out", str(out), "--batches", "8",
            "--detail_batch", "8", "--workers", "1", "--warmup", "1", "--steps", "2", "--profile_steps", "1",
            "--sync_steps", "2", "--loader_workers", "0", "1", "--loader_batch", "16",
            "--loader_repeats", "1", "--compile", "default", "--unpadded", "--budget_s", "0",
            "--variant=pad8 --train.pad_to_multiple_of=8 sdp=no_cudnn",
            "--variant=bad --train.no_such_field=1"]  # fmt: skip
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
        assert len(step["host_step_ms_each"]) == len(step["padded_length_each"]) == 2
        assert len(step["warmup_padded_length_each"]) == 1
        assert max(step["padded_length_each"]) <= length
        assert "needs CUDA" in step["sync_debug"]["skipped"]
        for label in ("compile=default", "unpadded"):  # recorded either way: measured or not available
            record = sections[f"{label}/{model}/b8"]
            assert "sequences_per_s" in record or "not available" in record.get("skipped", ""), record
        padded8 = sections[f"pad8/{model}/b8"]  # a --variant: its overrides and SDPA switches applied
        assert padded8["overrides"] == ["--train.pad_to_multiple_of=8"]
        assert padded8["sdp_off"] == ["cudnn_sdp"]
        assert all(n % 8 == 0 for n in padded8["padded_length_each"]), padded8["padded_length_each"]
        assert "no_such_field" in sections[f"bad/{model}/b8"]["skipped"]
    with benchmark_module("gpu_step") as gpu_step:  # the markdown report of that JSON
        assert gpu_step.main(["report", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| section | padded width |")
    timed = {name for name, r in sections.items() if isinstance(r, dict) and "step_ms_wall" in r}
    assert {line.split(" | ")[0][2:] for line in lines[2:]} == timed  # a row for each timed step section
    assert {"step/student/b8", "step/e5-small/b8", "pad8/student/b8", "pad8/e5-small/b8"} <= timed


def test_report_counts_the_slow_steps_apart():
    """Steps over 3x the median (cuDNN attention plans for a new width, recompiles) are counted apart
    from the median step; a record without CUDA spans (CPU) has none to count."""
    with benchmark_module("gpu_step") as gpu_step:
        record = {"step_ms_wall": 50.0, "tflops_padded": 2.0, "padded_length_median": 32, "batch": 1024,
                  "sequences_per_s": 20000.0, "sections_ms_median": {"step": 12.0},
                  "step_span_ms_each": [100.0, 10.0, 12.0, 90.0, 11.0],
                  "padded_length_each": [16, 16, 32, 48, 32], "overrides": []}  # fmt: skip
        result = {"nominal_bf16_tflops": 1000.0, "sections": {
            "cuda": record, "cpu": {**record, "step_span_ms_each": None}}}  # fmt: skip
        cuda, cpu = gpu_step.report_rows(result)
    assert cuda[3] == "2, up to 100" and cpu[3] == "—"  # 100 and 90 ms over 3 x 12 ms
    assert cuda[4:8] == ["12.0", "85,333", "8", "0.8 %"]  # 1024 / 12 ms; 2 TFLOPS x 50 ms / 12 ms


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
