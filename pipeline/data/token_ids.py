"""Token ids stored in the shards (``python -m pipeline tokenize``): identity, reading, padding.

A tokenised shard set names its tokenizer by one hash (:func:`tokenizer_hash`): the tokenizer's
serialised rules, its padding id, the text prefix and the truncation length. The trainer pads the
stored ids only when that hash equals its own model's (:func:`shards_have_ids`); then a batch is
the same tensors as tokenising its texts on the fly, without the Rust tokenizer in the loader.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from pipeline import distributed
from pipeline.errors import ConfigError
from pipeline.shards import ShardSet, read_shard_set

log = logging.getLogger(__name__)

# the id columns and the text columns they tokenise, in the same order
TOKEN_ID_COLUMNS = ("input_ids", "variant_input_ids", "hard_negative_input_ids")
TEXT_COLUMNS = ("text", "variants", "hard_negatives")


def canonical_tokenizer(tokenizer: Any) -> Any:
    """A copy of ``tokenizer``'s Rust backend without truncation or padding (both set per call)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def tokenizer_hash(tokenizer: Any, prefix: str, max_length: int) -> str:
    """sha256 over what fixes the ids of a text: tokenizer rules (as JSON), pad id, prefix, max_length.

    The JSON is the backend's own serialisation with truncation and padding off, so a tokenizer that
    a previous call left truncating hashes the same as a fresh one.
    """
    digest = hashlib.sha256(canonical_tokenizer(tokenizer).to_str().encode("utf-8"))
    digest.update(f"\0pad={tokenizer.pad_token_id}\0prefix={prefix}\0max_length={max_length}".encode())
    return digest.hexdigest()


def id_dtype(vocab_size: int) -> pa.DataType:
    """uint16 when every id fits in 16 bits, else uint32 (shards/README.md)."""
    return pa.uint16() if vocab_size <= np.iinfo(np.uint16).max + 1 else pa.uint32()


def shards_have_ids(shards: str | Path | ShardSet, tokenizer: Any, prefix: str, max_length: int) -> bool:
    """Whether to pad the shards' stored ids (hash matches), or tokenise on the fly (no ids).

    Ids made with another tokenizer, prefix or max_length are a ConfigError naming both hashes:
    padding them would train on the wrong tokens without a sign.
    """
    info = read_shard_set(shards)
    return ids_usable(info.tokenizer, info.directory, tokenizer, prefix, max_length)


def ids_usable(
    recorded: dict[str, Any] | None, shards: Path, tokenizer: Any, prefix: str, max_length: int
) -> bool:
    """:func:`shards_have_ids` on a shard set's tokenizer record (``ShardSet.tokenizer``; None: no ids)."""
    if recorded is None:
        return False
    mine = tokenizer_hash(tokenizer, prefix, max_length)
    if recorded.get("hash") != mine:
        raise ConfigError(
            f"data.shards {shards} holds token ids of tokenizer hash {str(recorded.get('hash'))[:16]} "
            f"({recorded.get('name')}, prefix {recorded.get('prefix')!r}, max_length "
            f"{recorded.get('max_length')}) but this model's is {mine[:16]} (prefix {prefix!r}, "
            f"max_length {max_length}); rerun `python -m pipeline tokenize --shards INPUT --out NEW_DIR "
            f"--model MODEL --max_length {max_length}` and train on NEW_DIR (or on untokenised shards)"
        )
    return True


def tokenising_on_gpu(
    device: str, shards: ShardSet | None, token_ids: bool, pairs: bool, max_length: int, model: str | None
) -> str | None:
    """One warning line (logged by the main process, and returned) when a CUDA run's loader tokenises
    sentence shards on the fly; None otherwise (CPU, stored ids used, pair shards or a supervised file,
    which the tokenize stage does not cover).

    On a GPU the loader must keep up with tens of thousands of sequences per second per rank, and one
    worker tokenising gives about a tenth of what padding stored ids gives (docs/gpu.md, "The loader").
    """
    if device != "cuda" or shards is None or token_ids or pairs:
        return None
    line = (
        f"the loader tokenises {shards.directory} on the fly on a GPU run: run `python -m pipeline tokenize "
        f"--shards {shards.directory} --out NEW_DIR --model {model or 'MODEL'} --max_length {max_length}` "
        "once and train on NEW_DIR (docs/tokenize.md)"
    )
    if distributed.is_main_process():
        log.warning(line)
    return line


class RaggedIds(Sequence):
    """A list<uint> id column as one int64 array and its row offsets; row i is a view of the array.

    A block is decoded with two array conversions, not one array per row: at GPU rates splitting every
    row of every id column (a thousand rows times five texts a block) was most of a loader worker's time
    (benchmarks/loader_worker.py). Rows a batch never reads cost nothing.
    """

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        # (T,) int64; (rows + 1,) from 0, as Python ints (a slice bound per row read, no numpy scalars)
        self.values, self.offsets = values, offsets.tolist()

    @classmethod
    def of(cls, array: pa.ListArray) -> RaggedIds:
        offsets = array.offsets.to_numpy()
        values = array.flatten().to_numpy(zero_copy_only=False).astype(np.int64)  # padded batches are int64
        return cls(values, offsets - offsets[0])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        return self.values[self.offsets[i] : self.offsets[i + 1]]


class NestedRaggedIds(Sequence):
    """A list<list<uint>> id column (variants, hard negatives): row i is the list of its texts' ids."""

    def __init__(self, inner: RaggedIds, offsets: np.ndarray):
        self.inner, self.offsets = inner, offsets.tolist()  # (rows + 1,) from 0, as RaggedIds's

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> list[np.ndarray]:  # type: ignore[override]
        return [self.inner[j] for j in range(self.offsets[i], self.offsets[i + 1])]


def ragged_rows(column: pa.ChunkedArray | pa.Array) -> RaggedIds | NestedRaggedIds:
    """list<uint> -> row i: an int64 array; list<list<uint>> -> row i: a list of such arrays."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_list(array.type.value_type):
        return RaggedIds.of(array)
    offsets = array.offsets.to_numpy()
    return NestedRaggedIds(RaggedIds.of(array.flatten()), offsets - offsets[0])


def pad_ids(rows: Sequence[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id rows -> (N, L) int64 ids and mask, padded on the right to the longest row.

    The same tensors as :class:`pipeline.data.collate.FastEncoder` gives for the texts (tested).
    """
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))  # (N,)
    width = int(lengths.max()) if len(rows) else 0
    real = np.arange(width)[None, :] < lengths[:, None]  # (N, L)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)  # (N, L)
    ids[real] = np.concatenate(rows) if len(rows) else []
    return torch.from_numpy(ids), torch.from_numpy(real.astype(np.int64))
