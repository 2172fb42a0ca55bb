"""What the corpus stages' three passes share: the work directory's files, the shuffle keys, the writer
that routes a unit's rows into key partitions (and their band hashes into buckets), and the
near-duplicate pieces. A stage's own passes (``preprocess/passes.py``, ``pairs/passes.py``) say what a
row is and how pass 1 finds rows, pass 2 removes exact duplicates and pass 3 cuts a shard.

pass 1, ``split``   one input unit -> rows routed by shuffle key into partitions:
                    ``split/unit-NNNNNN.arrow`` (record batches, one or more per partition) +
                    ``split/unit-NNNNNN.json`` (counts, which batches hold which partition); with
                    near-duplicate removal also ``split/unit-NNNNNN.bands.arrow`` (each kept row's
                    (band hash, key) pairs, routed into buckets by band hash).
pass 2, ``dedup``   one partition, read from every unit -> sorted by shuffle key, exact duplicates
                    removed: ``dedup/part-NNNNNN.arrow`` + ``.json`` (rows in, rows kept); with
                    near-duplicate removal one more piece per bucket (``dedup/bucket-NNNNNN.arrow`` +
                    ``.json``: the dropped keys by key partition, ``near_dup_bucket``).
pass 3, ``shards``  one output shard = one range of the global order (partitions concatenated in
                    key order, less the near duplicates) -> ``OUT/shard-NNNNNN.tar`` +
                    ``shards/shard-NNNNNN.json`` (its entry).

Every output is written to a temporary name and renamed; the ``.json`` goes last and records the
size of its data file, so a rerun skips a piece only when its ``.json`` parses and the size matches.
Work files are not fsynced (a killed process loses nothing the kernel already has); after a machine
crash the size check catches what the page cache did not write out, and the piece is redone.

The shuffle key of a row is a seeded bijective mix of its 64-bit id, so the key order is a
pseudo-random permutation of all unique rows, fixed by (id, seed) alone. Partition p holds the p-th of
P equal key ranges; sorting inside each partition and concatenating the partitions yields the whole
corpus in key order, whatever P, the unit sizes or the worker count.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import InputError
from pipeline.io import atomic_write, atomic_write_json, temporary_name
from pipeline.shards import shard_name
from pipeline.stages.corpus.neardup import NearDupParams, band_hashes, near_duplicates, signatures
from pipeline.stages.corpus.readers import Unit, iter_lines, line_number_base

Progress = Callable[[int], None]

RECORD_REASONS = ("empty", "invalid_utf8", "bad_json", "missing_field", "too_long_record", "unreadable")
SAMPLES_PER_RULE = 3  # examples kept per cleaning rule or drop reason (per unit, then per run)
EXAMPLES_PER_UNIT = 3  # bad records named (file:line) per unit in the log

BUFFER_BYTES = 32 << 20  # rows held per unit before its partitions are written out
DEDUP_BATCH_ROWS = 1 << 12  # rows per record batch in a partition file (random access by pass 3)

BAND_SCHEMA = pa.schema([pa.field("band", pa.uint64(), False), pa.field("key", pa.uint64(), False)])
_DROP_SCHEMA = pa.schema([pa.field("key", pa.uint64(), False), pa.field("match", pa.uint64(), False)])
IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


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


def unit_result(work: Path, index: int, result: dict[str, Any], band_batches: dict | None) -> dict[str, Any]:
    """Pass 1's record of one unit, written last: ``result`` with the sizes of the unit's files (and
    its band batches with near-duplicate removal on), so ``is_done`` knows a complete unit."""
    result["bytes"] = split_paths(work, index)[0].stat().st_size
    if band_batches is not None:
        bands = bands_path(work, index)
        result["band_batches"] = band_batches
        result["extra_bytes"] = {bands.name: bands.stat().st_size}
    write_json(split_paths(work, index)[1], result)
    return result


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


# --------------------------------------------------------------------------------------------- pass 1
class RoutedWriter:
    """Buffers rows of one unit and writes them to one Arrow IPC file grouped by a routing column
    (``part``: the key partition of a row, the bucket of a band hash)."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path, self.tmp, self.schema = path, temporary_name(path), schema
        self.sink = pa.OSFile(str(self.tmp), "wb")
        self.writer = pa.ipc.new_file(self.sink, schema, options=IPC_OPTIONS)
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


