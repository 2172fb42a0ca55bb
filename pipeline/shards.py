"""The shard format shared by every stage (specified for outsiders in ``shards/README.md``).

A shard is a plain POSIX tar file, readable by ``webdataset`` and ``tarfile``. Each tar member is one
webdataset *sample* holding a *block* of a few thousand sentences as an Arrow IPC file
(``{shard:06d}-{block:06d}.arrow``, zstd-compressed buffers). One member per sentence would cost a
512-byte tar header for a ~60-byte sentence; blocks keep the overhead to a few bytes per sentence.

Tars are written deterministically (fixed mtime/uid/mode, sorted members) so the same rows give
byte-identical shards, and atomically (temporary file, fsync, rename) so a killed writer never
leaves a truncated shard behind under the final name.

Beside every shard its writer puts a small *block index* (``shard-NNNNNN.idx``, listed with its sha256
in the manifest): per block its byte range in the tar, its row count, a CRC-32 of its bytes and each
row's length proxy. Training plans an epoch from the manifest and these indexes alone, so start and
resume read a few bytes per row instead of every block, and each block's bytes are checked against
their CRC when the loader first reads them.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline import __version__
from pipeline.errors import InputError
from pipeline.io import atomic_write, atomic_write_json, file_problem, read_json, sha256_file

FORMAT = "sentence-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BLOCK_EXT = "arrow"
INDEX_EXT = "idx"
SET_INDEX = "shard-blocks.idx"  # every shard's block index in one file, written with the manifest

# Columns every stage writes. Later stages add columns and keep these (see shards/README.md).
BASE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.uint64(), nullable=False),  # stable sentence id: first 8 bytes of blake2b(text)
        pa.field("text", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),  # collection name, e.g. "wiki_zh" or "plain"
    ]
)


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def index_name(shard: str) -> str:
    """``shard-000003.tar`` -> ``shard-000003.idx``: the block index written beside a shard."""
    return f"{Path(shard).stem}.{INDEX_EXT}"


def sentence_id(text: str) -> int:
    """A stable 64-bit id for a sentence: the same text has the same id in every run and stage."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


# --------------------------------------------------------------------------------------------- blocks
def table_to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def ipc_to_table(data: bytes) -> pa.Table:
    return pa.ipc.open_file(pa.BufferReader(data)).read_all()


def _tar_member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_shard(path: str | Path, blocks: Iterable[pa.Table], shard_index: int) -> dict[str, Any]:
    """Write ``blocks`` (one Arrow table each) as shard ``path`` and its block index beside it; return
    the shard's manifest entry (with the index's name, size and sha256 under ``index``)."""
    path = Path(path)
    index = _IndexBuilder()

    def write(tmp: Path) -> None:
        with tarfile.open(tmp, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for block_index, table in enumerate(blocks):
                data = table_to_ipc(table)
                member = _tar_member(f"{shard_index:06d}-{block_index:06d}.{BLOCK_EXT}", len(data))
                offset = tar.offset + tarfile.BLOCKSIZE  # a USTAR header of a short name is one block
                tar.addfile(member, io.BytesIO(data))
                index.add(offset, data, row_lengths(table))

    atomic_write(path, write)
    index_path = path.with_name(index_name(path.name))
    atomic_write(index_path, index.write)
    return {
        "name": path.name,
        "samples": index.samples,
        "sentences": index.sentences,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "index": index_entry(index_path),
    }


def iter_blocks(path: str | Path) -> Iterator[tuple[tarfile.TarInfo, pa.Table]]:
    """Yield ``(tar member, block)`` for every block of one shard, in order.

    The member carries ``offset_data`` and ``size``: where the block's bytes lie in the tar, which
    lets a reader seek straight to a block later.
    """
    path = Path(path)
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isfile() or not member.name.endswith("." + BLOCK_EXT):
                    continue
                f = tar.extractfile(member)
                assert f is not None
                yield member, ipc_to_table(f.read())
    except (tarfile.TarError, pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"shard {path} is unreadable ({exc}); re-create it with its stage") from None


def read_shard(path: str | Path) -> Iterator[pa.Table]:
    """Yield the blocks of one shard in order."""
    for _, table in iter_blocks(path):
        yield table


# --------------------------------------------------------------------------------------------- index
INDEX_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.uint64(), nullable=False),  # where the block's bytes start in the tar
        pa.field("size", pa.uint64(), nullable=False),  # how many bytes
        pa.field("rows", pa.uint32(), nullable=False),
        pa.field("crc32", pa.uint32(), nullable=False),  # zlib.crc32 of those bytes
        pa.field("lengths", pa.list_(pa.uint16()), nullable=False),  # each row's length proxy
    ]
)


