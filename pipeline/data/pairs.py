"""The one reader of pair and triple files: supervised objectives, STS evaluation, hard-negative mining.

Formats, chosen by the file suffix:

* ``.tsv`` / ``.txt``: tab-separated, UTF-8, no header. Pairs: ``text_a<TAB>text_b<TAB>label``
  (the bundled ``pipeline/resources/eval/*.tsv`` are such files); with ``require_label=False`` the
  label column may be left out. Triples: ``anchor<TAB>positive<TAB>negative``.
* ``.jsonl`` / ``.json``: one JSON object per line. Pairs: ``{"sentence1", "sentence2", "label"}``,
  each key with aliases (:data:`PAIR_KEYS`: ``text1``/``text2``/``score``, ``anchor``/``positive``,
  ``query``/``pos``, CBLUE's ``query1``/``query2``); a list of strings as the second text is one pair
  per element. Triples: ``{"anchor", "positive", "negative"}``. Other keys are ignored.
* ``.json`` holding one JSON array of such objects (CBLUE's ``CHIP-STS_train.json``,
  ``KUAKE-QQR_train.json``): read as if each element were a line; a problem names ``file:record N``.

Texts are stripped of surrounding whitespace. Labels are numbers (a graded score for CoSENT, a class
index for the Sentence-BERT classifier); text labels such as NLI's ``entailment`` are accepted only
through ``label_map`` (e.g. :data:`NLI_LABELS`).

Bad records. A line with the wrong number of columns, a missing key, an empty text, or a label that
is not a finite number is an error: with ``strict=True`` (the default) the reader raises InputError
naming ``file:line`` and what is wrong; with ``strict=False`` it skips the line, and logs one warning
with the number skipped and the first problem. Nothing is dropped silently. Blank lines are not
records and are skipped (their count is logged at INFO level).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import InputError

logger = logging.getLogger(__name__)

__all__ = ["NLI_LABELS", "PAIR_KEYS", "Pair", "Triple", "read_pairs", "read_records", "read_triples"]

# Sentence-transformers' AllNLI class order, for ``label_map`` with the SBERT classifier.
NLI_LABELS: dict[str, int] = {"contradiction": 0, "entailment": 1, "neutral": 2}

TSV_SUFFIXES = (".tsv", ".txt")
JSONL_SUFFIXES = (".jsonl", ".json")

# JSONL keys of a pair, first the name used in messages, then its accepted aliases.
PAIR_KEYS: tuple[tuple[str, ...], ...] = (
    ("sentence1", "text1", "text_a", "anchor", "query", "query1"),
    ("sentence2", "text2", "text_b", "positive", "pos", "query2"),
    ("label", "score"),
)
TRIPLE_KEYS: tuple[tuple[str, ...], ...] = (("anchor",), ("positive",), ("negative",))


@dataclass(frozen=True)
class Pair:
    text_a: str
    text_b: str
    label: float | None  # None only when read with require_label=False from a file without labels


@dataclass(frozen=True)
class Triple:
    anchor: str
    positive: str
    negative: str


class _BadRecord(ValueError):
    """One line's problem; the reader adds file:line."""


T = TypeVar("T")


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _BadRecord(f"{name} must be a string, got {type(value).__name__}")
    text = value.strip()
    if not text:
        raise _BadRecord(f"{name} is empty")
    return text


def _label(value: Any, label_map: Mapping[str, float] | None) -> float:
    if isinstance(value, bool):
        raise _BadRecord(f"label must be a number, got {value!r}")
    if isinstance(value, str):
        key = value.strip()
        if label_map is not None and key in label_map:
            return float(label_map[key])
        try:
            number = float(key)
        except ValueError:
            hint = f" (known: {', '.join(label_map)})" if label_map else "; pass label_map for text labels"
            raise _BadRecord(f"label {value!r} is not a number{hint}") from None
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        raise _BadRecord(f"label must be a number, got {type(value).__name__}")
    if not math.isfinite(number):
        raise _BadRecord(f"label {value!r} is not a finite number")
    return number


def _tsv_fields(line: str, names: tuple[str, ...], optional: int = 0) -> list[Any]:
    """The columns of a TSV line; the last ``optional`` of ``names`` may be missing (read as None)."""
    fields: list[Any] = line.split("\t")
    required = len(names) - optional
    if not required <= len(fields) <= len(names):
        count = f"{required} or {len(names)}" if optional else f"{len(names)}"
        columns = ", ".join(names[:required]) + "".join(f"[, {name}]" for name in names[required:])
        raise _BadRecord(f"expected {count} tab-separated columns ({columns}), got {len(fields)}")
    return fields + [None] * (len(names) - len(fields))


