"""``python -m pipeline pairs RAW_FILES... --out shards/pairs``: the pairs the corpus's records give.

preprocess's sibling (docs/pairs.md): the same inputs, readers, cleaning, audit, work units, phases and
restart rules (``preprocess/run.py``), but each record becomes the (anchor, positive) pairs its
structure gives (``extract.py``) instead of loose sentences. Phases (``--phase all`` runs them in
order; a SLURM array runs one phase per array, as preprocess):

  split     pass 1 over input units   (parallel: --workers processes, --task-index/--num-tasks)
  dedup     pass 2 over partitions, and over band-hash buckets with --near_duplicates (same)
  shards    pass 3 over output shards (same)
  finalize  manifest.json with counts per source and drop reason; the work directory is removed

Each piece is written atomically and skipped when a rerun finds it: a killed run resumes where it
stopped and gives the same bytes. Memory per piece is one unit's buffer, one partition or one shard,
flat in the corpus size.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tqdm.contrib.logging import logging_redirect_tqdm

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.shards import new_manifest, shard_name, write_manifest
from pipeline.stages.pairs import passes
from pipeline.stages.pairs.extract import PairRules
from pipeline.stages.preprocess import passes as pre_passes
from pipeline.stages.preprocess.neardup import NearDupParams
from pipeline.stages.preprocess.readers import expand_inputs
from pipeline.stages.preprocess.run import (
    Plan,
    _already_finished,
    _bar,
    _Executor,
    _load_or_make_plan,
    _log_skipped,
    _mine,
    _near_dup_drops,
    _partition_rows,
    _Pieces,
    _require,
    _shard_ranges,
    _use_system_allocator,
    merged_audit,
    output_config,
)
from pipeline.stages.runner import Execution

log = logging.getLogger(__name__)

Phase = Literal["all", "split", "dedup", "shards", "finalize"]
InputFormat = Literal[
    "auto", "plain", "wiki_zh", "news2016zh", "baike2018qa", "webtext2019zh", "translation2019zh"
]
WORK_DIR_NAME = ".work"


@dataclass
class Config(Execution):
    inputs: list[Path] = option(
        factory=list,
        help="Input files, directories or globs (JSON lines of the five collections; .gz/.bz2/.zip).",
    )
    out: Path = option(Path("data/pairs"), "Output directory for shard-*.tar and manifest.json.")
    work_dir: Path | None = option(None, "Intermediate files (default OUT/.work); removed when finished.")
    phase: Phase = option("all", "all | split | dedup | shards | finalize (arrays run one phase each).")
    input_format: InputFormat = option("auto", "Input format; auto detects it per file from its first lines.")
    min_anchor_chars: int = option(2, "Drop pairs whose anchor (title, question) is shorter (characters).")
    max_anchor_chars: int = option(128, "Drop pairs whose anchor is longer.")
    min_positive_chars: int = option(5, "Drop pairs whose positive is shorter.")
    max_positive_chars: int = option(
        384, "Answers and descriptions are cut to whole leading sentences within this many characters."
    )
    lead_chars: int = option(
        256, "News leads and wiki first paragraphs: whole leading sentences within this."
    )
    min_cjk_ratio: float = option(
        0.5,
        "Drop a pair when a side has a smaller CJK share of its units (translation's English side exempt).",
    )
    easy_prefix_ratio: float = option(
        0.5, "Too easy: the shorter side is a prefix of the longer and at least this share of its length."
    )
    easy_jaccard: float = option(0.6, "Too easy: character-3-gram Jaccard of the two sides at least this.")
    plain_neighbours: bool = option(False, "Plain-text inputs give neighbouring-sentence pairs (else none).")
    to_simplified: bool = option(False, "Convert traditional to simplified Chinese (OpenCC t2s).")
    near_duplicates: bool = option(
        False, "Remove near-duplicate pairs (MinHash-LSH over the character shingles of both sides)."
    )
    near_dup_shingle: int = option(3, "Characters per shingle for near-duplicate detection.")
    near_dup_bands: int = option(10, "LSH bands; pairs sharing one band's hash are near duplicates.")
    near_dup_rows: int = option(6, "MinHash values per band (threshold about (1/bands)^(1/rows) = 0.68).")
    max_record_bytes: int = option(4 << 20, "Longer input lines are dropped and counted (too_long_record).")
    chunk_bytes: int = option(4 << 20, "Uncompressed files are split into units of this many bytes.")
    num_partitions: int = option(0, "Hash partitions for dedup (0 = about one per 16 MB of input).")
    pairs_per_shard: int = option(4000, "Pairs per output shard (the last one may hold fewer).")
    rows_per_block: int = option(1000, "Pairs per block (tar member) inside a shard.")
    seed: int = option(0, "Seed of the global shuffle.")
    strict: bool = option(False, "Stop at the first bad record with its file:line instead of counting it.")
    overwrite: bool = option(False, "Delete a previous output in --out first.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.finalize_only:
            if self.phase not in ("all", "finalize"):
                raise ConfigError(f"--finalize-only contradicts --phase {self.phase}; pass one of them")
            self.phase = "finalize"
        if not self.inputs:
            raise ConfigError(
                "no inputs: pass input files or globs, e.g. `pairs data/*.json.gz --out shards/pairs`"
            )
        for name in (
            "pairs_per_shard",
            "rows_per_block",
            "min_anchor_chars",
            "min_positive_chars",
            "lead_chars",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for low, high in (
            ("min_anchor_chars", "max_anchor_chars"),
            ("min_positive_chars", "max_positive_chars"),
        ):
            if getattr(self, high) < getattr(self, low):
                raise ConfigError(f"{high} ({getattr(self, high)}) must be >= {low} ({getattr(self, low)})")
        for name in ("min_cjk_ratio", "easy_prefix_ratio", "easy_jaccard"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.num_tasks > 1 and self.phase == "all":
            raise ConfigError(
                "with --num_tasks > 1 choose one --phase (split, dedup, shards, finalize) per array"
            )
        if self.overwrite and (self.phase != "all" or self.num_tasks > 1):
            raise ConfigError(
                "--overwrite only works with --phase all in one task; empty --out before an array"
            )
        for name in ("near_dup_shingle", "near_dup_bands", "near_dup_rows"):
            if not 1 <= getattr(self, name) <= 64:
                raise ConfigError(f"{name} must be in [1, 64], got {getattr(self, name)}")
        if self.max_record_bytes < 1024:
            raise ConfigError(f"max_record_bytes must be >= 1024, got {self.max_record_bytes}")
        if self.chunk_bytes < 1 << 16:
            raise ConfigError(f"chunk_bytes must be >= 65536, got {self.chunk_bytes}")
        if not 0 <= self.num_partitions <= 1 << 20:
            raise ConfigError(f"num_partitions must be in [0, 1048576] (0 = auto), got {self.num_partitions}")

    @property
    def neardup(self) -> NearDupParams | None:
        if not self.near_duplicates:
            return None
        return NearDupParams(self.near_dup_shingle, self.near_dup_bands, self.near_dup_rows)

    @property
    def work(self) -> Path:
        return self.work_dir if self.work_dir is not None else self.out / WORK_DIR_NAME

    def rules(self) -> PairRules:
        return PairRules(
            min_anchor_chars=self.min_anchor_chars,
            max_anchor_chars=self.max_anchor_chars,
            min_positive_chars=self.min_positive_chars,
            max_positive_chars=self.max_positive_chars,
            lead_chars=self.lead_chars,
            min_cjk_ratio=self.min_cjk_ratio,
            easy_prefix_ratio=self.easy_prefix_ratio,
            easy_jaccard=self.easy_jaccard,
            plain_neighbours=self.plain_neighbours,
            to_simplified=self.to_simplified,
        )


# --------------------------------------------------------------------------------------------- run
def run(cfg: Config) -> int:
    started = time.perf_counter()
    _use_system_allocator()
    files = expand_inputs(cfg.inputs)
    if _already_finished(cfg):  # preprocess's rules and plan: the configs share those fields
        return 0
    plan = _load_or_make_plan(cfg, files)
    phases = ["split", "dedup", "shards", "finalize"] if cfg.phase == "all" else [cfg.phase]
    with logging_redirect_tqdm(), _Executor(cfg.workers) as executor:
        for phase in phases:
            if phase == "split":
                _split_phase(cfg, plan, executor)
            elif phase == "dedup":
                _dedup_phase(cfg, plan, executor)
            elif phase == "shards":
                _shards_phase(cfg, plan, executor)
            elif cfg.task_index == 0:
                _finalize(cfg, plan, time.perf_counter() - started)
            else:
                log.info("finalize: task %d has nothing to do (task 0 writes the manifest)", cfg.task_index)
    return 0


def _split_phase(cfg: Config, plan: Plan, executor: _Executor) -> None:
    params = passes.PairParams(
        rules=cfg.rules(),
        max_record_bytes=cfg.max_record_bytes,
        num_partitions=plan.num_partitions,
        seed=cfg.seed,
        strict=cfg.strict,
        neardup=cfg.neardup,
    )
    mine = _mine(cfg, len(plan.units))
    todo = [u for u in mine if not pre_passes.is_done(*pre_passes.split_paths(cfg.work, u))]
    _log_skipped("split", "units", len(mine), len(todo))
    jobs = [(passes.split_unit, (cfg.work, u, plan.units[u], params)) for u in todo]
    with _bar(cfg, "split", "pair") as bar:
        for result in executor.run(jobs, bar.update):
            for example in result["examples"]:
                log.warning("bad record %s", example)


def _dedup_phase(cfg: Config, plan: Plan, executor: _Executor) -> None:
    split = [pre_passes.split_paths(cfg.work, u) for u in range(len(plan.units))]
    _require(cfg, "split", split, read=False)
    pieces, bucket_pieces = _Pieces(), _Pieces()
    for u, (_, json_path) in enumerate(split):
        meta = pre_passes.read_json(json_path)
        pieces.add(u, meta["batches"])
        bucket_pieces.add(u, meta.get("band_batches", {}))
    pieces.freeze()
    bucket_pieces.freeze()
    num_buckets = plan.num_partitions if cfg.near_duplicates else 0
    mine = _mine(cfg, plan.num_partitions + num_buckets)
    parts = [p for p in mine if p < plan.num_partitions]
    buckets = [p - plan.num_partitions for p in mine if p >= plan.num_partitions]
    todo = [p for p in parts if not pre_passes.is_done(*pre_passes.dedup_paths(cfg.work, p))]
    todo_buckets = [q for q in buckets if not pre_passes.is_done(*pre_passes.bucket_paths(cfg.work, q))]
    _log_skipped("dedup", "partitions and buckets", len(mine), len(todo) + len(todo_buckets))

    def partition_pieces(p: int) -> list[tuple[str, list[int]]]:
        return [(str(split[u][0]), batches) for u, batches in pieces.of(p)]

    def bucket_args(q: int) -> list[tuple[str, list[int]]]:
        return [(str(pre_passes.bands_path(cfg.work, u)), batches) for u, batches in bucket_pieces.of(q)]

    jobs = itertools.chain(
        ((passes.dedup_partition, (cfg.work, p, partition_pieces(p), cfg.seed)) for p in todo),
        (
            (pre_passes.near_dup_bucket, (cfg.work, q, bucket_args(q), plan.num_partitions))
            for q in todo_buckets
        ),
    )
    with _bar(cfg, "dedup", "pair") as bar:
        for _ in executor.run(jobs, bar.update, len(todo) + len(todo_buckets)):
            pass


def _ranges(cfg: Config, plan: Plan) -> tuple[list[list[tuple[str, int, int]]], Any]:
    drops = _near_dup_drops(cfg, plan)
    return _shard_ranges(cfg, plan, drops, per_shard=cfg.pairs_per_shard), drops


def _shards_phase(cfg: Config, plan: Plan, executor: _Executor) -> None:
    ranges, drops = _ranges(cfg, plan)
    mine = _mine(cfg, len(ranges))
    todo = [
        s
        for s in mine
        if not pre_passes.is_done(cfg.out / shard_name(s), pre_passes.shard_entry_path(cfg.work, s))
    ]
    _log_skipped("shards", "shards", len(mine), len(todo))
    cfg.out.mkdir(parents=True, exist_ok=True)
    index = {str(pre_passes.dedup_paths(cfg.work, p)[0]): p for p in range(plan.num_partitions)}
    jobs = [
        (
            passes.write_output_shard,
            (
                cfg.out,
                cfg.work,
                s,
                ranges[s],
                cfg.rows_per_block,
                None if drops is None else [drops[index[path]] for path, _, _ in ranges[s]],
                cfg.seed,
            ),
        )
        for s in todo
    ]
    with _bar(cfg, "shards", "pair") as bar:
        for _ in executor.run(jobs, bar.update):
            pass


def _finalize(cfg: Config, plan: Plan, elapsed: float) -> None:
    split = [pre_passes.split_paths(cfg.work, u) for u in range(len(plan.units))]
    _require(cfg, "split", split, read=False)
    units = []
    for _, json_path in split:
        meta = pre_passes.read_json(json_path)
        units.append({key: meta[key] for key in ("source", "counts", "audit", "examples") if key in meta})
    parts = _require(cfg, "dedup", [pre_passes.dedup_paths(cfg.work, p) for p in range(plan.num_partitions)])
    ranges, drops = _ranges(cfg, plan)
    shard_pieces = [
        (cfg.out / shard_name(s), pre_passes.shard_entry_path(cfg.work, s)) for s in range(len(ranges))
    ]
    metas = _require(cfg, "shards", shard_pieces)
    near_duplicate = sum(p["unique"] for p in parts) - sum(_partition_rows(cfg, plan, drops))
    counts = summed_counts(units, parts, metas, near_duplicate)
    entries = [{k: v for k, v in m.items() if k not in ("by_source", "by_kind")} for m in metas]
    audit = merged_audit(units, parts)
    manifest = new_manifest("pairs", output_config(cfg), entries, counts=counts, audit=audit)
    write_manifest(cfg.out, manifest)
    shutil.rmtree(cfg.work, ignore_errors=True)
    for stale in cfg.out.glob(".shard-*.tmp-*"):
        stale.unlink(missing_ok=True)
    dropped = ", ".join(f"{k} {v:,}" for k, v in counts["dropped"].items() if v) or "none"
    if counts["kept"] == 0:
        log.warning("no pair was kept: check the inputs' formats and the limits against the dropped counts")
    log.info(
        "pairs done: kept %s of %s pairs from %s records; dropped: %s; %d shards; %.1fs -> %s",
        f"{counts['kept']:,}",
        f"{counts['pairs_extracted']:,}",
        f"{counts['records']:,}",
        dropped,
        len(entries),
        elapsed,
        cfg.out,
    )


def summed_counts(
    units: list[dict[str, Any]],
    parts: list[dict[str, Any]],
    shards: list[dict[str, Any]],
    near_duplicate: int,
) -> dict[str, Any]:
    """The manifest's counts (shards/README.md): totals, dropped by reason, and the same per source."""
    by_source: dict[str, Counter] = {}
    for unit in units:
        by_source.setdefault(unit["source"], Counter()).update(unit["counts"])
    for part in parts:
        for source, n in part["duplicate_by_source"].items():
            by_source.setdefault(source, Counter())["duplicate"] += n
    kept: Counter = Counter()
    kinds: Counter = Counter()
    for shard in shards:
        kept.update(shard["by_source"])
        kinds.update(shard["by_kind"])
    reasons = (*passes.RECORD_REASONS, *passes.PAIR_REASONS)
    per_source = {}
    total: Counter = Counter()
    for source, c in sorted(by_source.items()):
        c["near_duplicate"] = c["kept_pass1"] - c["duplicate"] - kept[source]
        c["kept"] = kept[source]
        total.update(c)
        per_source[source] = {
            "records": c["records"],
            "pairs_extracted": c["pairs_extracted"],
            "kept": c["kept"],
            "dropped": {r: c[r] for r in reasons if c[r]},
        }
    assert total["near_duplicate"] == near_duplicate, (total["near_duplicate"], near_duplicate)
    return {
        "records": total["records"],
        "records_with_pairs": total["records_with_pairs"],
        "pairs_extracted": total["pairs_extracted"],
        "kept": sum(kept.values()),
        "dropped": {r: total[r] for r in reasons},
        "by_source": per_source,
        "kept_by_kind": dict(sorted(kinds.items())),
    }
