"""launch/slurm/rehearse.py: README's "On a GPU cluster" read and localised by rules that must all still
match, guide.md's copy of the sequence the same, and the tiny rehearsal run as real SLURM jobs."""

from __future__ import annotations

import importlib.util
import json
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
