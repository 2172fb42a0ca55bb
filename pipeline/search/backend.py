"""faiss index construction and search parameters; the one place that knows about faiss-gpu.

All indexes use the inner-product metric on L2-normalised vectors, i.e. cosine similarity.
HNSW has no GPU implementation in faiss and always stays on the CPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import InputError
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
