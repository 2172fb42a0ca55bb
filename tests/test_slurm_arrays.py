"""launch/slurm/preprocess.sbatch and augment.sbatch as real SLURM array jobs: output equal to a local run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import REPO, array_states, cluster_env, sbatch, wait_for_job

from pipeline.resources import SAMPLE_CORPUS

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SMALL = ["--sentences_per_shard=200", "--rows_per_block=50"]


@pytest.fixture
def slurm_env() -> dict[str, str]:
    return {**cluster_env(), "PYTHON": sys.executable, "PIPELINE_REPO": str(REPO), "OMP_NUM_THREADS": "1"}


def outputs(directory: Path) -> dict[str, bytes]:
    """Every file of a stage's output (manifest and shards), work directories excluded."""
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def small_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:600]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def local_preprocess(corpus: Path, out: Path) -> None:
    cmd = [sys.executable, "-m", "pipeline", "preprocess", str(corpus), f"--out={out}", *SMALL]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_preprocess_array_job_equals_local_run(slurm_env, tmp_path):
    corpus = small_corpus(tmp_path)
    local_preprocess(corpus, tmp_path / "local")
    out = tmp_path / "slurm"
    submit = subprocess.run(
        [
            "bash",
            str(REPO / "launch" / "slurm" / "preprocess.sbatch"),
            "submit",
            str(out),
            str(corpus),
            *SMALL,
        ],
        env={**slurm_env, "TASKS": "2"},
        capture_output=True,
        text=True,
        cwd=tmp_path,  # the jobs' logs land here, not in the repository
    )
    assert submit.returncode == 0, submit.stderr
    jobs = dict(re.findall(r"(\w+)=(\d+)", submit.stdout))
    assert set(jobs) == {"split", "dedup", "shards", "finalize"}, submit.stdout
    for phase in ("split", "dedup", "shards", "finalize"):
        wait_for_job(slurm_env, jobs[phase], timeout=300)
        states = array_states(slurm_env, jobs[phase])
        logs = "\n".join(p.read_text()[-1500:] for p in tmp_path.glob("preprocess-*.out"))
        assert states and set(states) == {"COMPLETED"}, f"{phase}: {states}\n{logs}"
    assert len(array_states(slurm_env, jobs["split"])) == 2  # really an array of two tasks
    local, remote = outputs(tmp_path / "local"), outputs(out)
    assert len([n for n in local if n.startswith("shard-")]) >= 2
    assert local.keys() == remote.keys()
    for name in local:
        assert local[name] == remote[name], f"{name} differs between the local run and the array job"


def test_augment_array_job_equals_local_run(slurm_env, tmp_path):
    corpus = small_corpus(tmp_path)
    shards = tmp_path / "pre"
    local_preprocess(corpus, shards)
    local = tmp_path / "aug-local"
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        "augment",
        f"--shards={shards}",
        f"--out={local}",
        "--progress=false",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "aug-slurm"
    log = tmp_path / "augment-%A_%a.out"
    job = sbatch(
        slurm_env,
        "--array=0-1",
        "--cpus-per-task=1",
        f"--chdir={REPO}",
        f"--output={log}",
        str(REPO / "launch" / "slurm" / "augment.sbatch"),
        str(shards),
        str(out),
    )
    wait_for_job(slurm_env, job, timeout=300)
    states = array_states(slurm_env, job)
    logs = "\n".join(p.read_text()[-1500:] for p in tmp_path.glob("augment-*.out"))
    assert states == ["COMPLETED", "COMPLETED"], f"{states}\n{logs}"
    a, b = outputs(local), outputs(out)
    assert a.keys() == b.keys() and "manifest.json" in a
    for name in a:
        assert a[name] == b[name], f"{name} differs between the local run and the array job"
