"""faiss index construction and search parameters; the one place that knows about faiss-gpu; and an
exact search over a corpus of any size on a torch device (:class:`ChunkedExactSearch`).

All indexes use the inner-product metric on L2-normalised vectors, i.e. cosine similarity.
HNSW has no GPU implementation in faiss and always stays on the CPU.

Exact search at the corpus's size. A faiss flat index holds the whole corpus on one device (110M x 384
float32 is 169 GB: no GPU holds it). :class:`ChunkedExactSearch` keeps the corpus on the host and
compares blocks of queries with chunks of corpus rows on the device, merging a running top-k, so
device memory is bounded by the chunk sizes (plus what is kept resident), not by N; it needs torch
only, not faiss-gpu. Time and memory at 110M x 384: docs/search.md ("Mining at the corpus's size").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write

log = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "ivf", "hnsw")


def faiss_module() -> Any:
    # faiss logs each failed attempt to load an AVX build at INFO; only its warnings matter here.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss

    return faiss


def gpu_available() -> bool:
    faiss = faiss_module()
    get = getattr(faiss, "get_num_gpus", None)
    return bool(get and get() > 0)


def default_nlist(n: int) -> int:
    """About 4 * sqrt(N) lists (faiss' usual guidance), never more than N / 39 (its training minimum)."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39))


def new_index(index_type: str, dim: int, params: dict[str, Any]) -> Any:
    faiss = faiss_module()
    if index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if index_type == "ivf":
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, params["nlist"], faiss.METRIC_INNER_PRODUCT)
        index.nprobe = params["nprobe"]
        return index
    if index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["ef_construction"]
        index.hnsw.efSearch = params["ef_search"]
        return index
    raise ValueError(f"unknown index type {index_type!r}; choose one of {INDEX_TYPES}")


class GpuPlacement:
    """Moves flat/IVF indexes to GPU 0 when faiss sees one, and back to the CPU for writing.

    Only faiss-gpu builds have ``StandardGpuResources``; the resources object must outlive every
    GPU index made with it, so it is kept here.
    """

    def __init__(self, use_gpu: bool):
        self.resources: Any = None
        self.enabled = use_gpu and gpu_available()

    def to_device(self, index: Any, index_type: str) -> Any:
        if not self.enabled or index_type == "hnsw":
            return index
        faiss = faiss_module()
        if self.resources is None:
            self.resources = faiss.StandardGpuResources()
        log.info("moving the %s index to GPU 0", index_type)
        return faiss.index_cpu_to_gpu(self.resources, 0, index)

    def to_cpu(self, index: Any, index_type: str) -> Any:
        if not self.enabled or index_type == "hnsw":
            return index
        return faiss_module().index_gpu_to_cpu(index)

    @property
    def device(self) -> str:
        return "gpu" if self.enabled else "cpu"


def build_index(
    index_type: str,
    dim: int,
    params: dict[str, Any],
    train_vectors: np.ndarray | None,
    batches: Iterable[np.ndarray],
    use_gpu: bool,
) -> tuple[Any, str]:
    """Train (IVF) on ``train_vectors``, add ``batches`` in order; return a CPU index and "cpu"/"gpu"."""
    placement = GpuPlacement(use_gpu)
    index = placement.to_device(new_index(index_type, dim, params), index_type)
    if index_type == "ivf":
        assert train_vectors is not None
        log.info("training IVF (nlist=%d) on %d vectors", params["nlist"], len(train_vectors))
        index.train(np.ascontiguousarray(train_vectors, dtype=np.float32))
    for batch in batches:
        index.add(np.ascontiguousarray(batch, dtype=np.float32))
    return placement.to_cpu(index, index_type), placement.device


def set_search_params(index: Any, nprobe: int | None = None, ef_search: int | None = None) -> None:
    faiss = faiss_module()
    if nprobe is not None:
        try:
            faiss.extract_index_ivf(index).nprobe = nprobe
        except RuntimeError:
            pass  # not an IVF index
    if ef_search is not None and hasattr(index, "hnsw"):
        index.hnsw.efSearch = ef_search


def write_index(index: Any, path: Path) -> None:
    """faiss.write_index to a temporary name, fsync, rename: a killed build never leaves half a file."""
    atomic_write(path, lambda tmp: faiss_module().write_index(index, str(tmp)))


def read_index(path: Path) -> Any:
    try:
        return faiss_module().read_index(str(path))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unknown error"
        raise InputError(f"faiss index {path} is unreadable ({first}); rebuild the index") from None


