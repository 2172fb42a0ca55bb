"""Teacher vectors <-> Arrow columns, in the stored dtypes of ``teacher --dtype`` (shards/README.md).

Part of the shard format (beside :mod:`pipeline.shards`): the teacher stage writes these columns, the
loader and the miner read them, so neither reader imports the stage.

``float16``: ``teacher`` is ``fixed_size_list<float16, D>`` of the L2-normalised vectors (2 bytes a
value). ``int8``: ``teacher`` is ``fixed_size_list<int8, D>`` of ``round(v / s * 127)`` with the row's
scale ``s = max|v|`` beside it in ``teacher_scale`` (float32), 1 byte a value + 4 a row; the same for
``teacher_variants`` (``teacher_variant_scales``: a list of scales per row). The scale is float32, not
float16, so an int8 set reads in tools without half floats (2 more bytes a row, 0.5%).

:func:`block_teacher` is the one decoder every reader uses (training, mining, the benchmarks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.errors import InputError

DTYPES = ("float16", "int8")  # what ``teacher --dtype`` writes and the manifest's ``teacher.dtype`` says
MIN_HASH_PREFIX = 8  # hex digits of the teacher's hash that name it (data.teacher, teacher --model)
INT8_LEVELS = 127  # codes in [-127, 127]: symmetric, -128 unused
# each int8 vector column's scale column (pair shards: teacher_positive, the partner's vector)
SCALE_COLUMNS = {
    "teacher": "teacher_scale",
    "teacher_variants": "teacher_variant_scales",
    "teacher_positive": "teacher_positive_scale",
}


# ------------------------------------------------------------------------------ the manifest's record
def stored_dtype(teacher: dict[str, Any], shards: str | Path) -> str:
    """The recorded ``teacher.dtype`` (``float16`` when absent: sets written before int8 existed)."""
    dtype = str(teacher.get("dtype") or "float16")
    if dtype not in DTYPES:
        raise InputError(
            f"{Path(shards) / 'manifest.json'}: teacher vectors stored as {dtype!r}, which this version "
            f"cannot read ({' or '.join(DTYPES)}); use the version that wrote them or re-encode with "
            "`python -m pipeline teacher`"
        )
    return dtype


def matches(teacher: dict[str, Any], wanted: str) -> bool:
    """Does ``wanted`` (``data.teacher``: a name, folder name or path, or a hash prefix of at least
    :data:`MIN_HASH_PREFIX` hex digits) name the manifest's recorded ``teacher``?"""
    wanted = wanted.strip().rstrip("/")
    recorded = [str(teacher.get("name") or "").rstrip("/"), str(teacher.get("path") or "")]
    names = {n for n in recorded if n} | {Path(n).name for n in recorded if n}
    if wanted in names or (Path(wanted).exists() and str(Path(wanted).resolve()) in names):
        return True
    digest = teacher.get("hash") or ""
    return len(wanted) >= MIN_HASH_PREFIX and bool(digest) and digest.startswith(wanted.lower())


def describe(teacher: dict[str, Any]) -> str:
    return f"{teacher.get('name')} (hash {str(teacher.get('hash'))[:12]}, dim {teacher.get('dim')})"


