"""The shard format shared by every stage (specified for outsiders in ``shards/README.md``).

A shard is a plain POSIX tar file, readable by ``webdataset`` and ``tarfile``. Each tar member is one
webdataset *sample* holding a *block* of a few thousand sentences as an Arrow IPC file
(``{shard:06d}-{block:06d}.arrow``, zstd-compressed buffers). One member per sentence would cost a
512-byte tar header for a ~60-byte sentence; blocks keep the overhead to a few bytes per sentence.

Tars are written deterministically (fixed mtime/uid/mode, sorted members) so the same rows give
byte-identical shards, and atomically (temporary file, fsync, rename) so a killed writer never
leaves a truncated shard behind under the final name.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline import __version__
from pipeline.errors import InputError
from pipeline.io import atomic_write, file_problem, read_json, sha256_file

FORMAT = "sentence-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BLOCK_EXT = "arrow"

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
    """Write ``blocks`` (one Arrow table each) as shard ``path``; return its manifest entry."""
    path = Path(path)
    samples = sentences = 0

    def write(tmp: Path) -> None:
        nonlocal samples, sentences
        with tarfile.open(tmp, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for block_index, table in enumerate(blocks):
                data = table_to_ipc(table)
                member = _tar_member(f"{shard_index:06d}-{block_index:06d}.{BLOCK_EXT}", len(data))
                tar.addfile(member, io.BytesIO(data))
                samples += 1
                sentences += table.num_rows

    atomic_write(path, write)
    return {
        "name": path.name,
        "samples": samples,
        "sentences": sentences,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
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
