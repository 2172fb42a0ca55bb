"""Exact resume of luse on pair shards across two gloo processes (docs/pairs.md, "LUSE on pairs"): the
queue of the anchors' keys (with their groups and text hashes), the momentum encoder and the dropout views
come back bit for bit after ``kill -9`` at a random step. The pair shards, the driver and the helpers are
tests/test_pairs_train_resume.py's (through torchrun, as tests/test_resume.py)."""

from __future__ import annotations

import os
import random
import subprocess
import time

import pytest
from test_pairs_train_resume import STEPS, setup, torchrun  # noqa: F401 (setup: the module's fixture)
from test_resume import REPO, consumed, dumps, env, kill9_tree, losses, run_to_end, wait_for_step

pytestmark = pytest.mark.slow
LUSE = [
    "--loss=[{luse: {temperature: 0.05, queue_size: 32, momentum: 0.9, false_negatives: {same_text: true}}}]",
    "--data.num_dropout_views=1",
]


def luse_run(setup, run_dir) -> list[str]:  # noqa: F811
    """The pair resume test's command with the loss and the dropout views of luse on pairs."""
    cmd = torchrun(setup, run_dir)
    replaced = [a for a in cmd if not a.startswith(("--loss=", "--data.num_dropout_views="))]
    assert len(replaced) == len(cmd) - 2
    return [*replaced, *LUSE]


@pytest.fixture(scope="module")
def uninterrupted(setup):  # noqa: F811
    run_dir = setup["root"] / "luse-uninterrupted"
    run_to_end(luse_run(setup, run_dir))
    return {"losses": losses(run_dir), "dumps": dumps(run_dir, 2), "ids": consumed(run_dir), "dir": run_dir}


def test_kill9_at_a_random_step_then_rerun_is_exact(setup, uninterrupted):  # noqa: F811
    import json

    records = [json.loads(x) for x in (uninterrupted["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("false_negatives_count", 0) for r in records) > 0  # groups, queue: something masked
    seed = int(os.environ.get("RESUME_TEST_SEED", time.time_ns() % 10_000))
    kill_at = random.Random(seed).randint(3, STEPS - 3)
    print(f"killing at step {kill_at} (RESUME_TEST_SEED={seed})")
    run_dir = setup["root"] / f"luse-killed-{seed}"
    proc = subprocess.Popen(luse_run(setup, run_dir), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        reached = wait_for_step(run_dir, kill_at, proc)
    finally:
        kill9_tree(proc)
    assert reached < STEPS and not (run_dir / "model").exists(), "the run finished before the kill"
    run_to_end(luse_run(setup, run_dir))
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == uninterrupted["losses"][step][0] for v in values), step
    for mine, ref in zip(dumps(run_dir, 2), uninterrupted["dumps"], strict=True):
        assert mine["cursor"] == ref["cursor"]
        assert mine["param_checksum"] == ref["param_checksum"]  # bitwise identical parameters
        assert mine["queue_checksum"] == ref["queue_checksum"] is not None
    assert consumed(run_dir) == uninterrupted["ids"]
