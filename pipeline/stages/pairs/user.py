"""``python -m pipeline pairs --format flag|columns FILES --out DIR``: a user's own pair files -> the pair
shards the ``pairs`` and ``luse`` terms train on (docs/pairs.md, "Your own pairs").

The files are read by :mod:`pipeline.data.pair_formats` (FlagEmbedding JSON lines; sentence-transformers
columns in JSON lines, CSV, TSV or Parquet; gzip or not). Each (query, positive) of a record becomes one
row of a pair shard (shards/README.md, "Pair shards"): ``text`` the record's prompt followed by its query,
``positive``, ``source`` the file's name without its suffixes, ``kind`` ``user``, ``group`` the query's
(blake2b of its ``normalize_text`` form: the positives of one query, from any line or file, are never each
other's negatives), and ``hard_negatives`` the record's listed negatives, in order.

Then, in this order, each counted by reason in the manifest (``counts``) with the first examples and
their ``file:line`` (``audit.samples``):

1. a bad record is dropped (or, with ``--strict``, refused with its ``file:line``;
   :data:`pipeline.data.pair_formats.REASONS`); a row labelled below ``--min_label`` is kept out;
2. ``--exclude_eval`` (on by default): a pair whose query or positive is a sentence of a split of the five
   scored sets in ``--eval_dir`` is dropped (``eval_overlap``), as the corpus path does; a listed negative
   that is one leaves its list (``negative_eval_overlap``);
3. ``duplicate``: a pair equal to an earlier one under ``normalize_text`` on both sides (the pair id) is
   merged into it, its negatives added to the earlier one's: ``pipeline mine``'s output, one line per
   negative, becomes one pair with all of them;
4. a negative equal to its query or to a positive of its query (``negative_is_positive``), or to an
   earlier negative of its pair (``negative_duplicate``), leaves the list.

The kept pairs are shuffled (``--seed``) and cut into shards of ``--pairs_per_shard`` rows, each shard's
rows grouped by source into blocks of ``--rows_per_block`` (``block_sources`` in the manifest, as the corpus
path writes it). The whole input is held in memory; the corpus path (``--format corpus``) is the one that
streams.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.data.eval_overlap import eval_index
from pipeline.data.pair_formats import REASONS, ReadReport, read_pair_file
from pipeline.errors import InputError
from pipeline.normalize import key_text
from pipeline.shards import MANIFEST, new_manifest, shard_name, write_manifest, write_shard
from pipeline.stages.corpus.readers import expand_inputs
from pipeline.stages.pairs.extract import group_id, pair_id
from pipeline.stages.pairs.passes import PAIR_SCHEMA, source_runs

log = logging.getLogger(__name__)

KIND = "user"  # the kind of every pair read from a user's file
GROUP_SOURCE = "user"  # group ids: blake2b of "user\x1f" + the query's key, whatever file it is in
# A pair shard of a user's pairs: the corpus path's columns and the listed hard negatives.
USER_PAIR_SCHEMA = PAIR_SCHEMA.append(pa.field("hard_negatives", pa.list_(pa.string()), nullable=False))
PAIR_REASONS = ("eval_overlap", "duplicate")
NEGATIVE_REASONS = ("negative_eval_overlap", "negative_is_positive", "negative_duplicate")
EXAMPLES = 3
# The corpus path's options that a user's files do not take (left at their defaults or refused).
CORPUS_ONLY = (
    "work_dir", "phase", "input_format", "to_simplified", "near_duplicates", "num_partitions",
    "plain_neighbours", "min_anchor_chars", "max_anchor_chars", "min_positive_chars", "max_positive_chars",
    "lead_chars", "min_cjk_ratio", "easy_prefix_ratio", "easy_jaccard", "workers", "task_index", "num_tasks",
    "finalize_only", "chunk_bytes", "max_record_bytes",
)  # fmt: skip


@dataclass
class _Pair:
    id: int
    text: str  # the prompt and the query
    query_key: str
    positive: str
    source: str
    group: int
    negatives: list[str]
    where: str  # the first line that gave it


@dataclass
class _Counts:
    """The manifest's counts: per source and in all (shards/README.md, "Pair shards")."""

    pairs: Counter = field(default_factory=Counter)  # pairs_extracted, kept, and PAIR_REASONS
    negatives: Counter = field(default_factory=Counter)  # listed, kept, and NEGATIVE_REASONS
    by_source: dict[str, Counter] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, source: str, key: str, n: int = 1, example: str | None = None) -> None:
        counter = self.negatives if key.startswith("negative") else self.pairs
        counter[key] += n
        self.by_source.setdefault(source, Counter())[key] += n
        if example is not None and len(self.examples.setdefault(key, [])) < EXAMPLES:
            self.examples[key].append(example)


