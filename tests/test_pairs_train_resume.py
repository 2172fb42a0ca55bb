"""Exact resume of training on pair shards with one source per global batch (the pairs term, group masking):
kill -9 at a random step then a rerun gives the uninterrupted run's weights, and a resume at another world
size (2 gloo processes, then 1) consumes the same pairs in the same order. Same driver and helpers as
tests/test_resume.py (launch/pretrain.py through torchrun)."""

from __future__ import annotations

import gzip
import os
import random
import subprocess
import time

import pytest
from test_resume import (
    DRIVER,
    REPO,
    consumed,
    dumps,
    env,
    free_port,
    kill9_tree,
    losses,
    run_to_end,
    stopped_after,
    wait_for_step,
)

from pipeline.resources import ROOT as RESOURCES
from pipeline.shards import read_manifest

DEBUG = REPO / "launch" / "configs" / "debug.yaml"
STEPS = 12
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Pair shards of a few records per bundled collection: about 8 single-source batches of 16 an epoch,
    so 12 steps cross an epoch boundary."""
    from pipeline.stages.pairs.run import Config, run

    root = tmp_path_factory.mktemp("pairs_resume")
    inputs = root / "in"
    inputs.mkdir()
    taken = {"baike2018qa_toyhom_medical": 25, "translation2019zh_tatoeba": 50, "wiki_zh_csl": 30}
    for path, keep in taken.items():
        with gzip.open(RESOURCES / "corpus" / "pairs" / f"{path}.jsonl.gz", "rt", encoding="utf-8") as f:
            lines = f.readlines()[:keep]
        (inputs / f"{path}.jsonl").write_text("".join(lines), encoding="utf-8")
    shards = root / "pairs"
    options = {"pairs_per_shard": 64, "rows_per_block": 16, "progress": False}
    assert run(Config(inputs=[inputs], out=shards, **options)) == 0
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    counts = read_manifest(shards)["counts"]["by_source"]
    kept = {s: c["kept"] for s, c in counts.items()}
    return {"root": root, "shards": shards, "driver": driver, "kept": kept}


def torchrun(setup, run_dir, nproc: int = 2, steps: int = STEPS) -> list[str]:
    import sys

    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(free_port()), str(setup["driver"]), str(REPO / "launch"),
        "--config", str(DEBUG), f"--data.shards={setup['shards']}", f"--run_dir={run_dir}",
        f"--train.max_steps={steps}", "--checkpoint.every_steps=2", "--train.eval_max_pairs=32",
        "--train.debug_dump", "--loss=[{pairs: {temperature: 0.05}}]", "--data.num_variants=0",
        "--data.num_dropout_views=0", "--data.length_bucketing=false", "--data.one_source_per_batch=true",
        "--data.source_alpha=0.5",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(setup):
    run_dir = setup["root"] / "uninterrupted"
    run_to_end([*torchrun(setup, run_dir), f"--checkpoint.keep_last={STEPS // 2}"])  # for stopped_after
    return {"dir": run_dir, "losses": losses(run_dir), "dumps": dumps(run_dir, 2), "ids": consumed(run_dir)}


def test_the_run_crosses_an_epoch_with_single_source_batches(setup, uninterrupted):
    from pipeline.shards import read_shard

    source_of = {}
    for entry in read_manifest(setup["shards"])["shards"]:
        for block in read_shard(setup["shards"] / entry["name"]):
            source_of.update(zip(block.column("id").to_pylist(), block.column("source").to_pylist()))
    ids = uninterrupted["ids"]
    assert sorted(ids) == list(range(1, STEPS + 1))
    per_epoch = sum(n // 16 for n in setup["kept"].values())
    assert per_epoch < STEPS
    assert uninterrupted["dumps"][0]["cursor"]["epoch"] == 1
    for step, batch in ids.items():
        signed = [i % 2**64 for i in batch]  # the batch's ids are int64 views of the uint64 pair ids
        assert len(batch) == 16 and len({source_of[i] for i in signed}) == 1, step


def kill9_then_rerun(command, run_dir, uninterrupted, checked=("cursor", "param_checksum")):
    """Start ``command``, kill -9 its process tree at a random step, rerun it to the end, and check that
    every step's loss, the dumps' ``checked`` fields (bitwise checksums) and the consumed sample ids equal
    the uninterrupted run's. Returns the rerun's dumps."""
    seed = int(os.environ.get("RESUME_TEST_SEED", time.time_ns() % 10_000))
    kill_at = random.Random(seed).randint(3, STEPS - 3)
    print(f"killing at step {kill_at} (RESUME_TEST_SEED={seed})")
    run_dir = run_dir.with_name(f"{run_dir.name}-{seed}")
    proc = subprocess.Popen(command(run_dir), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        reached = wait_for_step(run_dir, kill_at, proc)
    finally:
        kill9_tree(proc)
    assert reached < STEPS and not (run_dir / "model").exists(), "the run finished before the kill"
    run_to_end(command(run_dir))
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == uninterrupted["losses"][step][0] for v in values), step
    mine = dumps(run_dir, 2)
    for dump, ref in zip(mine, uninterrupted["dumps"], strict=True):
        for key in checked:
            assert dump[key] == ref[key], key  # checksums: bitwise identical
    assert consumed(run_dir) == uninterrupted["ids"]
    return mine


def test_kill9_at_a_random_step_then_rerun_is_exact(setup, uninterrupted):
    kill9_then_rerun(lambda run_dir: torchrun(setup, run_dir), setup["root"] / "killed", uninterrupted)


def test_resume_at_another_world_size_takes_the_same_pairs_in_the_same_order(setup, uninterrupted):
    run_dir = setup["root"] / "two-then-one"
    stopped_after(uninterrupted["dir"], run_dir, 6)  # two processes for 6 steps (their checkpoint) ...
    run_to_end(torchrun(setup, run_dir, nproc=1, steps=STEPS))  # ... then one
    assert consumed(run_dir) == uninterrupted["ids"]
    assert dumps(run_dir, 1)[0]["cursor"] == uninterrupted["dumps"][0]["cursor"]
