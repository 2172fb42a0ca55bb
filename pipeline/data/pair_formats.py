"""Pair files in the formats users already have, read into one record type: a query, its positives, its
listed hard negatives (``pipeline pairs --format flag|columns FILES``, docs/pairs.md "Your own pairs").

``flag``: FlagEmbedding's JSON lines, one query per line::

    {"query": "...", "pos": ["...", ...], "neg": ["...", ...], "prompt": "..."}

``pos`` a non-empty list of texts, ``neg`` (optional) a list of texts, ``prompt`` (optional) the
instruction put before the query (FlagEmbedding's per-record query instruction). Other keys
(``pos_scores``, ``neg_scores``, ``type``, ...) are ignored.

``columns``: sentence-transformers-style named columns, in JSON lines, CSV or TSV (a header row names
them) or Parquet. The query and positive columns are one of :data:`LAYOUTS` (``anchor``/``positive``,
``query``/``positive``, ``query``/``answer``, ``question``/``answer``, ``sentence1``/``sentence2``);
``negative`` and ``negative_1``, ``negative_2``, ... are hard negatives (a JSON or Parquet ``negative``
may hold a list); ``label`` or ``score`` keeps the rows with a label >= ``min_label`` (required then).
Other columns are ignored and named once in the log.

Any of them may be gzip-compressed (``.gz``, or found by its first bytes). Every text is stripped of
surrounding whitespace.

Bad input. A problem with the file as a whole (it does not exist, an unknown suffix, no known column
layout, a label column without ``min_label``, a Parquet column that is not text) is one
:class:`~pipeline.errors.InputError` line. A bad record (:data:`REASONS`: a line that is not JSON or not
UTF-8, a missing or mistyped field, an empty positive list, an empty text, a row with the wrong number of
columns, a label that is not a number) is, with ``strict``, one InputError line naming ``file:line`` and
what is wrong; else it is dropped and counted by reason in :class:`ReadReport`, which keeps the first
few of each reason with their ``file:line`` and logs one line per reason. Nothing is dropped silently.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import InputError

log = logging.getLogger(__name__)

FORMATS = ("flag", "columns")
# The query and positive columns of the ``columns`` format, tried in this order.
LAYOUTS: tuple[tuple[str, str], ...] = (
    ("anchor", "positive"),
    ("query", "positive"),
    ("query", "answer"),
    ("question", "answer"),
    ("sentence1", "sentence2"),
)
LABEL_COLUMNS = ("label", "score")
NEGATIVE_COLUMN = re.compile(r"^negative(?:_(\d+))?$")
# Why a record is dropped (or, with strict, refused).
REASONS = (
    "invalid_utf8",  # a line that is not UTF-8 text
    "bad_json",  # a line that is not one JSON object
    "missing_field",  # a required key or column is absent (or null)
    "wrong_type",  # a field of the wrong type: pos not a list, a text not a string, ...
    "empty_positive_list",  # pos is []
    "empty_text",  # the query, a positive or a negative is empty after stripping
    "wrong_columns",  # a CSV/TSV row with another number of fields than its header
    "bad_label",  # a label that is not a finite number
)
EXAMPLES = 3  # first bad records kept per reason, with their file:line
_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}


@dataclass(frozen=True)
class PairRecord:
    """One query with its positives and listed hard negatives, as one line of a user's file gave it."""

    query: str
    positives: tuple[str, ...]
    negatives: tuple[str, ...] = ()
    prompt: str = ""  # put before the query (FlagEmbedding's per-record instruction); "" none
    where: str = ""  # "file:line N" (Parquet: "file:row N"), for messages


@dataclass
class ReadReport:
    """What the readers read and dropped: counts by reason, and the first :data:`EXAMPLES` of each with
    their ``file:line``."""

    records: int = 0  # records read (lines, rows), bad ones included, blank lines not
    blank: int = 0  # blank lines (not records)
    below_min_label: int = 0  # rows kept out by min_label (a filter, not a problem)
    dropped: Counter = field(default_factory=Counter)  # bad records by reason
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> ["file:line N: problem"]

    def bad(self, reason: str, message: str) -> None:
        self.dropped[reason] += 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < EXAMPLES:
            kept.append(message)

    def log(self) -> None:
        """One warning line per reason: how many, and the first."""
        for reason, n in sorted(self.dropped.items()):
            log.warning("dropped %d record(s) (%s); first: %s", n, reason, self.examples[reason][0])


