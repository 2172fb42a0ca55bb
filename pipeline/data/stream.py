"""Streaming training batches with an exact, world-size-free cursor (docs/DESIGN.md, "Training data order").

An epoch is one *global stream*: the manifest's blocks in a seeded permutation, the rows of each block
in a seeded permutation, concatenated. The order is a pure function of (seed, epoch, manifest). The
stream is cut into global batches of G samples; rank r of W takes rows ``[r*G/W, (r+1)*G/W)`` of each.
The last partial global batch is dropped (and counted) so every rank takes the same number of steps:
an uneven split would leave one rank waiting in a collective for ever.

With length bucketing (``bucket_window`` W > 0) the stream is cut into windows of W global batches;
each window's samples are sorted by length (longest first, ties in stream order), cut into W global
batches, and those batches are permuted by a seeded draw. Every rank of a global batch then gets
rows of similar length, so padding to the batch's longest row wastes little. The order stays a pure
function of (seed, epoch, manifest, G, W) and a global batch still holds the same samples at any
world size; only the samples within a window change batches.

Pair shards whose manifest records each block's source are batched by source instead
(:class:`~pipeline.data.sources.SourceOrder`: one source per global batch, or every source in proportion),
also a pure function of (seed, epoch, manifest, G, alpha) cut into global batches the same way.

The cursor is ``(epoch, batches consumed)``: it names a position in the global stream, so it means
the same thing at any world size or number of loader workers. Resuming seeks straight to the block
that holds the next batch (block offsets come from the shards' block indexes, read at start without
reading a block), tokenising nothing that was already consumed.

Loader worker w of K produces the batches ``start + w, start + w + K, ...``; torch's DataLoader hands
out worker outputs round-robin starting at worker 0, which yields them in stream order.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline import distributed
from pipeline.data.collate import Batch
from pipeline.data.sources import BlockSources, SourceOrder
from pipeline.data.token_ids import TOKEN_ID_COLUMNS, ragged_rows
from pipeline.errors import ConfigError, InputError, PipelineError
from pipeline.shards import (
    ShardSet,
    block_index,
    check_block,
    check_shard_size,
    ipc_to_table,
    read_shard_set,
    set_index,
)
from pipeline.vectors import SCALE_COLUMNS, block_teacher, teacher_matrix

log = logging.getLogger(__name__)
POSITIVE_SCALE = SCALE_COLUMNS["teacher_positive"]  # the teacher stage's int8 scales of teacher_positive


# --------------------------------------------------------------------------------------------- index
@dataclass(frozen=True)
class BlockRef:
    """Where one block lives: a byte range inside a shard tar (a tar member's data), with its CRC-32.

    ``lengths`` is each row's length for bucketing (``pipeline.shards.row_lengths``): a view into the
    memory-mapped block index, so holding the refs of 110M rows costs pages only where they are read.
    """

    path: str
    offset: int
    size: int
    rows: int
    lengths: np.ndarray | None = field(default=None, compare=False, repr=False)
    crc32: int | None = None  # None: not checked when read
    block: int = 0  # its number within the shard, for messages


def index_shards(
    shard_set: str | Path | ShardSet, verify: bool = True, check_blocks: bool | None = None
) -> list[BlockRef]:
    """Every block of a shard set (its directory or its :class:`~pipeline.shards.ShardSet`), in manifest
    order, from the manifest and the block index.

    Reads a few bytes per block and two per row (the lengths stay memory-mapped), never the blocks:
    start and resume do not grow with the bytes of the data. Each shard's size is checked here;
    ``verify`` also checks each index's sha256, and ``check_blocks`` (default: ``verify``) makes
    :func:`read_block` check each block's CRC-32 when it reads it.
    """
    check_blocks = verify if check_blocks is None else check_blocks
    info = read_shard_set(shard_set)
    directory, manifest = info.directory, info.manifest
    blocks: list[BlockRef] = []
    whole = set_index(directory, manifest, verify)
    if whole is not None:  # one file for the whole set: what stages of this version write
        names = [str(directory / entry["name"]) for entry in manifest["shards"]]
        if verify:  # a truncated shard is refused here, a modified block when it is read
            for entry in manifest["shards"]:
                check_shard_size(directory, entry)
        first = np.searchsorted(whole.shards, np.arange(len(names)))  # each shard's first block
        for k in range(len(whole)):
            shard = int(whole.shards[k])
            crc = int(whole.crcs[k]) if check_blocks else None
            offset, size, rows = int(whole.offsets[k]), int(whole.sizes[k]), int(whole.rows[k])
            number = k - int(first[shard])  # the block's number within its shard, for messages
            blocks.append(BlockRef(names[shard], offset, size, rows, whole.lengths(k), crc, number))
    for entry in manifest["shards"] if whole is None else []:
        index = block_index(directory, entry, verify)
        path = str(index.shard)
        for k in range(len(index)):
            crc = int(index.crcs[k]) if check_blocks else None
            offset, size, rows = int(index.offsets[k]), int(index.sizes[k]), int(index.rows[k])
            blocks.append(BlockRef(path, offset, size, rows, index.lengths(k), crc, k))
    if not blocks:
        raise InputError(f"{directory} holds no blocks; check the stage that wrote it")
    return blocks


def read_block(ref: BlockRef, columns: Collection[str] | None = None) -> pa.Table:
    """The block's table; with ``columns``, only those of them it holds (the others are not decompressed:
    a training batch reads the ids and the teacher vectors, not the texts beside them)."""
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.size)
    if ref.crc32 is not None:
        check_block(Path(ref.path), ref.block, data, ref.crc32)
    if columns is None:
        return ipc_to_table(data)
    reader = pa.ipc.open_file(pa.BufferReader(data))
    fields = [i for i, name in enumerate(reader.schema.names) if name in columns]
    options = pa.ipc.IpcReadOptions(included_fields=fields, use_threads=False)
    return pa.ipc.open_file(pa.BufferReader(data), options=options).read_all()


# --------------------------------------------------------------------------------------------- order
class EpochOrder:
    """The global stream of one epoch over items grouped in blocks: positions -> (block, row)."""

    def __init__(self, block_rows: Sequence[int], seed: int, epoch: int):
        self.block_rows = np.asarray(block_rows, dtype=np.int64)
        self.seed, self.epoch = seed, epoch
        self.block_order = np.random.default_rng([seed, epoch]).permutation(len(self.block_rows))
        self.ends = np.cumsum(self.block_rows[self.block_order])  # stream end of each permuted block

    @property
    def num_items(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def row_permutation(self, block: int) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch, block]).permutation(int(self.block_rows[block]))

    def locate(self, start: int, stop: int) -> list[tuple[int, np.ndarray]]:
        """Stream positions [start, stop) as (block, row indices) runs, in stream order."""
        out = []
        pos = start
        while pos < stop:
            k = int(np.searchsorted(self.ends, pos, side="right"))
            block = int(self.block_order[k])
            block_start = int(self.ends[k] - self.block_rows[block])
            end = min(stop, int(self.ends[k]))
            perm = self.row_permutation(block)
            out.append((block, perm[pos - block_start : end - block_start]))
            pos = end
        return out


BUCKET_STREAM = 0x6275636B  # keeps the window permutations' seeds apart from the row permutations'


class BucketedOrder:
    """Global batches of one epoch, length-bucketed in windows of ``window`` batches (module docstring).

    ``lengths[block]`` is the length proxy of each row of that block. The last window of an epoch may
    hold fewer than ``window`` batches; the dropped tail stays the stream's last samples, as without
    bucketing. Each worker computes a window once (a sort of window * G lengths) and keeps it.
    """

    def __init__(
        self, order: EpochOrder, lengths: Sequence[np.ndarray], global_batch: int, window: int, batches: int
    ):
        self.order, self.lengths = order, lengths
        self.global_batch, self.window, self.batches = global_batch, window, batches
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None  # (window, blocks, rows) sorted

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is None or self._cached[0] != w:
            G = self.global_batch
            first = w * self.window
            count = min(self.window, self.batches - first)
            runs = self.order.locate(first * G, (first + count) * G)
            blocks = np.concatenate([np.full(len(rows), block, dtype=np.int64) for block, rows in runs])
            rows = np.concatenate([np.asarray(rows, dtype=np.int64) for _, rows in runs])
            lengths = np.concatenate([self.lengths[block][rows] for block, rows in runs]).astype(np.int64)
            by_length = np.argsort(-lengths, kind="stable")  # longest first; ties keep stream order
            seed = np.random.default_rng([self.order.seed, self.order.epoch, BUCKET_STREAM, w])
            batch_order = seed.permutation(count)
            take = (batch_order[:, None] * G + np.arange(G)[None, :]).reshape(-1)
            self._cached = (w, blocks[by_length][take], rows[by_length][take])
        return self._cached[1], self._cached[2]

    def batch_runs(self, batch: int, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """Rows ``[lo, hi)`` of global batch ``batch`` as (block, row indices) runs, in batch order."""
        blocks, rows = self._window(batch // self.window)
        at = (batch % self.window) * self.global_batch
        blocks, rows = blocks[at + lo : at + hi], rows[at + lo : at + hi]
        cuts = np.flatnonzero(np.diff(blocks)) + 1
        return [(int(b[0]), r) for b, r in zip(np.split(blocks, cuts), np.split(rows, cuts)) if len(b)]


@dataclass
class Cursor:
    """Position in the training data: epoch and global batches consumed in it. Stateful."""

    epoch: int = 0
    batches: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])


# --------------------------------------------------------------------------------------------- sources
class ShardSource:
    """Rows of the shard blocks; a small LRU of decoded blocks (a worker revisits a block K batches on)."""

    def __init__(self, blocks: Sequence[BlockRef], columns: Sequence[str], cache_blocks: int = 4):
        self.blocks = list(blocks)
        self.columns = list(columns)
        # what a block is decoded for: the columns, and the int8 scales that go with teacher vectors
        self._wanted = {*self.columns, *(SCALE_COLUMNS[c] for c in self.columns if c in SCALE_COLUMNS)}
        self.cache_blocks = cache_blocks
        self._cache: OrderedDict[int, dict[str, list[Any]]] = OrderedDict()

    @property
    def block_rows(self) -> list[int]:
        return [b.rows for b in self.blocks]

    def _block(self, index: int) -> dict[str, list[Any]]:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        table = read_block(self.blocks[index], self._wanted)
        cols = {}
        for name in self.columns:
            if name == "teacher" and name in table.column_names:  # (rows, D) float32, no Python floats
                cols[name] = block_teacher(table)  # float16, or int8 with its teacher_scale column
            elif name == "teacher_positive" and name in table.column_names:  # pair shards: the partner's
                scale = table.column(POSITIVE_SCALE) if POSITIVE_SCALE in table.column_names else None
                cols[name] = teacher_matrix(table.column(name), scale)  # (rows, D) float32
            elif name in TOKEN_ID_COLUMNS and name in table.column_names:  # int64 arrays, no Python ints
                cols[name] = ragged_rows(table.column(name))
            elif name in table.column_names:
                cols[name] = table.column(name).to_pylist()
            elif name in ("variants", "variant_ops", "variant_input_ids"):
                cols[name] = [[] for _ in range(table.num_rows)]  # preprocess-only shards: no variants
            else:
                raise InputError(f"{self.blocks[index].path}: blocks lack the column {name!r}")
        self._cache[index] = cols
        if len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
        return cols

    @property
    def lengths(self) -> list[np.ndarray] | None:
        if any(b.lengths is None for b in self.blocks):
            return None
        return [b.lengths for b in self.blocks]

    def rows(self, runs: list[tuple[int, np.ndarray]]) -> dict[str, Any]:
        """The columns of the rows ``runs`` names, in run order: a vector column (the teacher's) as one
        (rows, D) array gathered with one index per block, any other as a list.

        One gather per (block, column) instead of a Python step per value: at GPU batch sizes (4,096
        rows) the per-row loop was a large share of a loader worker's time (benchmarks/loader.py).
        """
        parts: dict[str, list[Any]] = {name: [] for name in self.columns}
        for block, rows in runs:
            cols = self._block(block)
            index = np.asarray(rows, dtype=np.int64)
            listed = index.tolist()  # Python ints index a list faster than numpy scalars
            for name in self.columns:
                column = cols[name]
                vector = isinstance(column, np.ndarray)
                parts[name].append(column[index] if vector else [column[i] for i in listed])
        out: dict[str, Any] = {}
        for name, chunks in parts.items():
            if chunks and isinstance(chunks[0], np.ndarray):
                out[name] = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)  # (rows, D)
            else:
                out[name] = chunks[0] if len(chunks) == 1 else list(chain.from_iterable(chunks))
        return out


class MemorySource:
    """Records held in memory (supervised pair/triple files): one block, the same cursor semantics."""

    def __init__(self, records: dict[str, list[Any]], text_columns: Sequence[str] = ()):
        self.records = records
        self.n = len(next(iter(records.values())))
        self.text_columns = list(text_columns)

    @property
    def lengths(self) -> list[np.ndarray] | None:
        """Per record: the most characters of its text columns (None without text columns)."""
        if not self.text_columns:
            return None
        chars = [[len(t) for t in self.records[name]] for name in self.text_columns]
        return [np.max(np.asarray(chars, dtype=np.int64), axis=0)]

    @property
    def block_rows(self) -> list[int]:
        return [self.n]

    def rows(self, runs: list[tuple[int, np.ndarray]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in self.records}
        for _, rows in runs:
            for name, column in self.records.items():
                out[name].extend(column[i] for i in rows)
        return out


# --------------------------------------------------------------------------------------------- dataset
class Delivery(NamedTuple):
    """What a loader worker sends the main process for one batch index: the collator's batch, or the
    error that stopped the worker. The stream's control record, apart from the batches it carries: the
    stream reads it, checks the position and yields ``batch`` alone. (A NamedTuple: the DataLoader's
    pin-memory thread pins the batch inside it.)"""

    epoch: int
    index: int  # the batch's index in its epoch
    batch: Any = None  # the collator's output (the trainer's collators: a Batch)
    error: PipelineError | None = None  # e.g. a damaged block, raised in the main process as one line


class _RankBatches(IterableDataset):
    """This rank's slices of global batches ``start, start+1, ...`` of one epoch, collated in workers."""

    def __init__(
        self,
        source: Any,
        collate: Callable[[dict[str, list[Any]]], Any],
        order: EpochOrder | BucketedOrder | SourceOrder,
        global_batch: int,
        rank: int,
        world: int,
        start: int,
        stop: int,
    ):
        super().__init__()
        self.source, self.collate, self.order = source, collate, order
        self.global_batch, self.rank, self.world = global_batch, rank, world
        self.start, self.stop = start, stop

    def __iter__(self) -> Iterator[Delivery]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        local = self.global_batch // self.world
        for b in range(self.start + worker, self.stop, workers):
            lo = self.rank * local
            if isinstance(self.order, (BucketedOrder, SourceOrder)):
                runs = self.order.batch_runs(b, lo, lo + local)
            else:
                runs = self.order.locate(b * self.global_batch + lo, b * self.global_batch + lo + local)
            try:
                rows = self.source.rows(runs)
            except PipelineError as exc:  # e.g. a damaged block: the main process raises it as one line
                yield Delivery(self.order.epoch, b, error=exc)
                return
            out = self.collate(rows)  # the trainer's collators give a Batch; any value works too
            if isinstance(out, Batch):
                out = out.at(self.order.epoch, b)  # hooks read where a batch came from
            yield Delivery(self.order.epoch, b, out)


class BatchStream:
    """This rank's batches, epoch after epoch; owns the cursor (``state_dict``/``load_state_dict``).

    ``collate(rows) -> Batch`` turns the rows of one rank-slice (a mapping column -> list) into tensors
    (any value works; the stream yields it as the collator gave it, a Batch marked with its position);
    it runs in the loader workers, so it must be picklable. Errors and positions travel beside the
    batches in a :class:`Delivery`, never inside them. The cursor advances when the consumer
    takes a batch, so a checkpoint taken between steps records exactly what was used.
    ``bucket_window`` > 0 turns on length bucketing over windows of that many global batches.
    ``pin_memory``: batches in page-locked memory (a CUDA device), so host-to-device copies are async.
    ``sources`` (the source of each block, pair shards): batches in a
    :class:`~pipeline.data.sources.SourceOrder` of ``source_mode`` ("batch": one source per global batch,
    drawn with probability proportional to size^``source_alpha``; "mixed": every source in proportion).
    """

    def __init__(
        self,
        source: Any,
        collate: Callable[[dict[str, list[Any]]], Any],
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        num_workers: int = 0,
        prefetch_factor: int = 4,
        bucket_window: int = 0,
        pin_memory: bool = False,
        sources: BlockSources | None = None,
        source_alpha: float = 0.5,
        source_mode: str = "batch",
    ):
        if global_batch_size % world_size:
            raise ConfigError(f"global batch {global_batch_size} is not divisible by world size {world_size}")
        self.source, self.collate = source, collate
        self.global_batch, self.rank, self.world = global_batch_size, rank, world_size
        self.seed, self.num_workers, self.prefetch_factor = seed, num_workers, prefetch_factor
        self.pin_memory = pin_memory  # for a CUDA device: the step's .to(device, non_blocking=True) overlaps
        self.block_rows = source.block_rows
        self.num_items = int(sum(self.block_rows))
        self.sources, self.source_alpha, self.source_mode = sources, source_alpha, source_mode
        if sources is not None and bucket_window:
            raise ConfigError(
                "data.length_bucketing sorts batches across sources; set it to false for pair shards "
                "batched by source (docs/pairs.md, 'Training on pairs')"
            )
        self.batches_per_epoch = self.num_items // global_batch_size
        if sources is not None and source_mode == "batch":  # sum over sources of floor(n_s / G)
            self.batches_per_epoch = int((sources.rows(self.block_rows) // global_batch_size).sum())
        self.dropped_per_epoch = self.num_items - self.batches_per_epoch * global_batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"the data has {self.num_items} samples, fewer than one global batch "
                f"({global_batch_size}); lower train.global_batch_size"
            )
        self.bucket_window = bucket_window
        self.lengths = source.lengths if bucket_window else None
        if bucket_window and self.lengths is None:
            raise ConfigError("data.length_bucketing needs row lengths, which this data source lacks")
        if bucket_window and hasattr(source, "cache_blocks"):
            # a window's batches draw rows from every block the window spans: keep them all decoded
            smallest = max(1, min(self.block_rows))
            spanned = -(-bucket_window * global_batch_size // smallest) + 2
            source.cache_blocks = max(source.cache_blocks, min(spanned, len(self.block_rows)))
        self.cursor = Cursor()

    def state_dict(self) -> dict[str, Any]:
        # num_items and global_batch make a cursor from a different dataset or batch size detectable
        state: dict[str, Any] = {
            **self.cursor.state_dict(),
            "global_batch_size": self.global_batch,
            "num_items": self.num_items,
            "seed": self.seed,
            "bucket_window": self.bucket_window,
        }
        if self.sources is not None:  # the order's other inputs (absent: the plain order, as before)
            state["source_mode"], state["source_alpha"] = self.source_mode, self.source_alpha
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        # bucket_window changes which samples a batch holds: a cursor means nothing across it
        mine = (
            ("global_batch_size", self.global_batch),
            ("num_items", self.num_items),
            ("bucket_window", self.bucket_window),
        )
        for key, mine_value in mine:
            if key in state and int(state[key]) != mine_value:
                raise ConfigError(
                    f"the saved data cursor was made with {key}={state[key]}, this run has {mine_value}: "
                    "resume with the same data, train.global_batch_size and data.length_bucketing/"
                    "bucket_window, or start a new run_dir"
                )
        mine_sources = (self.source_mode, self.source_alpha) if self.sources is not None else None
        saved = (state["source_mode"], float(state["source_alpha"])) if "source_mode" in state else None
        if saved != mine_sources:
            raise ConfigError(
                f"the saved data cursor was made with source batching {saved or 'off'}, this run has "
                f"{mine_sources or 'off'}: resume with the same data.one_source_per_batch, "
                "data.source_alpha and pair shards, or start a new run_dir"
            )
        self.cursor.load_state_dict(state)

    def epoch_batches(self) -> Iterator[Any]:
        """The rest of the current epoch from the cursor; moves the cursor to the next epoch at the end."""
        epoch, start = self.cursor.epoch, self.cursor.batches
        if start < self.batches_per_epoch:
            order: EpochOrder | BucketedOrder | SourceOrder = EpochOrder(self.block_rows, self.seed, epoch)
            if self.sources is not None:
                order = SourceOrder(
                    self.block_rows, self.sources, self.global_batch, self.seed, epoch, self.source_alpha,
                    self.source_mode,
                )  # fmt: skip
            elif self.bucket_window:
                order = BucketedOrder(
                    order, self.lengths, self.global_batch, self.bucket_window, self.batches_per_epoch
                )
            dataset = _RankBatches(
                self.source,
                self.collate,
                order,
                self.global_batch,
                self.rank,
                self.world,
                start,
                self.batches_per_epoch,
            )
            # Workers ignore SIGTERM/SIGUSR1: SLURM signals the whole process group, and a worker killed
            # by SIGUSR1's default action would fail the main process before it could checkpoint.
            extra = (
                {
                    "prefetch_factor": self.prefetch_factor,
                    "worker_init_fn": distributed.ignore_preemption_signals,
                }
                if self.num_workers
                else {}
            )
            # A private generator: creating a DataLoader iterator draws a seed, and drawing it from the
            # global RNG would shift every dropout mask after a resume (which creates one mid-run).
            # No persistent_workers: each loader is iterated once (one per epoch, or per rollback), so
            # there is nothing to keep its workers for; they start once per epoch.
            generator = torch.Generator().manual_seed(self.seed)
            loader = DataLoader(
                dataset,
                batch_size=None,
                num_workers=self.num_workers,
                generator=generator,
                pin_memory=self.pin_memory,
                **extra,
            )
            for delivery in loader:
                if delivery.error is not None:
                    raise delivery.error
                assert delivery.index == self.cursor.batches, "loader order broke the cursor"
                self.cursor.batches += 1
                yield delivery.batch
        self.cursor.epoch, self.cursor.batches = epoch + 1, 0

    def __iter__(self) -> Iterator[Any]:
        """Batches for ever, epoch after epoch (the loop decides when to stop). An iterator still open
        when the interpreter exits is closed then, its loader workers with it (see ``_close_at_exit``)."""
        batches = self._forever()
        _open_iterators.add(batches)
        return batches

    def _forever(self) -> Iterator[Any]:
        while True:
            yield from self.epoch_batches()


# Loader workers ignore SIGTERM (above), and at exit multiprocessing stops its daemonic children with
# SIGTERM and then waits for them: a script that leaves a stream iterator open would wait for ever (and
# a build's preemption handler swallows the SIGTERM that would end it). Registered after torch and
# multiprocessing registered theirs, this runs before both (atexit runs last-in, first-out): closing an
# iterator ends its loader, which tells its workers to finish and joins them.
_open_iterators: weakref.WeakSet[Iterator[Any]] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for batches in list(_open_iterators):
        batches.close()
