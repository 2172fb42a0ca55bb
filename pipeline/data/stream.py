"""Streaming training batches with an exact, world-size-free cursor (docs/DESIGN.md, "Training data order").

An epoch is one *global stream*: the manifest's blocks in a seeded permutation, the rows of each block
in a seeded permutation, concatenated. The order is a pure function of (seed, epoch, manifest). The
stream is cut into global batches of G samples; rank r of W takes rows ``[r*G/W, (r+1)*G/W)`` of each.
The last partial global batch is dropped (and counted) so every rank takes the same number of steps:
an uneven split would leave one rank waiting in a collective for ever.

The cursor is ``(epoch, batches consumed)``: it names a position in the global stream, so it means
the same thing at any world size or number of loader workers. Resuming seeks straight to the block
that holds the next batch (block offsets are in the index built at start), tokenising nothing that
was already consumed.

Loader worker w of K produces the batches ``start + w, start + w + K, ...``; torch's DataLoader hands
out worker outputs round-robin starting at worker 0, which yields them in stream order.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.errors import ConfigError, InputError
from pipeline.shards import ipc_to_table, iter_blocks, read_manifest, verify_shard
from pipeline.train.signals import ignore_preemption_signals

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- index
@dataclass(frozen=True)
class BlockRef:
    """Where one block lives: a byte range inside a shard tar (a tar member's data)."""

    path: str
    offset: int
    size: int
    rows: int


def index_shards(directory: str | Path, verify: bool = True) -> list[BlockRef]:
    """Every block of a shard directory, in manifest order, with its byte range and row count.

    Reads each block once (row counts are not in the manifest). Call it on one rank and broadcast.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"data.shards: {directory} is not a directory; run preprocess/augment first")
    manifest = read_manifest(directory)
    blocks: list[BlockRef] = []
    for entry in manifest["shards"]:
        path = verify_shard(directory, entry) if verify else directory / entry["name"]
        for member, table in iter_blocks(path):
            blocks.append(BlockRef(str(path), member.offset_data, member.size, table.num_rows))
    if not blocks:
        raise InputError(f"{directory} holds no blocks; check the stage that wrote it")
    return blocks


def read_block(ref: BlockRef) -> pa.Table:
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        return ipc_to_table(f.read(ref.size))


def cached_variants(directory: str | Path) -> int:
    """How many variants per sentence the augment stage cached (0 for shards without the column)."""
    manifest = read_manifest(directory)

    def find(node: Any) -> int | None:
        if isinstance(node, dict):
            if isinstance(node.get("num_variants"), int):
                return node["num_variants"]
            for value in node.values():
                if (found := find(value)) is not None:
                    return found
        return None

    found = find(manifest.get("config", {}))
    if found is not None:
        return found
    first = Path(directory) / manifest["shards"][0]["name"]
    for _, table in iter_blocks(first):
        if "variants" not in table.column_names:
            return 0
        return max((len(v) for v in table.column("variants").to_pylist()), default=0)
    return 0


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
        self.cache_blocks = cache_blocks
        self._cache: OrderedDict[int, dict[str, list[Any]]] = OrderedDict()

    @property
    def block_rows(self) -> list[int]:
        return [b.rows for b in self.blocks]

    def _block(self, index: int) -> dict[str, list[Any]]:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        table = read_block(self.blocks[index])
        cols = {}
        for name in self.columns:
            if name in table.column_names:
                cols[name] = table.column(name).to_pylist()
            elif name in ("variants", "variant_ops"):
                cols[name] = [[] for _ in range(table.num_rows)]  # preprocess-only shards: no variants
            else:
                raise InputError(f"{self.blocks[index].path}: blocks lack the column {name!r}")
        self._cache[index] = cols
        if len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
        return cols

    def rows(self, runs: list[tuple[int, np.ndarray]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in self.columns}
        for block, rows in runs:
            cols = self._block(block)
            for name in self.columns:
                column = cols[name]
                out[name].extend(column[i] for i in rows)
        return out


class MemorySource:
    """Records held in memory (supervised pair/triple files): one block, the same cursor semantics."""

    def __init__(self, records: dict[str, list[Any]]):
        self.records = records
        self.n = len(next(iter(records.values())))

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
class _RankBatches(IterableDataset):
    """This rank's slices of global batches ``start, start+1, ...`` of one epoch, collated in workers."""

    def __init__(
        self,
        source: Any,
        collate: Callable[[dict[str, list[Any]]], Any],
        order: EpochOrder,
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

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        local = self.global_batch // self.world
        for b in range(self.start + worker, self.stop, workers):
            first = b * self.global_batch + self.rank * local
            rows = self.source.rows(self.order.locate(first, first + local))
            yield {"epoch": self.order.epoch, "batch": b, **self.collate(rows)}


class BatchStream:
    """This rank's batches, epoch after epoch; owns the cursor (``state_dict``/``load_state_dict``).

    ``collate(rows) -> dict`` turns the rows of one rank-slice (a mapping column -> list) into tensors;
    it runs in the loader workers, so it must be picklable. The cursor advances when the consumer
    takes a batch, so a checkpoint taken between steps records exactly what was used.
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
    ):
        if global_batch_size % world_size:
            raise ConfigError(f"global batch {global_batch_size} is not divisible by world size {world_size}")
        self.source, self.collate = source, collate
        self.global_batch, self.rank, self.world = global_batch_size, rank, world_size
        self.seed, self.num_workers, self.prefetch_factor = seed, num_workers, prefetch_factor
        self.block_rows = source.block_rows
        self.num_items = int(sum(self.block_rows))
        self.batches_per_epoch = self.num_items // global_batch_size
        self.dropped_per_epoch = self.num_items - self.batches_per_epoch * global_batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"the data has {self.num_items} samples, fewer than one global batch "
                f"({global_batch_size}); lower train.global_batch_size"
            )
        self.cursor = Cursor()

    def state_dict(self) -> dict[str, int]:
        # num_items and global_batch make a cursor from a different dataset or batch size detectable
        return {
            **self.cursor.state_dict(),
            "global_batch_size": self.global_batch,
            "num_items": self.num_items,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("global_batch_size", self.global_batch), ("num_items", self.num_items)):
            if key in state and int(state[key]) != mine:
                raise ConfigError(
                    f"the saved data cursor was made with {key}={state[key]}, this run has {mine}: "
                    "resume with the same data and train.global_batch_size, or start a new run_dir"
                )
        self.cursor.load_state_dict(state)

    def epoch_batches(self) -> Iterator[dict[str, Any]]:
        """The rest of the current epoch from the cursor; moves the cursor to the next epoch at the end."""
        epoch, start = self.cursor.epoch, self.cursor.batches
        if start < self.batches_per_epoch:
            dataset = _RankBatches(
                self.source,
                self.collate,
                EpochOrder(self.block_rows, self.seed, epoch),
                self.global_batch,
                self.rank,
                self.world,
                start,
                self.batches_per_epoch,
            )
            # Workers ignore SIGTERM/SIGUSR1: SLURM signals the whole process group, and a worker killed
            # by SIGUSR1's default action would fail the main process before it could checkpoint.
            extra = (
                {"prefetch_factor": self.prefetch_factor, "worker_init_fn": ignore_preemption_signals}
                if self.num_workers
                else {}
            )
            # A private generator: creating a DataLoader iterator draws a seed, and drawing it from the
            # global RNG would shift every dropout mask after a resume (which creates one mid-run).
            generator = torch.Generator().manual_seed(self.seed)
            loader = DataLoader(
                dataset, batch_size=None, num_workers=self.num_workers, generator=generator, **extra
            )
            for batch in loader:
                assert batch["batch"] == self.cursor.batches, "loader order broke the cursor"
                self.cursor.batches += 1
                yield batch
        self.cursor.epoch, self.cursor.batches = epoch + 1, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches for ever, epoch after epoch (the loop decides when to stop)."""
        while True:
            yield from self.epoch_batches()


# --------------------------------------------------------------------------------------------- collate
class FastEncoder:
    """Tokenise a list of texts to padded (N, L) int64 arrays with the Rust tokenizer directly.

    Gives the same ids and mask as ``tokenizer(texts, padding=True, truncation=True, max_length=L)``
    (tested) at about twice the speed: transformers' conversion of the encodings to tensors costs as
    much as the tokenisation itself. The backend is copied, so the caller's tokenizer is untouched.
    ``prefix`` (the encoder's, e.g. e5's "query: ") goes before every text, as in ``SentenceEncoder``.
    """

    def __init__(self, tokenizer: Any, max_length: int, prefix: str = ""):
        from tokenizers import Tokenizer

        self.prefix = prefix

        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.backend.enable_truncation(max_length=max_length)
        self.backend.enable_padding(pad_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token)

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # encode_batch_fast skips character offsets, which we never use (tokenizers >= 0.20)
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encodings = encode([self.prefix + t for t in texts])
        ids = np.array([e.ids for e in encodings], dtype=np.int64)  # (N, L), L = longest in the batch
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)  # (N, L)
        return torch.from_numpy(ids), torch.from_numpy(mask)


class ViewCollator:
    """Rows of the shards -> one tokenised batch of n = 1 + k + d views per sentence (LUSE, SimCSE).

    View 0 is the original, views 1..k its first k cached variants (a sentence with fewer than k
    variants repeats its original in the missing slots, which then acts as one more dropout view),
    views k+1..k+d repeat the original for dropout. All n*B texts share one padding length so the
    model encodes them in one forward. Rows are ordered view-major: row v*B + i is view v of sentence i.
    """

    columns = ("id", "text", "variants")

    def __init__(
        self, tokenizer: Any, max_length: int, num_variants: int, num_dropout_views: int, prefix: str = ""
    ):
        self.encode = FastEncoder(tokenizer, max_length, prefix)
        self.k, self.d = num_variants, num_dropout_views

    def __call__(self, rows: dict[str, list[Any]]) -> dict[str, Any]:
        texts = rows["text"]
        views = [texts]
        for j in range(self.k):
            views.append([v[j] if j < len(v) else t for t, v in zip(texts, rows["variants"])])
        ids, mask = self.encode([t for view in views for t in view])  # (1 + k) * B rows
        b = len(texts)
        if self.d:  # dropout views: the original's tokens again; dropout makes them differ
            ids = torch.cat([ids, ids[:b].repeat(self.d, 1)])
            mask = torch.cat([mask, mask[:b].repeat(self.d, 1)])
        return {
            "ids": torch.tensor(np.asarray(rows["id"], dtype=np.uint64).view(np.int64)),
            "input_ids": ids,  # (n * B, L)
            "attention_mask": mask,  # (n * B, L)
            "num_views": 1 + self.k + self.d,
        }


class PairCollator:
    """Supervised records -> tokenised columns (sentence1/2[/3]) and labels, one tensor set per column."""

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        text_columns: Sequence[str],
        label_dtype: Any = None,
        prefix: str = "",
    ):
        self.encode = FastEncoder(tokenizer, max_length, prefix)
        self.text_columns, self.label_dtype = list(text_columns), label_dtype

    def __call__(self, rows: dict[str, list[Any]]) -> dict[str, Any]:
        ids, mask = self.encode([t for col in self.text_columns for t in rows[col]])
        out = {
            "ids": torch.tensor(rows["index"], dtype=torch.int64),
            "input_ids": ids,  # (n * B, L), column-major like the views
            "attention_mask": mask,
            "num_views": len(self.text_columns),
        }
        if self.label_dtype is not None:
            out["labels"] = torch.tensor(rows["label"], dtype=self.label_dtype)
        return out