class BadRecord(ValueError):
    """One record's problem and its reason (:data:`REASONS`); the reader adds ``file:line``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ------------------------------------------------------------------------------------------ reading
def read_pair_file(
    path: Path, fmt: str, report: ReadReport, strict: bool = False, min_label: float | None = None
) -> Iterator[PairRecord]:
    """The records of one file in format ``fmt`` (:data:`FORMATS`), bad ones counted in ``report`` (or,
    with ``strict``, refused); ``min_label`` keeps the labelled rows of a ``columns`` file at or above it."""
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r} is not one of {', '.join(FORMATS)} (or corpus)")
    kind = file_kind(path)
    if fmt == "flag" and kind != "json":
        raise InputError(f"{path}: --format flag reads JSON lines (.jsonl, .jsonl.gz), not {kind}")
    if kind == "json":
        rows: Iterator[tuple[str, Any]] = _json_rows(path)
    elif kind == "parquet":
        rows = _parquet_rows(path)
    else:
        rows = _delimited_rows(path, "," if kind == "csv" else "\t")
    layout: Columns | None = None
    for where, row in rows:
        if row is None:  # a blank line
            report.blank += 1
            continue
        report.records += 1
        try:
            if isinstance(row, BadRecord):
                raise row
            if fmt == "flag":
                record = flag_record(row, where)
            else:
                if layout is None:  # the first record's columns decide the file's layout
                    layout = Columns.of(path, list(row) if isinstance(row, dict) else row.columns, min_label)
                record = layout.record(row, where)
        except BadRecord as exc:
            message = f"{where}: {exc}"
            if strict:
                hint = "fix the record, or leave out --strict to count and skip it"
                raise InputError(f"{message} ({hint})") from None
            report.bad(exc.reason, message)
            continue
        if record is None:
            report.below_min_label += 1
            continue
        yield record


def file_kind(path: Path) -> str:
    """``json``, ``csv``, ``tsv`` or ``parquet``, from the suffix (a ``.gz`` one left out)."""
    if not path.is_file():
        raise InputError(f"pair file {path} does not exist")
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    kind = _SUFFIXES.get(suffixes[-1] if suffixes else "")
    if kind is None:
        known = ", ".join(_SUFFIXES)
        raise InputError(f"{path}: unknown pair file suffix; name it one of {known} (optionally .gz)")
    return kind


def _open_bytes(path: Path) -> io.BufferedIOBase:
    """The file's bytes, gunzipped when it starts with gzip's magic number (whatever its name)."""
    with path.open("rb") as handle:
        gzipped = handle.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else path.open("rb")  # type: ignore[return-value]


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line N, the line's JSON object, None for a blank line, or its BadRecord)."""
    with _open_bytes(path) as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRecord("invalid_utf8", f"not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                yield where, None
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, BadRecord("bad_json", f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(value, dict):
                yield where, BadRecord("bad_json", f"expected one JSON object, got a {type(value).__name__}")
                continue
            yield where, value


@dataclass(frozen=True)
class _Row:
    """A CSV/TSV or Parquet row: its values by column (missing ones absent)."""

    columns: list[str]
    values: dict[str, Any]


def _delimited_rows(path: Path, delimiter: str) -> Iterator[tuple[str, Any]]:
    """(file:line N, a _Row, None for a blank line, or its BadRecord) of a CSV or TSV file whose first
    row names the columns; quoting as Python's csv module and pandas write it."""
    with _open_bytes(path) as handle:
        text = io.TextIOWrapper(handle, encoding="utf-8-sig", errors="surrogateescape", newline="")
        reader = csv.reader(text, delimiter=delimiter)
        header: list[str] | None = None
        try:
            for fields in reader:
                where = f"{path}:{reader.line_num}"
                if header is None:
                    header = [f.strip() for f in fields]
                    continue
                if not fields or all(not f.strip() for f in fields):
                    yield where, None
                    continue
                if any(_has_surrogate(f) for f in fields):
                    yield where, BadRecord("invalid_utf8", "not UTF-8 text")
                    continue
                if len(fields) != len(header):
                    problem = f"{len(fields)} fields for the header's {len(header)} ({', '.join(header)})"
                    yield where, BadRecord("wrong_columns", problem)
                    continue
                yield where, _Row(header, dict(zip(header, fields)))
        except csv.Error as exc:  # a NUL byte, a field over the csv module's limit: the rest is unreadable
            raise InputError(f"{path}:{reader.line_num}: not readable as delimited text ({exc})") from None
        if header is None:
            raise InputError(f"{path}: empty; a CSV/TSV pair file's first row names its columns")


def _has_surrogate(text: str) -> bool:
    return any("\udc80" <= c <= "\udcff" for c in text)


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:row N, a _Row) of a Parquet file; every column that a layout reads must hold text (or, for
    ``negative``, lists of text): another type is one InputError for the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open_bytes(path) as handle:
        table = pq.read_table(handle)
    columns = table.column_names
    for name in columns:
        kind = table.schema.field(name).type
        read = name in {c for layout in LAYOUTS for c in layout} or NEGATIVE_COLUMN.match(name)
        is_text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        is_list = pa.types.is_list(kind) and pa.types.is_string(kind.value_type)
        if read and not (is_text or (is_list and name == "negative")):
            raise InputError(f"{path}: column {name} holds {kind}, not text; write it as strings")
    number = 0
    for batch in table.to_batches():
        for values in batch.to_pylist():
            number += 1
            yield f"{path}:row {number}", _Row(columns, {k: v for k, v in values.items() if v is not None})


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise BadRecord("wrong_type", f"{name} must be a string, got {_type_name(value)}")
    text = value.strip()
    if not text:
        raise BadRecord("empty_text", f"{name} is empty")
    return text


def _texts(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise BadRecord("wrong_type", f"{name} must be a list of strings, got {_type_name(value)}")
    return tuple(_text(v, f"{name}[{i}]") for i, v in enumerate(value))


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def flag_record(row: dict[str, Any], where: str) -> PairRecord:
    """A FlagEmbedding line: ``query``, ``pos`` (a non-empty list), ``neg`` and ``prompt`` optional."""
    for key in ("query", "pos"):
        if row.get(key) is None:
            raise BadRecord("missing_field", f'missing key {key!r}; a line is {{"query": ..., "pos": [...]}}')
    query = _text(row["query"], "query")
    positives = _texts(row["pos"], "pos")
    if not positives:
        raise BadRecord("empty_positive_list", "pos is an empty list; give at least one positive")
    negatives = _texts(row["neg"], "neg") if row.get("neg") is not None else ()
    prompt = row.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise BadRecord("wrong_type", f"prompt must be a string, got {_type_name(prompt)}")
    return PairRecord(query, positives, negatives, prompt or "", where)


@dataclass(frozen=True)
class Columns:
    """The layout of a ``columns`` file: its query and positive columns (the first record's decide them,
    for the whole file) and the threshold on a label column. A record's negatives are its ``negative``
    then ``negative_1``, ``negative_2``, ... columns, and its label its ``label`` or ``score``: a JSON
    line may have fewer or more of them than the first."""

    query: str
    positive: str
    min_label: float | None

    @staticmethod
    def of(path: Path, names: list[str], min_label: float | None) -> Columns:
        """The layout of a file whose first record has columns ``names``; an InputError when none is known."""
        found = next(((q, p) for q, p in LAYOUTS if q in names and p in names), None)
        if found is None:
            known = "; ".join("/".join(layout) for layout in LAYOUTS)
            raise InputError(
                f"{path}: unknown column layout ({', '.join(map(str, names)) or 'no columns'}); name the "
                f"query and positive columns one of: {known} (negatives: negative, negative_1, ...; "
                "FlagEmbedding's query/pos/neg lines: --format flag)"
            )
        ignored = [n for n in names if n not in (*found, *LABEL_COLUMNS) and not NEGATIVE_COLUMN.match(n)]
        if ignored:
            log.info("%s: %s, %s as query and positive; ignored: %s", path, *found, ", ".join(ignored))
        return Columns(*found, min_label)

    def record(self, row: Any, where: str) -> PairRecord | None:
        """The record of one row (a JSON object or a _Row); None when its label is below the threshold."""
        values = row.values if isinstance(row, _Row) else row
        for name in (self.query, self.positive):
            if values.get(name) is None:
                raise BadRecord("missing_field", f"missing column {name!r}")
        label = next((n for n in LABEL_COLUMNS if values.get(n) is not None), None)
        if label is not None:
            if self.min_label is None:
                raise InputError(
                    f"{where}: has a {label} column; pass --min_label L to keep the pairs labelled >= L as "
                    "positives (or train on the labels: cosent/sbert with data.supervised_file)"
                )
            if _label(values[label], isinstance(row, _Row)) < self.min_label:
                return None
        query, positive = _text(values[self.query], self.query), _text(values[self.positive], self.positive)
        negatives: list[str] = []
        names = sorted((n for n in values if NEGATIVE_COLUMN.match(n)), key=_negative_order)
        for name in names:
            value = values[name]
            if value is None or (isinstance(row, _Row) and value == ""):
                continue  # a row with fewer negatives than the widest: an empty cell is no negative
            negatives.extend(_texts(value, name) if isinstance(value, list) else [_text(value, name)])
        return PairRecord(query, (positive,), tuple(negatives), "", where)


def _negative_order(name: str) -> int:
    """``negative`` first, then ``negative_1``, ``negative_2``, ... in number order."""
    return int(NEGATIVE_COLUMN.match(name)[1] or 0)


def _label(value: Any, from_text: bool) -> float:
    if isinstance(value, str) and from_text:
        try:
            value = float(value.strip())
        except ValueError:
            raise BadRecord("bad_label", f"label {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRecord("bad_label", f"label {value!r} is not a finite number")
    return float(value)