def row_lengths(table: pa.Table) -> np.ndarray:
    """Per row, the length proxy length bucketing sorts by: the most tokens (with ids stored, ``pipeline
    tokenize``) or else characters of its ``text`` or any of its ``variants`` (uint16, saturating)."""
    import pyarrow.compute as pc

    if "text" not in table.column_names and "input_ids" not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.uint16)
    tokens = "input_ids" in table.column_names
    size = pc.list_value_length if tokens else pc.utf8_length
    text, variants_column = ("input_ids", "variant_input_ids") if tokens else ("text", "variants")
    lengths = size(table.column(text)).to_numpy(zero_copy_only=False).astype(np.int64)
    if variants_column in table.column_names:
        variants = table.column(variants_column).combine_chunks()
        flat = size(pc.list_flatten(variants)).to_numpy(zero_copy_only=False).astype(np.int64)
        parents = pc.list_parent_indices(variants).to_numpy(zero_copy_only=False)
        np.maximum.at(lengths, parents, flat)
    return np.minimum(lengths, np.iinfo(np.uint16).max).astype(np.uint16)


class _IndexBuilder:
    """Collects one shard's block index while the shard is written."""

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.rows: list[int] = []
        self.crcs: list[int] = []
        self.lengths: list[np.ndarray] = []

    @property
    def samples(self) -> int:
        return len(self.offsets)

    @property
    def sentences(self) -> int:
        return sum(self.rows)

    def add(self, offset: int, data: bytes, lengths: np.ndarray) -> None:
        self.offsets.append(offset)
        self.sizes.append(len(data))
        self.rows.append(len(lengths))
        self.crcs.append(zlib.crc32(data))
        self.lengths.append(lengths)

    def table(self) -> pa.Table:
        flat = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.uint16)
        offsets = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int32)
        lengths = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.uint16()))
        columns = [
            pa.array(self.offsets, pa.uint64()),
            pa.array(self.sizes, pa.uint64()),
            pa.array(self.rows, pa.uint32()),
            pa.array(self.crcs, pa.uint32()),
            lengths,
        ]
        return pa.Table.from_arrays(columns, schema=INDEX_SCHEMA)

    def write(self, path: Path) -> None:
        # uncompressed, one record batch: a reader memory-maps it and views the lengths without a copy
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, INDEX_SCHEMA) as writer:
            writer.write_table(self.table(), max_chunksize=max(1, self.samples))


# the shard set's index: the shards' indexes concatenated in manifest order, with each block's shard
SET_INDEX_SCHEMA = pa.schema([pa.field("shard", pa.uint32(), nullable=False), *INDEX_SCHEMA])


class ShardIndex:
    """A block index (one shard's, or the set's with its ``shard`` column), memory-mapped: opening it
    reads a few bytes per block; the per-row lengths are views whose pages are read when touched."""

    def __init__(self, shard: Path | None, index_path: Path, schema: pa.Schema = INDEX_SCHEMA):
        self.shard = shard
        try:
            table = pa.ipc.open_file(pa.memory_map(str(index_path), "r")).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(
                f"block index {index_path} is unreadable ({exc}); write it again with "
                f"`python -m pipeline shards index {index_path.parent}`"
            ) from None
        if table.schema != schema:
            raise InputError(f"{index_path} is not a block index of this format; rerun its stage")
        self.table = table
        self.shards = _column(table, "shard") if "shard" in schema.names else None
        self.offsets = _column(table, "offset")
        self.sizes = _column(table, "size")
        self.rows = _column(table, "rows")
        self.crcs = _column(table, "crc32")
        lengths = table.column("lengths")
        lengths = lengths.chunk(0) if lengths.num_chunks == 1 else lengths.combine_chunks()
        self.length_offsets = lengths.offsets.to_numpy()
        values = lengths.values
        self._flat_lengths = values.to_numpy(zero_copy_only=True) if len(values) else np.zeros(0, np.uint16)

    def __len__(self) -> int:
        return len(self.offsets)

    def lengths(self, block: int) -> np.ndarray:
        """Block ``block``'s per-row lengths: a view into the mapped file (pages read when touched)."""
        return self._flat_lengths[self.length_offsets[block] : self.length_offsets[block + 1]]


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy().astype(np.int64)


