"""Synonym sources for EDA: the bundled Cilin dictionary or a word-vector cache built by ``synonyms``.

Both load into one :class:`SynonymSource`: a read-only mapping word -> synonyms (best first, never the
word itself). The EDA operations only ask ``source.get(word)``, so they do not care where the
synonyms came from.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import InputError
from pipeline.io import sha256_file

# A Cilin line: an 8-character code (7 letters/digits + the relation mark) then space-separated words.
_CILIN_LINE = re.compile(r"^([A-Za-z0-9]{7})([=#@])\s+(.+?)\s*$")


class SynonymSource:
    """Word -> tuple of synonyms. ``name`` and ``sha256`` identify the file in manifests."""

    def __init__(self, table: dict[str, tuple[str, ...]], name: str, sha256: str = "") -> None:
        self._table = table
        self.name = name
        self.sha256 = sha256

    def get(self, word: str) -> tuple[str, ...]:
        return self._table.get(word, ())

    def __contains__(self, word: str) -> bool:
        return word in self._table

    def __getitem__(self, word: str) -> tuple[str, ...]:
        return self._table[word]

    def __len__(self) -> int:
        return len(self._table)


def load_cilin(path: str | Path) -> SynonymSource:
    """HIT Tongyici Cilin (extended): only ``=`` groups are synonyms.

    ``#`` groups are related words (e.g. 良民 顺民) and ``@`` lines hold one word with no synonym;
    replacing a word with a merely related one would change the meaning, so both are skipped.
    A word in several ``=`` groups gets the union, in file order.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"Cilin file {path} not found; pass --synonyms-path or use the bundled one")
    merged: dict[str, dict[str, None]] = {}  # dict as an ordered set
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            match = _CILIN_LINE.match(line)
            if match is None:
                raise InputError(
                    f"{path}:{line_no}: not a Cilin line (expected 'CODE= word word ...', "
                    f"got {line.strip()[:40]!r}); fix or remove the line"
                )
            if match.group(2) != "=":
                continue
            words = list(dict.fromkeys(match.group(3).split()))
            for word in words:
                bucket = merged.setdefault(word, {})
                for other in words:
                    if other != word:
                        bucket[other] = None
    table = {word: tuple(syns) for word, syns in merged.items() if syns}
    return SynonymSource(table, name=f"cilin:{path.name}", sha256=sha256_file(path))


def load_vector_cache(path: str | Path) -> SynonymSource:
    """A Parquet cache written by ``python -m pipeline synonyms`` (columns word, synonyms, scores)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise InputError(f"synonym cache {path} not found; build it with `python -m pipeline synonyms`")
    try:
        table = pq.read_table(path, columns=["word", "synonyms"])
    except Exception as exc:  # pyarrow raises several types for a bad file or missing columns
        raise InputError(
            f"synonym cache {path} is not a Parquet file with columns word, synonyms ({exc}); "
            "rebuild it with `python -m pipeline synonyms`"
        ) from None
    words = table.column("word").to_pylist()
    synonyms = table.column("synonyms").to_pylist()
    mapping = {w: tuple(s) for w, s in zip(words, synonyms) if s}
    return SynonymSource(mapping, name=f"vectors:{path.name}", sha256=sha256_file(path))


def load_stopwords(path: str | Path) -> frozenset[str]:
    """One word per line; blank lines and lines starting with ``#`` are ignored."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"stopword file {path} not found; pass an existing --stopwords file")
    with open(path, encoding="utf-8") as f:
        return frozenset(w for line in f if (w := line.strip()) and not w.startswith("#"))