def run(cfg: Any) -> int:
    """Convert ``cfg.inputs`` (format ``cfg.format``) into pair shards in ``cfg.out``."""
    started = time.perf_counter()
    refuse_corpus_options(cfg)
    files = expand_inputs(cfg.inputs)
    if not prepare_out(cfg.out, cfg.overwrite):
        return 0
    evaluation = eval_index(cfg.eval_dir) if cfg.exclude_eval else {}
    read, counts = ReadReport(), _Counts()
    records_by_source: Counter = Counter()
    pairs: dict[int, _Pair] = {}
    for path in files:
        source = path.name.split(".")[0] or path.name
        before = read.records
        for record in read_pair_file(path, cfg.format, read, cfg.strict, cfg.min_label):
            add_record(record, source, pairs, counts, evaluation)
        records_by_source[source] += read.records - before
    read.log()
    kept = filter_negatives(list(pairs.values()), counts, evaluation)
    for p in kept:
        counts.add(p.source, "kept")
    most = max((len(p.negatives) for p in kept), default=0)
    entries = write_pair_shards(cfg.out, kept, cfg.seed, cfg.pairs_per_shard, cfg.rows_per_block, most > 0)
    manifest_counts = summed_counts(read, counts, records_by_source)
    samples = {**read.examples, **counts.examples}
    extra = {"hard_negatives": {"k": most, "listed": True}} if most else {}
    manifest = new_manifest("pairs", recorded_config(cfg), entries, counts=manifest_counts,
                            audit={"samples": samples}, **extra)  # fmt: skip
    write_manifest(cfg.out, manifest)
    dropped = {**manifest_counts["dropped"], **manifest_counts["negatives"]["dropped"]}
    said = ", ".join(f"{k} {v:,}" for k, v in dropped.items() if v) or "none"
    log.info(
        "pairs done: kept %s of %s pairs from %s records (%s hard negatives); dropped: %s; %d shards; "
        "%.1fs -> %s",
        f"{len(kept):,}", f"{manifest_counts['pairs_extracted']:,}", f"{read.records:,}",
        f"{counts.negatives['negatives_kept']:,}", said, len(entries), time.perf_counter() - started, cfg.out,
    )  # fmt: skip
    if not kept:
        raise InputError(f"no pair was kept of {', '.join(map(str, files))}; the counts by reason are above")
    return 0


def refuse_corpus_options(cfg: Any) -> None:
    """The corpus path's options set on a user's files: one InputError naming them."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(cfg)}
    changed = [n for n in CORPUS_ONLY if n in defaults and getattr(cfg, n) != defaults[n]]
    if changed:
        raise InputError(
            f"--{', --'.join(changed)} appl{'ies' if len(changed) == 1 else 'y'} to --format corpus (the raw "
            f"collections), not to --format {cfg.format}; leave {'it' if len(changed) == 1 else 'them'} out"
        )


def prepare_out(out: Path, overwrite: bool) -> bool:
    """Whether to write ``out``: refuses a folder holding anything (a finished run too) unless
    ``overwrite``, which removes a previous set's files first."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; choose a directory")
    if out.exists() and any(out.iterdir()):
        ours = [e for e in out.iterdir() if e.name.startswith("shard-") or e.name == MANIFEST]
        foreign = sorted(e.name for e in out.iterdir() if e not in ours)
        if foreign or not overwrite:
            held = ", ".join((foreign or [e.name for e in ours])[:3])
            raise InputError(f"--out {out} is not empty (holds {held}); choose an empty directory"
                             + ("" if foreign else " or pass --overwrite"))  # fmt: skip
        for entry in ours:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return True


def add_record(record: Any, source: str, pairs: dict[int, _Pair], counts: _Counts,
               evaluation: dict[str, frozenset[str]]) -> None:  # fmt: skip
    """The record's pairs into ``pairs`` (by pair id), dropped or merged as the module docstring says."""
    query_key = key_text(record.query)
    anchor = record.prompt + record.query
    anchor_key = key_text(anchor)
    for positive in record.positives:
        counts.add(source, "pairs_extracted")
        positive_key = key_text(positive)
        split = evaluation.get(query_key) or evaluation.get(positive_key)
        if split:
            counts.add(
                source, "eval_overlap", example=f"{record.where}: a text of {', '.join(sorted(split))}"
            )
            continue
        pid = pair_id(anchor_key, positive_key)
        if pid in pairs:
            pairs[pid].negatives.extend(record.negatives)
            counts.add(source, "duplicate", example=f"{record.where}: the pair of {pairs[pid].where}")
            continue
        group = group_id(GROUP_SOURCE, query_key)
        pairs[pid] = _Pair(
            pid, anchor, query_key, positive, source, group, list(record.negatives), record.where
        )


