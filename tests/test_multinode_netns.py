"""Two "nodes" in two network namespaces (tests/netns.py): a node killed, hung or cut off, then resumed.

Each node is one training process started as launch/slurm/pretrain.sbatch starts a rank (torchrun's
variables, env:// rendezvous at node 0's veth address 10.231.0.1, gloo told its interface by
GLOO_SOCKET_IFNAME), in a process group of its own. Scenarios, each on the debug config:

* kill -9 of every process of node 1 (all that run in its namespace) mid-run;
* SIGSTOP of them all (a hang);
* node 1's end of the link taken down (a partition: no packet crosses, no socket is closed).

In each, the surviving node must exit by itself within ``train.collective_timeout`` (30 s here) + 60 s,
with status 76 and one line starting ``collective timeout:`` that names rank 1 as the silent one
(after kill -9 gloo sees the peer's sockets close and reports it at once; a hang or a partition waits
for the timeout; cut off, node 1 exits the same way and names node 0's store address). A relaunch of
both nodes must then resume from the newest checkpoint and end bit-identical to an uninterrupted
two-node run: every logged loss, every batch's sample ids, both ranks' parameter and queue checksums
and data cursor, and the saved model file (sha256).

The uninterrupted run and the three faulted ones run at the same time, each on a namespace pair of its
own (the same addresses, isolated from each other), so the 30 s waits overlap: about half the wall
time of one after another (docs/fault_tolerance.md has the times).

Needs root, iproute2 and veth support; skips with the reason elsewhere, and fails instead under
``CI=true`` (CI runs as root and must exercise it), as the SLURM tests do.
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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from _train_data import make_shards
from netns import ADDRESSES, IFNAME, TwoNodes, unavailable

from pipeline.train.signals import EXIT_CODE_COLLECTIVE_TIMEOUT

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "launch" / "configs" / "debug.yaml"
STEPS = 16
FAULT_AFTER = 5  # the fault lands after this step is logged (checkpoints every 2 steps)
COLLECTIVE_TIMEOUT = 30
GRACE = 60  # the survivors must be gone within COLLECTIVE_TIMEOUT + GRACE of the fault
PORT = 29500  # free by construction: nothing else listens inside these namespaces
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
        with open(run_dir / f"ids-rank{os.environ['RANK']}.txt", "a") as f:
            f.write(f"{t.state.step + 1} " + " ".join(str(i) for i in batch.ids.tolist()) + "\\n")

    pretrain.exit_process(pretrain.main(argv, on_batch=record_ids))  # as the script's own entry
    """
)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def namespaces():
    reason = unavailable()
    if reason is not None:
        if _truthy("CI"):
            pytest.fail(f"the network-namespace tests must run in CI: {reason}")
        pytest.skip(f"no network namespaces: {reason}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("netns")
    shards = root / "shards"
    make_shards(shards, [[40, 24], [32]], num_variants=2)
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    return {"root": root, "shards": shards, "driver": driver}


def node_env(nodes: TwoNodes, node: int) -> dict[str, str]:
    """What pretrain.sbatch exports for a rank, one rank per node; gloo told which interface to use."""
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false",
        "MASTER_ADDR": nodes.addresses[0], "MASTER_PORT": str(PORT), "RANK": str(node), "LOCAL_RANK": "0",
        "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": str(node), "GLOO_SOCKET_IFNAME": IFNAME,
    }  # fmt: skip
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    return env


def train_args(setup, run_dir: Path) -> list[str]:
    return [
        "--config", str(DEBUG), f"--data.shards={setup['shards']}", f"--run_dir={run_dir}",
        f"--train.max_steps={STEPS}", "--checkpoint.every_steps=2",
        "--loss=[{luse: {temperature: 0.05, queue_size: 32, momentum: 0.9}}]",
        "--train.eval_max_pairs=32", "--train.debug_dump", "--data.length_bucketing=false",
        f"--train.collective_timeout={COLLECTIVE_TIMEOUT}",
    ]  # fmt: skip


