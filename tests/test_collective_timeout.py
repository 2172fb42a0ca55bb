"""Bounded hangs: a rank that goes silent makes the others exit with status 76 and one line.

Two real gloo processes. The unit checks stop one rank before a collective and read the line the other
prints; the end-to-end check trains the debug config with two processes started the way
launch/slurm/pretrain.sbatch starts them (env://, no launcher agent), SIGSTOPs rank 1 mid-run (a stopped
node: its sockets stay open, nothing fails, it just never answers) and expects rank 0 to exit with
EXIT_CODE_COLLECTIVE_TIMEOUT and the line. Assertions are on the status and the line, never on time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from _train_data import make_shards

from pipeline.train.config import PROJECT_ROOT
from pipeline.train.hangs import failure_kind
from pipeline.train.signals import EXIT_CODE_COLLECTIVE_TIMEOUT, EXIT_CODE_PREEMPTED

DEBUG = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"

# A rank of a 2-rank gloo group; rank SILENT stops itself before the collective that the other waits in.
WORKER = textwrap.dedent(
    """
    import os, signal, sys
    from datetime import timedelta
    import torch, torch.distributed as tdist
    from pipeline import distributed as dist
    from pipeline.train.hangs import failure_line

    rank, silent, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    tdist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=timeout))
    dist.barrier()

    def compute_loss(x):  # named like a loss term's: the line says what the collective carried
        return dist.all_gather_with_grad(x)

    if rank == silent:
        os.kill(os.getpid(), signal.SIGSTOP)  # a stopped node: sockets open, no answer, no error
    try:
        compute_loss(torch.ones(2, 3, requires_grad=True))
    except RuntimeError as exc:
        print(failure_line(exc, "at step 7", timeout, grace_s=2.0), flush=True)
        os._exit(0)
    """
)


# The trainer's init, then a group created later without a timeout (as DeepSpeed clones the world group).
LATER_GROUP = textwrap.dedent(
    """
    import os, signal, sys
    import torch, torch.distributed as tdist
    from pipeline.train.hangs import init_process_group

    rank = int(sys.argv[1])
    assert init_process_group("gloo", 3.0)
    group = tdist.new_group(ranks=[0, 1])
    tdist.barrier(group=group)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        tdist.all_reduce(torch.ones(2), group=group)
    except RuntimeError as exc:
        print("raised:", str(exc).splitlines()[0], flush=True)
        os._exit(0)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(port: int, rank: int, world: int = 2) -> dict[str, str]:
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(PROJECT_ROOT),
    }


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # SIGKILL also ends a stopped process
            p.wait()


def test_exit_code_is_distinct_and_documented():
    assert EXIT_CODE_COLLECTIVE_TIMEOUT == 76 and EXIT_CODE_COLLECTIVE_TIMEOUT != EXIT_CODE_PREEMPTED
    text = (PROJECT_ROOT / "docs" / "fault_tolerance.md").read_text()
    assert "collective timeout:" in text and "76" in text


def test_other_errors_are_not_taken_for_a_collective_failure():
    # no process group: nothing is a collective failure, whatever the words
    assert failure_kind(RuntimeError("Timed out waiting 3000ms for recv operation to complete")) is None
    assert failure_kind(RuntimeError("DataLoader timed out after 5 seconds")) is None
    assert failure_kind(ValueError("timeout")) is None


def test_a_rendezvous_that_never_completes_is_one_too():
    import torch.distributed as tdist

    joined = tdist.DistStoreError("Timed out after 3 seconds waiting for clients. 1/2 clients joined.")
    assert failure_kind(joined) == "timed out"  # no process group yet: only the rendezvous raises these


def test_a_rank_whose_peers_never_arrive_exits_76_at_start_up(tmp_path):
    """One of two ranks started: the rendezvous times out before anything is built."""
    port = _free_port()
    cmd = [
        sys.executable,
        str(PROJECT_ROOT / "launch" / "pretrain.py"),
        "--config",
        str(DEBUG),
        f"--data.shards={tmp_path / 'unused'}",
        f"--run_dir={tmp_path / 'run'}",
        "--train.collective_timeout=3",
    ]
    env = _env(port, 0)
    proc = subprocess.run(cmd, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_CODE_COLLECTIVE_TIMEOUT, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("collective timeout:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("collective timeout: init_process_group (pipeline/train/build.py:"), lines[0]
    assert "at start-up did not complete within 3 s on rank 0" in lines[0], lines[0]
    assert f"the ranks that did not join the rendezvous at 127.0.0.1:{port} (WORLD_SIZE=2)" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("silent", [1, 0], ids=["rank1_silent", "store_host_silent"])
def test_a_silent_rank_is_named_by_the_one_that_waits(tmp_path, silent):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port, timeout = _free_port(), 3
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(silent), str(timeout)],
            env=_env(port, r),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    waiting = procs[1 - silent]
    try:
        out, err = waiting.communicate(timeout=240)
    finally:
        _kill(procs)
    lines = [line for line in out.splitlines() if line.startswith("collective timeout:")]
    assert len(lines) == 1, (out, err[-2000:])
    line = lines[0]
    assert "all_gather of embeddings" in line and "compute_loss" in line and "at step 7" in line
    assert f"did not complete within {timeout} s on rank {1 - silent}" in line
    if silent == 1:
        assert "silent: rank 1 (no answer within 2 s)" in line
    else:  # rank 0 hosts the rendezvous store: asking it is what goes unanswered
        assert "silent: rank 0 or its node, which hosts the rendezvous store at 127.0.0.1" in line


@pytest.mark.slow
def test_a_group_created_later_gets_the_collective_timeout_too(tmp_path):
    script = tmp_path / "later_group.py"
    script.write_text(LATER_GROUP)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r)],
            env=_env(port, r),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=240)  # torch's own default would be 30 min
    finally:
        _kill(procs)
    assert "raised:" in out and "Timed out waiting 3000ms" in out, (out, err[-2000:])


def _metrics_steps(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines() if '"loss"' in x]
    return max(steps, default=0)


@pytest.mark.slow
def test_training_survivor_of_a_stopped_rank_exits_76_with_one_line(tmp_path):
    shards = tmp_path / "shards"
    make_shards(shards, [[32], [32]], num_variants=2)
    run_dir = tmp_path / "run"
    port = _free_port()
    cmd = [
        sys.executable,
        str(PROJECT_ROOT / "launch" / "pretrain.py"),
        "--config",
        str(DEBUG),
        f"--data.shards={shards}",
        f"--run_dir={run_dir}",
        "--train.max_steps=100000",
        "--train.progress=false",
        # long enough for a loaded machine's start-up (the rendezvous and rank 0's tokenizer build are
        # collectives too), short enough for a test
        "--train.collective_timeout=20",
    ]
    procs = [
        subprocess.Popen(
            cmd,
            env=_env(port, r),
            cwd=PROJECT_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 400
        while _metrics_steps(run_dir) < 3 and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
        os.kill(procs[1].pid, signal.SIGSTOP)  # a stopped node: open sockets, no answer
        _, err = procs[0].communicate(timeout=300)
    finally:
        _kill(procs)
    assert procs[0].returncode == EXIT_CODE_COLLECTIVE_TIMEOUT, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("collective timeout:")]
    assert len(lines) == 1, err[-3000:]
    assert "at step " in lines[0] and "did not complete within 20 s on rank 0" in lines[0]
    assert "silent: rank 1 (no answer within" in lines[0]
