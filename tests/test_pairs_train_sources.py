"""One source per global batch over pair shards (pipeline/data/sources.py, docs/pairs.md "Training on
pairs"): the pairs stage writes single-source blocks and records them, the teacher stage carries the record,
the order is single-source, follows size^alpha, is a pure function of its inputs and of no world size."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.sources import BlockSources, SourceOrder, check_pair_rank, pair_order
from pipeline.errors import ConfigError
from pipeline.resources import ROOT as RESOURCES
from pipeline.shards import read_manifest, read_shard, read_shard_set

BUNDLED = RESOURCES / "corpus" / "pairs"


def synthetic(sizes: list[int], block: int = 100) -> tuple[list[int], BlockSources]:
    """Blocks of ``block`` rows (a short last one per source), sources interleaved across the blocks."""
    rows, of = [], []
    for s, n in enumerate(sizes):
        full, rest = divmod(n, block)
        rows += [block] * full + ([rest] if rest else [])
        of += [s] * (full + bool(rest))
    perm = np.random.default_rng(1).permutation(len(rows))  # blocks of a source need not be adjacent
    names = tuple(f"s{i}" for i in range(len(sizes)))
    return [rows[i] for i in perm], BlockSources(names, np.asarray(of, dtype=np.int64)[perm])


def global_rows(order: SourceOrder, batch: int, world: int = 1) -> list[tuple[int, int]]:
    """(block, row) of every row of global batch ``batch``, ranks concatenated."""
    local = order.global_batch // world
    out = []
    for r in range(world):
        for block, rows in order.batch_runs(batch, r * local, (r + 1) * local):
            out += [(block, int(i)) for i in rows]
    return out


def test_every_global_batch_holds_one_source_and_the_epoch_length_is_the_sum_of_floors():
    sizes = [1000, 4000, 16000, 50]  # the last is smaller than a batch: never drawn
    rows, sources = synthetic(sizes)
    order = SourceOrder(rows, sources, 64, seed=3, epoch=0, alpha=0.5)
    assert order.num_batches == sum(n // 64 for n in sizes) == 15 + 62 + 250
    for b in range(order.num_batches):
        got = global_rows(order, b)
        assert len(got) == 64 and len(set(got)) == 64
        assert {int(sources.of_block[block]) for block, _ in got} == {order.batch_source(b)}
    assert 3 not in set(order.draw.tolist())


def test_source_frequencies_follow_size_to_the_alpha():
    sizes = [10_000, 40_000, 160_000]
    rows, sources = synthetic(sizes, block=500)
    for alpha in (0.0, 0.5, 1.0):
        counts: Counter = Counter()
        for epoch in range(4):  # 4 x 13,125 draws
            counts.update(SourceOrder(rows, sources, 16, 0, epoch, alpha).draw.tolist())
        total = sum(counts.values())
        weights = np.asarray(sizes, dtype=float) ** alpha
        for s, p in enumerate(weights / weights.sum()):
            assert abs(counts[s] / total - p) < 0.01, (alpha, s, counts[s] / total, p)


def test_each_source_walks_a_permutation_of_its_rows_and_a_new_one_on_each_wrap():
    rows, sources = synthetic([640, 6400], block=64)
    order = SourceOrder(rows, sources, 32, seed=5, epoch=0, alpha=0.0)  # uniform: the small one wraps
    small = [b for b in range(order.num_batches) if order.batch_source(b) == 0]
    assert len(small) > 40  # about half of 220 batches: 20 batches of rows, wrapped twice or more
    stream = [x for b in small for x in global_rows(order, b)]
    first, second = stream[:640], stream[640:1280]
    assert len(set(first)) == len(set(second)) == 640 and set(first) == set(second)  # each wrap: every row
    assert first != second  # a new permutation


def test_the_order_is_a_pure_function_of_its_inputs_and_of_no_world_size():
    rows, sources = synthetic([3000, 7000, 900])
    a = SourceOrder(rows, sources, 64, seed=11, epoch=2, alpha=0.5)
    b = SourceOrder(rows, sources, 64, seed=11, epoch=2, alpha=0.5)
    assert np.array_equal(a.draw, b.draw)
    for batch in (0, 7, a.num_batches - 1):
        whole = global_rows(a, batch)
        assert global_rows(b, batch) == whole
        for world in (2, 4, 8):  # rank slices, concatenated in rank order, are the global batch
            assert global_rows(b, batch, world) == whole
    assert not np.array_equal(SourceOrder(rows, sources, 64, seed=12, epoch=2).draw, a.draw)
    assert not np.array_equal(SourceOrder(rows, sources, 64, seed=11, epoch=3).draw, a.draw)


def test_mixed_batches_hold_every_source_in_proportion():
    sizes = [2000, 6000]
    rows, sources = synthetic(sizes)
    order = SourceOrder(rows, sources, 64, seed=0, epoch=0, mode="mixed")
    assert order.num_batches == sum(sizes) // 64
    seen = Counter()
    for b in range(order.num_batches):
        got = global_rows(order, b)
        assert len(set(got)) == 64
        seen.update(int(sources.of_block[block]) for block, _ in got)
        assert global_rows(order, b, world=4) == got
    assert abs(seen[0] / sum(seen.values()) - 0.25) < 0.01
    mixed = sum(len({int(sources.of_block[k]) for k, _ in global_rows(order, b)}) > 1 for b in range(20))
    assert mixed == 20


# --------------------------------------------------------------------------------------------- the stages
@pytest.fixture(scope="module")
def stage_outputs(tmp_path_factory):
    """The bundled real pairs through the pairs stage and a tiny teacher that drops some (top-2 of 8)."""
    import gzip
    import json

    from _tiny_models import build_char_encoder

    from pipeline.stages.pairs.run import Config, run
    from pipeline.stages.teacher.run import Config as TeacherConfig
    from pipeline.stages.teacher.run import run as teacher_run

    root = tmp_path_factory.mktemp("sources")
    pairs = root / "pairs"
    options = {"pairs_per_shard": 700, "rows_per_block": 64, "progress": False}
    assert run(Config(inputs=[BUNDLED], out=pairs, **options)) == 0
    texts = []
    for path in sorted(BUNDLED.glob("*.gz")):
        for line in gzip.open(path, "rt", encoding="utf-8"):
            texts += [v for v in json.loads(line).values() if isinstance(v, str)][:6]
    teacher = build_char_encoder(root / "teacher", texts, 24, 48, 260, max_length=64)
    taught = root / "taught"
    cfg = TeacherConfig(shards=pairs, out=taught, model=str(teacher), batch_size=64, progress=False,
                        pair_top_k=2, pair_pool=8)  # fmt: skip
    assert teacher_run(cfg) == 0
    return {"pairs": pairs, "taught": taught}


def block_source_rows(directory: Path) -> list[tuple[list[str], list[set[str]]]]:
    out = []
    for entry in read_manifest(directory)["shards"]:
        blocks = [set(b.column("source").to_pylist()) for b in read_shard(directory / entry["name"])]
        out.append((entry["block_sources"], blocks))
    return out


@pytest.mark.parametrize("which", ["pairs", "taught"])
def test_the_stages_write_single_source_blocks_and_record_each_blocks_source(stage_outputs, which):
    shards = block_source_rows(stage_outputs[which])
    assert sum(len(recorded) for recorded, _ in shards) > 5
    for recorded, blocks in shards:
        assert [{s} for s in recorded] == blocks  # one source a block, the one recorded
    by_source = read_manifest(stage_outputs["pairs"])["counts"]["by_source"]
    assert {s for recorded, _ in shards for s in recorded} == {s for s, c in by_source.items() if c["kept"]}
    assert len(by_source) >= 3


def _data(**fields):
    from pipeline.train.config import DataConfig

    return DataConfig(**{"length_bucketing": False, **fields})


def test_the_trainer_reads_the_record_without_reading_a_block(stage_outputs):
    from pipeline.data.stream import index_shards

    shard_set = read_shard_set(stage_outputs["taught"])
    blocks = index_shards(shard_set)
    got = pair_order(_data(one_source_per_batch=True, source_alpha=0.3), shard_set, blocks)
    assert got["source_mode"] == "batch" and got["source_alpha"] == 0.3
    assert len(got["sources"].of_block) == len(blocks)
    assert pair_order(_data(), shard_set, blocks)["source_mode"] == "mixed"
    with pytest.raises(ConfigError, match="length_bucketing"):
        pair_order(_data(length_bucketing=True), shard_set, blocks)


def test_shards_without_the_record_are_refused_with_the_fix(stage_outputs, tmp_path):
    import shutil

    from pipeline.data.stream import index_shards
    from pipeline.shards import write_manifest

    copy = tmp_path / "old"
    shutil.copytree(stage_outputs["pairs"], copy)
    manifest = read_manifest(copy)
    for entry in manifest["shards"]:
        entry.pop("block_sources")
    write_manifest(copy, manifest)
    shard_set = read_shard_set(copy)
    blocks = index_shards(shard_set)
    with pytest.raises(ConfigError, match=r"records no source per block.*pipeline pairs"):
        pair_order(_data(one_source_per_batch=True), shard_set, blocks)
    assert pair_order(_data(), shard_set, blocks) == {}  # the plain order, as before the record


def test_pair_max_rank_checks_the_teachers_filter(stage_outputs):
    check_pair_rank(2, read_shard_set(stage_outputs["taught"]))  # filtered with --pair-top-k 2
    check_pair_rank(0, read_shard_set(stage_outputs["pairs"]))
    with pytest.raises(ConfigError, match="--pair-top-k 1"):
        check_pair_rank(1, read_shard_set(stage_outputs["taught"]))
    with pytest.raises(ConfigError, match="no consistency filter"):
        check_pair_rank(2, read_shard_set(stage_outputs["pairs"]))
