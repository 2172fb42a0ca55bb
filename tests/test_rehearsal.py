"""launch/slurm/rehearse.py: README's "On a GPU cluster" read and localised by rules that must all still
match, guide.md's copy of the sequence the same, and the tiny rehearsal run as real SLURM jobs."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import REPO, cluster_env

SCRIPT = REPO / "launch" / "slurm" / "rehearse.py"


@pytest.fixture(scope="module")
def rehearse(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("rehearse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "rehearse", module)  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        yield module


def readme_block(rehearse, page: Path = REPO / "README.md") -> list[str]:
    return rehearse.cluster_block(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("form", ["FULL", "TINY"])
def test_every_rule_finds_its_text_and_no_gpu_request_is_left(rehearse, tmp_path, form):
    form = getattr(rehearse, form)
    teacher = str(tmp_path / "models" / "e5-small") if form is rehearse.TINY else None
    commands = rehearse.localise(readme_block(rehearse), rehearse.rules(form, tmp_path, ["c.txt"], teacher))
    text = "\n".join(commands)
    for gone in ("gpu", "cuda", "runs/cluster", "--nodes=2", "/shared/", "setup.sh", "-7 "):
        assert gone not in text, f"{gone!r} left in the localised commands:\n{text}"
    pretrain = next(c for c in commands if "pretrain.sbatch" in c)
    assert "--config launch/configs/default.yaml" in pretrain and "--train.device=cpu" in pretrain
    assert f"--train.max_samples={form.batch * form.steps}" in pretrain and "--ntasks-per-node=2" in pretrain
    assert sum("--dependency=afterok:" in c for c in commands) == 8  # the chain: every job after another


def test_a_readme_line_no_rule_matches_stops_the_rehearsal(rehearse, tmp_path):
    commands = [c.replace("--gres=gpu:1", "--gres=gpu:a100:1") for c in readme_block(rehearse)]
    message = r"README's cluster block changed: no text for the rule\(s\) '--gres=gpu:1\\\\b' \(no GPU\)"
    with pytest.raises(rehearse.RehearsalError, match=message):
        rehearse.localise(commands, rehearse.rules(rehearse.FULL, tmp_path, ["c.txt"], None))


def test_the_guide_shows_the_readme_sequence(rehearse):
    assert readme_block(rehearse, REPO / "docs" / "guide.md") == readme_block(rehearse)


@pytest.mark.slurm
@pytest.mark.slow
def test_the_readme_sequence_runs_as_slurm_jobs(tmp_path):
    """The tiny form: every job COMPLETED, the export loads in sentence-transformers, one process gives
    the same avg5, and a rank killed mid-run is requeued and ends with the same weights."""
    out = tmp_path / "rehearsal"
    env = {**cluster_env(), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--tiny"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "rehearsal.json").read_text())
    names = {"preprocess", "augment", "pipeline", "teacher", "tokenize", "pretrain"}
    assert {j["JobName"] for j in result["jobs"]} == names
    assert all(j["JobState"] == "COMPLETED" for j in result["jobs"]), result["jobs"]
    assert result["st_min_cosine"] > 0.999
    assert abs(result["avg5"]["slurm, 2 ranks"] - result["avg5"]["one process"]) <= 0.3
    assert result["kill"]["restarts"] == 1 and result["kill"]["resumed_from"].startswith("step-")
    assert result["sha256"]["uninterrupted"] == result["sha256"]["killed and requeued"]
    report = [sys.executable, str(REPO / "benchmarks" / "cluster_rehearsal.py"), "report", "--out", str(out)]
    tables = subprocess.run(report, capture_output=True, text=True, check=True).stdout
    assert re.search(r"\| \d+ \| pretrain \| COMPLETED \| 0 \|", tables) and "killed and requeued" in tables
    assert "[pretrain.sbatch] training exited with status 0" in tables  # the last line of its log


def test_the_lr_check_accumulates_large_batches_and_reports_each_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("cluster_lr", REPO / "benchmarks" / "cluster_lr.py")
    lr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lr)
    small = lr.command(tmp_path, tmp_path, 256, "1e-3", 51200, 25, 256)
    large = lr.command(tmp_path, tmp_path, 2048, "2e-3", 51200, 5, 256)
    assert not any("grad_accum" in a for a in small) and "--train.grad_accum_steps=8" in large
    assert "--optim.warmup_steps=6" in small and "--train.max_samples=51200" in large
    run = tmp_path / "b2048_lr2e-3"
    run.mkdir()
    records = [{"event": "eval", "step": 0, "sts_b_valid_spearman": 71.6}, {"step": 5, "loss": 0.1},
               {"event": "eval", "step": 5, "sts_b_valid_spearman": 75.25}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "| 2,048 | 2e-3 | 0: 71.60 / 5: 75.25 | 75.25 (step 5) | no |" in lr.report(tmp_path)