class UnitWriter:
    """Routes one unit's kept rows into key partitions (``split_paths``) and, with near-duplicate
    removal on, their (band hash, key) pairs into buckets (``bands_path``)."""

    def __init__(
        self,
        work: Path,
        index: int,
        schema: pa.Schema,
        num_partitions: int,
        seed: int,
        neardup: NearDupParams | None,
    ):
        self.schema, self.num_partitions, self.seed, self.neardup = schema, num_partitions, seed, neardup
        self.rows = RoutedWriter(split_paths(work, index)[0], schema)
        self.bands = RoutedWriter(bands_path(work, index), BAND_SCHEMA) if neardup else None

    def add(self, columns: dict[str, Any], nbytes: int, shingled: list[str]) -> None:
        """Route rows: ``columns`` holds every column of the schema (``id`` a uint64 array), ``nbytes``
        about the memory they hold, ``shingled`` the texts their MinHash signatures are taken of."""
        keys = shuffle_keys(columns["id"], self.seed)
        parts = partition_of(keys, self.num_partitions)
        arrays = {n: pa.array(columns[n], self.schema.field(n).type) for n in self.schema.names}
        self.rows.add(pa.table({**arrays, "part": parts}), nbytes)
        nd = self.neardup
        if self.bands is not None and nd is not None:
            hashes = band_hashes(signatures(shingled, nd, self.seed), nd).ravel()
            buckets = partition_of(hashes, self.num_partitions)
            pairs = pa.table({"band": hashes, "key": np.repeat(keys, nd.bands), "part": buckets})
            self.bands.add(pairs, 24 * len(hashes))

    def close(self) -> tuple[dict[str, list[int]], dict[str, list[int]] | None]:
        batches = self.rows.close()
        return batches, self.bands.close() if self.bands is not None else None

    def abort(self) -> None:
        try:
            self.rows.abort()
        finally:
            if self.bands is not None:
                self.bands.abort()


class BadRecords:
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


def records(
    unit: Unit, max_record_bytes: int, bad: BadRecords, counts: Counter, parse: Callable[[str], Any] | None
) -> Iterator[tuple[int, Any]]:
    """The unit's records, with their line numbers: each line's text (``parse`` None: plain text) or
    the JSON object ``parse`` makes of it. Bad records go to ``bad`` (too long, invalid UTF-8, not a
    JSON object), blank lines count as ``empty``, every line as ``records``; a stream that cannot be
    read further is one ``unreadable`` record, and every record before the damage is kept."""
    number = lines = 0
    try:
        for number, line, _ in iter_lines(unit, max_record_bytes):
            lines += 1
            if line is None:
                bad(number, "too_long_record", f"longer than max_record_bytes={max_record_bytes}")
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
            if parse is None:
                yield number, text
                continue
            try:
                obj = parse(text)
            except ValueError as exc:
                bad(number, "bad_json", str(exc))
                continue
            if not isinstance(obj, dict):
                bad(number, "bad_json", f"a JSON {type(obj).__name__}, not an object")
                continue
            yield number, obj
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile) as exc:
        # A truncated or corrupt compressed stream: keep every record read before the damage.
        bad(number + 1, "unreadable", f"stream cannot be read further ({exc}); later records are lost")
    if lines:  # counted here, into ``counts`` once: cheaper (a Counter keeps a key given 0)
        counts["records"] += lines


# --------------------------------------------------------------------------------------------- pass 2
def gather(pieces: list[tuple[str, list[int]]], schema: pa.Schema) -> pa.Table:
    """The listed record batches of each unit file, as one contiguous table: one copy up front, since
    takes on a many-chunk array concatenate it anyway, each time."""
    tables = [gather_one(path, batch_indices, schema) for path, batch_indices in pieces]
    return pa.concat_tables(tables).combine_chunks() if tables else schema.empty_table()


def gather_one(path: str, batch_indices: list[int], schema: pa.Schema) -> pa.Table:
    with pa.OSFile(path) as source_file:
        reader = pa.ipc.open_file(source_file)
        return pa.Table.from_batches([reader.get_batch(i) for i in batch_indices], schema)


