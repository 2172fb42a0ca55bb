"""Preprocessing's three passes over loose sentences (the template, the work files and the writer they
share with the pairs stage: ``pipeline/stages/corpus``).

pass 1, ``split``   one input unit -> cleaned, split, filtered sentences, routed by shuffle key into
                    partitions (``corpus.passes.UnitWriter``).
pass 2, ``dedup``   one partition, read from every unit -> sorted by (shuffle key, text, source), exact
                    duplicates removed.
pass 3, ``shards``  one output shard = one range of the global order (partitions concatenated in
                    key order, less the near duplicates) -> ``OUT/shard-NNNNNN.tar``.

A sentence's id is blake2b of its text (``pipeline.shards.sentence_id``), so its shuffle key is fixed
by (text, seed) alone.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.eval_overlap import eval_files, eval_index
from pipeline.normalize import key_texts
from pipeline.shards import BASE_SCHEMA, write_shard
from pipeline.stages.corpus.neardup import NearDupParams
from pipeline.stages.corpus.passes import (
    SAMPLES_PER_RULE,
    BadRecords,
    OutputShard,
    Progress,
    UnitWriter,
    gather_one,
    records,
    shuffle_keys,
    unit_result,
    write_partition,
)
from pipeline.stages.corpus.readers import SOURCES, Unit
from pipeline.stages.preprocess.text import (
    Cleaner,
    ends_sentence,
    filter_sentences,
    has_control,
    split_sentences,
)

# title: a wiki_zh article's first line (its title); truncated: the unterminated last sentence of a
# field cut at a fixed length (``truncated_fields``); eval_overlap: a sentence of a scored evaluation
# set (``exclude_eval``); near_duplicate: see ``neardup.py``.
SENTENCE_REASONS = (
    "too_short",
    "too_long",
    "low_cjk",
    "title",
    "truncated",
    "eval_overlap",
    "duplicate",
    "near_duplicate",
)
CLEANING_RULES = Cleaner.RULES

FLUSH_SENTENCES = 1 << 15  # split sentences filtered, hashed and routed per batch

_SPLIT_SCHEMA = pa.schema([pa.field("id", pa.uint64(), nullable=False), pa.field("text", pa.string())])


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
    eval_dir: str | None = None  # exclude_eval on: drop the sentences of the scored sets in this folder


# --------------------------------------------------------------------------------------------- keys
def text_ids(texts: list[str]) -> np.ndarray:
    """``pipeline.shards.sentence_id`` for many texts at once."""
    digests = b"".join(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest() for t in texts)
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def eval_keys(eval_dir: str) -> frozenset[str]:
    """The ``normalize_text`` keys of every sentence of every split of the five scored sets in
    ``eval_dir`` (``pipeline.data.eval_overlap.eval_index``): read once per process and folder state
    (about 80k keys, 2 to 5 s; a worker keeps them for all its units), again when a file changed."""
    files = eval_files(Path(eval_dir))
    return _eval_keys(eval_dir, tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=2)
def _eval_keys(eval_dir: str, stamp: tuple) -> frozenset[str]:
    return frozenset(eval_index(Path(eval_dir)))


def without_eval(sentences: list[str], keys: frozenset[str]) -> tuple[list[str], list[str]]:
    """``sentences`` split into those whose key (``key_texts``: ``normalize_text``, vectorised) is not
    in ``keys`` and those whose key is, each in order."""
    hits = [key in keys for key in key_texts(sentences)]
    if not any(hits):
        return sentences, []
    kept = list(itertools.compress(sentences, [not h for h in hits]))
    return kept, list(itertools.compress(sentences, hits))


# --------------------------------------------------------------------------------------------- pass 1
def _filter_and_add(
    candidates: list[str],
    filters: Filters,
    counts: Counter,
    writer: UnitWriter,
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
    if kept and filters.eval_dir is not None:
        # after the length and CJK rules (a sentence counts under the first rule it fails), before
        # dedup: every occurrence of a scored sentence counts here, none under duplicate
        kept, overlap = without_eval(kept, eval_keys(filters.eval_dir))
        if overlap:
            counts["eval_overlap"] += len(overlap)
            for sentence in overlap[:3]:
                cleaner.note_drop("eval_overlap", sentence)
    if kept:
        writer.add({"id": text_ids(kept), "text": kept}, sum(map(len, kept)) * 3, kept)
    progress(len(candidates))


def split_unit(work: Path, index: int, unit: Unit, filters: Filters, progress: Progress) -> dict[str, Any]:
    """Pass 1 for one unit: read, clean, split, filter, route into partitions. Returns its counts."""
    counts: Counter = Counter()
    bad = BadRecords(unit, counts, filters.strict)
    writer = UnitWriter(work, index, _SPLIT_SCHEMA, filters.num_partitions, filters.seed, filters.neardup)
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
    }
    return unit_result(work, index, result, band_batches)


def _read_unit(
    unit: Unit,
    filters: Filters,
    counts: Counter,
    bad: BadRecords,
    writer: UnitWriter,
    cleaner: Cleaner,
    progress: Progress,
) -> None:
    fields = None if unit.format == "plain" else filters.fields[unit.format]
    field_list = ", ".join(fields or [])
    tails = {f.split(".", 1)[1] for f in filters.truncated_fields if f.split(".", 1)[0] == unit.format}
    candidates: list[str] = []  # split sentences waiting for the (vectorised) length and CJK filters
    parse = None if fields is None else json.loads
    for number, record in records(unit, filters.max_record_bytes, bad, counts, parse):
        dropped = counts["title"] + counts["truncated"]  # sentences this record drops before filtering
        if fields is None:
            values = [("", record)]
        else:
            values = [(f, v) for f in fields if isinstance(v := record.get(f), str)]
            if not values:
                bad(number, "missing_field", f"none of the text fields ({field_list}) is a string")
                continue
            if unit.format == "wiki_zh":
                values = _without_title(values, record.get("title"), counts, cleaner)
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
    tables, sources = [], []
    for path, batch_indices, source in pieces:
        tables.append(gather_one(path, batch_indices, _SPLIT_SCHEMA))
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
    result = {
        "partition": part,
        "rows_in": rows_in,
        "unique": out.num_rows,
        "shared_keys": {str(k): n + 1 for k, n in sorted(shared_keys.items())},
        "samples": samples,
    }
    return write_partition(work, part, out, BASE_SCHEMA, result, progress)


# --------------------------------------------------------------------------------------------- pass 3
def write_output_shard(job: OutputShard, progress: Progress) -> dict[str, Any]:
    """Pass 3 for one shard: its rows, in order, cut into blocks."""
    rows = job.rows(BASE_SCHEMA)
    # Each block is a fresh copy (take), one record batch, whatever the partition boundaries and
    # slice offsets were: the bytes then depend on the rows only, not on P or the unit sizes.
    blocks = (
        rows.take(np.arange(start, min(start + job.rows_per_block, rows.num_rows))).combine_chunks()
        for start in range(0, rows.num_rows, job.rows_per_block)
    )
    return job.done(write_shard(job.path, blocks, job.shard), progress)
