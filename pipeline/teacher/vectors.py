"""The ``teacher`` column: (N, D) vectors <-> Arrow ``fixed_size_list<float16, D>`` (shards/README.md)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def vector_column(vectors: np.ndarray) -> pa.FixedSizeListArray:
    """(N, D) float16 -> fixed_size_list<float16, D>, without a Python loop."""
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float16()), vectors.shape[1])


def teacher_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A ``teacher`` column -> (N, D) float32 (the inverse of :func:`vector_column`)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    dim = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)
