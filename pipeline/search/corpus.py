"""Reading what gets indexed or queried: a sentence file (one per line) or a directory of our shards."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import InputError
from pipeline.shards import read_manifest, read_shard, sentence_id, verify_shard

log = logging.getLogger(__name__)


@dataclass
class Corpus:
    """Unique sentences in input order with their stable ids, and what was skipped on the way."""

    ids: list[int]
    texts: list[str]
    kind: str  # "sentences" (a text file) or "shards" (a stage output directory)
    counts: Counter = field(default_factory=Counter)

    def fingerprint(self) -> str:
        """sha256 of the ordered texts: a restart may reuse encoded chunks only if this matches."""
        h = hashlib.sha256()
        for text in self.texts:
            h.update(text.encode("utf-8"))
            h.update(b"\n")
        return h.hexdigest()


def read_lines(path: Path, what: str = "sentence file") -> tuple[list[tuple[int, str]], int]:
    """Non-blank stripped lines of a UTF-8 file with their 1-based line numbers, and the blank count."""
    if not path.is_file():
        raise InputError(f"{what} {path} does not exist; pass an existing UTF-8 file, one entry per line")
    lines: list[tuple[int, str]] = []
    blank = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{path}:{number}: not valid UTF-8 ({exc.reason}); re-encode the file"
                ) from None
            if text:
                lines.append((number, text))
            else:
                blank += 1
    return lines, blank


def read_corpus(path: str | Path, dedup: bool = True) -> Corpus:
    """Sentences from a text file or a shard directory (``manifest.json``), duplicates dropped and counted."""
    path = Path(path)
    counts: Counter = Counter()
    if path.is_dir():
        kind = "shards"
        manifest = read_manifest(path)
        rows: list[tuple[int, str]] = []
        for entry in manifest["shards"]:
            for block in read_shard(verify_shard(path, entry)):
                rows.extend(zip(block.column("id").to_pylist(), block.column("text").to_pylist()))
        counts["read"] = len(rows)
    elif path.exists():
        kind = "sentences"
        lines, counts["blank"] = read_lines(path)
        counts["read"] = len(lines) + counts["blank"]
        rows = [(sentence_id(text), text) for _, text in lines]
    else:
        raise InputError(
            f"input {path} does not exist; pass a sentence file (one per line) or a shard directory"
        )
    ids: list[int] = []
    texts: list[str] = []
    seen: set[str] = set()
    for row_id, text in rows:
        if dedup and text in seen:
            counts["duplicate"] += 1
            continue
        seen.add(text)
        ids.append(row_id)
        texts.append(text)
    counts["indexed"] = len(texts)
    if not texts:
        raise InputError(f"input {path} holds no sentences ({dict(counts)}); nothing to index")
    log.info("read %d sentences from %s (%s)", len(texts), path, dict(counts))
    return Corpus(ids=ids, texts=texts, kind=kind, counts=counts)
