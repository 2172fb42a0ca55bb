"""Hard negatives mined with the teacher over the whole shard set (``teacher --hard_negatives K``).

Every sentence is searched among the teacher vectors of all shards (a faiss inner-product index of
the L2-normalised vectors: cosine). Walking its ``depth`` nearest neighbours in rank order, a
neighbour is skipped when it is the sentence itself, equal to it or to one of its own variants after
:func:`pipeline.normalize.normalize_text` (a near-duplicate in text), above ``max_similarity``
cosine (a near-duplicate in meaning, likely a positive) or below ``min_similarity``; the first K
survivors are its hard negatives, hardest first. A sentence may get fewer than K (counted as
``short``). Exact (flat) search makes the choice deterministic; IVF/HNSW trade that for speed.

This step holds all N teacher vectors (float32) and texts in one process: ~1.5 KiB per sentence at
D=384, so tens of millions of sentences per large-memory node. The shards are then rewritten one by
one, each with its completion record, so a killed mining run redoes only the unfinished shards.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.io import atomic_write_json
from pipeline.normalize import normalize_text
from pipeline.shards import read_shard, write_shard
from pipeline.stages.runner import read_record, record_path, shard_index
from pipeline.vectors import block_teacher

log = logging.getLogger(__name__)

SEARCH_BATCH = 4096  # queries per faiss call
COUNT_KEYS = (
    "sentences",
    "negatives",
    "short",
    "self",
    "duplicate",
    "variant",
    "too_similar",
    "too_dissimilar",
)


@dataclass(frozen=True)
class MineParams:
    k: int
    depth: int
    max_similarity: float
    min_similarity: float
    index_type: str = "flat"

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Pool:
    """Every sentence of the shard set, in manifest order: what a neighbour's row number means."""

    ids: np.ndarray  # (N,) uint64
    texts: list[str]
    keys: list[str]  # normalize_text(text)
    variant_keys: list[frozenset[str]]  # normalize_text of each of the sentence's own variants
    vectors: np.ndarray  # (N, D) float32, L2-normalised
    starts: list[int]  # first row of each shard


def load_pool(shard_dir: Path, entries: list[dict[str, Any]]) -> Pool:
    ids, texts, variants, vectors, starts = [], [], [], [], []
    row = 0
    for entry in entries:
        starts.append(row)
        for block in read_shard(shard_dir / entry["name"]):
            ids.append(block.column("id").to_numpy())
            texts.extend(block.column("text").to_pylist())
            if "variants" in block.column_names:
                variants.extend(block.column("variants").to_pylist())
            else:
                variants.extend([] for _ in range(block.num_rows))
            vectors.append(block_teacher(block))  # int8: dequantised and re-normalised
            row += block.num_rows
    return Pool(
        np.concatenate(ids),
        texts,
        [normalize_text(t) for t in texts],
        [frozenset(normalize_text(v) for v in vs) for vs in variants],
        np.ascontiguousarray(np.concatenate(vectors)),
        starts,
    )


