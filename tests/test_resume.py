"""Exact resume of the real training loop: kill -9 at a random step, a different world size, SLURM requeue.

Every run is the debug config on tiny shards with the queue, a momentum encoder and EDA variants on,
started through launch/pretrain.py by a small driver that also records the sample ids each rank
consumes at each step (``RUN/ids-rank{r}.txt``: ``step id id ...``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from _train_data import make_shards
from slurm_cluster import cluster_env, job_info, sbatch, wait_for_job, wait_for_start

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "launch" / "configs" / "debug.yaml"
STEPS = 12  # 96 samples / global batch 16 = 6 steps per epoch: the runs cross an epoch boundary
pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path

    sys.path.insert(0, sys.argv[1])  # launch/: the script, not the package (that is installed)
    import pretrain

    argv = sys.argv[2:]
    run_dir = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("--run_dir=")))

    def record_ids(t, batch):  # the trainer's hook, called with each batch before its step
        rank = int(os.environ.get("RANK", "0"))
        with open(run_dir / f"ids-rank{rank}.txt", "a") as f:
            f.write(f"{t.state.step + 1} " + " ".join(str(i) for i in batch.ids.tolist()) + "\\n")

    pretrain.exit_process(pretrain.main(argv, on_batch=record_ids))  # as the script's own entry
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    shards = root / "shards"
    ids = make_shards(shards, [[40, 24], [32]], num_variants=2)
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    return {"root": root, "shards": shards, "ids": ids, "driver": driver}


def env() -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
    out.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    return out


BUCKETING = ["--data.length_bucketing=true", "--data.bucket_window=2"]  # 3 windows of 2 batches per epoch
PLAIN = ["--data.length_bucketing=false"]  # seeded random batches (bucketing is the default)


def train_args(setup, run_dir: Path, steps: int = STEPS) -> list[str]:
    return [
        "--config",
        str(DEBUG),
        f"--data.shards={setup['shards']}",
        f"--run_dir={run_dir}",
        f"--train.max_steps={steps}",
        "--checkpoint.every_steps=2",
        "--loss=[{luse: {temperature: 0.05, queue_size: 32, momentum: 0.9}}]",
        "--train.eval_max_pairs=32",
        "--train.debug_dump",
    ]


def torchrun(setup, run_dir: Path, nproc: int = 2, steps: int = STEPS) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),  # not 0: torchrun's port-0 rendezvous hung here under load
        str(setup["driver"]),
        str(REPO / "launch"),
        *train_args(setup, run_dir, steps),
    ]


def run_to_end(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out.setdefault(record["step"], []).append(record["loss"])
    return out


def dumps(run_dir: Path, world: int) -> list[dict]:
    return [json.loads((run_dir / "debug" / f"rank{r}.json").read_text()) for r in range(world)]


def consumed(run_dir: Path) -> dict[int, list[int]]:
    """step -> the global batch's ids, ranks concatenated in rank order (the last attempt's record)."""
    per_rank: dict[int, dict[int, list[int]]] = {}
    for path in sorted(run_dir.glob("ids-rank*.txt")):
        rank = int(path.stem.removeprefix("ids-rank"))
        for line in path.read_text().splitlines():
            step, *ids = (int(x) for x in line.split())
            per_rank.setdefault(step, {})[rank] = ids  # a step redone after a resume overwrites
    return {step: [i for r in sorted(ranks) for i in ranks[r]] for step, ranks in sorted(per_rank.items())}


# The reference runs keep every checkpoint (harmless: intervals and retention are not part of the run), so
# that a test can start from the state a run stopped after step k leaves (stopped_after) without paying a
# process launch for a run of k steps.
KEEP_ALL = f"--checkpoint.keep_last={STEPS // 2}"


@pytest.fixture(scope="module")
def uninterrupted(setup):
    run_dir = setup["root"] / "uninterrupted"
    run_to_end([*torchrun(setup, run_dir), *PLAIN, KEEP_ALL])
    return {"dir": run_dir, "losses": losses(run_dir), "dumps": dumps(run_dir, 2), "ids": consumed(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted_bucketed(setup):
    run_dir = setup["root"] / "uninterrupted-bucketed"
    run_to_end([*torchrun(setup, run_dir), *BUCKETING, KEEP_ALL])
    return {"dir": run_dir, "losses": losses(run_dir), "dumps": dumps(run_dir, 2), "ids": consumed(run_dir)}


def stopped_after(reference: Path, run_dir: Path, step: int) -> None:
    """Make ``run_dir`` what a run stopped after ``step`` leaves: the reference run's checkpoint of that
    step, and its metrics and recorded sample ids up to that step."""
    name = f"step-{step:08d}"
    shutil.copytree(reference / "checkpoints" / name, run_dir / "checkpoints" / name)
    for path in [reference / "metrics.jsonl", *reference.glob("ids-rank*.txt")]:
        if path.suffix == ".jsonl":
            kept = [x for x in path.read_text().splitlines() if json.loads(x).get("step", 0) <= step]
        else:
            kept = [x for x in path.read_text().splitlines() if int(x.split()[0]) <= step]
        (run_dir / path.name).write_text("".join(x + "\n" for x in kept))


def assert_same_run(run_dir: Path, reference: dict) -> None:
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():  # steps redone after the resume repeat the same loss too
        assert all(v == reference["losses"][step][0] for v in values), (
            step,
            values,
            reference["losses"][step],
        )
    for mine, ref in zip(dumps(run_dir, 2), reference["dumps"], strict=True):
        assert mine["step"] == STEPS and mine["samples_seen"] == ref["samples_seen"]
        assert mine["cursor"] == ref["cursor"]
        assert mine["param_checksum"] == ref["param_checksum"]  # bitwise identical parameters
        assert mine["queue_checksum"] == ref["queue_checksum"]


def wait_for_step(
    run_dir: Path, step: int, proc: subprocess.Popen | None = None, timeout: float = 300
) -> int:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines() if '"loss"' in x]
            if steps and max(steps) >= step:
                return max(steps)
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"training exited with {proc.returncode} before step {step}")
        time.sleep(0.05)
    raise AssertionError(f"training did not reach step {step} in {timeout} s")


def kill9_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank (torchrun starts its workers in their own sessions)."""
    parent = psutil.Process(proc.pid)
    victims = [parent, *parent.children(recursive=True)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=60)
    proc.wait(timeout=60)


