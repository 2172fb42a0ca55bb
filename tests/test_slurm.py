"""launch/slurm/pretrain.sbatch on a real (local) SLURM: signal forwarding, checkpoint, requeue, resume;
requeue after a crash, its limit and the crash-loop stop; the no-GPU guard.

Most tests use a small stand-in trainer with the real checkpointer, signal handler and process group,
so the job mechanics are tested in seconds; one runs the real trainer (debug config) through a kill -9
of one rank, and tests/test_resume.py runs more of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from _train_data import make_shards
from slurm_cluster import REPO, cluster_env, job_info, sbatch, wait_for_job, wait_for_start

pytestmark = pytest.mark.slurm


@pytest.fixture
def slurm_env() -> dict[str, str]:
    return cluster_env()


STEPS = 30
# x <- 1.01 x + sum over ranks of a draw from each rank's own torch RNG: the final x is exact only if
# every rank's random stream and the shared state are restored exactly after the requeue.
# Knobs (environment): FAKE_EXIT=N exits N at once; FAKE_CKPT_EVERY=K saves a checkpoint every K steps;
# FAKE_CRASH_AFTER=S makes rank 1 SIGKILL itself S steps after each (re)start.
FAKE_TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from pipeline import distributed
    from pipeline.train.checkpoint import Checkpointer
    from pipeline.train.rng import RNGState
    from pipeline.train.signals import EXIT_CODE_PREEMPTED, PreemptionHandler

    class Model:
        def __init__(self): self.backbone = torch.nn.Linear(2, 2)
        def save_pretrained(self, d):
            Path(d).mkdir(parents=True, exist_ok=True)
            save_file(self.backbone.state_dict(), str(Path(d) / "model.safetensors"))

    class State:
        def __init__(self): self.step, self.x = 0, torch.ones((), dtype=torch.float64)
        def state_dict(self): return {"step": self.step, "x": self.x}
        def load_state_dict(self, s): self.step, self.x = s["step"], s["x"]

    run, steps = Path(sys.argv[1]), int(sys.argv[2])
    if int(os.environ.get("FAKE_EXIT", "0")):
        print("error: a configuration mistake (the fake trainer's)", file=sys.stderr)
        sys.exit(int(os.environ["FAKE_EXIT"]))
    ckpt_every = int(os.environ.get("FAKE_CKPT_EVERY", "0"))
    crash_after = int(os.environ.get("FAKE_CRASH_AFTER", "0"))
    dist.init_process_group("gloo")  # env:// from the variables pretrain.sbatch exports
    rank = dist.get_rank()
    handler = PreemptionHandler().install()
    model, state, ckpt = Model(), State(), Checkpointer(run)
    torch.manual_seed(rank)  # after Model(), whose init draws from the same generator
    latest = ckpt.latest()
    if latest is not None:
        ckpt.load(latest, model, {"state": state}, {"rng": RNGState()})
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    start = state.step
    while state.step < steps:
        draw = torch.rand((), dtype=torch.float64)
        state.x = 1.01 * state.x + distributed.all_reduce_sum(draw)
        state.step += 1
        if rank == 0:
            with open(run / "progress.txt", "a") as f:
                f.write(f"{state.step} {restarts}\\n")
        time.sleep(0.3)
        if ckpt_every and state.step % ckpt_every == 0:
            ckpt.save(state.step, model, {"state": state}, {"rng": RNGState()}, {"steps": steps})
        if crash_after and rank == 1 and state.step == start + crash_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if handler.should_stop():
            ckpt.save(state.step, model, {"state": state}, {"rng": RNGState()}, {"steps": steps})
            distributed.shutdown()  # as Trainer.close(): a live gloo group aborts the exit (134)
            sys.exit(EXIT_CODE_PREEMPTED)
    if rank == 0:
        (run / "result.json").write_text(json.dumps({"x": float(state.x), "restarts": restarts}))
    distributed.shutdown()
    """
)


def expected_x(steps: int, world: int) -> float:
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    x = torch.ones((), dtype=torch.float64)
    for _ in range(steps):
        x = 1.01 * x + sum(torch.rand((), dtype=torch.float64, generator=g) for g in gens)
    return float(x)


def test_generated_config_uses_the_required_plugins(slurm_env):
    conf = Path(slurm_env["SLURM_CONF"]).read_text()
    for line in (
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "AuthInfo=cred_expire=5",
        "NodeName=localhost NodeAddr=127.0.0.1",
    ):
        assert line in conf
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=slurm_env, capture_output=True, text=True)
    assert out.stdout.strip() in ("idle", "mixed", "allocated")


