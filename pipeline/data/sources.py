"""Pair shards as training data (docs/pairs.md, "Training on pairs").

:func:`pair_batches` decides, from the loss and the shard set's manifest, whether a run's batches are
pairs (anchor, positive): with the ``pairs`` term, with ``luse`` (a sentence-shard term that
:attr:`~pipeline.losses.terms.LossTerm.trains_on_pairs`: its views of a pair are the anchor, the positive
and :func:`pair_dropout_views` re-encodings of the anchor), or with no main term (distillation alone)
over pair shards, which then distils both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.errors import ConfigError
from pipeline.shards import ShardSet


def pair_batches(loss: Any, shard_set: ShardSet | None) -> bool:
    """Whether the run's batches are pairs; a ConfigError when the loss and the shards do not fit."""
    if shard_set is None:
        return False
    pairs = shard_set.holds_pairs
    if loss.data == "pair_shards" and not pairs:
        raise ConfigError(
            f"loss term {loss.main.name} reads pair shards, but {shard_set.directory} holds sentences "
            f"(stage {shard_set.stage}); point data.shards to the output of `pipeline pairs` (or of "
            "`pipeline teacher` over it)"
        )
    if pairs and loss.main is not None and loss.data != "pair_shards" and not loss.main.trains_on_pairs:
        raise ConfigError(
            f"{shard_set.directory} holds pairs (`pipeline pairs`); loss term {loss.main.name} reads "
            "sentence shards: use the pairs or luse term, or distill/kl alone (docs/pairs.md, 'Training on "
            "pairs')"
        )
    return pairs


def pair_dropout_views(loss: Any, data: Any) -> int:
    """d: the dropout re-encodings of the anchor a batch of pair shards carries after (anchor, positive):
    ``data.num_dropout_views`` for a main term that trains on pairs (luse), else 0. Pair shards cache no EDA
    variants: such a term with ``data.num_variants`` > 0 is a ConfigError, as is an option of the term
    that does not apply to pairs (the term's ``pair_views`` says)."""
    main = loss.main
    if main is None or not main.trains_on_pairs:
        return 0
    if data.num_variants:
        raise ConfigError(
            f"data.num_variants={data.num_variants} but pair shards cache no EDA variants; {main.name} on "
            "pairs reads the anchor, the positive and data.num_dropout_views re-encodings of the anchor: set "
            "data.num_variants: 0"
        )
    config = next(t.config for t in loss.terms if t.term is main)
    return main.pair_views(config, data.num_dropout_views) - 2


# --------------------------------------------------------------------------------------------- sources
SOURCE_STREAM = 0x736F7572  # keeps the source orders' seeds apart from EpochOrder's and the buckets'
BLOCK_SOURCES = "block_sources"  # a pair shard's manifest entry: the source of each of its blocks


@dataclass(frozen=True)
class BlockSources:
    """The source of every block of a shard set (in :func:`pipeline.data.stream.index_shards` order), from
    the manifest's per-shard ``block_sources`` record: known at start without reading a block."""

    names: tuple[str, ...]  # the sources, sorted
    of_block: np.ndarray  # (blocks,) int64: index into names

    def rows(self, block_rows: Sequence[int]) -> np.ndarray:
        """(sources,) int64: rows of each source."""
        rows = np.asarray(block_rows, dtype=np.int64)
        return np.bincount(self.of_block, weights=rows, minlength=len(self.names)).astype(np.int64)


def block_sources(shard_set: ShardSet, blocks: Sequence[Any], option: str) -> BlockSources:
    """Each block's source from the manifest; a ConfigError (naming ``option`` and the fix) when a shard's
    entry lacks the record or it does not match the shard's blocks (``blocks``: BlockRefs with ``path``)."""
    entries = shard_set.manifest.get("shards", [])
    fix = "re-run `python -m pipeline pairs` (and the teacher stage over its output) with this version"
    per_shard: list[str] = []
    for entry in entries:
        recorded = entry.get(BLOCK_SOURCES)
        if not isinstance(recorded, list) or any(not isinstance(s, str) for s in recorded):
            raise ConfigError(
                f"{option}: {shard_set.directory} records no source per block (shard {entry.get('name')}); "
                f"{fix}"
            )
        per_shard.extend(recorded)
    counts: dict[str, int] = {}
    for ref in blocks:  # blocks come shard by shard, in manifest order
        counts[str(ref.path)] = counts.get(str(ref.path), 0) + 1
    expected = [counts.get(str(shard_set.directory / e["name"]), 0) for e in entries]
    recorded_counts = [len(e[BLOCK_SOURCES]) for e in entries]
    if expected != recorded_counts:
        raise ConfigError(
            f"{option}: the source record of {shard_set.directory} does not match its blocks; {fix}"
        )
    names = tuple(sorted(set(per_shard)))
    index = {name: i for i, name in enumerate(names)}
    return BlockSources(names, np.asarray([index[s] for s in per_shard], dtype=np.int64))


