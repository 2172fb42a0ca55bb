"""What a training run builds from its data, in this package: the sentences its character vocabulary is
built from (:func:`training_texts`) and its batches (:func:`build_stream`), from the resolved
:class:`~pipeline.data.plan.DataPlan`: the source (sentence shards, pair shards or a supervised file),
the collator that turns its rows into a typed :class:`~pipeline.data.collate.Batch`, and the
:class:`~pipeline.data.stream.BatchStream` that orders them over the ranks.

``d`` is the run's ``data`` section and ``t`` its ``train`` section (the trainer's config dataclasses,
passed in: this layer does not import the trainer).
"""

from __future__ import annotations

from typing import Any

from pipeline import distributed as dist
from pipeline.data.collate import MLMCollator, PairCollator, PairShardCollator, ViewCollator, token_layout
from pipeline.data.holdout import split_blocks
from pipeline.data.labelled import memory_columns
from pipeline.data.pairs import read_records
from pipeline.data.plan import DataPlan
from pipeline.data.sources import pair_order
from pipeline.data.stream import BatchStream, MemorySource, ShardSource, index_shards
from pipeline.data.token_ids import tokenising_on_gpu
from pipeline.errors import ConfigError, InputError, PipelineError
from pipeline.shards import ShardSet, read_shard, shard_paths


def training_texts(d: Any, source: str, limit: int) -> list[str]:
    """Sentences of the training data (never the evaluation sets), at most ``limit``: a supervised file's
    texts (not its labels) for ``source`` "pairs" or "triples", else the shards' ``text`` column."""
    if source not in ("shards", "pair_shards"):
        records = read_records(d.supervised_file, source)
        return [t for r in records for t in r[:-1] if isinstance(t, str)][:limit]
    texts: list[str] = []
    for path in shard_paths(d.shards):
        for table in read_shard(path):
            texts.extend(table.column("text").to_pylist())
            if len(texts) >= limit:
                return texts[:limit]
    return texts


def shard_blocks(shards: ShardSet, verify: bool, rank: int) -> list[Any]:
    """Every rank reads the small block indexes itself; rank 0 alone checks their sha256s and broadcasts
    only whether they passed (a message or None), never the index (it grows with the data)."""
    error: str | None = None
    try:
        blocks = index_shards(shards, verify=verify and rank == 0, check_blocks=verify)
    except PipelineError as exc:
        blocks, error = [], f"{type(exc).__name__}\0{exc}"
    error = dist.broadcast_object(error)
    if error is not None:
        kind, message = error.split("\0", 1)
        raise (InputError if kind == "InputError" else ConfigError)(message)
    return blocks


def build_stream(
    plan: DataPlan,
    d: Any,
    t: Any,
    tokenizer: Any,
    rank: int,
    world: int,
    prefix: str = "",
    device: str = "cpu",
    workers: int = 0,
    model: str | None = None,
) -> BatchStream:
    """This rank's batches, as ``plan`` resolved them. ``prefix`` is the encoder's text prefix, put
    before every text once; ``workers`` the loader processes (``data.num_workers`` resolved for the
    device); on ``device`` cuda the batches are pinned. ``model``: the encoder's name, for the one line a
    CUDA run that tokenises in its loader gets."""
    tokenising_on_gpu(device, plan.shard_set, plan.token_ids, plan.pairs, d.max_length, model)  # one line
    order: dict[str, Any] = {}  # pair shards: their batch order by source (pipeline/data/sources.py)
    if plan.pairs:  # pair shards: anchors then positives (docs/pairs.md)
        blocks = shard_blocks(plan.shard_set, d.verify_shards, rank)
        # with teacher_positive: distill reads both
        # luse on pairs: d dropout re-encodings of the anchors; a user's pairs: their listed negatives
        collate = PairShardCollator(
            tokenizer, d.max_length, prefix, plan.teacher, plan.text_hashes, plan.num_dropout_views,
            plan.num_hard_negatives,
        )  # fmt: skip
        source: Any = ShardSource(blocks, collate.columns)
        order = pair_order(d, plan.shard_set, blocks)
    elif plan.shard_set is not None:
        blocks = shard_blocks(plan.shard_set, d.verify_shards, rank)
        blocks, _ = split_blocks(blocks, d.holdout_rows, d.shards)  # data.holdout_rows: never in a batch
        collate = ViewCollator(
            tokenizer, d.max_length, plan.num_variants, plan.num_dropout_views, prefix, plan.teacher,
            plan.num_hard_negatives, plan.token_ids, plan.text_hashes,
        )  # fmt: skip
        source = ShardSource(blocks, collate.columns)
        if plan.mlm_probability is not None:  # masks drawn in the loader workers, from the data cursor
            collate = MLMCollator(collate, tokenizer, t.seed, plan.mlm_probability)
    else:  # a supervised file (and its teacher vectors: pipeline/data/labelled.py)
        labels = plan.label_dtype is not None
        columns = memory_columns(d.supervised_file, plan.source, plan.num_texts, labels, plan.pair_teacher,
                                 d.holdout_rows)  # fmt: skip
        text_columns = [f"text{i}" for i in range(plan.num_texts)]
        collate = PairCollator(tokenizer, d.max_length, text_columns, plan.label_dtype, prefix, plan.teacher)
        source = MemorySource(columns, text_columns)
    collate = token_layout(collate, tokenizer.pad_token_id, d.max_length, t)  # unpadded / bucketed widths
    window = d.bucket_window if d.length_bucketing else 0
    return BatchStream(
        source, collate, t.global_batch_size, rank, world, t.seed, workers, d.prefetch_factor, window,
        pin_memory=device == "cuda", **order,
    )  # fmt: skip