@pytest.mark.slow
def test_usr1_checkpoints_requeues_and_resumes_exactly(slurm_env, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    log = tmp_path / "job.out"
    env = {**slurm_env, "PYTHON": sys.executable, "PRETRAIN": str(trainer), "OMP_NUM_THREADS": "1"}
    env.update(ALLOW_CPU="1", RUN_DIR=str(run))
    job = sbatch(
        env,
        "--ntasks-per-node=2",
        f"--chdir={REPO}",
        f"--output={log}",
        "--job-name=ft-requeue",
        str(REPO / "launch" / "slurm" / "pretrain.sbatch"),
        str(run),
        str(STEPS),
    )
    progress = run / "progress.txt"
    wait_for_start(env, job)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        progress.exists() and len(progress.read_text().split("\n")) > 5
    ):
        time.sleep(0.3)
    assert progress.exists(), (
        f"the job never started: {job_info(env, job)}\n{log.read_text() if log.exists() else ''}"
    )
    signalled_at = int(progress.read_text().split()[-2])
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)

    info = wait_for_job(env, job, timeout=180, log=log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert info["Restarts"] == "1", text[-3000:]
    # 75 = EXIT_CODE_PREEMPTED reaches the script intact (a process exiting with a live gloo group
    # aborts instead: status 134, "terminate called without an active exception").
    assert "caught SIGUSR1" in text and "exited with status 75" in text and "requeueing" in text, text[-3000:]
    # The checkpoint written on the signal: a step shortly after the signal was sent.
    saved = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert saved and signalled_at <= saved[-1] < STEPS, saved
    # Resumed from that step: every step appears exactly once across the two attempts.
    lines = [line.split() for line in progress.read_text().splitlines()]
    assert [int(s) for s, _ in lines] == list(range(1, STEPS + 1))
    assert {r for _, r in lines} == {"0", "1"}
    result = json.loads((run / "result.json").read_text())
    assert result["restarts"] == "1"
    assert result["x"] == pytest.approx(expected_x(STEPS, 2), rel=0, abs=1e-9)


def fake_job(slurm_env, tmp_path, name: str, steps: int = STEPS, **knobs: str) -> tuple[dict, str, Path]:
    """Submit the fake trainer on 2 tasks with ``knobs`` in its environment; wait for the end."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    log = tmp_path / "job.out"
    env = {**slurm_env, "PYTHON": sys.executable, "PRETRAIN": str(trainer), "OMP_NUM_THREADS": "1"}
    env.update({"RUN_DIR": str(run), **knobs})
    job = sbatch(
        env,
        "--ntasks-per-node=2",
        f"--chdir={REPO}",
        f"--output={log}",
        f"--job-name={name}",
        str(REPO / "launch" / "slurm" / "pretrain.sbatch"),
        str(run),
        str(steps),
    )
    info = wait_for_job(env, job, timeout=240, log=log)
    return info, log.read_text(), run


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[pretrain.sbatch]")]


def test_no_gpus_allocated_stops_at_once_with_one_line(slurm_env, tmp_path):
    info, text, run = fake_job(slurm_env, tmp_path, "ft-nogpu")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["Restarts"] == "0", text
    errors = [line for line in sbatch_lines(text) if "error:" in line]
    assert len(errors) == 1 and "has no GPUs allocated: add --gpus-per-node=N" in errors[0], text
    assert "ALLOW_CPU=1" in errors[0]
    assert not (run / "progress.txt").exists()  # nothing started


def test_a_bad_max_failure_requeues_fails_with_one_line(slurm_env, tmp_path):
    info, text, run = fake_job(slurm_env, tmp_path, "ft-badmax", ALLOW_CPU="1", MAX_FAILURE_REQUEUES="three")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", text
    assert "MAX_FAILURE_REQUEUES=three: use a whole number" in text
    assert not (run / "progress.txt").exists()


def test_a_config_error_is_not_requeued(slurm_env, tmp_path):
    # CUDA_VISIBLE_DEVICES as SLURM sets it for a GPU job: the no-GPU guard lets it through
    info, text, _ = fake_job(slurm_env, tmp_path, "ft-exit2", CUDA_VISIBLE_DEVICES="0", FAKE_EXIT="2")
    assert "no GPUs allocated" not in text
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", text
    assert "exit 2 is a configuration or input error" in text and "not requeueing" in text


@pytest.mark.slow
def test_a_crash_loop_stops_with_one_line(slurm_env, tmp_path):
    # rank 1 dies 2 steps into every attempt, before any checkpoint: one retry, then the crash-loop line
    info, text, run = fake_job(slurm_env, tmp_path, "ft-loop", ALLOW_CPU="1", FAKE_CRASH_AFTER="2")
    lines = sbatch_lines(text)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", text[-3000:]
    assert any("failure requeue 1 of 3, to resume from checkpoint none" in line for line in lines), lines
    loop = [line for line in lines if "crash loop" in line]
    assert len(loop) == 1 and "no checkpoint newer than none since the previous restart" in loop[0], lines
    assert "not requeueing" in loop[0]
    assert (run / ".requeue_state").read_text().split()[1:] == ["failures=1", "checkpoint=none"]


@pytest.mark.slow
def test_failures_that_make_progress_are_requeued_up_to_the_limit(slurm_env, tmp_path):
    # a checkpoint every 2 steps, rank 1 dies 3 steps after each (re)start: progress every time, so
    # only MAX_FAILURE_REQUEUES stops it (1 here, to keep the test short)
    info, text, run = fake_job(
        slurm_env,
        tmp_path,
        "ft-limit",
        ALLOW_CPU="1",
        FAKE_CKPT_EVERY="2",
        FAKE_CRASH_AFTER="3",
        MAX_FAILURE_REQUEUES="1",
    )
    lines = sbatch_lines(text)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", text[-3000:]
    assert any("failure requeue 1 of 1, to resume from checkpoint step-00000002" in x for x in lines), lines
    assert any("after 1 failure requeue(s), the limit (MAX_FAILURE_REQUEUES=1)" in x for x in lines), lines
    assert not any("crash loop" in x for x in lines)
    saved = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert saved[-1] == "step-00000004", saved  # the second attempt resumed at 2 and saved 4


# ----------------------------------------------------------------- the real trainer, kill -9 of a rank
REAL_STEPS = 12


def real_job(slurm_env, root: Path, shards: Path, name: str) -> tuple[str, dict, Path, Path]:
    run = root / name
    log = root / f"{name}.out"
    env = {**slurm_env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)  # the CPU opt-in must come from the config (debug.yaml: cpu)
    job = sbatch(
        env,
        "--ntasks-per-node=2",
        f"--chdir={REPO}",
        f"--output={log}",
        f"--job-name={name}",
        str(REPO / "launch" / "slurm" / "pretrain.sbatch"),
        "--config",
        str(REPO / "launch" / "configs" / "debug.yaml"),
        f"--data.shards={shards}",
        f"--run_dir={run}",
        f"--train.max_steps={REAL_STEPS}",
        "--checkpoint.every_steps=2",
        "--train.eval_max_pairs=16",
        "--data.length_bucketing=false",
    )
    return job, env, run, log


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rank_process(job: str, rank: int) -> psutil.Process | None:
    for p in psutil.process_iter(["name"]):
        try:
            e = p.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if e.get("SLURM_JOB_ID") == job and e.get("RANK") == str(rank) and "python" in (p.info["name"] or ""):
            return p
    return None


def wait_for_metrics_step(run: Path, step: int, timeout: float, what: str) -> int:
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines() if '"loss"' in x]
            if steps and max(steps) >= step:
                return max(steps)
        time.sleep(0.1)
    raise AssertionError(f"{what} did not reach step {step} in {timeout} s")


@pytest.mark.slow
def test_kill9_of_one_rank_is_requeued_and_ends_with_the_uninterrupted_weights(slurm_env, tmp_path):
    shards = tmp_path / "shards"
    make_shards(shards, [[40, 24], [32]], num_variants=2)
    job, env, reference, ref_log = real_job(slurm_env, tmp_path, shards, "uninterrupted")
    info = wait_for_job(env, job, timeout=600, log=ref_log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", ref_log.read_text()[-3000:]

    job, env, run, log = real_job(slurm_env, tmp_path, shards, "killed")
    wait_for_start(env, job)
    reached = wait_for_metrics_step(run, 5, 300, f"job {job}")
    victim = rank_process(job, 1)
    assert victim is not None, f"no rank-1 process of job {job}"
    victim.send_signal(signal.SIGKILL)
    assert reached < REAL_STEPS, "the job finished before the kill"
    info = wait_for_job(env, job, timeout=600, log=log)
    text = log.read_text()
    lines = sbatch_lines(text)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    assert any("failure requeue 1 of 3, to resume from checkpoint step-0000000" in x for x in lines), lines
    assert f"run dir {run}" in text  # read from the config by launch/slurm/run_info.py
    assert f"resumed from {run / 'checkpoints'}" in text
    model = "model/model.safetensors"
    assert sha256(run / model) == sha256(reference / model)  # the same final weights, bit for bit
    assert os.path.exists(run / ".requeue_state")
