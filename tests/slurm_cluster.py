"""A session fixture for a real single-node SLURM cluster (launch/slurm/local_cluster.sh) and job helpers.

Test modules wrap :func:`cluster_env` in a fixture (``@pytest.fixture def slurm_env(): return
cluster_env()``). When the cluster is not running it is started if we are root
and slurm is installed (or, with ``CI=true`` or ``SLURM_LOCAL_INSTALL=1``, installed first with
apt-get). Where that is impossible the tests skip with the reason, except under CI, where they fail:
CI must exercise them.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "launch" / "slurm" / "local_cluster.sh"
_CLUSTER_ENV: dict[str, str] = {}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def _cluster_conf() -> str:
    out = subprocess.run(["bash", str(CLUSTER_SCRIPT), "env"], capture_output=True, text=True, check=True)
    return out.stdout.strip().split("=", 1)[1]


def _unavailable(reason: str) -> None:
    if _truthy("CI"):
        pytest.fail(f"SLURM tests must run in CI but the local cluster is unavailable: {reason}")
    pytest.skip(f"no local SLURM cluster: {reason} (run `bash launch/slurm/local_cluster.sh start` as root)")


def cluster_env() -> dict[str, str]:
    """``os.environ`` plus SLURM_CONF of a running local cluster, for subprocess calls (cached)."""
    if _CLUSTER_ENV:
        return dict(_CLUSTER_ENV)
    env = {**os.environ, "SLURM_CONF": os.environ.get("SLURM_CONF") or _cluster_conf()}
    status = subprocess.run(["bash", str(CLUSTER_SCRIPT), "status"], env=env, capture_output=True)
    if status.returncode != 0:
        if os.geteuid() != 0:
            _unavailable("it is not running and starting it needs root")
        if not (_truthy("CI") or _truthy("SLURM_LOCAL_INSTALL")):
            env["SLURM_LOCAL_NO_INSTALL"] = "1"  # never apt-get install behind a developer's back
        start = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=600
        )
        if start.returncode != 0:
            _unavailable(start.stderr.strip().splitlines()[-1] if start.stderr.strip() else "start failed")
    env.pop("SLURM_LOCAL_NO_INSTALL", None)
    _CLUSTER_ENV.update(env)
    return dict(env)


def sbatch(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def job_info(env: dict[str, str], job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (the first record: an array's first task)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True)
    line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return dict(re.findall(r"(\w+)=(\S*)", line))


def array_states(env: dict[str, str], job_id: str) -> list[str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True)
    return re.findall(r"JobState=(\S+)", out.stdout)


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


# The local cluster is one node whose CPUs one 2-task job takes: a job waits in the queue while another
# test run's job (two runs at once on one machine) has the node. That wait is bounded by this, not by the
# time a test gives its job to run.
QUEUE_TIMEOUT = 1800.0


# Pending reasons that no wait clears: the job asks for more than the node or partition has.
NEVER_STARTS = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints"}


def refuse_never_starting(env: dict[str, str], job_id: str, states: list[str]) -> None:
    """Fail at once, not after QUEUE_TIMEOUT, when every task is pending for a reason no wait clears."""
    if not states or any(s != "PENDING" for s in states):
        return
    info = job_info(env, job_id)
    if info.get("Reason") in NEVER_STARTS:
        subprocess.run(["scancel", job_id], env=env)
        node = subprocess.run(["scontrol", "-o", "show", "node"], env=env, capture_output=True, text=True)
        cpus = re.findall(r"CPUTot=(\d+)", node.stdout)
        raise AssertionError(
            f"job {job_id} can never start ({info['Reason']}): it asks for {info.get('NumCPUs')} CPUs, "
            f"{info.get('NumNodes')} node(s); the local node has CPUTot={','.join(cpus) or '?'} "
            "(bash launch/slurm/local_cluster.sh start restarts a cluster whose CPU count is not the "
            "machine's)"
        )


def wait_for_job(env: dict[str, str], job_id: str, timeout: float, log: Path | None = None) -> dict[str, str]:
    """Poll until every task of ``job_id`` is in a final state; returns the first task's info.

    ``timeout`` counts the time the job is out of the queue; time with every task pending counts
    against QUEUE_TIMEOUT instead."""
    running = pending = 0.0
    last = time.monotonic()
    while running < timeout and pending < QUEUE_TIMEOUT:
        states = array_states(env, job_id)
        if states and all(s in FINAL_STATES for s in states):
            return job_info(env, job_id)
        refuse_never_starting(env, job_id, states)
        time.sleep(1)
        now = time.monotonic()
        if states and all(s == "PENDING" for s in states):
            pending += now - last
        else:
            running += now - last
        last = now
    subprocess.run(["scancel", job_id], env=env)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(
        f"job {job_id} did not finish in {timeout} s out of the queue ({pending:.0f} s pending): "
        f"{job_info(env, job_id)}\n{tail}"
    )


def wait_for_start(env: dict[str, str], job_id: str) -> None:
    """Wait until ``job_id`` leaves the queue (at most QUEUE_TIMEOUT), so that a test's own deadline for
    the job's progress does not count time spent behind another run's job."""
    deadline = time.monotonic() + QUEUE_TIMEOUT
    while time.monotonic() < deadline:
        states = array_states(env, job_id)
        if states and any(s != "PENDING" for s in states):
            return
        refuse_never_starting(env, job_id, states)
        time.sleep(1)
    info = job_info(env, job_id)
    raise AssertionError(f"job {job_id} was still pending after {QUEUE_TIMEOUT:.0f} s: {info}")
