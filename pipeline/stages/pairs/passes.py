"""The pairs stage's three passes over pairs (the template, the work files and the writer they share
with preprocess: ``pipeline/stages/corpus``).

pass 1, ``split``   one input unit -> records read (the corpus readers and bad-record audit), pairs
                    extracted (``extract.py``), cleaned, filtered, hashed and routed by shuffle key into
                    partitions: ``split/unit-NNNNNN.arrow`` + ``.json``; with near-duplicate removal
                    also the pairs' (band hash, key) rows, routed into buckets (``.bands.arrow``).
pass 2, ``dedup``   one partition from every unit -> sorted by (shuffle key, columns), exact duplicates
                    (same pair key) removed: ``dedup/part-NNNNNN.arrow`` + ``.json``; one piece per
                    near-duplicate bucket (``corpus.passes.near_dup_bucket``).
pass 3, ``shards``  one output shard = a range of the global order -> ``OUT/shard-NNNNNN.tar`` (block
                    index beside it) + ``shards/shard-NNNNNN.json`` (its entry and per-source counts).

The exact-dedup key of a pair is its id: blake2b of the ``normalize_text`` forms of anchor and
positive (``extract.pair_id``), so two pairs that differ only in spacing, width, case or punctuation
are one pair. A 64-bit collision (about N^2 / 2^65 pairs) also counts as a duplicate. Near duplicates:
MinHash-LSH over the character shingles of ``anchor_key + "\\x1f" + positive_key``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.normalize import key_texts
from pipeline.shards import write_shard
from pipeline.stages.corpus import passes as corpus
from pipeline.stages.corpus.neardup import NearDupParams
from pipeline.stages.corpus.passes import RECORD_REASONS as RECORD_REASONS  # a pair manifest's too
from pipeline.stages.corpus.passes import BadRecords, OutputShard, Progress, UnitWriter
from pipeline.stages.corpus.readers import Unit
from pipeline.stages.pairs.extract import (
    EXTRACTORS,
    REQUIRED,
    Candidate,
    PairRules,
    pair_ids,
    plain_pairs,
    sibling_duplicates,
    too_easy,
)
from pipeline.stages.preprocess.passes import eval_keys
from pipeline.stages.preprocess.text import Cleaner, filter_sentences

# Columns of a pair shard (shards/README.md): the base columns (text = the anchor) and the pair's own.
PAIR_SCHEMA = pa.schema(
    [
        pa.field("id", pa.uint64(), nullable=False),  # the pair id: blake2b of both sides' normalize_text
        pa.field("text", pa.string(), nullable=False),  # the anchor (title, question, chinese, ...)
        pa.field("source", pa.string(), nullable=False),  # collection name
        pa.field("positive", pa.string(), nullable=False),  # its partner (answer, desc, lead, english, ...)
        pa.field("kind", pa.string(), nullable=False),  # extract.KINDS
        pa.field("group", pa.uint64(), nullable=False),  # the record's id: pairs of one record share it
        pa.field("batch_key", pa.string(), nullable=False),  # topic / category / news source, or ""
    ]
)
SIDE_REASONS = ("too_short", "too_long", "low_cjk")
PAIR_REASONS = (
    *(f"{side}_{r}" for side in ("anchor", "positive") for r in SIDE_REASONS),
    "too_easy",
    "eval_overlap",  # a side is a sentence of a scored evaluation set (``exclude_eval``)
    "sibling_duplicate",
    "duplicate",
    "near_duplicate",
)
FLUSH_PAIRS = 1 << 14  # candidates filtered, hashed and routed per batch
_EXAMPLES = 3


@dataclass(frozen=True)
class PairParams:
    """What pass 1 needs from the config (small and picklable)."""

    rules: PairRules
    max_record_bytes: int
    num_partitions: int
    seed: int
    strict: bool
    neardup: NearDupParams | None = None
    eval_dir: str | None = None  # exclude_eval on: drop pairs with a sentence of the scored sets here


class _Samples:
    """The first few examples per drop reason (anchor and positive, shortened)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[Any]] = {}

    def wants(self, reason: str) -> bool:
        return len(self.samples.get(reason, ())) < _EXAMPLES

    def add(self, reason: str, example: Any) -> None:
        if self.wants(reason):
            self.samples.setdefault(reason, []).append(example)


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:80] + "…"


