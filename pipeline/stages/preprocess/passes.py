"""The three parallel passes of preprocessing and the files they leave in the work directory.

pass 1, ``split``   one input unit -> cleaned, split, filtered sentences, routed by shuffle key into
                    partitions: ``split/unit-NNNNNN.arrow`` (record batches, one or more per partition)
                    + ``split/unit-NNNNNN.json`` (counts, which batches hold which partition).
pass 2, ``dedup``   one partition, read from every unit -> sorted by (shuffle key, text), exact
                    duplicates removed: ``dedup/part-NNNNNN.arrow`` + ``.json`` (rows in, rows kept).
pass 3, ``shards``  one output shard = one range of the global order (partitions concatenated in
                    key order) -> ``OUT/shard-NNNNNN.tar`` + ``shards/shard-NNNNNN.json`` (its entry).

With near-duplicate removal on (``neardup.py``), pass 1 also writes ``split/unit-NNNNNN.bands.arrow``
(each kept sentence's (band hash, key) pairs, routed into buckets by band hash), pass 2 has one more
piece per bucket (``dedup/bucket-NNNNNN.arrow`` + ``.json``: the dropped keys by key partition), and
pass 3 leaves the dropped rows out.

Every output is written to a temporary name and renamed; the ``.json`` goes last and records the
size of its data file, so a rerun skips a piece only when its ``.json`` parses and the size matches.
Work files are not fsynced (a killed process loses nothing the kernel already has); after a machine
crash the size check catches what the page cache did not write out, and the piece is redone.

The shuffle key of a sentence is a seeded bijective mix of its 64-bit id (blake2b of the text), so
the key order is a pseudo-random permutation of all unique sentences, fixed by (text, seed) alone.
Partition p holds the p-th of P equal key ranges; sorting inside each partition and concatenating
the partitions yields the whole corpus in key order, whatever P, the unit sizes or the worker count.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import InputError
from pipeline.io import atomic_write, atomic_write_json, temporary_name
from pipeline.shards import BASE_SCHEMA, shard_name, write_shard
from pipeline.stages.preprocess.neardup import NearDupParams, band_hashes, near_duplicates, signatures
from pipeline.stages.preprocess.readers import SOURCES, Unit, iter_lines, line_number_base
from pipeline.stages.preprocess.text import (
    SAMPLES_PER_RULE,
    Cleaner,
    ends_sentence,
    filter_sentences,
    has_control,
    split_sentences,
)

Progress = Callable[[int], None]

RECORD_REASONS = ("empty", "invalid_utf8", "bad_json", "missing_field", "too_long_record", "unreadable")
# title: a wiki_zh article's first line (its title); truncated: the unterminated last sentence of a
# field cut at a fixed length (``truncated_fields``); near_duplicate: see ``neardup.py``.
SENTENCE_REASONS = ("too_short", "too_long", "low_cjk", "title", "truncated", "duplicate", "near_duplicate")
CLEANING_RULES = Cleaner.RULES
EXAMPLES_PER_UNIT = 3  # bad records named (file:line) per unit in the log

FLUSH_SENTENCES = 1 << 15  # split sentences filtered, hashed and routed per batch
BUFFER_BYTES = 32 << 20  # text held per unit before its partitions are written out
DEDUP_BATCH_ROWS = 1 << 12  # rows per record batch in a partition file (random access by pass 3)

_SPLIT_SCHEMA = pa.schema([pa.field("id", pa.uint64(), nullable=False), pa.field("text", pa.string())])
_BAND_SCHEMA = pa.schema([pa.field("band", pa.uint64(), False), pa.field("key", pa.uint64(), False)])
_DROP_SCHEMA = pa.schema([pa.field("key", pa.uint64(), False), pa.field("match", pa.uint64(), False)])
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


@dataclass(frozen=True)
class Filters:
    """What pass 1 needs from the config (small and picklable)."""

    fields: dict[str, list[str]]
    min_chars: int
    max_chars: int
    min_cjk_ratio: float
    max_record_bytes: int
    num_partitions: int
    seed: int
    strict: bool
    to_simplified: bool = False
    truncated_fields: tuple[str, ...] = ()  # "collection.field" whose unterminated tail is dropped
    neardup: NearDupParams | None = None  # near-duplicate removal on: write (band hash, key) pairs


# --------------------------------------------------------------------------------------------- layout
def split_paths(work: Path, unit: int) -> tuple[Path, Path]:
    return work / "split" / f"unit-{unit:06d}.arrow", work / "split" / f"unit-{unit:06d}.json"


def dedup_paths(work: Path, part: int) -> tuple[Path, Path]:
    return work / "dedup" / f"part-{part:06d}.arrow", work / "dedup" / f"part-{part:06d}.json"


def bands_path(work: Path, unit: int) -> Path:
    return work / "split" / f"unit-{unit:06d}.bands.arrow"


def bucket_paths(work: Path, bucket: int) -> tuple[Path, Path]:
    return work / "dedup" / f"bucket-{bucket:06d}.arrow", work / "dedup" / f"bucket-{bucket:06d}.json"


def shard_entry_path(work: Path, shard: int) -> Path:
    return work / "shards" / f"shard-{shard:06d}.json"


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Atomic (temporary name + rename) but not fsynced: see the module docstring."""
    atomic_write_json(path, obj, durable=False)