def filter_negatives(
    pairs: list[_Pair], counts: _Counts, evaluation: dict[str, frozenset[str]]
) -> list[_Pair]:
    """Each pair's negatives without those equal to its query or a positive of its query, to an earlier
    negative of the pair, or to a sentence of a scored set; the pairs in their order."""
    positives: dict[int, set[str]] = {}
    for p in pairs:
        positives.setdefault(p.group, {p.query_key}).add(key_text(p.positive))
    for p in pairs:
        kept, seen = [], set()
        for negative in p.negatives:
            counts.add(p.source, "negatives_listed")
            key = key_text(negative)
            if key in evaluation:
                counts.add(p.source, "negative_eval_overlap", example=f"{p.where}: {negative}")
            elif key in positives[p.group]:
                counts.add(p.source, "negative_is_positive", example=f"{p.where}: {negative}")
            elif key in seen:
                counts.add(p.source, "negative_duplicate")
            else:
                seen.add(key)
                kept.append(negative)
        counts.add(p.source, "negatives_kept", len(kept))
        p.negatives = kept
    return pairs


def write_pair_shards(
    out: Path, pairs: list[_Pair], seed: int, per_shard: int, per_block: int, negatives: bool
) -> list[dict]:
    """The pairs in a seeded random order, ``per_shard`` to a shard, each shard's rows grouped by source
    into blocks of ``per_block`` (the shuffle order kept within a source), with a ``hard_negatives`` column
    when ``negatives`` (some pair lists one); the shards' manifest entries."""
    order = np.random.default_rng(seed).permutation(len(pairs))
    entries = []
    for s, start in enumerate(range(0, len(pairs), per_shard)):
        rows = [pairs[i] for i in order[start : start + per_shard]]
        sources = np.asarray([p.source for p in rows], dtype=object)
        by_source = np.argsort(sources, kind="stable")
        cuts = [
            (lo, min(lo + per_block, end))
            for begin, end in source_runs(sources[by_source])
            for lo in range(begin, end, per_block)
        ]
        blocks = (_table([rows[i] for i in by_source[lo:hi]], negatives) for lo, hi in cuts)
        entry = write_shard(out / shard_name(s), blocks, s)
        entry["block_sources"] = [str(sources[by_source[lo]]) for lo, _ in cuts]
        entries.append(entry)
    return entries


def _table(rows: list[_Pair], negatives: bool) -> pa.Table:
    columns = {
        "id": [p.id for p in rows],
        "text": [p.text for p in rows],
        "source": [p.source for p in rows],
        "positive": [p.positive for p in rows],
        "kind": [KIND] * len(rows),
        "group": [p.group for p in rows],
        "batch_key": [""] * len(rows),
    }
    if not negatives:  # the corpus path's columns: training reads whether pairs list negatives from them
        return pa.table(columns, schema=PAIR_SCHEMA)
    return pa.table({**columns, "hard_negatives": [p.negatives for p in rows]}, schema=USER_PAIR_SCHEMA)


def summed_counts(read: ReadReport, counts: _Counts, records_by_source: Counter) -> dict[str, Any]:
    """The manifest's counts: records read and dropped by reason, pairs extracted, kept and dropped, hard
    negatives listed, kept and dropped; the same per source."""
    per_source = {}
    for source, c in sorted(counts.by_source.items()):
        per_source[source] = {
            "records": records_by_source[source],
            "pairs_extracted": c["pairs_extracted"],
            "kept": c["kept"],
            "dropped": {r: c[r] for r in PAIR_REASONS if c[r]},
            "negatives": {
                "listed": c["negatives_listed"],
                "kept": c["negatives_kept"],
                "dropped": {r: c[r] for r in NEGATIVE_REASONS if c[r]},
            },  # fmt: skip
        }
    return {
        "records": read.records,
        "blank": read.blank,
        "records_dropped": {r: read.dropped[r] for r in REASONS},
        "below_min_label": read.below_min_label,
        "pairs_extracted": counts.pairs["pairs_extracted"],
        "kept": counts.pairs["kept"],
        "dropped": {r: counts.pairs[r] for r in PAIR_REASONS},
        "negatives": {
            "listed": counts.negatives["negatives_listed"],
            "kept": counts.negatives["negatives_kept"],
            "dropped": {r: counts.negatives[r] for r in NEGATIVE_REASONS},
        },
        "by_source": per_source,
        "kept_by_kind": {KIND: counts.pairs["kept"]} if counts.pairs["kept"] else {},
    }


def recorded_config(cfg: Any) -> dict[str, Any]:
    """The options that decide the output, as the manifest records them."""
    names = ("format", "inputs", "exclude_eval", "eval_dir", "min_label", "seed", "pairs_per_shard",
             "rows_per_block", "strict")  # fmt: skip
    return {n: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
            for n in names for v in [getattr(cfg, n)]}  # fmt: skip