def block_index(directory: str | Path, entry: dict[str, Any], verify: bool = True) -> ShardIndex:
    """The block index of one manifest entry; ``verify`` checks its size and sha256 (a few bytes per row)
    and the shard's size (a truncated shard is refused here, a modified block when it is read)."""
    directory = Path(directory)
    shard = directory / entry["name"]
    recorded = entry.get("index")
    if recorded is None:
        raise InputError(
            f"{directory / MANIFEST} lists {entry['name']} without a block index (written by a version "
            f"before 0.2): add the indexes once with `python -m pipeline shards index {directory}`"
        )
    path = directory / recorded["name"]
    problem = file_problem(path, recorded["bytes"], recorded["sha256"]) if verify else None
    if problem:
        raise InputError(f"{path} {problem} against {directory / MANIFEST}: re-create it (rerun the stage)")
    check_shard_size(directory, entry)
    return ShardIndex(shard, path)


def check_shard_size(directory: Path, entry: dict[str, Any]) -> None:
    """Refuse a missing shard, or one whose size is not its manifest's (truncated or modified): free."""
    shard = Path(directory) / entry["name"]
    problem = None
    if not shard.is_file():
        problem = "is missing"
    elif (size := shard.stat().st_size) != entry["bytes"]:
        problem = f"has {size} bytes, the manifest says {entry['bytes']} (truncated or modified)"
    if problem:
        raise InputError(f"{shard} {problem} against {directory / MANIFEST}: re-create it (rerun the stage)")


def index_entry(path: Path) -> dict[str, Any]:
    """A block index's record in its shard's manifest entry."""
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def check_block(shard: Path, block: int, data: bytes, crc32: int) -> None:
    """Refuse a block whose bytes do not match the CRC-32 its index recorded (a flipped bit, a torn write)."""
    if zlib.crc32(data) != crc32:
        raise InputError(
            f"shard {shard} block {block} fails its CRC-32 check against {index_name(shard.name)} "
            "(modified or corrupted): re-create it (rerun the stage)"
        )


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> None:
    """Finish a shard set: the set's block index (every shard's index in one file, so a reader opens one
    file instead of one per shard), then ``manifest.json``, whose presence means the stage finished."""
    directory = Path(directory)
    entries = manifest["shards"]
    if entries and all("index" in entry for entry in entries):
        path = directory / SET_INDEX
        atomic_write(path, lambda tmp: _write_set_index(directory, entries, tmp))
        manifest["index"] = index_entry(path)
    atomic_write_json(directory / MANIFEST, manifest)


def _write_set_index(directory: Path, entries: list[dict[str, Any]], path: Path) -> None:
    parts = []
    for position, entry in enumerate(entries):
        table = block_index(directory, entry, verify=True).table  # a last check of what the stage wrote
        shard = pa.array(np.full(table.num_rows, position, np.uint32))
        parts.append(table.add_column(0, SET_INDEX_SCHEMA.field("shard"), shard))
    combined = pa.concat_tables(parts).combine_chunks()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, SET_INDEX_SCHEMA) as writer:
        writer.write_table(combined, max_chunksize=max(1, combined.num_rows))


def set_index(directory: str | Path, manifest: dict[str, Any], verify: bool = True) -> ShardIndex | None:
    """The shard set's block index, or None for a set finished before it existed (then read the
    shards' own indexes); ``verify`` checks its size and sha256 (about 2 bytes a row)."""
    recorded = manifest.get("index")
    if recorded is None:
        return None
    directory = Path(directory)
    path = directory / recorded["name"]
    problem = file_problem(path, recorded["bytes"], recorded["sha256"]) if verify else None
    if problem:
        raise InputError(
            f"{path} {problem} against {directory / MANIFEST}: write it again with "
            f"`python -m pipeline shards index {directory}`"
        )
    return ShardIndex(None, path, SET_INDEX_SCHEMA)