# ------------------------------------------------------------------------------------------ the columns
def quantize_int8(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) floats -> (N, D) int8 codes ``round(v / s * 127)`` and (N,) float32 scales ``s = max|v|``."""
    v = np.asarray(vectors, dtype=np.float32)
    scale = np.abs(v).max(axis=1) if v.size else np.zeros(len(v), np.float32)  # (N,)
    safe = np.where(scale > 0, scale, 1.0)  # an all-zero row stays zeros
    codes = np.rint(v / safe[:, None] * INT8_LEVELS).astype(np.int8)  # |v / s| <= 1: no overflow
    return codes, scale.astype(np.float32)


def vector_column(vectors: np.ndarray, value_type: pa.DataType = pa.float16()) -> pa.FixedSizeListArray:
    """(N, D) values -> fixed_size_list<value_type, D>, without a Python loop."""
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), value_type), vectors.shape[1])


def encode_vectors(vectors: np.ndarray, dtype: str) -> tuple[pa.Array, pa.Array | None]:
    """(N, D) L2-normalised vectors -> (the vector column, its scale column or None) in ``dtype``."""
    if dtype == "float16":
        return vector_column(np.asarray(vectors, dtype=np.float16)), None
    if dtype == "int8":
        codes, scale = quantize_int8(vectors)
        return vector_column(codes, pa.int8()), pa.array(scale, pa.float32())
    raise ValueError(f"unknown teacher dtype {dtype!r}; expected one of {DTYPES}")


def teacher_matrix(
    column: pa.ChunkedArray | pa.Array, scale: pa.ChunkedArray | pa.Array | None = None
) -> np.ndarray:
    """A vector column (and, for int8, its scale column) -> (N, D) float32.

    float16 rows come back as stored (normalised before the cast: norm 1 to ~1e-3, bit for bit what
    earlier versions returned). int8 rows are dequantised (``q * s / 127``) and re-normalised to unit
    length. Any other value type is refused: it was written by a version this one does not know.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_fixed_size_list(column.type):
        raise InputError(f"teacher vectors of type {column.type}: expected fixed_size_list<float16|int8, D>")
    dim, value_type = column.type.list_size, column.type.value_type
    values = column.flatten().to_numpy(zero_copy_only=False)
    if pa.types.is_float16(value_type):
        return values.astype(np.float32).reshape(-1, dim)
    if not pa.types.is_int8(value_type):
        raise InputError(
            f"teacher vectors stored as {value_type}: this version reads {' or '.join(DTYPES)}; "
            "re-encode with `python -m pipeline teacher` or upgrade"
        )
    if scale is None:
        raise InputError(
            "int8 teacher vectors without their scale column (teacher_scale); the shard is incomplete"
        )
    if isinstance(scale, pa.ChunkedArray):
        scale = scale.combine_chunks()
    s = scale.to_numpy(zero_copy_only=False).astype(np.float32)  # (N,)
    out = values.astype(np.float32).reshape(-1, dim) * (s / INT8_LEVELS)[:, None]  # (N, D)
    norm = np.linalg.norm(out, axis=1, keepdims=True)  # (N, 1)
    return out / np.where(norm > 0, norm, 1.0)


def block_teacher(table: pa.Table | pa.RecordBatch, name: str = "teacher") -> np.ndarray:
    """A block's ``teacher`` column, with its scale column when int8 -> (rows, D) float32 (see above)."""
    scale = SCALE_COLUMNS[name]
    return teacher_matrix(table.column(name), table.column(scale) if scale in table.column_names else None)


def variant_columns(vectors: np.ndarray, offsets: np.ndarray, dtype: str) -> list[tuple[str, pa.Array]]:
    """``teacher_variants`` (and ``teacher_variant_scales`` when int8): row i holds
    ``vectors[offsets[i] : offsets[i + 1]]``; ``offsets`` start at 0 (int32)."""
    values, scale = encode_vectors(vectors, dtype)
    out = [("teacher_variants", pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values))]
    if scale is not None:
        out.append(("teacher_variant_scales", pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), scale)))
    return out


def variant_matrices(table: pa.Table | pa.RecordBatch) -> list[np.ndarray]:
    """A block's ``teacher_variants`` -> one (k_i, D) float32 array per row, decoded as above."""
    column = table.column("teacher_variants")
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    scale = None
    if "teacher_variant_scales" in table.column_names:
        scale = table.column("teacher_variant_scales")
        scale = (scale.combine_chunks() if isinstance(scale, pa.ChunkedArray) else scale).flatten()
    offsets = column.offsets.to_numpy()
    offsets = offsets - offsets[0]  # a sliced column's offsets start inside its values
    flat = teacher_matrix(column.flatten(), scale)
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(column))]