def _json_fields(line: str, keys: tuple[tuple[str, ...], ...], optional: int = 0) -> list[Any]:
    """The values of a JSONL line under ``keys`` (each: name, aliases...); the last ``optional`` may lack."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _BadRecord(f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise _BadRecord(f"expected a JSON object, got {type(record).__name__}")
    values = [next((record[alias] for alias in aliases if alias in record), None) for aliases in keys]
    required = len(keys) - optional
    missing = [aliases for aliases, value in zip(keys[:required], values) if value is None]
    if missing:
        named = ", ".join(a[0] + (f" (or {', '.join(a[1:])})" if a[1:] else "") for a in missing)
        raise _BadRecord(f"missing key(s) {named}; expected {', '.join(a[0] for a in keys)}")
    return values


def _json_array(path: Path) -> list[str] | None:
    """A ``.json`` file holding one JSON array: its elements, each as a JSON line; None for JSON lines."""
    with path.open("rb") as handle:
        head = handle.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()
    if not head.startswith(b"["):
        return None
    try:
        records = json.loads(path.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a valid JSON array ({exc}); write one JSON object per line") from None
    return [json.dumps(r, ensure_ascii=False) for r in records]


def _units(path: Path) -> tuple[str, Iterator[tuple[int, str | _BadRecord]]]:
    """(what a number counts, (number, text) per record): lines, or a JSON array's elements."""
    array = _json_array(path) if path.suffix.lower() == ".json" else None
    if array is None:
        return "", _lines(path)
    return "record ", enumerate(array, start=1)


def _lines(path: Path) -> Iterator[tuple[int, str | _BadRecord]]:
    """(line number, text) per line; a line that is not UTF-8 is a bad record, not the whole file's end."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a spreadsheet export's byte-order mark
            try:
                yield number, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield number, _BadRecord(f"not UTF-8 text ({exc.reason} at byte {exc.start})")


def _read(
    path: str | Path,
    tsv_names: tuple[str, ...],
    json_keys: tuple[tuple[str, ...], ...],
    build: Callable[[list[Any]], list[T]],
    strict: bool,
    kind: str,
    optional: int = 0,
    counts: Counter | None = None,
) -> list[T]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{kind} file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in TSV_SUFFIXES:
        split, columns = _tsv_fields, tsv_names
    elif suffix in JSONL_SUFFIXES:
        split, columns = _json_fields, json_keys
    else:
        raise InputError(f"{path}: unknown {kind} format {suffix!r}; use .tsv, .txt, .jsonl or .json")

    records: list[T] = []
    skipped, blank = 0, 0
    first_problem = ""
    unit, lines = _units(path)
    for number, line in lines:
        if isinstance(line, str) and not line.strip():
            blank += 1
            continue
        try:
            if isinstance(line, _BadRecord):
                raise line
            records.extend(build(split(line, columns, optional)))
        except _BadRecord as exc:
            problem = f"{path}:{unit}{number}: {exc}"
            if strict:
                raise InputError(
                    f"{problem} (fix the line, or read with strict=False to skip bad lines)"
                ) from None
            skipped += 1
            first_problem = first_problem or problem
    if counts is not None:
        counts.update(blank=blank, bad_lines=skipped)
    if blank:
        logger.info("%s: skipped %d blank line(s)", path, blank)
    if skipped:
        logger.warning(
            "%s: skipped %d bad line(s) of %d; first: %s",
            path,
            skipped,
            skipped + len(records),
            first_problem,
        )
    if not records:
        raise InputError(
            f"{path}: no valid {kind} records" + (f"; first problem: {first_problem}" if skipped else "")
        )
    return records


def read_pairs(
    path: str | Path,
    strict: bool = True,
    label_map: Mapping[str, float] | None = None,
    require_label: bool = True,
    counts: Counter | None = None,
) -> list[Pair]:
    """Sentence pairs with a numeric label from a ``.tsv``/``.txt`` or ``.jsonl`` file.

    ``label_map`` maps text labels to numbers (e.g. :data:`NLI_LABELS`); numeric labels pass as is.
    ``require_label=False`` accepts lines without a label (``Pair.label`` is then None); a label that
    is present must still be a number. ``counts``, if given, receives ``blank`` and ``bad_lines``.
    """

    def build(fields: list[Any]) -> list[Pair]:
        text_a = _text(fields[0], "text_a")
        label = None if fields[2] is None else _label(fields[2], label_map)
        seconds = fields[1] if isinstance(fields[1], list) and fields[1] else [fields[1]]
        return [Pair(text_a, _text(text_b, "text_b"), label) for text_b in seconds]

    names = ("text_a", "text_b", "label")
    return _read(path, names, PAIR_KEYS, build, strict, "pair", 0 if require_label else 1, counts)


def read_triples(path: str | Path, strict: bool = True) -> list[Triple]:
    """(anchor, positive, hard negative) triples from a ``.tsv``/``.txt`` or ``.jsonl`` file."""

    def build(fields: list[Any]) -> list[Triple]:
        anchor, positive = _text(fields[0], "anchor"), _text(fields[1], "positive")
        return [Triple(anchor, positive, _text(fields[2], "negative"))]

    return _read(path, ("anchor", "positive", "negative"), TRIPLE_KEYS, build, strict, "triple")


def read_records(path: str | Path, source: str) -> list[tuple]:
    """A supervised file's records as tuples (texts..., label), label None for triples (``source``:
    the loss's data, "pairs" or "triples"): the rows the trainer's in-memory batches are made of."""
    if source == "triples":
        return [(t.anchor, t.positive, t.negative, None) for t in read_triples(path)]
    return [(p.text_a, p.text_b, p.label) for p in read_pairs(path)]