def write_partition(
    work: Path, part: int, table: pa.Table, schema: pa.Schema, result: dict[str, Any], progress: Progress
) -> dict[str, Any]:
    """Pass 2's output for one partition: its deduplicated rows in record batches of
    ``DEDUP_BATCH_ROWS`` (pass 3 reads ranges), then its record (``result``, with ``rows_in``, and the
    file's size); returns the record."""
    arrow_path, json_path = dedup_paths(work, part)

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema, options=IPC_OPTIONS) as w:
            w.write_table(table, max_chunksize=DEDUP_BATCH_ROWS)

    atomic_write(arrow_path, write, durable=False)
    result["bytes"] = arrow_path.stat().st_size
    write_json(json_path, result)
    progress(result["rows_in"])
    return result


def near_dup_bucket(
    work: Path, bucket: int, pieces: list[tuple[str, list[int]]], num_partitions: int, progress: Progress
) -> dict[str, Any]:
    """Pass 2 for one near-duplicate bucket: gather its (band hash, key) pairs from every unit, apply
    the rule of ``neardup.near_duplicates`` and write the dropped keys grouped by key partition."""
    arrow_path, json_path = bucket_paths(work, bucket)
    table = gather(pieces, BAND_SCHEMA)
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
            w = pa.ipc.new_file(sink, _DROP_SCHEMA, options=IPC_OPTIONS)
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
    """Rows of a partition that its dropped keys remove (a key shared by n rows removes n rows)."""
    extra = sum(n - 1 for k, n in shared_keys.items() if drops.size and _contains(drops, int(k)))
    return len(drops) + extra


def _contains(sorted_keys: np.ndarray, key: int) -> bool:
    i = int(np.searchsorted(sorted_keys, np.uint64(key)))
    return i < len(sorted_keys) and int(sorted_keys[i]) == key


# --------------------------------------------------------------------------------------------- pass 3
@dataclass(frozen=True)
class OutputShard:
    """Pass 3's job: output shard ``shard``, cut from ``pieces``, rows ``[lo, hi)`` of each listed
    partition file in order, into blocks of ``rows_per_block``. With ``drops`` (near-duplicate
    removal; one array of dropped keys per piece) the row numbers count the partition's rows without
    the dropped ones."""

    out: Path
    work: Path
    shard: int
    pieces: list[tuple[str, int, int]]
    rows_per_block: int
    drops: list[np.ndarray] | None
    seed: int

    @property
    def path(self) -> Path:
        return self.out / shard_name(self.shard)

    def rows(self, schema: pa.Schema) -> pa.Table:
        """The shard's rows: without drops, only the record batches that hold each range are read; with
        them, the whole partition (its row numbers are known only without the dropped rows)."""
        tables = []
        for number, (path, lo, hi) in enumerate(self.pieces):
            if self.drops is not None:
                table = read_partition(path, self.drops[number], self.seed)
                tables.append(table.slice(lo, hi - lo).combine_chunks())
                continue
            with pa.OSFile(path) as source_file:
                reader = pa.ipc.open_file(source_file)
                first, last = lo // DEDUP_BATCH_ROWS, (hi - 1) // DEDUP_BATCH_ROWS
                batches = [reader.get_batch(i) for i in range(first, last + 1)]
                table = pa.Table.from_batches(batches, schema=schema)
                tables.append(table.slice(lo - first * DEDUP_BATCH_ROWS, hi - lo).combine_chunks())
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def done(self, meta: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """Record the shard just written (its manifest entry, and what else the stage counts): after
        the shard, so that a record means a complete shard."""
        write_json(shard_entry_path(self.work, self.shard), meta)
        progress(meta["sentences"])
        return meta


def read_partition(path: str, drops: np.ndarray | None, seed: int) -> pa.Table:
    """A whole deduplicated partition, without the rows whose shuffle key is in ``drops``."""
    with pa.OSFile(path) as source_file:
        table = pa.ipc.open_file(source_file).read_all()
    if drops is None or not len(drops):
        return table
    keys = shuffle_keys(table["id"].to_numpy(), seed)
    return table.filter(pa.array(~np.isin(keys, drops)))
