"""Every script of benchmarks/ runs end to end at tiny sizes (seconds each): a smoke test, not a figure.

Each case runs the script's ``main`` in this process, as ``python benchmarks/X.py ARGS`` would (its
folder first on ``sys.path``), on tiny shards and a 2-layer model built here, and checks what it
printed. The figures in docs/BENCHMARKS.md come from the full sizes on the commands written there.
Scripts owned by other work in progress (faults, gpu_throughput, train_throughput, pairs_*) have their
own tests or none here. Cases over ~20 s on a quiet machine are marked ``slow``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
from _tiny_models import build_char_encoder
from _train_data import make_shards, with_teacher

from pipeline.resources import SAMPLE_CORPUS, sample_sentences

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *argv: str, capsys, monkeypatch) -> str:
    """``python benchmarks/NAME.py ARGV`` in this process; its stdout (a non-zero exit fails)."""
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / f"{name}.py"), *argv])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        runpy.run_path(str(BENCHMARKS / f"{name}.py"), run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), f"{name} exited {exc.code}"
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bench_shards")
    make_shards(directory, [[48], [48]], num_variants=2)
    return directory


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    texts = sample_sentences(400)
    return build_char_encoder(tmp_path_factory.mktemp("bench_model") / "model", texts, 32, 64, 64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench_corpus") / "corpus.txt"
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:200]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- no data, no model
def test_cpu_attention(capsys, monkeypatch):
    out = run_script("cpu_attention", "--threads", "1", "--batch", "2", "--heads", "2", "--head_dim", "8",
                     "--lengths", "8", "--repeats", "1", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    rows = [
        line.strip("| ").split(" | ")
        for line in out.splitlines()
        if line.startswith(("| bfloat16", "| float32"))
    ]
    assert len(rows) == 4 and all(float(row[-1]) > 0 for row in rows)  # 2 dtypes x 2 passes, a ratio each


def test_false_negatives(capsys, monkeypatch):
    out = run_script("false_negatives", "--batch", "4", "--views", "2", "--dim", "8", "--teacher_dim", "8",
                     "--queue", "8", "--repeats", "1", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "text_hashes_ms_per_batch" in out


def test_mining_projection(capsys, monkeypatch):
    out = run_script("mining_projection", "--n", "1000", "--queries", "10", "--dim", "8", "--k", "4",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "h100_hours_at_50pct" in out


def test_neardup(capsys, monkeypatch):
    out = run_script("neardup", "--base", "200", "--show", "1", capsys=capsys, monkeypatch=monkeypatch)
    assert "precision" in out and "recall" in out


def test_augment(capsys, monkeypatch):
    out = run_script("augment", "--sentences", "100", "--words", "300", "--dim", "8", "--top-k", "3",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "faiss speedup over numpy" in out


def test_preprocess_quality(corpus, capsys, monkeypatch):
    out = run_script("preprocess_quality", str(corpus), capsys=capsys, monkeypatch=monkeypatch)
    assert "current" in out and "kept" in out


def test_search(capsys, monkeypatch):
    out = run_script("search", "--n", "1000", "--queries", "10", "--dim", "16", "--clusters", "20",
                     "--train-size", "1000", "--nprobe", "2", "--ef-search", "8", "--hidden", "32",
                     "--fit-sentences", "100", "--eval-pairs", "20", "--reduce-dims", "8",
                     "--batch-size", "32", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "recall" in out.lower()


@pytest.mark.slow
def test_projection(tmp_path, capsys, monkeypatch):
    out = run_script("projection", "--models", "model_small", "--variant-sample", "50",
                     "--flop-sentences", "1", "--json", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert '"flops"' in out or "flops" in out


# ------------------------------------------------------------------------------ tables of runs
def test_luse_trial_prints_its_tables(tmp_path, capsys, monkeypatch):
    import json

    for arm in ("cut", "luse"):
        for seed in (1, 2):
            run = tmp_path / f"{arm}-s{seed}"
            (run / "zs").mkdir(parents=True)
            (run / "ft").mkdir()
            sts = {s: 10.0 * seed + (arm == "luse") for s in ("ATEC", "BQ", "LCQMC", "PAWSX", "STS-B")}
            (run / "zs" / "eval.json").write_text(json.dumps({"sts": {"model": sts}}), encoding="utf-8")
            regimes = {r: {"test": [50.0 + seed], "dev": [40.0 + seed]} for r in ("train", "freeze")}
            ft = {"tasks": {"afqmc": {"metric": "accuracy", "regimes": regimes}}}
            (run / "ft" / "finetune.json").write_text(json.dumps(ft), encoding="utf-8")
    out = run_script("luse_trial", str(tmp_path), "--pairs", capsys=capsys, monkeypatch=monkeypatch)
    assert "| arm | seeds |" in out and "± " in out


# ------------------------------------------------------------------------ shards and a tiny model
DEBUG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "debug.yaml"


def test_padding(shards, model, capsys, monkeypatch):
    out = run_script("padding", "--shards", str(shards), "--model", str(model), "--batch", "16",
                     "--windows", "2", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "sentences in" in out


def test_loader(shards, model, tmp_path, capsys, monkeypatch):
    from pipeline.cli import main as cli

    ids = tmp_path / "ids"
    argv = ["tokenize", f"--shards={shards}", f"--out={ids}", f"--model={model}", "--max_length=32"]
    assert cli([*argv, "--progress=false"]) == 0
    out = run_script("loader", "--shards", str(ids), "--text_shards", str(shards), "--model", str(model),
                     "--batch", "8", "--variants", "2", "--window", "2", "--samples", "64", "--repeats", "1",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert str(ids) in out


def test_loader_worker(shards, model, tmp_path, capsys, monkeypatch):
    from pipeline.cli import main as cli

    taught, ids = with_teacher(shards, tmp_path / "taught", dim=8), tmp_path / "ids"
    argv = ["tokenize", f"--shards={taught}", f"--out={ids}", f"--model={model}", "--max_length=32"]
    assert cli([*argv, "--progress=false"]) == 0
    out = run_script("loader_worker", "--shards", str(ids), "--model", str(model), "--batch", "8",
                     "--window", "2", "--samples", "40", capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "samples/s, 1 + 0 texts, batch 8" in out


def test_step_profile(shards, model, capsys, monkeypatch):
    out = run_script("step_profile", "--model", str(model), "--shards", str(shards), "--batch", "4",
                     "--max_length", "16", "--steps", "1", "--warmup", "1", "--threads", "1",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "parameters" in out


def test_teacher_int8(shards, model, tmp_path, capsys, monkeypatch):
    out = run_script("teacher_int8", "--shards", str(shards), "--model", str(model), "--sentences", "40",
                     "--workers", "1", "--repeats", "1", "--out", str(tmp_path / "t.json"),
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "fp32 / int8 per pair" in out and "cosine to fp32 over 48 sentences" in out  # the first shard


def test_step_bytes(model, capsys, monkeypatch):
    out = run_script("step_bytes", "--model", str(model), "--vocab", "200", "--layers", "0,1", "--steps", "1",
                     "--warmup", "0", "--threads", "1", "--updates", "1",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "mlm-masked" in out and "frozen" in out and "in place" in out


@pytest.mark.slow
def test_guard_cost(capsys, monkeypatch):
    out = run_script("guard_cost", "--config", str(DEBUG), "--blocks", "1", "--steps", "1",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "config debug.yaml" in out


def test_checkpoint_save_and_load(capsys, monkeypatch):
    out = run_script("checkpoint", "--config", str(DEBUG), "--repeats", "1", "--skip-preemption",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "save" in out.lower()


@pytest.mark.slow
def test_student(shards, model, tmp_path, capsys, monkeypatch):
    out = run_script("student", "--model", str(model), "--shards", str(shards), "--keep_layers", "1",
                     "--work", str(tmp_path / "work"), "--no_eval",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert out


@pytest.mark.slow
def test_quality_trains_and_scores_one_condition(shards, tmp_path, capsys, monkeypatch):
    out = run_script("quality", "--shards", str(shards), "--out", str(tmp_path / "q"),
                     "--conditions", "simcse", "--steps", "2", "--sequences", "8", "--seeds", "1",
                     "--max-pairs", "20", "--jobs", "1", "--eval-every", "2",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "unsup. SimCSE" in out


def test_scale_stages(tmp_path, capsys, monkeypatch):
    out = run_script("scale", "--sizes", "2k", "--parts", "preprocess", "--work", str(tmp_path / "w"),
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "| part | cost | unit |" in out


@pytest.mark.slow
def test_preprocess(tmp_path, capsys, monkeypatch):
    out = run_script("preprocess", "--sentences", "2000", "--rss-sizes", "1000,2000", "--workers", "1",
                     "--dir", str(tmp_path / "p"), capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "benchmark took" in out


@pytest.mark.slow
def test_finetune_cost_and_compare(model, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "ft"
    tiny = ["--tasks=[STS-B]", "--max_train=16", "--max_dev=8", "--max_test=8", "--train_lrs=[0.0001]",
            "--freeze_lrs=[0.001]", "--freeze_epochs=1", "--batch_size=8"]  # fmt: skip
    out = run_script("finetune_cost", "--model", str(model), "--out", str(out_dir), *tiny,
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "| task | regime |" in out
    out = run_script("finetune_compare", f"tiny={out_dir}", "--train-lrs", "1e-4", "--freeze-lrs", "1e-3",
                     capsys=capsys, monkeypatch=monkeypatch)  # fmt: skip
    assert "STS-B" in out and "tiny TrainBERT" in out