# ------------------------------------------------------------------------------ chunked exact search
def search_device(requested: str) -> str:
    """``auto`` -> cuda when torch sees a GPU, else cpu; ``cuda`` without one is a one-line error."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"search device {requested}: torch sees no GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES, "
            "or run `python -m pipeline doctor`); pass cpu to search on the CPU"
        )
    return requested


class ChunkedExactSearch:
    """Exact top-k inner product of query rows against ``vectors`` (N, D), on a torch ``device``.

    The corpus stays a host array; chunks of ``corpus_chunk`` rows go to the device (the first
    ``resident_bytes`` worth stay there, the rest are copied once per :meth:`search` call) and are
    compared with blocks of ``query_block`` queries: a (query_block, corpus_chunk) score matrix, whose
    top k merges into the running top k. Peak device memory is about resident_bytes +
    corpus_chunk x D x (4 + itemsize) (a chunk as copied, then cast) + query_block x corpus_chunk x
    itemsize (the scores) + topk's workspace, whatever N is.

    Results equal a faiss flat index's up to ties and float rounding: on CUDA the products are computed
    in ``dtype`` (float16 by default: tensor cores, half the memory; scores about 1e-3 off, so neighbours
    whose cosines differ by less may swap ranks), on CPU in float32. Rows are returned in descending
    score, like faiss; fewer than k corpus rows pad with -1 as faiss does.
    """

    def __init__(
        self,
        vectors: np.ndarray,
        device: str = "cpu",
        corpus_chunk: int = 1 << 18,
        query_block: int = 1 << 13,
        resident_bytes: int = 0,
        dtype: Any = None,
    ):
        import torch

        if vectors.ndim != 2:
            raise ValueError(f"vectors must be (N, D), got {vectors.shape}")
        if corpus_chunk < 1 or query_block < 1 or resident_bytes < 0:
            raise ValueError("corpus_chunk and query_block must be >= 1, resident_bytes >= 0")
        self.vectors = vectors
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        self.corpus_chunk, self.query_block = corpus_chunk, query_block
        self.resident: dict[int, Any] = {}  # chunk start -> device tensor, kept for every query block
        self.resident_bytes = resident_bytes
        self.chunks_copied = 0  # host-to-device chunk copies so far (resident ones count once)
        self.peak_scores = 0  # the largest score matrix computed, in elements
        # queries per call for a caller that batches: on a GPU many, so the corpus streams rarely
        self.preferred_batch = 1 << 20 if self.device.type == "cuda" else 4096

    @property
    def ntotal(self) -> int:
        return self.vectors.shape[0]

    def _chunk(self, start: int) -> Any:
        import torch

        if start in self.resident:
            return self.resident[start]
        rows = self.vectors[start : start + self.corpus_chunk]
        chunk = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        if self.device.type == "cuda":
            chunk = chunk.pin_memory()
        chunk = chunk.to(self.device, non_blocking=True).to(self.dtype)  # (C, D)
        self.chunks_copied += 1
        kept = sum(c.numel() * c.element_size() for c in self.resident.values())
        if kept + chunk.numel() * chunk.element_size() <= self.resident_bytes:
            self.resident[start] = chunk
        return chunk

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores (Q, k) float32, rows (Q, k) int64), best first, like ``faiss.Index.search``.

        Corpus chunks outside, query blocks inside: each chunk that is not resident is copied once per
        call, so pass many queries per call (:attr:`preferred_batch`); the running top k of every
        query of the call stays on the device (Q x k x 12 bytes).
        """
        import torch

        q_all = np.ascontiguousarray(queries, dtype=np.float32)
        n, keep = self.ntotal, min(k, self.ntotal)
        scores_out = np.full((len(q_all), k), -np.inf, dtype=np.float32)
        rows_out = np.full((len(q_all), k), -1, dtype=np.int64)
        with torch.no_grad():
            blocks = [
                torch.from_numpy(q_all[qs : qs + self.query_block]).to(self.device).to(self.dtype)
                for qs in range(0, len(q_all), self.query_block)
            ]  # (b, D) each
            best = [torch.full((q.shape[0], 0), -torch.inf, device=self.device) for q in blocks]
            best_rows = [torch.zeros((q.shape[0], 0), dtype=torch.long, device=self.device) for q in blocks]
            for cs in range(0, n, self.corpus_chunk):
                chunk = self._chunk(cs)  # (C, D)
                for i, q in enumerate(blocks):
                    scores = q @ chunk.T  # (b, C) in dtype (cuBLAS accumulates float16 in float32)
                    self.peak_scores = max(self.peak_scores, scores.numel())
                    top, idx = scores.topk(min(keep, scores.shape[1]), dim=1)  # (b, <= k)
                    merged = torch.cat([best[i], top.float()], dim=1)  # (b, <= 2k)
                    merged_rows = torch.cat([best_rows[i], idx + cs], dim=1)
                    best[i], order = merged.topk(min(keep, merged.shape[1]), dim=1)
                    best_rows[i] = merged_rows.gather(1, order)
            if blocks:  # one host sync per call
                scores_out[:, :keep] = torch.cat(best).cpu().numpy()
                rows_out[:, :keep] = torch.cat(best_rows).cpu().numpy()
        return scores_out, rows_out
