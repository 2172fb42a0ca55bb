"""Input side of the corpus stages (preprocess, pairs): find input files, cut them into work units,
detect formats, read records.

A *work unit* is the smallest piece of input that one process handles: a whole compressed file, one
zip member, or a byte range of an uncompressed file (so one 8 GB JSON-lines file still spreads over
many workers). Units depend only on the inputs and ``chunk_bytes``, never on ``--workers`` or
``--num-tasks``, which is what makes the output independent of how the work is spread.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import logging
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from pipeline.errors import ConfigError, InputError

log = logging.getLogger(__name__)

COLLECTIONS = ("wiki_zh", "news2016zh", "baike2018qa", "webtext2019zh", "translation2019zh")
SOURCES = (*COLLECTIONS, "plain")  # the values of the `source` column; index = source code

# Keys that identify each nlp_chinese_corpus collection (a subset of its record keys).
SIGNATURES = {
    "wiki_zh": {"url", "text"},
    "news2016zh": {"news_id", "content"},
    "baike2018qa": {"qid", "category", "answer"},
    "webtext2019zh": {"qid", "answer_id", "content"},
    "translation2019zh": {"english", "chinese"},
}
DETECT_LINES = 32  # non-blank lines sampled from the head of a file to detect its format
_GZIP_MAGIC, _BZ2_MAGIC, _ZIP_MAGIC = b"\x1f\x8b", b"BZh", b"PK\x03\x04"


@dataclass(frozen=True)
class Unit:
    """One piece of input: ``path`` (as matched), optional zip ``member``, byte range for plain files."""

    path: str
    member: str | None
    compression: str  # none | gzip | bz2 | zip
    start: int  # first byte (uncompressed files only; 0 otherwise)
    end: int  # one past the last byte; -1 = to the end of the stream
    format: str  # a collection name or "plain"

    @property
    def label(self) -> str:
        """How messages name this input: ``file``, ``archive.zip!member``."""
        return f"{self.path}!{self.member}" if self.member else self.path

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Unit:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


# --------------------------------------------------------------------------------------------- files
def expand_inputs(patterns: list[str | Path]) -> list[Path]:
    """Files named by ``patterns`` (files, directories searched recursively, or globs), deduplicated."""
    found: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        text = str(pattern)
        path = Path(text)
        if path.is_file():
            matches = [path]
        elif path.is_dir():
            # Hidden files and directories are skipped (among them our own OUT/.work if OUT is inside).
            matches = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
        else:
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True) if Path(m).is_file())
        if not matches:
            raise InputError(
                f"no input matched {text!r}: check the path, or quote the glob so the shell "
                "does not expand it"
            )
        for match in matches:
            key = match.resolve()
            if key not in seen:
                seen.add(key)
                found.append(match)
    return found


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def compression_of(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if head.startswith(_BZ2_MAGIC):
        return "bz2"
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    return "none"


def open_stream(path: str, compression: str, member: str | None = None) -> IO[bytes]:
    """A binary stream over the (decompressed) content of a file or zip member."""
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "bz2":
        return bz2.open(path, "rb")
    if compression == "zip":
        archive = zipfile.ZipFile(path)
        stream = archive.open(member or "")
        archive.close()  # the member stream keeps its own reference to the file
        return stream
    return open(path, "rb", buffering=1 << 20)


def plan_units(
    files: list[Path], input_format: str, chunk_bytes: int, max_record_bytes: int
) -> tuple[list[Unit], int]:
    """Cut ``files`` into work units (formats detected); also return the estimated text bytes."""
    units: list[Unit] = []
    estimate = 0
    for path in files:
        compression = compression_of(path)
        size = path.stat().st_size
        if compression == "zip":
            try:
                with zipfile.ZipFile(path) as archive:
                    members = sorted((i.filename, i.file_size) for i in archive.infolist() if not i.is_dir())
            except (zipfile.BadZipFile, OSError) as exc:
                raise InputError(f"{path}: not a readable zip archive ({exc}); repair or remove it") from None
            for name, member_size in members:
                fmt = _format_for(str(path), compression, name, input_format, max_record_bytes)
                units.append(Unit(str(path), name, compression, 0, -1, fmt))
                estimate += member_size
            continue
        fmt = _format_for(str(path), compression, None, input_format, max_record_bytes)
        if compression != "none":
            units.append(Unit(str(path), None, compression, 0, -1, fmt))
            estimate += 4 * size  # text compresses about 3-5x
            continue
        estimate += size
        for start in range(0, max(size, 1), chunk_bytes):
            end = min(start + chunk_bytes, size)
            units.append(Unit(str(path), None, compression, start, end if end < size else -1, fmt))
    return units, estimate


def _format_for(path: str, compression: str, member: str | None, input_format: str, limit: int) -> str:
    if input_format != "auto":
        return input_format
    label = f"{path}!{member}" if member else path
    try:
        with open_stream(path, compression, member) as stream:
            head = _head_lines(stream, limit)
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(f"{label}: cannot read ({exc}); repair or remove the file") from None
    return detect_format(head, label)


def _head_lines(stream: IO[bytes], limit: int) -> list[bytes]:
    lines: list[bytes] = []
    while len(lines) < DETECT_LINES:
        try:
            line = stream.readline(limit)
        except (OSError, EOFError):  # a truncated archive: detect from what was readable
            break
        if not line:
            break
        if line.strip():
            lines.append(line)
    return lines


def detect_format(lines: list[bytes], label: str) -> str:
    """``plain`` unless most sampled lines are JSON objects; then the collection they match best."""
    objects: list[dict] = []
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            objects.append(value)
    if not objects or 2 * len(objects) < len(lines):
        return "plain"
    votes = {name: sum(1 for o in objects if keys <= o.keys()) for name, keys in SIGNATURES.items()}
    best = max(votes, key=lambda name: votes[name])
    if votes[best] == 0:
        keys = ", ".join(sorted(objects[0].keys())[:12])
        raise InputError(
            f"{label}: JSON lines with keys ({keys}) match none of {', '.join(COLLECTIONS)}; "
            "set --input_format to the collection (and --text_fields) or convert the file to plain text"
        )
    return best


# --------------------------------------------------------------------------------------------- lines
def iter_lines(unit: Unit, max_record_bytes: int) -> Iterator[tuple[int, bytes | None, int]]:
    """``(line_number_in_unit, line or None if over max_record_bytes, byte offset)`` for each line.

    A line belongs to the byte range its first byte falls in, so neighbouring chunks of one file
    read every line exactly once. Memory stays bounded by ``max_record_bytes`` whatever the input:
    the rest of an over-long line is skipped in 1 MiB pieces.
    """
    stream = open_stream(unit.path, unit.compression, unit.member)
    with stream:
        pos = 0
        if unit.start > 0:
            stream.seek(unit.start - 1)
            pos = unit.start - 1 + _skip_line(stream)  # finish the line that began before `start`
        number = 0
        while unit.end < 0 or pos < unit.end:
            line = stream.readline(max_record_bytes + 1)
            if not line:
                return
            number += 1
            offset = pos
            pos += len(line)
            if len(line) > max_record_bytes and not line.endswith(b"\n"):
                pos += _skip_line(stream)
                yield number, None, offset
            else:
                yield number, line, offset


def _skip_line(stream: IO[bytes]) -> int:
    skipped = 0
    while True:
        piece = stream.readline(1 << 20)
        skipped += len(piece)
        if not piece or piece.endswith(b"\n"):
            return skipped


def line_number_base(unit: Unit) -> int:
    """Lines of the file before ``unit`` starts (only computed to name a bad line in a message)."""
    if unit.start == 0:
        return 0
    count = 0
    with open(unit.path, "rb") as f:
        remaining = unit.start
        while remaining > 0:
            block = f.read(min(remaining, 1 << 22))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    # The line that straddles `start` belongs to the previous unit (see iter_lines).
    with open(unit.path, "rb") as f:
        f.seek(unit.start - 1)
        straddles = f.read(1) != b"\n"
    return count + (1 if straddles else 0)


def validate_format(name: str) -> None:
    if name not in ("auto", *SOURCES):
        raise ConfigError(f"input_format: {name!r} is not one of auto, {', '.join(SOURCES)}")
