"""Durable file writes and checksums, shared by every stage.

A file written here is first written under a temporary name in the same directory, fsynced, renamed
over the final name and the directory fsynced: a reader sees the old file or the whole new one, and a
killed writer (or a power cut after the call returns) never leaves a partial file under the final name.
The temporary name carries the pid and a random token because pids are not unique across the nodes of
a cluster that share a file system.

A full disk is one :class:`DiskFullError` (exit code 74) naming the directory and the space needed,
raised before the write when the free space is below the size of the last file of the same kind
written to that directory, or when the write itself fails with ENOSPC; the partial temporary file is
removed and the previous file under the final name is left as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import InputError, PipelineError

__all__ = [
    "EXIT_CODE_DISK_FULL",
    "DiskFullError",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_parquet",
    "check_free_space",
    "disk_full_error",
    "file_problem",
    "fsync_dir",
    "fsync_file",
    "format_size",
    "needed_phrase",
    "fsync_tree",
    "is_disk_full",
    "read_json",
    "sha256_file",
    "temporary_name",
    "tensor_checksum",
]


# sysexits.h EX_IOERR: an input/output error. The run or stage can be rerun unchanged once space is freed.
EXIT_CODE_DISK_FULL = 74
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(PipelineError):
    """Not enough space to write an output: the message names the directory and the space needed."""

    exit_code = EXIT_CODE_DISK_FULL


def is_disk_full(exc: BaseException | None) -> bool:
    """An ENOSPC/EDQUOT error, also as pyarrow (an OSError without errno) and safetensors (its own
    SafetensorError) report it, or anywhere in the chain of exceptions that led to ``exc`` (torch.save
    turns the ENOSPC of a write into a RuntimeError about the zip file's position)."""
    for _ in range(10):  # the chain, bounded
        if exc is None:
            return False
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(exc: BaseException, directory: str | Path | None) -> DiskFullError:
    """One line for an ENOSPC raised outside :func:`atomic_write` (a work file a stage streams into),
    naming the output directory and its free space (the size of such a file is not known in advance)."""
    where = Path(directory) if directory is not None else None
    free = (
        f", {format_size(shutil.disk_usage(where).free)} free" if where is not None and where.exists() else ""
    )
    return DiskFullError(
        f"disk full in {where or 'the output directory'}{free} ({exc}): free space there (work files and "
        "shards need about the size of the input again) and rerun the same command: finished work is kept"
    )


def format_size(size: int) -> str:
    """Bytes for a message: KiB below a MiB (so that a small shard is not "0.0 MiB"), else MiB."""
    return f"{size / 1024:.0f} KiB" if size < 1 << 20 else f"{size / 2**20:.1f} MiB"


def needed_phrase(expected: int, written: int) -> str:
    """How much a write that failed after ``written`` bytes needs: the estimate when it is larger, else
    "more than" what was written (the write was not finished: its size is not known)."""
    if expected > written:
        return f"about {format_size(expected)} needed"
    return f"more than {format_size(written)} needed"


def check_free_space(directory: str | Path, needed: int, what: str) -> None:
    """Raise :class:`DiskFullError` when ``directory`` has less than ``needed`` bytes free.

    ``what`` names the write for the message ("checkpoint step-00001000", "shard-00012.tar").
    """
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise DiskFullError(
            f"not enough disk space in {directory} for {what}: {format_size(free)} free, about "
            f"{format_size(needed)} needed (the size of the last one written); free space there (or write "
            "elsewhere) and rerun"
        )


# (directory, suffix) -> size of the last file of that kind written there by this process: the expected
# size of the next one (shards of a stage are alike in size, so are manifests and checkpoints).
_last_size: dict[tuple[str, str], int] = {}


def _expected_size(path: Path) -> int:
    key = (str(path.parent), path.suffix)
    if key not in _last_size:  # first write of this kind here: the largest such file already there
        sizes = [0]
        if path.suffix:  # (suffixless files are small pointers: "latest", "best")
            with os.scandir(path.parent) as entries:
                for entry in entries:
                    if entry.name.endswith(path.suffix) and entry.is_file(follow_symlinks=False):
                        sizes.append(entry.stat().st_size)
        _last_size[key] = max(sizes)
    return _last_size[key]


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in ``path`` durable (the entry lives in the directory, not the file)."""
    fsync_file(path)


def walk_files(root: str | Path) -> Iterator[Path]:
    """Every file under ``root``, directories in walk order and names sorted within each."""
    for dirpath, _, filenames in os.walk(root):
        for name in sorted(filenames):
            yield Path(dirpath) / name


def fsync_tree(root: str | Path) -> None:
    """Flush every file and directory under ``root`` to disk before a rename makes it visible."""
    for path in walk_files(root):
        fsync_file(path)
    for dirpath, _, _ in os.walk(root):
        fsync_dir(dirpath)


def temporary_name(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write(path: str | Path, write: Callable[[Path], None], durable: bool = True) -> None:
    """Call ``write(tmp)`` to fill a temporary file, then rename it over ``path``.

    ``durable=False`` skips the fsyncs (the rename stays atomic for a killed process, not for a power
    cut): for work files that are cheap to recompute and written often.
    """
    path = Path(path)
    expected = _expected_size(path)
    check_free_space(path.parent, expected, path.name)
    tmp = temporary_name(path)
    try:
        write(tmp)
        if durable:
            fsync_file(tmp)
        written = tmp.stat().st_size
        os.replace(tmp, path)
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        partial = tmp.stat().st_size if tmp.exists() else 0
        raise DiskFullError(
            f"disk full in {path.parent} while writing {path.name} ({format_size(partial)} written, the "
            f"partial file removed; {needed_phrase(expected, partial)}): free space there (or write "
            "elsewhere) and rerun"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    _last_size[(str(path.parent), path.suffix)] = written
    if durable:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data), durable)


def atomic_write_json(path: str | Path, obj: Any, durable: bool = True) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"), durable)


def atomic_write_parquet(path: str | Path, table: Any) -> None:
    """A pyarrow table as a zstd-compressed parquet file, atomically."""
    import pyarrow.parquet as pq

    atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def tensor_checksum(tensors: Any) -> str:
    """sha256 of torch tensors' float32 bytes, in order (the debug dump's parameter and queue checksums:
    equal on two ranks or two runs only when every value is bit-equal)."""
    h = hashlib.sha256()
    for x in tensors:
        h.update(x.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_problem(path: str | Path, size: int, sha256: str) -> str | None:
    """What is wrong with ``path`` against its recorded size and sha256 (None: nothing).

    The size is checked first: it is free and catches truncation without reading the file.
    """
    path = Path(path)
    if not path.is_file():
        return "is missing"
    actual = path.stat().st_size
    if actual != size:
        return f"has {actual} bytes, the manifest says {size} (truncated or modified)"
    if sha256_file(path) != sha256:
        return "fails its sha256 check (modified or corrupted)"
    return None


def read_json(path: str | Path, what: str, fix: str) -> Any:
    """The JSON document at ``path``; a missing or unreadable file is one InputError naming it.

    ``what`` names the file for the message ("manifest", "checkpoint.json"); ``fix`` says what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} not found: {fix}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{what} {path} is not valid JSON ({exc}): {fix}") from None