class SourceOrder:
    """The global batches of one epoch, each from one source (``mode`` "batch"), or each holding every
    source in proportion to its size (``mode`` "mixed"): a pure function of (seed, epoch, the blocks and
    their sources, G, alpha), so the cursor (epoch, batches consumed) means the same at any world size.

    Every source s (n_s rows) is an endless stream: its blocks in a seeded permutation, the rows of each
    block in a seeded permutation, and a new pair of permutations on each wrap (seeds
    ``[seed, epoch, SOURCE_STREAM, s, wrap(, block)]``).

    ``batch``: the epoch has ``sum_s floor(n_s / G)`` global batches; the source of each is drawn with
    probability ``n_s^alpha / sum_t n_t^alpha`` over the sources with n_s >= G (one seeded draw for the
    epoch). Each wrap of source s gives m_s = floor(n_s / G) batches, its first m_s G rows (the last
    n_s mod G rows of that permutation are skipped, so no batch spans two wraps or holds a row twice):
    the k-th batch of s is batch k mod m_s of wrap floor(k / m_s). A source drawn more often than m_s
    times wraps (alpha < 1 up-samples small sources); one drawn less leaves its tail to the next epoch's
    fresh permutation.

    ``mixed``: the epoch has ``floor(N / G)`` global batches; batch b takes a seeded multinomial share of
    G rows from each source (probabilities n_s / N), the next rows of each source's stream, in a seeded
    permutation of the batch (a share that crosses a wrap may repeat a row of that source within the
    batch: the pairs term masks it as a pair of its own group). Rank r of W takes rows
    [r G / W, (r + 1) G / W) of a global batch either way.
    """

    def __init__(
        self,
        block_rows: Sequence[int],
        sources: BlockSources,
        global_batch: int,
        seed: int,
        epoch: int,
        alpha: float = 0.5,
        mode: str = "batch",
    ):
        if mode not in ("batch", "mixed"):
            raise ValueError(f"mode must be batch or mixed, got {mode!r}")
        self.block_rows = np.asarray(block_rows, dtype=np.int64)
        self.sources, self.global_batch, self.seed, self.epoch = sources, global_batch, seed, epoch
        self.mode = mode
        self.rows = sources.rows(self.block_rows)  # (S,)
        self.blocks_of = [np.flatnonzero(sources.of_block == s) for s in range(len(sources.names))]
        G = global_batch
        rng = np.random.default_rng([seed, epoch, SOURCE_STREAM])
        if mode == "batch":
            per_source = self.rows // G
            self.num_batches = int(per_source.sum())
            weights = np.where(per_source > 0, self.rows.astype(np.float64) ** alpha, 0.0)
            self.probabilities = weights / weights.sum() if weights.sum() else weights
            self.draw = (
                rng.choice(len(self.rows), size=self.num_batches, p=self.probabilities)
                if self.num_batches
                else np.zeros(0, dtype=np.int64)
            )  # (batches,) the source of each global batch
            self.kth = np.zeros(self.num_batches, dtype=np.int64)  # (batches,) its index among its source's
            for s in range(len(self.rows)):
                at = np.flatnonzero(self.draw == s)
                self.kth[at] = np.arange(len(at))
        else:
            self.num_batches = int(self.rows.sum()) // G
            self.probabilities = self.rows / max(1, int(self.rows.sum()))
            self.shares = rng.multinomial(G, self.probabilities, size=self.num_batches)  # (batches, S)
            self.starts = np.cumsum(self.shares, axis=0) - self.shares  # (batches, S) exclusive
        self._wraps: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _wrap(self, s: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(block order, stream ends) of wrap w of source s."""
        key = (s, w)
        if key not in self._wraps:
            if len(self._wraps) > 4 * len(self.rows):  # a worker walks forwards: keep the recent ones
                self._wraps.clear()
            blocks = self.blocks_of[s]
            rng = np.random.default_rng([self.seed, self.epoch, SOURCE_STREAM, s, w])
            order = blocks[rng.permutation(len(blocks))]
            self._wraps[key] = (order, np.cumsum(self.block_rows[order]))
        return self._wraps[key]

    def locate(self, s: int, start: int, stop: int) -> list[tuple[int, np.ndarray]]:
        """Positions [start, stop) of source s's endless stream as (block, row indices) runs."""
        n = int(self.rows[s])
        out = []
        pos = start
        while pos < stop:
            w, offset = divmod(pos, n)
            order, ends = self._wrap(s, w)
            k = int(np.searchsorted(ends, offset, side="right"))
            block = int(order[k])
            block_start = int(ends[k] - self.block_rows[block])
            end = min(stop - w * n, int(ends[k]))
            perm = np.random.default_rng([self.seed, self.epoch, SOURCE_STREAM, s, w, block]).permutation(
                int(self.block_rows[block])
            )
            out.append((block, perm[offset - block_start : end - block_start]))
            pos = w * n + end
        return out

    def batch_source(self, batch: int) -> int | None:
        """The source of global batch ``batch`` (None in mixed mode)."""
        return int(self.draw[batch]) if self.mode == "batch" else None

    def batch_runs(self, batch: int, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """Rows ``[lo, hi)`` of global batch ``batch`` as (block, row indices) runs, in batch order."""
        G = self.global_batch
        if self.mode == "batch":  # the k-th batch of s: batch k mod m_s of wrap k div m_s (class docstring)
            s, k = int(self.draw[batch]), int(self.kth[batch])
            wrap, within = divmod(k, int(self.rows[s]) // G)
            base = wrap * int(self.rows[s]) + within * G  # a batch never spans two wraps: no row twice
            return self.locate(s, base + lo, base + hi)
        blocks, rows = [], []
        for s in np.flatnonzero(self.shares[batch]):
            start = int(self.starts[batch, s])
            for block, r in self.locate(int(s), start, start + int(self.shares[batch, s])):
                blocks.append(np.full(len(r), block, dtype=np.int64))
                rows.append(np.asarray(r, dtype=np.int64))
        mix_seed = [self.seed, self.epoch, SOURCE_STREAM, len(self.rows), batch]  # apart from the streams'
        mix = np.random.default_rng(mix_seed).permutation(G)
        b, r = np.concatenate(blocks)[mix][lo:hi], np.concatenate(rows)[mix][lo:hi]
        cuts = np.flatnonzero(np.diff(b)) + 1
        return [(int(x[0]), y) for x, y in zip(np.split(b, cuts), np.split(r, cuts)) if len(x)]


def pair_order(data: Any, shard_set: ShardSet, blocks: Sequence[Any]) -> dict[str, Any]:
    """The batch order of pair shards, as :class:`~pipeline.data.stream.BatchStream` keyword arguments,
    from ``data`` (the training config's section), after checking ``data.pair_max_rank``.

    With the manifest's per-block source record the batches follow a :class:`SourceOrder`: one source per
    global batch with ``data.one_source_per_batch``, else every source in proportion ("mixed": pair
    shards' blocks hold one source each, so the plain block-local order would give near single-source
    batches). Without the record (shards of an earlier version): the plain order, and
    ``one_source_per_batch`` is refused.
    """
    check_pair_rank(data.pair_max_rank, shard_set)
    if not all(BLOCK_SOURCES in e for e in shard_set.manifest.get("shards", [])):
        if data.one_source_per_batch:
            block_sources(shard_set, blocks, "data.one_source_per_batch")  # raises, naming the fix
        return {}
    if data.length_bucketing:
        raise ConfigError(
            f"data.length_bucketing: {shard_set.directory} holds pairs, batched by source (docs/pairs.md, "
            "'Training on pairs'); set data.length_bucketing: false"
        )
    return {
        "sources": block_sources(shard_set, blocks, "data.one_source_per_batch"),
        "source_alpha": data.source_alpha,
        "source_mode": "batch" if data.one_source_per_batch else "mixed",
    }


def check_pair_rank(max_rank: int, shard_set: ShardSet) -> None:
    """``data.pair_max_rank`` k > 0: the shards must hold only pairs the teacher's consistency filter
    ranked within k, i.e. the teacher stage ran with ``--pair-top-k`` between 1 and k (it drops the rest
    when it writes the shards, so the data order and its cursor never skip a row)."""
    if not max_rank:
        return
    recorded = (shard_set.manifest.get("pair_filter") or {}).get("k")
    if not isinstance(recorded, int) or not 1 <= recorded <= max_rank:
        got = "no consistency filter" if recorded is None else f"--pair-top-k {recorded} (0 keeps all)"
        raise ConfigError(
            f"data.pair_max_rank={max_rank} but {shard_set.directory} was written with {got}; run "
            f"`python -m pipeline teacher --shards PAIRS --out NEW_DIR --pair-top-k {max_rank}` and train on "
            "NEW_DIR"
        )


def refuse_pair_options(data: Any, pairs: bool) -> None:
    """The pair-shard data options on other data are a ConfigError."""
    if not pairs and (data.one_source_per_batch or data.pair_max_rank):
        raise ConfigError(
            "data.one_source_per_batch and data.pair_max_rank read pair shards (`python -m pipeline pairs`, "
            "then teacher); unset them or point data.shards to pair shards"
        )