class Launch:
    """Both nodes started, each in its namespace and a process group of its own; logs beside the run."""

    def __init__(self, nodes: TwoNodes, setup, run_dir: Path, name: str) -> None:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.logs = [run_dir.parent / f"{run_dir.name}.{name}.node{n}.log" for n in (0, 1)]
        self.procs = []
        for node, log in enumerate(self.logs):
            cmd = [sys.executable, str(setup["driver"]), str(REPO / "launch"), *train_args(setup, run_dir)]
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        [*nodes.prefix(node), *cmd],
                        cwd=REPO,
                        env=node_env(nodes, node),
                        start_new_session=True,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )  # fmt: skip
                )

    def wait(self, node: int, timeout: float) -> int | None:
        try:
            return self.procs[node].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, node: int, sig: int) -> None:
        try:
            os.killpg(self.procs[node].pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        for node, proc in enumerate(self.procs):
            self.signal(node, signal.SIGKILL)
            proc.wait(timeout=60)

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")


def run_to_end(nodes: TwoNodes, setup, run_dir: Path, name: str) -> Launch:
    launch = Launch(nodes, setup, run_dir, name)
    try:
        codes = [launch.wait(node, 600) for node in (0, 1)]
    finally:
        launch.kill()
    assert codes == [0, 0], f"exit codes {codes}\n{launch.log(0)[-3000:]}\n{launch.log(1)[-3000:]}"
    return launch


def logged_losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        record = json.loads(line)
        if "loss" in record:
            out.setdefault(record["step"], []).append(record["loss"])
    return out


def consumed(run_dir: Path) -> dict[int, list[int]]:
    """step -> the global batch's ids, ranks concatenated in rank order (the last attempt's record)."""
    per_rank: dict[int, dict[int, list[int]]] = {}
    for path in sorted(run_dir.glob("ids-rank*.txt")):
        rank = int(path.stem.removeprefix("ids-rank"))
        for line in path.read_text().splitlines():
            step, *ids = (int(x) for x in line.split())
            per_rank.setdefault(step, {})[rank] = ids  # a step redone after a resume overwrites
    return {step: [i for r in sorted(ranks) for i in ranks[r]] for step, ranks in sorted(per_rank.items())}


def final_state(run_dir: Path) -> dict:
    keep = ("step", "samples_seen", "cursor", "param_checksum", "queue_checksum", "world_size")
    dumps = [json.loads((run_dir / "debug" / f"rank{r}.json").read_text()) for r in (0, 1)]
    model = hashlib.sha256((run_dir / "model" / "model.safetensors").read_bytes()).hexdigest()
    return {
        "losses": logged_losses(run_dir),
        "ids": consumed(run_dir),
        "ranks": [{k: d.get(k) for k in keep} for d in dumps],
        "model": model,
    }


def wait_for_step(run_dir: Path, step: int, launch: Launch, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = max(logged_losses(run_dir), default=0)
        if done >= step:
            return done
        for node, proc in enumerate(launch.procs):
            if proc.poll() is not None:
                raise AssertionError(f"node {node} exited with {proc.returncode} before step {step}:\n"
                                     f"{launch.log(node)[-3000:]}")  # fmt: skip
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step} in {timeout} s")


def timeout_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("collective timeout:")]


def inject(fault: str, nodes: TwoNodes) -> None:
    """Every process of node 1 (all that run in its namespace) killed or stopped, or its link cut."""
    if fault == "kill9":
        assert nodes.signal(1, signal.SIGKILL)
    elif fault == "sigstop":
        assert nodes.signal(1, signal.SIGSTOP)
    else:
        nodes.cut(1)


FAULTS = ("kill9", "sigstop", "partition")


def uninterrupted(setup) -> dict:
    with TwoNodes() as nodes:
        run_dir = setup["root"] / "uninterrupted"
        launch = run_to_end(nodes, setup, run_dir, "run")
        return {"state": final_state(run_dir), "log0": launch.log(0)}


