"""Preemption signals: flag only, all-rank agreement, a save that a second signal cannot interrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pipeline.train.checkpoint import Checkpointer, verify_checkpoint
from pipeline.train.signals import EXIT_CODE_PREEMPTED, Cadence, PreemptionHandler

REPO = Path(__file__).resolve().parents[1]

TRAINER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    import pipeline.train.checkpoint as ck
    from pipeline.train.signals import EXIT_CODE_PREEMPTED, PreemptionHandler

    class Model:
        def save_pretrained(self, d):
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "weights.bin").write_bytes(b"w" * 1000)

    class Blob:
        def __init__(self): self.x = torch.arange(100_000.0); self.step = 0
        def state_dict(self): return {"x": self.x, "step": self.step}
        def load_state_dict(self, s): self.x, self.step = s["x"], s["step"]

    real_save = ck._torch_save
    def slow_save(obj, path):  # a save long enough for the test to signal again in the middle
        real_save(obj, path)
        if path.name == "state.pt":
            print("SAVING", flush=True)
            time.sleep(1.5)
    ck._torch_save = slow_save

    handler = PreemptionHandler().install()
    blob, ckpt = Blob(), ck.Checkpointer(Path(sys.argv[1]))
    print("READY", flush=True)
    for step in range(1, 100_000):
        blob.step = step
        time.sleep(0.01)  # "training"
        if handler.should_stop():
            ckpt.save(step, Model(), {"blob": blob}, {}, {"a": 1})
            print(f"SAVED {step} {','.join(handler.received)}", flush=True)
            sys.exit(EXIT_CODE_PREEMPTED)
    sys.exit(0)
    """
)


def test_signal_saves_and_exits_with_the_preempted_code(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(run)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGUSR1)
        assert proc.stdout.readline().strip() == "SAVING"
        proc.send_signal(signal.SIGUSR1)  # a second and a third signal while the checkpoint is written
        proc.send_signal(signal.SIGTERM)
        saved = proc.stdout.readline().split()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_CODE_PREEMPTED
    assert saved[0] == "SAVED" and saved[2].startswith("SIGUSR1")
    ckpt = Checkpointer(run)
    latest = ckpt.latest()
    assert latest is not None and latest.name == f"step-{int(saved[1]):08d}"
    verify_checkpoint(latest)  # complete and intact despite the signals during the write
    state = torch.load(latest / "state.pt", weights_only=True)
    assert state["blob"]["step"] == int(saved[1])


def test_handler_only_sets_a_flag_and_restores_previous_handlers():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
    try:
        handler = PreemptionHandler(signals=(signal.SIGUSR1,)).install()
        assert not handler.requested and not handler.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.requested and handler.received == ["SIGUSR1"]
        assert handler.should_stop()  # one process: its own flag decides
        handler.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_policy_by_steps_and_minutes():
    policy = Cadence(every_steps=5, every_minutes=0, now=0.0)
    assert [s for s in range(0, 16) if policy.due(s, now=0.0)] == [5, 10, 15]
    timed = Cadence(every_steps=0, every_minutes=1.0, now=100.0)
    assert not timed.due(1, now=159.0)
    assert timed.due(2, now=160.0)
    assert not timed.due(3, now=200.0)  # the clock restarted at the save
    assert timed.due(4, now=221.0)
    timed.happened(now=300.0)  # an unscheduled save (preemption) restarts it too
    assert not timed.due(5, now=330.0)
    assert not Cadence().due(10)  # both rules off
    with pytest.raises(ValueError):
        Cadence(every_steps=-1)


def test_time_rule_is_read_only_at_check_steps():
    """The loop reads the clock (a broadcast and a host sync) at log steps only; step saves still count."""

    def due_steps(check_every: int) -> list[int]:
        policy = Cadence(every_steps=7, every_minutes=1.0, now=0.0, check_every=check_every)
        return [s for s in range(1, 12) if policy.due(s, now=30.0 * s)]  # 30 s per step

    assert due_steps(check_every=1) == [2, 4, 6, 7, 9, 11]
    assert due_steps(check_every=5) == [5, 7, 10]  # step 9's time save waits for check step 10
    with pytest.raises(ValueError):
        Cadence(check_every=0)


TWO_RANKS = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from pipeline.train.signals import Cadence, PreemptionHandler

    def worker(rank, init):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        handler = PreemptionHandler()
        first = handler.should_stop()
        if rank == 1:
            handler.request()  # only rank 1 was signalled
        second = handler.should_stop()
        # Rank 0's clock says a save is due, rank 1's does not: rank 0 decides for both.
        policy = Cadence(every_minutes=1.0, now=0.0)
        due = policy.due(1, now=100.0 if rank == 0 else 1.0)
        # One write per line: two ranks share the pipe, and print() writes text and newline separately.
        sys.stdout.write(f"rank{rank} {first} {second} {handler.requested} {due}\\n")
        sys.stdout.flush()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
    """
)


def test_all_ranks_agree_on_stop_and_on_timed_saves(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, str(script), f"file://{tmp_path / 'store'}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank0 False True True True", "rank1 False True True True"]
