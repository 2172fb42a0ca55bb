"""Exact resume of luse on pair shards across two gloo processes (docs/pairs.md, "LUSE on pairs"): the
queue of the anchors' keys (with their groups and text hashes), the momentum encoder and the dropout views
come back bit for bit after ``kill -9`` at a random step. The pair shards, the driver and the helpers are
tests/test_pairs_train_resume.py's (through torchrun, as tests/test_resume.py)."""

from __future__ import annotations

import pytest
from test_pairs_train_resume import kill9_then_rerun, setup, torchrun  # noqa: F401 (setup: the module's fixture)
from test_resume import consumed, dumps, losses, run_to_end

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
    checked = ("cursor", "param_checksum", "queue_checksum")
    rerun = kill9_then_rerun(lambda run_dir: luse_run(setup, run_dir), setup["root"] / "luse-killed",
                             uninterrupted, checked)  # fmt: skip
    assert all(d["queue_checksum"] is not None for d in rerun)