def _filter_and_add(
    source: str,
    candidates: list[Candidate],
    params: PairParams,
    counts: Counter,
    writer: UnitWriter,
    cleaner: Cleaner,
    samples: _Samples,
    progress: Progress,
) -> None:
    """The length and CJK rules on each side (preprocess's vectorised ``filter_sentences``), then the
    too-easy rule; the survivors get their ids and go to the writer."""
    rules = params.rules
    anchors = [c.anchor for c in candidates]
    positives = [c.positive for c in candidates]
    _, _, a_masks, a_repaired = filter_sentences(
        anchors, rules.min_anchor_chars, rules.max_anchor_chars, rules.min_cjk_ratio
    )
    _, _, p_masks, p_repaired = filter_sentences(
        positives, rules.min_positive_chars, rules.max_positive_chars, rules.min_cjk_ratio
    )
    cleaner.note_repaired(a_repaired + p_repaired)
    latin = np.array([c.latin_positive for c in candidates], dtype=bool)
    p_masks["low_cjk"] = p_masks["low_cjk"] & ~latin
    reason = np.zeros(len(candidates), dtype=np.int8)  # 0 = kept, else 1 + index in PAIR_REASONS
    for i, name in enumerate(SIDE_REASONS):  # anchor reasons first, then the positive's; first one wins
        reason[(reason == 0) & a_masks[name]] = 1 + i
    for i, name in enumerate(SIDE_REASONS):
        reason[(reason == 0) & p_masks[name]] = 1 + len(SIDE_REASONS) + i
    survivors = np.flatnonzero(reason == 0).tolist()
    a_keys = key_texts([anchors[i] for i in survivors])
    # a positive's key from the sibling rule holds unless the length filter repaired the text
    p_keys = [
        candidates[i].positive_key if positives[i] == candidates[i].positive else None for i in survivors
    ]
    missing = [n for n, k in enumerate(p_keys) if k is None]
    for n, k in zip(missing, key_texts([positives[survivors[n]] for n in missing]), strict=True):
        p_keys[n] = k
    easy = [
        too_easy(a, p, rules.easy_prefix_ratio, rules.easy_jaccard)
        for a, p in zip(a_keys, p_keys, strict=True)
    ]
    reason[list(itertools.compress(survivors, easy))] = 1 + PAIR_REASONS.index("too_easy")
    kept = [not e for e in easy]
    if params.eval_dir is not None:  # on the keys the too-easy rule has just computed: a set lookup each
        keys = eval_keys(params.eval_dir)
        overlap = [k and (a in keys or p in keys) for k, a, p in zip(kept, a_keys, p_keys, strict=True)]
        reason[list(itertools.compress(survivors, overlap))] = 1 + PAIR_REASONS.index("eval_overlap")
        kept = [k and not o for k, o in zip(kept, overlap, strict=True)]
    a_keys, p_keys = list(itertools.compress(a_keys, kept)), list(itertools.compress(p_keys, kept))
    rows = list(itertools.compress(survivors, kept))
    kept_candidates = [candidates[i] for i in rows]
    columns = {
        "id": pair_ids(a_keys, p_keys),
        "text": [anchors[i] for i in rows],
        "source": [source] * len(rows),
        "positive": [positives[i] for i in rows],
        "kind": [c.kind for c in kept_candidates],
        "group": [c.group for c in kept_candidates],
        "batch_key": [c.batch_key for c in kept_candidates],
    }
    keys_text: list[str] = []
    if params.neardup is not None:
        keys_text = [f"{a}\x1f{p}" for a, p in zip(a_keys, p_keys, strict=True)]
    for code, n in zip(*np.unique(reason, return_counts=True), strict=True):
        if code:
            name = PAIR_REASONS[code - 1]
            counts[name] += int(n)
            if samples.wants(name):
                for i in np.flatnonzero(reason == code)[:_EXAMPLES].tolist():
                    samples.add(name, {"anchor": _short(anchors[i]), "positive": _short(positives[i])})
    counts["kept_pass1"] += len(rows)
    for kind, n in Counter(columns["kind"]).items():  # the kept pairs' kinds
        counts[f"kind:{kind}"] += n
    if rows:
        nbytes = 3 * sum(map(len, columns["text"])) + 3 * sum(map(len, columns["positive"]))
        writer.add(columns, nbytes, keys_text)
    progress(len(candidates))


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pass 1 allocates millions of short-lived containers (JSON objects, candidates, lists) and no
    reference cycles that grow with the unit (a few dozen objects a unit): the cyclic collector's
    passes over them are about 4% of the pass for nothing. Paused for one unit, process-wide."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def split_unit(work: Path, index: int, unit: Unit, params: PairParams, progress: Progress) -> dict[str, Any]:
    """Pass 1 for one unit: read, extract, clean, filter, route into partitions. Returns its counts."""
    counts: Counter = Counter()
    bad = BadRecords(unit, counts, params.strict)
    writer = UnitWriter(work, index, PAIR_SCHEMA, params.num_partitions, params.seed, params.neardup)
    cleaner = Cleaner(params.rules.to_simplified)
    samples = _Samples()
    try:
        with _cyclic_gc_paused():
            _read_unit(unit, params, counts, bad, writer, cleaner, samples, progress)
        batches, band_batches = writer.close()
    except BaseException:
        writer.abort()
        raise
    audit = cleaner.audit()
    audit["samples"].update(samples.samples)
    result: dict[str, Any] = {
        "unit": unit.to_dict(),
        "source": unit.format,
        "counts": dict(sorted(counts.items())),
        "batches": batches,
        "examples": bad.examples,
        "audit": audit,
    }
    return corpus.unit_result(work, index, result, band_batches)