def is_done(data_path: Path, json_path: Path) -> bool:
    """True if the piece's ``.json`` is readable and its data files have the recorded sizes."""
    try:
        meta = read_json(json_path)
        extra = meta.get("extra_bytes", {})
        return data_path.stat().st_size == meta["bytes"] and all(
            (data_path.parent / name).stat().st_size == size for name, size in extra.items()
        )
    except (OSError, ValueError, KeyError, AttributeError):
        return False


# --------------------------------------------------------------------------------------------- keys
_MASK = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def shuffle_keys(ids: np.ndarray, seed: int) -> np.ndarray:
    """A seeded bijection of the uint64 ids (the splitmix64 finalizer): the global shuffle order."""
    z = ids.astype(np.uint64) ^ np.uint64(_splitmix64(seed))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # wraps mod 2^64, as intended
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def partition_of(keys: np.ndarray, num_partitions: int) -> np.ndarray:
    """Partition p holds keys in [p, p+1) * 2^64 / P: order-preserving, so partitions concatenate."""
    return ((keys >> np.uint64(32)) * np.uint64(num_partitions)) >> np.uint64(32)


def text_ids(texts: list[str]) -> np.ndarray:
    """``pipeline.shards.sentence_id`` for many texts at once."""
    digests = b"".join(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest() for t in texts)
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