@pytest.mark.parametrize("bucketing", [False, True], ids=["plain", "bucketed"])
def test_kill9_at_a_random_step_then_rerun_is_exact(setup, request, bucketing):
    reference = request.getfixturevalue("uninterrupted_bucketed" if bucketing else "uninterrupted")
    seed = int(os.environ.get("RESUME_TEST_SEED", time.time_ns() % 10_000))
    kill_at = random.Random(seed).randint(3, STEPS - 3)
    print(f"killing at step {kill_at} (RESUME_TEST_SEED={seed})")
    run_dir = setup["root"] / f"killed-{seed}-{'bucketed' if bucketing else 'plain'}"
    cmd = [*torchrun(setup, run_dir), *(BUCKETING if bucketing else PLAIN)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        reached = wait_for_step(run_dir, kill_at, proc)
    finally:
        kill9_tree(proc)
    assert reached < STEPS and not (run_dir / "model").exists(), "the run finished before the kill"
    resumed = run_to_end(cmd)
    saved_before = reached - reached % 2
    assert f"resumed from {run_dir / 'checkpoints'}" in resumed.stderr
    assert any(f"step-{s:08d}" in resumed.stderr for s in (saved_before, saved_before + 2)), resumed.stderr[
        -3000:
    ]
    assert_same_run(run_dir, reference)


@pytest.mark.parametrize("bucketing", [False, True], ids=["plain", "bucketed"])
def test_resume_at_another_world_size_consumes_every_sample_once(setup, request, bucketing):
    uninterrupted = request.getfixturevalue("uninterrupted_bucketed" if bucketing else "uninterrupted")
    extra = BUCKETING if bucketing else PLAIN
    run_dir = setup["root"] / f"two-then-one-{'bucketed' if bucketing else 'plain'}"
    stopped_after(uninterrupted["dir"], run_dir, 4)  # two processes for 4 steps (their checkpoint) ...
    resumed = run_to_end([*torchrun(setup, run_dir, nproc=1, steps=STEPS), *extra])  # ... then one process
    assert "is resumed by 1" in resumed.stderr  # the warning that RNG streams start afresh
    got = consumed(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    # Every step consumed the same global batch as the uninterrupted two-process run, in order...
    assert got == uninterrupted["ids"]
    # ... so each epoch (6 steps of 16) holds every sample exactly once, none repeated or skipped.
    for epoch in range(2):
        seen = [i for step in range(1 + 6 * epoch, 7 + 6 * epoch) for i in got[step]]
        assert len(seen) == len(set(seen)) == len(setup["ids"])
        assert sorted(seen) == sorted(i if i < 2**63 else i - 2**64 for i in setup["ids"])
    dump = dumps(run_dir, 1)[0]
    assert dump["world_size"] == 1 and dump["step"] == STEPS
    assert dump["cursor"]["bucket_window"] == (2 if bucketing else 0)
    assert dump["samples_seen"] == uninterrupted["dumps"][0]["samples_seen"]


@pytest.mark.slurm
def test_slurm_usr1_requeue_resume_equals_uninterrupted(setup, uninterrupted):
    slurm_env = cluster_env()
    run_dir = setup["root"] / "slurm"
    log = setup["root"] / "slurm.out"
    job_env = {**slurm_env, **env(), "PYTHON": sys.executable, "PRETRAIN": str(setup["driver"])}
    job = sbatch(
        job_env,
        "--ntasks-per-node=2",
        f"--chdir={REPO}",
        f"--output={log}",
        "--job-name=resume-e2e",
        str(REPO / "launch" / "slurm" / "pretrain.sbatch"),
        str(REPO / "launch"),  # the driver's first argument, then the training arguments
        *train_args(setup, run_dir),
        *PLAIN,
    )
    try:
        wait_for_start(job_env, job)
        signalled_at = wait_for_step(run_dir, 3, timeout=300)
    except AssertionError:
        raise AssertionError(f"{job_info(job_env, job)}\n{log.read_text() if log.exists() else ''}") from None
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=job_env, check=True)
    info = wait_for_job(job_env, job, timeout=600, log=log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    assert "exited with status 75" in text and "requeueing" in text
    assert signalled_at < STEPS, "the job finished before the signal"
    assert_same_run(run_dir, uninterrupted)


ZERO2 = ["--train.deepspeed_config=launch/deepspeed/zero2.json"]


@pytest.fixture(scope="module")
def zero2_reference(setup) -> Path:
    """A two-process DeepSpeed ZeRO-2 run of 4 steps; it keeps its checkpoints of steps 2 and 4."""
    run_dir = setup["root"] / "zero2-full"
    run_to_end([*torchrun(setup, run_dir, steps=4), *ZERO2])
    return run_dir


def test_two_process_deepspeed_zero2_run_keeps_ranks_identical(zero2_reference):
    """(Was in tests/test_launch.py with a run of its own: the resume test below needs this run anyway.)"""
    rank0, rank1 = dumps(zero2_reference, 2)
    assert rank0["param_checksum"] == rank1["param_checksum"]
    assert rank0["queue_checksum"] == rank1["queue_checksum"]
    got = losses(zero2_reference)
    assert sorted(got) == [1, 2, 3, 4] and all(len(v) == 1 and v[0] == v[0] for v in got.values()), got


def test_deepspeed_zero2_resume_is_exact(setup, zero2_reference):
    reference = zero2_reference
    run_dir = setup["root"] / "zero2-resumed"
    stopped_after(reference, run_dir, 2)
    resumed = run_to_end([*torchrun(setup, run_dir, steps=4), *ZERO2])
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000002'}" in resumed.stderr
    assert losses(run_dir) == losses(reference)
    for mine, ref in zip(dumps(run_dir, 2), dumps(reference, 2), strict=True):
        assert mine["param_checksum"] == ref["param_checksum"]
        assert mine["queue_checksum"] == ref["queue_checksum"]
    # A different process count is refused: tests/test_checkpoint.py checks that message without DeepSpeed.