_SCAN_ONCE = json.JSONDecoder().scan_once  # what json.loads runs, less its checks


def _parse_json(text: str) -> Any:
    """``json.loads(text)``, a third faster on a line that is one JSON value and its line break: the
    decoder's scanner called directly. Anything else (leading whitespace, a BOM, trailing data, an
    error) goes to ``json.loads``, for its value or its error message."""
    try:
        value, end = _SCAN_ONCE(text, 0)
    except (StopIteration, ValueError):
        return json.loads(text)
    if end == len(text) or text[end:] in ("\n", "\r\n"):
        return value
    return json.loads(text)


def _read_unit(
    unit: Unit,
    params: PairParams,
    counts: Counter,
    bad: BadRecords,
    writer: UnitWriter,
    cleaner: Cleaner,
    samples: _Samples,
    progress: Progress,
) -> None:
    source = unit.format
    plain = source == "plain"
    if plain and not params.rules.plain_neighbours:
        counts["plain_skipped"] += 1  # a plain-text unit gives no pairs unless --plain_neighbours
        return
    extract = None if plain else EXTRACTORS[source]
    required = () if plain else REQUIRED[source]

    def note(reason: str, text: str) -> None:  # a pair the extractor dropped itself (sibling_duplicate)
        counts[reason] += 1
        counts["pairs_extracted"] += 1
        samples.add(reason, _short(text))

    candidates: list[Candidate] = []
    settled = 0  # candidates[:settled] have no sibling rule left to decide

    def settle() -> None:
        """Decide the pending sibling rules (one batch of keys): drop those pairs, noted in order."""
        nonlocal candidates, settled
        tail = candidates[settled:]
        verdicts = sibling_duplicates(tail, params.rules)
        if any(verdicts):
            for c, dropped in zip(tail, verdicts, strict=True):
                if dropped:  # the lead says it too, in whole sentences (already in pairs_extracted)
                    counts["sibling_duplicate"] += 1
                    if samples.wants("sibling_duplicate"):
                        samples.add("sibling_duplicate", _short(c.positive))
            del candidates[settled:]
            candidates += [c for c, dropped in zip(tail, verdicts, strict=True) if not dropped]
        settled = len(candidates)

    with_pairs = extracted = 0  # counted here, into ``counts`` at the end: cheaper
    parse = None if plain else _parse_json
    for number, record in corpus.records(unit, params.max_record_bytes, bad, counts, parse):
        if plain:
            found = plain_pairs(record, cleaner, params.rules)
        else:
            missing = [f for f in required if not isinstance(record.get(f), (str, int))]
            if missing:
                bad(number, "missing_field", f"no string field {', '.join(missing)}")
                continue
            found = extract(record, cleaner, params.rules, note)
        if not found:
            counts["empty"] += 1
            continue
        with_pairs += 1
        extracted += len(found)
        candidates += found
        # a batch is the records up to the first that brings FLUSH_PAIRS pairs past the sibling
        # rule: settled only when the count with the undecided ones reaches it (log-many times)
        if len(candidates) >= FLUSH_PAIRS:
            settle()
            if len(candidates) >= FLUSH_PAIRS:
                _filter_and_add(source, candidates, params, counts, writer, cleaner, samples, progress)
                candidates, settled = [], 0
    for name, n in (("records_with_pairs", with_pairs), ("pairs_extracted", extracted)):
        if n:  # a Counter keeps a key given 0: added only when there is something to add
            counts[name] += n
    settle()
    if candidates:
        _filter_and_add(source, candidates, params, counts, writer, cleaner, samples, progress)