# --------------------------------------------------------------------------------------------- pass 1
class _RoutedWriter:
    """Buffers rows of one unit and writes them to one Arrow IPC file grouped by a routing column
    (``part``: the key partition of a sentence, the bucket of a band hash)."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path, self.tmp, self.schema = path, temporary_name(path), schema
        self.sink = pa.OSFile(str(self.tmp), "wb")
        self.writer = pa.ipc.new_file(self.sink, schema, options=_IPC_OPTIONS)
        self.pending: list[pa.Table] = []
        self.pending_bytes = 0
        self.batches: dict[int, list[int]] = {}
        self.num_batches = 0

    def add(self, table: pa.Table, nbytes: int) -> None:
        self.pending.append(table)
        self.pending_bytes += nbytes
        if self.pending_bytes >= BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        table = pa.concat_tables(self.pending)
        table = table.take(pc.sort_indices(table, sort_keys=[("part", "ascending")]))
        parts = table["part"].to_numpy()
        starts = np.flatnonzero(np.r_[True, parts[1:] != parts[:-1]])
        ends = np.r_[starts[1:], len(parts)]
        data = table.select(self.schema.names).cast(self.schema)
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            for batch in data.slice(start, end - start).combine_chunks().to_batches():
                self.writer.write_batch(batch)
                self.batches.setdefault(int(parts[start]), []).append(self.num_batches)
                self.num_batches += 1
        self.pending, self.pending_bytes = [], 0

    def close(self) -> dict[str, list[int]]:
        self.flush()
        self.writer.close()
        self.sink.close()
        os.replace(self.tmp, self.path)
        return {str(p): b for p, b in sorted(self.batches.items())}

    def abort(self) -> None:
        """Drop the temporary file (an error, or --strict, stopped the unit)."""
        try:
            self.writer.close()
            self.sink.close()
        finally:
            self.tmp.unlink(missing_ok=True)


class _PartitionWriter:
    """Routes kept sentences of one unit into key partitions and, with near-duplicate removal on,
    their (band hash, key) pairs into buckets (``bands_path``)."""

    def __init__(self, path: Path, bands: Path, filters: Filters):
        self.filters = filters
        self.sentences = _RoutedWriter(path, _SPLIT_SCHEMA)
        self.bands = _RoutedWriter(bands, _BAND_SCHEMA) if filters.neardup else None

    def add(self, texts: list[str]) -> None:
        ids = text_ids(texts)
        keys = shuffle_keys(ids, self.filters.seed)
        parts = partition_of(keys, self.filters.num_partitions)
        table = pa.table({"id": ids, "text": pa.array(texts, pa.string()), "part": parts})
        self.sentences.add(table, sum(map(len, texts)) * 3)
        params = self.filters.neardup
        if self.bands is not None and params is not None:
            hashes = band_hashes(signatures(texts, params, self.filters.seed), params).ravel()
            buckets = partition_of(hashes, self.filters.num_partitions)
            pairs = pa.table({"band": hashes, "key": np.repeat(keys, params.bands), "part": buckets})
            self.bands.add(pairs, 24 * len(hashes))

    def close(self) -> tuple[dict[str, list[int]], dict[str, list[int]] | None]:
        batches = self.sentences.close()
        return batches, self.bands.close() if self.bands is not None else None

    def abort(self) -> None:
        try:
            self.sentences.abort()
        finally:
            if self.bands is not None:
                self.bands.abort()


class _BadRecords:
    """Counts bad records by reason; names the first few (``file:line``); ``strict`` makes one fatal."""

    def __init__(self, unit: Unit, counts: Counter, strict: bool):
        self.unit, self.counts, self.strict = unit, counts, strict
        self.examples: list[str] = []
        self._base: int | None = None

    def __call__(self, number: int, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        if self.strict or len(self.examples) < EXAMPLES_PER_UNIT:
            if self._base is None:
                self._base = line_number_base(self.unit)
            message = f"{self.unit.label}:{self._base + number}: {reason}: {detail}"
            if self.strict:
                raise InputError(
                    f"{message} (--strict; fix the input, or drop --strict to count and skip it)"
                )
            self.examples.append(message)


def _filter_and_add(
    candidates: list[str],
    filters: Filters,
    counts: Counter,
    writer: _PartitionWriter,
    cleaner: Cleaner,
    progress: Progress,
) -> None:
    kept, dropped, masks, repaired = filter_sentences(
        candidates, filters.min_chars, filters.max_chars, filters.min_cjk_ratio
    )
    cleaner.note_repaired(repaired)
    counts.update(dropped)
    for reason, mask in masks.items():
        if dropped[reason] and cleaner.wants(reason):
            for i in np.flatnonzero(mask)[:3].tolist():
                cleaner.note_drop(reason, candidates[i])
    if kept:
        writer.add(kept)
    progress(len(candidates))


def split_unit(work: Path, index: int, unit: Unit, filters: Filters, progress: Progress) -> dict[str, Any]:
    """Pass 1 for one unit: read, clean, split, filter, route into partitions. Returns its counts."""
    arrow_path, json_path = split_paths(work, index)
    counts: Counter = Counter()
    bad = _BadRecords(unit, counts, filters.strict)
    writer = _PartitionWriter(arrow_path, bands_path(work, index), filters)
    cleaner = Cleaner(filters.to_simplified)
    try:
        _read_unit(unit, filters, counts, bad, writer, cleaner, progress)
        batches, band_batches = writer.close()
    except BaseException:
        writer.abort()
        raise
    result = {
        "unit": unit.to_dict(),
        "source": SOURCES.index(unit.format),
        "counts": dict(sorted(counts.items())),
        "batches": batches,
        "examples": bad.examples,
        "audit": cleaner.audit(),
        "bytes": arrow_path.stat().st_size,
    }
    if band_batches is not None:
        result["band_batches"] = band_batches
        result["extra_bytes"] = {bands_path(work, index).name: bands_path(work, index).stat().st_size}
    write_json(json_path, result)
    return result


def _read_unit(
    unit: Unit,
    filters: Filters,
    counts: Counter,
    bad: _BadRecords,
    writer: _PartitionWriter,
    cleaner: Cleaner,
    progress: Progress,
) -> None:
    fields = None if unit.format == "plain" else filters.fields[unit.format]
    field_list = ", ".join(fields or [])
    tails = {f.split(".", 1)[1] for f in filters.truncated_fields if f.split(".", 1)[0] == unit.format}
    candidates: list[str] = []  # split sentences waiting for the (vectorised) length and CJK filters
    number = 0
    try:
        for number, line, _ in iter_lines(unit, filters.max_record_bytes):
            counts["records"] += 1
            dropped = counts["title"] + counts["truncated"]  # sentences this record drops before filtering
            if line is None:
                bad(number, "too_long_record", f"longer than max_record_bytes={filters.max_record_bytes}")
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad(number, "invalid_utf8", f"{exc.reason} at byte {exc.start}")
                continue
            if text.startswith("\ufeff"):  # a byte-order mark (first line of some Windows-made files)
                text = text[1:]
            if not text or text.isspace():
                counts["empty"] += 1  # blank lines are normal between paragraphs: counted, not reported
                continue
            if fields is None:
                values = [("", text)]
            else:
                try:
                    obj = json.loads(text)
                except ValueError as exc:
                    bad(number, "bad_json", str(exc))
                    continue
                if not isinstance(obj, dict):
                    bad(number, "bad_json", f"a JSON {type(obj).__name__}, not an object")
                    continue
                values = [(f, v) for f in fields if isinstance(v := obj.get(f), str)]
                if not values:
                    bad(number, "missing_field", f"none of the text fields ({field_list}) is a string")
                    continue
                if unit.format == "wiki_zh":
                    values = _without_title(values, obj.get("title"), counts, cleaner)
            if any(has_control(v) for _, v in values):
                counts["control_chars"] += 1  # removed by normalisation; the record is kept
            before = len(candidates)
            for field, value in values:
                start = len(candidates)
                for paragraph in cleaner.paragraphs(value):
                    candidates += split_sentences(paragraph)
                if field in tails and len(candidates) > start and not ends_sentence(candidates[-1]):
                    counts["truncated"] += 1  # cut off mid-sentence at the collection's length limit
                    cleaner.note_drop("truncated", candidates.pop())
            split = len(candidates) - before + counts["title"] + counts["truncated"] - dropped
            if split == 0:
                counts["empty"] += 1
                continue
            counts["records_with_text"] += 1
            counts["sentences_split"] += split
            if len(candidates) >= FLUSH_SENTENCES:
                _filter_and_add(candidates, filters, counts, writer, cleaner, progress)
                candidates = []
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile) as exc:
        # A truncated or corrupt compressed stream: keep every record read before the damage.
        bad(number + 1, "unreadable", f"stream cannot be read further ({exc}); later records are lost")
    if candidates:
        _filter_and_add(candidates, filters, counts, writer, cleaner, progress)


def _without_title(
    values: list[tuple[str, str]], title: Any, counts: Counter, cleaner: Cleaner
) -> list[tuple[str, str]]:
    """wiki_zh ``text`` starts with the article's title on a line of its own: a heading, not a
    sentence. It is taken off and counted (reason ``title``)."""
    if not isinstance(title, str) or not title.strip():
        return values
    out = []
    for field, value in values:
        if field == "text" and value.startswith(title) and value[len(title) : len(title) + 1] in ("\n", ""):
            value = value[len(title) :]
            counts["title"] += 1
            cleaner.note_drop("title", title)
        out.append((field, value))
    return out


# --------------------------------------------------------------------------------------------- pass 2
def dedup_partition(
    work: Path, part: int, pieces: list[tuple[str, list[int], int]], seed: int, progress: Progress
) -> dict[str, Any]:
    """Pass 2 for one partition: gather its rows from every unit, sort by key, drop exact duplicates."""
    arrow_path, json_path = dedup_paths(work, part)
    tables, sources = [], []
    for path, batch_indices, source in pieces:
        with pa.OSFile(path) as source_file:
            reader = pa.ipc.open_file(source_file)
            tables.append(pa.Table.from_batches([reader.get_batch(i) for i in batch_indices], _SPLIT_SCHEMA))
        sources.append(np.full(tables[-1].num_rows, source, np.uint8))
    # One contiguous copy up front: takes on a many-chunk array concatenate it anyway, each time.
    table = pa.concat_tables(tables).combine_chunks() if tables else _SPLIT_SCHEMA.empty_table()
    del tables
    rows_in = table.num_rows
    src = np.concatenate(sources) if sources else np.zeros(0, np.uint8)
    keys = shuffle_keys(table["id"].to_numpy(), seed)
    # (key, text, source): a total order on distinct rows, so the result does not depend on which
    # unit a row came from; equal texts have equal keys and end up adjacent, the first source wins.
    sortable = pa.table({"key": keys, "text": table["text"], "src": src})
    order = pc.sort_indices(
        sortable, sort_keys=[("key", "ascending"), ("text", "ascending"), ("src", "ascending")]
    ).to_numpy()
    del sortable
    # A row is a duplicate when its text equals the previous row's. Only rows whose key equals the
    # previous key can be (keys are 64-bit), so only those texts are compared: memory stays at the
    # partition plus its output instead of one more sorted copy of all the text.
    sorted_keys = keys[order]
    same_key = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1]) + 1
    keep = np.ones(rows_in, dtype=bool)
    if len(same_key):
        text = table["text"]
        equal = pc.equal(text.take(order[same_key]), text.take(order[same_key - 1]))
        keep[same_key[equal.to_numpy(zero_copy_only=False)]] = False
    # Distinct texts with one 64-bit key (a hash collision; practically never): near-duplicate
    # removal works by key and would remove each of them, so they are counted.
    kept_keys = sorted_keys[keep]
    shared = np.flatnonzero(kept_keys[1:] == kept_keys[:-1])
    shared_keys = Counter(int(k) for k in kept_keys[shared].tolist())
    duplicates = np.flatnonzero(~keep)[:SAMPLES_PER_RULE]
    samples = {"duplicate": table["text"].take(order[duplicates]).to_pylist()} if len(duplicates) else {}
    final = order[keep]
    source_names = pc.take(pa.array(SOURCES, pa.string()), pa.array(src[final]))
    kept = table.take(final)
    del table
    out = pa.Table.from_arrays([kept["id"], kept["text"], source_names], schema=BASE_SCHEMA)

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, BASE_SCHEMA, options=_IPC_OPTIONS) as w:
            w.write_table(out, max_chunksize=DEDUP_BATCH_ROWS)

    atomic_write(arrow_path, write, durable=False)
    result = {
        "partition": part,
        "rows_in": rows_in,
        "unique": out.num_rows,
        "shared_keys": {str(k): n + 1 for k, n in sorted(shared_keys.items())},
        "samples": samples,
        "bytes": arrow_path.stat().st_size,
    }
    write_json(json_path, result)
    progress(rows_in)
    return result


def near_dup_bucket(
    work: Path, bucket: int, pieces: list[tuple[str, list[int]]], num_partitions: int, progress: Progress
) -> dict[str, Any]:
    """Pass 2 for one near-duplicate bucket: gather its (band hash, key) pairs from every unit, apply
    the rule of ``neardup.near_duplicates`` and write the dropped keys grouped by key partition."""
    arrow_path, json_path = bucket_paths(work, bucket)
    tables = []
    for path, batch_indices in pieces:
        with pa.OSFile(path) as source_file:
            reader = pa.ipc.open_file(source_file)
            tables.append(pa.Table.from_batches([reader.get_batch(i) for i in batch_indices], _BAND_SCHEMA))
    table = pa.concat_tables(tables).combine_chunks() if tables else _BAND_SCHEMA.empty_table()
    del tables
    drop, match = near_duplicates(table["band"].to_numpy(), table["key"].to_numpy())
    pairs = table.num_rows
    del table
    parts = partition_of(drop, num_partitions)
    order = np.argsort(parts, kind="stable")  # drop is sorted by key: stays sorted inside a partition
    drop, match, parts = drop[order], match[order], parts[order]
    starts = np.flatnonzero(np.r_[True, parts[1:] != parts[:-1]]) if len(parts) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(parts)] if len(parts) else np.zeros(0, np.int64)
    batches: dict[str, list[int]] = {}

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink:
            w = pa.ipc.new_file(sink, _DROP_SCHEMA, options=_IPC_OPTIONS)
            for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
                w.write_batch(pa.record_batch([drop[start:end], match[start:end]], schema=_DROP_SCHEMA))
                batches[str(int(parts[start]))] = [i]
            w.close()

    atomic_write(arrow_path, write, durable=False)
    result = {
        "bucket": bucket,
        "pairs": pairs,
        "dropped": len(drop),
        "batches": batches,
        "examples": [[int(d), int(m)] for d, m in zip(drop[:SAMPLES_PER_RULE], match[:SAMPLES_PER_RULE])],
        "bytes": arrow_path.stat().st_size,
    }
    write_json(json_path, result)
    progress(pairs)
    return result


def near_dup_drops(work: Path, buckets: list[dict[str, Any]], num_partitions: int) -> list[np.ndarray]:
    """For each key partition, the sorted unique keys that some bucket dropped."""
    found: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for meta in buckets:
        if not meta["batches"]:
            continue
        with pa.OSFile(str(bucket_paths(work, meta["bucket"])[0])) as source_file:
            reader = pa.ipc.open_file(source_file)
            for part, indices in meta["batches"].items():
                for i in indices:
                    found[int(part)].append(reader.get_batch(i).column(0).to_numpy())
    return [np.unique(np.concatenate(f)) if f else np.zeros(0, np.uint64) for f in found]


def removed_rows(drops: np.ndarray, shared_keys: dict[str, int]) -> int:
    """Rows of a partition that its dropped keys remove (a key shared by n texts removes n rows)."""
    extra = sum(n - 1 for k, n in shared_keys.items() if drops.size and _contains(drops, int(k)))
    return len(drops) + extra


def _contains(sorted_keys: np.ndarray, key: int) -> bool:
    i = int(np.searchsorted(sorted_keys, np.uint64(key)))
    return i < len(sorted_keys) and int(sorted_keys[i]) == key


def read_partition(path: str, drops: np.ndarray | None, seed: int) -> pa.Table:
    """A whole deduplicated partition, without the rows whose shuffle key is in ``drops``."""
    with pa.OSFile(path) as source_file:
        table = pa.ipc.open_file(source_file).read_all()
    if drops is None or not len(drops):
        return table
    keys = shuffle_keys(table["id"].to_numpy(), seed)
    return table.filter(pa.array(~np.isin(keys, drops)))


# --------------------------------------------------------------------------------------------- pass 3
def write_output_shard(
    out: Path,
    work: Path,
    shard: int,
    pieces: list[tuple[str, int, int]],
    rows_per_block: int,
    drops: list[np.ndarray] | None,
    seed: int,
    progress: Progress,
) -> dict[str, Any]:
    """Pass 3 for one shard: rows ``[lo, hi)`` of each listed partition file, in order, cut into blocks.

    With ``drops`` (near-duplicate removal; one array of dropped keys per piece) the row numbers
    count the partition's rows without the dropped ones, so the whole partition is read."""
    tables = []
    for number, (path, lo, hi) in enumerate(pieces):
        if drops is not None:
            tables.append(read_partition(path, drops[number], seed).slice(lo, hi - lo).combine_chunks())
            continue
        with pa.OSFile(path) as source_file:
            reader = pa.ipc.open_file(source_file)
            first, last = lo // DEDUP_BATCH_ROWS, (hi - 1) // DEDUP_BATCH_ROWS
            batches = [reader.get_batch(i) for i in range(first, last + 1)]
            table = pa.Table.from_batches(batches, schema=BASE_SCHEMA)
            tables.append(table.slice(lo - first * DEDUP_BATCH_ROWS, hi - lo).combine_chunks())
    rows = pa.concat_tables(tables)
    # Each block is a fresh copy (take), one record batch, whatever the partition boundaries and
    # slice offsets were: the bytes then depend on the rows only, not on P or the unit sizes.
    blocks = (
        rows.take(np.arange(start, min(start + rows_per_block, rows.num_rows))).combine_chunks()
        for start in range(0, rows.num_rows, rows_per_block)
    )
    entry = write_shard(out / shard_name(shard), blocks, shard)
    write_json(shard_entry_path(work, shard), entry)
    progress(entry["sentences"])
    return entry