def add_indexes(directory: str | Path) -> int:
    """Write the block index of every shard of ``directory`` that lacks one (shards of versions before 0.2)
    and the set's index, and rewrite the manifest; returns how many shard indexes were written. Reads
    every block of the shards without an index once."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    added = 0
    for entry in manifest["shards"]:
        if "index" in entry:
            continue
        path = verify_shard(directory, entry)
        index = _IndexBuilder()
        for member, table in iter_blocks(path):
            with open(path, "rb") as f:
                f.seek(member.offset_data)
                data = f.read(member.size)
            index.add(member.offset_data, data, row_lengths(table))
        index_path = directory / index_name(entry["name"])
        atomic_write(index_path, index.write)
        entry["index"] = index_entry(index_path)
        added += 1
    write_manifest(directory, manifest)
    return added


# --------------------------------------------------------------------------------------------- manifest
def new_manifest(stage: str, config: dict[str, Any], shards: list[dict[str, Any]], **extra: Any) -> dict:
    """A manifest: the shards with counts and checksums, their totals, the resolved config."""
    totals = {
        "shards": len(shards),
        "samples": sum(s["samples"] for s in shards),
        "sentences": sum(s["sentences"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
    }
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "stage": stage,
        "tool_version": __version__,
        "config": config,
        "shards": shards,
        "totals": totals,
        **extra,
    }


@dataclass(frozen=True)
class ShardSet:
    """What a reader of a shard set needs to know, from its ``manifest.json`` read once
    (:func:`read_shard_set`); the trainer checks its config against this record."""

    directory: Path
    manifest: dict[str, Any]  # the whole manifest, for the block index (set_index) and the shard list
    stage: str | None  # the stage that wrote the set: preprocess, augment, teacher, tokenize
    num_variants: int  # EDA variants cached per sentence (augment's k; 0 without a variants column)
    teacher: dict[str, Any] | None  # the teacher stage's record: name, path, hash, dim, dtype, ...
    hard_negatives: int  # mined hard negatives cached per sentence (0 = none)
    tokenizer: dict[str, Any] | None  # the tokenize stage's record (hash, name, prefix, max_length)
    has_index: bool  # a block index for the whole set (shard-blocks.idx)

    @property
    def teacher_dim(self) -> int | None:
        return None if self.teacher is None else self.teacher.get("dim")

    @property
    def holds_pairs(self) -> bool:
        """Whether the set holds (anchor, positive) pairs rather than sentences (:func:`holds_pairs`)."""
        return holds_pairs(self.manifest)


def holds_pairs(manifest: dict[str, Any]) -> bool:
    """Whether a shard set's manifest describes pair shards: written by ``pipeline pairs``, or by a stage
    over its output (the teacher stage records ``input_stage: pairs``). The one reader of "what kind of
    shard set is this": the trainer's data plan and the stages that refuse or carry pairs ask it."""
    return manifest.get("stage") == "pairs" or manifest.get("input_stage") == "pairs"


def read_shard_set(directory: str | Path | ShardSet) -> ShardSet:
    """The manifest of the shard set in ``directory`` as a :class:`ShardSet` (a ShardSet is returned as is).

    ``num_variants`` is augment's recorded k: in the manifest's ``config`` (augment), or in the
    ``input_config`` a later stage (teacher, tokenize) carries from its augmented input; when neither
    records it (a stage over a stage), the longest variant list of the first block.
    """
    from pipeline.errors import ConfigError

    if isinstance(directory, ShardSet):
        return directory
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"data.shards: {directory} is not a directory; run preprocess/augment first")
    manifest = read_manifest(directory)
    k = None
    for config in (manifest.get("config"), manifest.get("input_config")):
        if isinstance(config, dict) and isinstance(config.get("num_variants"), int):
            k = config["num_variants"]
            break
    if k is None and manifest.get("shards"):  # not recorded (a stage over a stage over augment): one block
        for _, table in iter_blocks(directory / manifest["shards"][0]["name"]):
            variants = table.column("variants").to_pylist() if "variants" in table.column_names else []
            k = max((len(v) for v in variants), default=0)
            break
    return ShardSet(
        directory=directory,
        manifest=manifest,
        stage=manifest.get("stage"),
        num_variants=k or 0,
        teacher=manifest.get("teacher"),
        hard_negatives=int((manifest.get("hard_negatives") or {}).get("k", 0)),
        tokenizer=manifest.get("tokenizer"),
        has_index=manifest.get("index") is not None,
    )


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    manifest = read_json(
        path,
        "manifest",
        "point to a directory written by `python -m pipeline preprocess` or `augment`, or re-run the "
        "stage that wrote it",
    )
    if not isinstance(manifest, dict):
        raise InputError(f"{path} is not a {FORMAT} manifest (not a JSON object)")
    if manifest.get("format") != FORMAT:
        raise InputError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise InputError(
            f"{path} has format version {manifest['format_version']}; this tool reads "
            f"<= {FORMAT_VERSION}: upgrade the package"
        )
    return manifest


def verify_shard(directory: str | Path, entry: dict[str, Any]) -> Path:
    """Check one shard's size and sha256 against its manifest entry; return its path."""
    path = Path(directory) / entry["name"]
    problem = file_problem(path, entry["bytes"], entry["sha256"])
    if problem:
        raise InputError(
            f"shard {path} {problem} against {Path(directory) / MANIFEST}: re-create it (rerun the stage)"
        )
    return path


def shard_paths(directory: str | Path, verify: bool = False) -> list[Path]:
    """The shard paths of a stage's output directory, in manifest order."""
    manifest = read_manifest(directory)
    if verify:
        return [verify_shard(directory, e) for e in manifest["shards"]]
    return [Path(directory) / e["name"] for e in manifest["shards"]]