# --------------------------------------------------------------------------------------------- pass 2
def dedup_partition(
    work: Path, part: int, pieces: list[tuple[str, list[int], str]], seed: int, progress: Progress
) -> dict[str, Any]:
    """Pass 2 for one partition: gather its pairs from every unit (each piece's source is in its rows),
    sort, drop exact duplicates (equal ids); the first pair in (key, text, positive, source, kind,
    group, batch_key) order stays."""
    table = corpus.gather([(path, batch_indices) for path, batch_indices, _ in pieces], PAIR_SCHEMA)
    rows_in = table.num_rows
    keys = corpus.shuffle_keys(table["id"].to_numpy(), seed)
    sortable = table.append_column("key", pa.array(keys, pa.uint64()))
    order_keys = [("key", "ascending")] + [(n, "ascending") for n in PAIR_SCHEMA.names if n != "id"]
    order = pc.sort_indices(sortable, sort_keys=order_keys).to_numpy()
    del sortable
    sorted_keys = keys[order]
    keep = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]] if rows_in else np.zeros(0, bool)
    dropped = order[~keep]
    samples = [
        {"anchor": _short(a), "positive": _short(p)}
        for a, p in zip(
            table["text"].take(dropped[: corpus.SAMPLES_PER_RULE]).to_pylist(),
            table["positive"].take(dropped[: corpus.SAMPLES_PER_RULE]).to_pylist(),
            strict=True,
        )
    ]
    sources_in = Counter(table["source"].to_pylist())
    out = table.take(order[keep])
    del table
    unique_by_source = Counter(out["source"].to_pylist())
    result = {
        "partition": part,
        "rows_in": rows_in,
        "unique": out.num_rows,
        "duplicate_by_source": {s: n - unique_by_source.get(s, 0) for s, n in sorted(sources_in.items())},
        "samples": {"duplicate": samples} if samples else {},
    }
    return corpus.write_partition(work, part, out, PAIR_SCHEMA, result, progress)


# --------------------------------------------------------------------------------------------- pass 3
def write_output_shard(job: OutputShard, progress: Progress) -> dict[str, Any]:
    """Pass 3 for one shard: its rows cut into blocks of ``rows_per_block``, one source each; the
    record also counts pairs per source and kind."""
    rows = job.rows(PAIR_SCHEMA)
    # One source per block (the shard's rows grouped by source, the shuffle order kept within each), so a
    # trainer knows every block's source from the manifest (``block_sources``) without reading a block.
    sources = np.asarray(rows["source"].to_pylist(), dtype=object)
    order = np.argsort(sources, kind="stable") if len(sources) else np.zeros(0, dtype=np.int64)
    cuts = [
        (start, min(start + job.rows_per_block, end))
        for begin, end in source_runs(sources[order])
        for start in range(begin, end, job.rows_per_block)
    ]
    blocks = (rows.take(order[lo:hi]).combine_chunks() for lo, hi in cuts)
    entry = write_shard(job.path, blocks, job.shard)
    entry["block_sources"] = [str(sources[order[lo]]) for lo, _ in cuts]
    by_source = Counter(rows["source"].to_pylist())
    by_kind = Counter(rows["kind"].to_pylist())
    meta = {**entry, "by_source": dict(sorted(by_source.items())), "by_kind": dict(sorted(by_kind.items()))}
    return job.done(meta, progress)


def source_runs(sorted_sources: np.ndarray) -> list[tuple[int, int]]:
    """[begin, end) of each run of equal values in a sorted array."""
    if not len(sorted_sources):
        return []
    changes = np.flatnonzero(sorted_sources[1:] != sorted_sources[:-1]) + 1
    starts = [0, *changes.tolist()]
    return list(zip(starts, [*starts[1:], len(sorted_sources)]))