def faulted(setup, fault: str) -> dict:
    """Node 1 lost after step FAULT_AFTER (``fault``), on a pair of namespaces of its own; then both
    nodes relaunched to the end. What happened, for the test to judge."""
    with TwoNodes() as nodes:
        run_dir = setup["root"] / fault
        launch = Launch(nodes, setup, run_dir, "faulted")
        try:
            reached = wait_for_step(run_dir, FAULT_AFTER, launch)
            faulted_at = time.monotonic()
            inject(fault, nodes)
            code = launch.wait(0, COLLECTIVE_TIMEOUT + GRACE)
            survivor_exit = time.monotonic() - faulted_at
            # cut off, node 1 is a survivor too (killed or stopped, it is not)
            code1 = launch.wait(1, max(1.0, faulted_at + COLLECTIVE_TIMEOUT + GRACE - time.monotonic()))
        finally:
            launch.kill()
            nodes.mend(1)
        out = {"reached": reached, "code": code, "code1": code1 if fault == "partition" else None}
        out.update(
            exit_s=survivor_exit,
            log0=launch.log(0),
            log1=launch.log(1),
            finished=(run_dir / "model").exists(),
        )
        print(f"\n{fault}: fault after step {reached}; node 0 exited with {code} {survivor_exit:.1f} s later "
              f"(node 1: {out['code1']}); node 0: {timeout_lines(out['log0'])}; "
              f"node 1: {timeout_lines(out['log1'])}")  # fmt: skip
        resumed = run_to_end(nodes, setup, run_dir, "resumed")
        return {**out, "resumed_log0": resumed.log(0), "state": final_state(run_dir), "run_dir": run_dir}


@pytest.fixture(scope="module")
def outcomes(namespaces, setup) -> dict[str, Future]:
    """The uninterrupted run and the three faulted ones, at the same time, each on its own namespaces:
    the runs that wait out a timeout overlap (about 2x less wall time than one after another)."""
    with ThreadPoolExecutor(1 + len(FAULTS)) as pool:
        runs = {"uninterrupted": pool.submit(uninterrupted, setup)}
        runs.update({fault: pool.submit(faulted, setup, fault) for fault in FAULTS})
    return runs


def test_two_nodes_train_over_the_link(outcomes):
    got = outcomes["uninterrupted"].result()
    assert sorted(got["state"]["losses"]) == list(range(1, STEPS + 1))
    assert [r["world_size"] for r in got["state"]["ranks"]] == [2, 2]
    assert "2 processes on 2 nodes" in got["log0"], got["log0"][-3000:]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_node_lost_then_both_relaunched_resume_exactly(outcomes, fault):
    got, ref = outcomes[fault].result(), outcomes["uninterrupted"].result()["state"]
    log0, log1 = got["log0"], got["log1"]
    lines = timeout_lines(log0)
    assert got["code"] is not None, (
        f"node 0 still running {COLLECTIVE_TIMEOUT + GRACE} s after the fault:\n{log0[-3000:]}"
    )
    assert got["reached"] < STEPS and not got["finished"], "the run finished before the fault"
    # kill -9: the peer's sockets close at once and gloo says so ("lost its peer"), no timeout needed
    assert got["code"] == EXIT_CODE_COLLECTIVE_TIMEOUT, log0[-3000:]
    assert len(lines) == 1 and "Traceback" not in log0, log0[-3000:]
    assert "silent: rank 1 " in lines[0], lines[0]
    if fault == "partition":  # node 1 cannot reach the store on node 0: it names node 0's address
        assert got["code1"] == EXIT_CODE_COLLECTIVE_TIMEOUT, log1[-3000:]
        assert f"silent: rank 0 or its node, which hosts the rendezvous store at {ADDRESSES[0]}" in log1
    # both nodes again: resumed from the newest complete checkpoint, to the uninterrupted run's end state
    assert f"resumed from {got['run_dir'] / 'checkpoints'}" in got["resumed_log0"], got["resumed_log0"][
        -3000:
    ]
    state = got["state"]
    assert sorted(state["losses"]) == list(range(1, STEPS + 1))
    for step, values in state["losses"].items():  # a step redone after the resume repeats its loss too
        assert all(v == ref["losses"][step][0] for v in values), (step, values)
    assert state["ids"] == ref["ids"]
    assert state["ranks"] == ref["ranks"]
    assert state["model"] == ref["model"]
