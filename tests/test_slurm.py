"""launch/slurm/pretrain.sbatch on a real (local) SLURM: signal forwarding, checkpoint, requeue, resume.

The trainer here is a small stand-in with the real checkpointer, signal handler and process group,
so the job mechanics are tested in seconds; tests/test_resume.py runs the real training loop.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import REPO, cluster_env, job_info, sbatch, wait_for_job

pytestmark = pytest.mark.slurm


@pytest.fixture
def slurm_env() -> dict[str, str]:
    return cluster_env()


STEPS = 30
# x <- 1.01 x + sum over ranks of a draw from each rank's own torch RNG: the final x is exact only if
# every rank's random stream and the shared state are restored exactly after the requeue.
FAKE_TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
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
    dist.init_process_group("gloo")  # env:// from the variables pretrain.sbatch exports
    rank = dist.get_rank()
    handler = PreemptionHandler().install()
    model, state, ckpt = Model(), State(), Checkpointer(run)
    torch.manual_seed(rank)  # after Model(), whose init draws from the same generator
    latest = ckpt.latest()
    if latest is not None:
        ckpt.load(latest, model, {"state": state}, {"rng": RNGState()})
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    while state.step < steps:
        draw = torch.rand((), dtype=torch.float64)
        state.x = 1.01 * state.x + distributed.all_reduce_sum(draw)
        state.step += 1
        if rank == 0:
            with open(run / "progress.txt", "a") as f:
                f.write(f"{state.step} {restarts}\\n")
        time.sleep(0.3)
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