def build_search_index(vectors: np.ndarray, params: MineParams, device: str = "auto") -> Any:
    """The index the pool is searched with. Flat on a GPU: a chunked exact search on the device (the
    corpus stays in host memory, device memory stays bounded: pipeline/search/backend.py); flat on the
    CPU, IVF and HNSW: faiss as before (IVF built on a GPU when faiss-gpu has one and ``device`` is not
    cpu, then searched on the CPU)."""
    from pipeline.search.backend import ChunkedExactSearch, build_index, default_nlist, search_device

    device = search_device(device)
    if params.index_type == "flat" and device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        log.info("exact search on %s (float16, chunks of the corpus; %.1f GB free)", device, free / 1e9)
        return ChunkedExactSearch(vectors, device, resident_bytes=free // 2)
    n, dim = vectors.shape
    index_params: dict[str, Any] = {}
    if params.index_type == "ivf":
        index_params = {"nlist": default_nlist(n), "nprobe": 16}
    elif params.index_type == "hnsw":
        index_params = {"hnsw_m": 32, "ef_construction": 80, "ef_search": max(64, params.depth)}
    train = vectors[np.random.default_rng(0).permutation(n)[:100_000]] if params.index_type == "ivf" else None
    index, _ = build_index(params.index_type, dim, index_params, train, [vectors], use_gpu=device != "cpu")
    return index


def select_negatives(
    row: int,
    neighbours: np.ndarray,
    similarities: np.ndarray,
    pool: Pool,
    params: MineParams,
    counts: Counter,
) -> list[int]:
    """The first ``k`` of ``neighbours`` (rank order) that pass the filters of the module docstring."""
    chosen: list[int] = []
    own_key, own_variants = pool.keys[row], pool.variant_keys[row]
    for other, sim in zip(neighbours.tolist(), similarities.tolist()):
        if other < 0:  # faiss pads with -1 when fewer than depth vectors exist
            break
        if other == row:
            counts["self"] += 1
        elif pool.keys[other] == own_key:
            counts["duplicate"] += 1
        elif pool.keys[other] in own_variants:
            counts["variant"] += 1
        elif sim > params.max_similarity:
            counts["too_similar"] += 1
        elif sim < params.min_similarity:
            counts["too_dissimilar"] += 1
        else:
            chosen.append(other)
            if len(chosen) == params.k:
                break
    counts["sentences"] += 1
    counts["negatives"] += len(chosen)
    counts["short"] += len(chosen) < params.k
    return chosen


def mine_rows(
    index: Any, pool: Pool, lo: int, hi: int, params: MineParams, counts: Counter
) -> list[list[int]]:
    """Hard negatives (pool rows) of rows [lo, hi)."""
    out: list[list[int]] = []
    depth = min(params.depth, len(pool.texts))
    step = getattr(index, "preferred_batch", SEARCH_BATCH)  # the chunked GPU search streams per call
    for start in range(lo, hi, step):
        stop = min(hi, start + step)
        sims, rows = index.search(pool.vectors[start:stop], depth)  # (b, depth) each
        out += [
            select_negatives(start + i, rows[i], sims[i], pool, params, counts) for i in range(stop - start)
        ]
    return out


def mine_shards(
    shard_dir: Path, entries: list[dict[str, Any]], out_dir: Path, work_dir: Path, params: MineParams,
    progress: bool = True, device: str = "auto",
) -> tuple[list[dict[str, Any]], dict[str, int]]:  # fmt: skip
    """Write every encoded shard of ``shard_dir`` to ``out_dir`` with its hard negatives.

    Returns the output manifest entries and the summed counts. A shard whose record exists (and whose
    file has the recorded size) is not redone.
    """
    from pipeline import progress as progress_bars

    pool = load_pool(shard_dir, entries)
    log.info("mining %d hard negatives per sentence among %d sentences (%s index, depth %d)",
             params.k, len(pool.texts), params.index_type, params.depth)  # fmt: skip
    index = build_search_index(pool.vectors, params, device)  # the teacher's --device; cpu opts out
    out_entries, total = [], Counter({key: 0 for key in COUNT_KEYS})
    bounds = pool.starts + [len(pool.texts)]
    bar = progress_bars.bar(
        total=len(pool.texts), unit="sent", unit_scale=True, disable=not progress, desc="mine"
    )
    for position, entry in enumerate(entries):
        name, lo, hi = entry["name"], bounds[position], bounds[position + 1]
        record = read_record(work_dir, out_dir, name)
        if record is None:
            for stale in out_dir.glob(f".{name}.tmp-*"):
                stale.unlink(missing_ok=True)
            counts = Counter({key: 0 for key in COUNT_KEYS})
            negatives = mine_rows(index, pool, lo, hi, params, counts)
            blocks = _with_negatives(read_shard(shard_dir / name), negatives, pool)
            record = {"entry": write_shard(out_dir / name, blocks, shard_index(name, position)),
                      "counts": dict(counts)}  # fmt: skip
            atomic_write_json(record_path(work_dir, name), record)
        out_entries.append(record["entry"])
        total.update(record["counts"])
        bar.update(hi - lo)
    bar.close()
    return out_entries, dict(total)


def _with_negatives(blocks: Any, negatives: list[list[int]], pool: Pool) -> Any:
    row = 0
    for block in blocks:
        mine = negatives[row : row + block.num_rows]
        texts = pa.array([[pool.texts[r] for r in rows] for rows in mine], pa.list_(pa.string()))
        ids = pa.array([[int(pool.ids[r]) for r in rows] for rows in mine], pa.list_(pa.uint64()))
        block = block.append_column(pa.field("hard_negatives", texts.type, nullable=False), texts)
        block = block.append_column(pa.field("hard_negative_ids", ids.type, nullable=False), ids)
        row += block.num_rows
        yield block
