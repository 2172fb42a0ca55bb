"""``python -m pipeline preprocess``: raw corpus files -> deduplicated, globally shuffled shards.

Phases (``--phase all`` runs them in order; see docs/preprocess.md for SLURM arrays):

  split     pass 1 over input units   (parallel: --workers processes, --task-index/--num-tasks)
  dedup     pass 2 over partitions, and over band-hash buckets with --near_duplicates (same)
  shards    pass 3 over output shards (same)
  finalize  manifest.json, then the work directory is removed (one process)

Each piece of each phase is written atomically and skipped when a rerun finds it, so a killed run
resumes where it stopped and produces the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing as mp
import shutil
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from tqdm.contrib.logging import logging_redirect_tqdm

from pipeline import progress
from pipeline.config import option, to_dict
from pipeline.errors import ConfigError, InputError
from pipeline.resources import SAMPLE_CORPUS
from pipeline.shards import MANIFEST, new_manifest, shard_name, write_manifest
from pipeline.stages.preprocess import passes
from pipeline.stages.preprocess.neardup import NearDupParams
from pipeline.stages.preprocess.readers import COLLECTIONS, Unit, expand_inputs, plan_units
from pipeline.stages.runner import EXECUTION_FIELDS, Execution

log = logging.getLogger(__name__)

Phase = Literal["all", "split", "dedup", "shards", "finalize"]
InputFormat = Literal[
    "auto", "plain", "wiki_zh", "news2016zh", "baike2018qa", "webtext2019zh", "translation2019zh"
]

# Options that say how to run, not what to produce: left out of the manifest (so it is identical for
# any --workers/--num-tasks) and free to change when a stopped run is resumed.
EXECUTION_KEYS = (*EXECUTION_FIELDS, "work_dir", "phase", "overwrite", "strict")
WORK_DIR_NAME = ".work"
PARTITION_TARGET_BYTES = 16 << 20  # auto num_partitions: about this much input per partition


@dataclass
class TextFields:
    """Which fields of each nlp_chinese_corpus collection become text (each field split on its own)."""

    wiki_zh: list[str] = option(["text"], "wiki_zh fields ({id,url,title,text}); text starts with the title")
    news2016zh: list[str] = option(
        ["title", "content"], "news2016zh fields ({news_id,keywords,desc,title,...})"
    )
    baike2018qa: list[str] = option(["title", "desc", "answer"], "baike2018qa fields ({qid,category,...})")
    webtext2019zh: list[str] = option(["title", "desc", "content"], "webtext2019zh fields ({qid,title,...})")
    translation2019zh: list[str] = option(["chinese"], "translation2019zh fields ({english,chinese})")

    def __post_init__(self) -> None:
        for name in COLLECTIONS:
            if not getattr(self, name):
                raise ConfigError(f"text_fields.{name} is empty: list at least one field, e.g. [text]")


@dataclass
class Config(Execution):
    inputs: list[Path] = option(
        factory=lambda: [SAMPLE_CORPUS],
        help="Input files, directories or globs (plain text or JSON lines; .gz/.bz2/.zip read as is).",
    )
    out: Path = option(Path("data/preprocessed"), "Output directory for shard-*.tar and manifest.json.")
    work_dir: Path | None = option(None, "Intermediate files (default OUT/.work); removed when finished.")
    phase: Phase = option(
        "all",
        "all | split | dedup | shards | finalize (arrays run one phase each; --finalize-only = finalize).",
    )
    input_format: InputFormat = option("auto", "Input format; auto detects it per file from its first lines.")
    text_fields: TextFields = option(factory=TextFields, help="Fields that become text, per collection.")
    min_chars: int = option(5, "Drop sentences shorter than this many characters.")
    max_chars: int = option(256, "Drop sentences longer than this many characters.")
    min_cjk_ratio: float = option(
        0.5,
        "Drop sentences in which CJK ideographs make a smaller share of the units (0-1); a unit is an "
        "ideograph, a Latin word, a number or another script's letter (punctuation counts for nothing).",
    )
    truncated_fields: list[str] = option(
        ["webtext2019zh.content"],
        "collection.field values cut at a fixed length: their unterminated last sentence is dropped "
        "(truncated); [] keeps every tail.",
    )
    to_simplified: bool = option(False, "Convert traditional to simplified Chinese (OpenCC t2s).")
    near_duplicates: bool = option(
        False, "Remove near duplicates (MinHash-LSH over character shingles; near_duplicate)."
    )
    near_dup_shingle: int = option(3, "Characters per shingle for near-duplicate detection.")
    near_dup_bands: int = option(10, "LSH bands; a pair sharing one band's hash is a near duplicate.")
    near_dup_rows: int = option(6, "MinHash values per band (threshold about (1/bands)^(1/rows) = 0.68).")
    max_record_bytes: int = option(4 << 20, "Longer input lines are dropped and counted (too_long_record).")
    chunk_bytes: int = option(4 << 20, "Uncompressed files are split into units of this many bytes.")
    num_partitions: int = option(0, "Hash partitions for dedup (0 = about one per 16 MB of input).")
    sentences_per_shard: int = option(4000, "Sentences per output shard (the last one may hold fewer).")
    rows_per_block: int = option(1000, "Sentences per block (tar member) inside a shard.")
    seed: int = option(0, "Seed of the global shuffle.")
    strict: bool = option(False, "Stop at the first bad record with its file:line instead of counting it.")
    overwrite: bool = option(False, "Delete a previous output in --out first.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.finalize_only:  # the offline stages' common option: preprocess's last phase
            if self.phase not in ("all", "finalize"):
                raise ConfigError(f"--finalize-only contradicts --phase {self.phase}; pass one of them")
            self.phase = "finalize"
        if not self.inputs:
            raise ConfigError("no inputs: pass input files or globs, e.g. `preprocess data/*.json.gz`")
        for name in ("sentences_per_shard", "rows_per_block", "min_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_tasks > 1 and self.phase == "all":
            raise ConfigError(
                "with --num_tasks > 1 choose one --phase (split, dedup, shards, finalize) per array"
            )
        if self.overwrite and (self.phase != "all" or self.num_tasks > 1):
            raise ConfigError(
                "--overwrite only works with --phase all in one task; empty --out before an array"
            )
        if self.max_chars < self.min_chars:
            raise ConfigError(f"max_chars ({self.max_chars}) must be >= min_chars ({self.min_chars})")
        if not 0.0 <= self.min_cjk_ratio <= 1.0:
            raise ConfigError(f"min_cjk_ratio must be in [0, 1], got {self.min_cjk_ratio}")
        for name in self.truncated_fields:
            collection, _, field = name.partition(".")
            if collection not in COLLECTIONS or not field:
                raise ConfigError(
                    f"truncated_fields: {name!r} is not collection.field with a collection of "
                    f"{', '.join(COLLECTIONS)} (e.g. webtext2019zh.content)"
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


def output_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as recorded in the manifest and the work plan (execution keys left out)."""
    data = to_dict(cfg)
    return {k: v for k, v in data.items() if k not in EXECUTION_KEYS}


# --------------------------------------------------------------------------------------------- run
def run(cfg: Config) -> int:
    started = time.perf_counter()
    _use_system_allocator()
    files = expand_inputs(cfg.inputs)
    if _already_finished(cfg):
        return 0
    plan = _load_or_make_plan(cfg, files)
    phases = ["split", "dedup", "shards", "finalize"] if cfg.phase == "all" else [cfg.phase]
    # logging_redirect_tqdm: log lines (bad records) print above the progress bar, not into it
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


def _is_ours(path: Path, cfg: Config) -> bool:
    name = path.name
    return (
        (name == WORK_DIR_NAME and cfg.work_dir is None)
        or name.startswith("shard-")  # shard-*.tar and whatever write_shard writes beside it
        or (name.startswith(".shard-") or name.startswith(f".{MANIFEST}.tmp-"))
        or name == MANIFEST
    )


def _already_finished(cfg: Config) -> bool:
    """Refuse to clobber a foreign or different output; True if this exact run already finished."""
    out = cfg.out
    if not out.exists():
        return False
    if not out.is_dir():
        raise InputError(f"--out {out} is a file; choose a directory")
    if cfg.overwrite:
        for entry in out.iterdir():
            if _is_ours(entry, cfg):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        if cfg.work_dir is not None and cfg.work_dir.exists():
            shutil.rmtree(cfg.work_dir)
        return False
    foreign = sorted(e.name for e in out.iterdir() if not _is_ours(e, cfg))
    if foreign:
        raise InputError(
            f"--out {out} is not empty (holds {', '.join(foreign[:3])}); "
            "choose an empty directory or pass --overwrite"
        )
    manifest = out / MANIFEST
    if manifest.exists():
        recorded = passes.read_json(manifest).get("config")
        if recorded != output_config(cfg):
            raise InputError(
                f"--out {out} holds a finished run with a different config; "
                "choose another --out or pass --overwrite"
            )
        log.info("%s is already complete (manifest.json matches this config); nothing to do", out)
        if cfg.work.exists() and cfg.task_index == 0:
            shutil.rmtree(cfg.work, ignore_errors=True)
        return True
    return False


# --------------------------------------------------------------------------------------------- plan
@dataclass
class Plan:
    units: list[Unit]
    num_partitions: int


def _file_stamp(files: list[Path]) -> list[dict[str, Any]]:
    return [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]


def _load_or_make_plan(cfg: Config, files: list[Path]) -> Plan:
    """The work units and partition count, fixed when a run starts and checked when it resumes."""
    path = cfg.work / "plan.json"
    stamp = _file_stamp(files)
    if path.exists():
        saved = passes.read_json(path)
        if saved["config"] != output_config(cfg):
            raise InputError(
                f"{cfg.work} holds an unfinished run with a different config; rerun with the same options "
                "or pass --overwrite to start over"
            )
        if saved["files"] != stamp:
            raise InputError(
                f"the input files changed since the run in {cfg.work} started; pass --overwrite to start over"
            )
        units = [Unit.from_dict(u) for u in saved["units"]]
        log.info(
            "continuing the run in %s (%d units, %d partitions)",
            cfg.work,
            len(units),
            saved["num_partitions"],
        )
        return Plan(units, saved["num_partitions"])
    units, text_bytes = plan_units(files, cfg.input_format, cfg.chunk_bytes, cfg.max_record_bytes)
    num_partitions = cfg.num_partitions or max(4, math.ceil(text_bytes / PARTITION_TARGET_BYTES))
    for sub in ("split", "dedup", "shards"):
        (cfg.work / sub).mkdir(parents=True, exist_ok=True)
    formats = Counter(u.format for u in units)
    log.info(
        "%d input files -> %d units (%s), %d partitions",
        len(files),
        len(units),
        ", ".join(f"{n} {f}" for f, n in sorted(formats.items())),
        num_partitions,
    )
    # Array tasks may write this at the same time, from several nodes: the content is identical and
    # each writes its own uniquely named temporary file before the rename.
    plan = {"config": output_config(cfg), "files": stamp, "units": [u.to_dict() for u in units]}
    passes.write_json(path, {**plan, "num_partitions": num_partitions})
    return Plan(units, num_partitions)


def _mine(cfg: Config, count: int) -> list[int]:
    """This task's share of ``count`` pieces: every num_tasks-th, starting at task_index."""
    return list(range(cfg.task_index, count, cfg.num_tasks))


# --------------------------------------------------------------------------------------------- phases
def _bar(cfg: Config, desc: str, unit: str) -> Any:
    return progress.bar(desc=desc, unit=unit, unit_scale=True, mininterval=1.0, disable=not cfg.progress)


def _split_phase(cfg: Config, plan: Plan, executor: _Executor) -> None:
    filters = passes.Filters(
        fields=asdict(cfg.text_fields),
        min_chars=cfg.min_chars,
        max_chars=cfg.max_chars,
        min_cjk_ratio=cfg.min_cjk_ratio,
        max_record_bytes=cfg.max_record_bytes,
        num_partitions=plan.num_partitions,
        seed=cfg.seed,
        strict=cfg.strict,
        to_simplified=cfg.to_simplified,
        truncated_fields=tuple(cfg.truncated_fields),
        neardup=cfg.neardup,
    )
    mine = _mine(cfg, len(plan.units))
    todo = [u for u in mine if not passes.is_done(*passes.split_paths(cfg.work, u))]
    _log_skipped("split", "units", len(mine), len(todo))
    jobs = [(passes.split_unit, (cfg.work, u, plan.units[u], filters)) for u in todo]
    with _bar(cfg, "split", "sent") as bar:
        for result in executor.run(jobs, bar.update):
            for example in result["examples"]:
                log.warning("bad record %s", example)


class _Pieces:
    """Which record batches of which unit files belong to each partition (or bucket), held as three
    integer arrays: the per-unit JSON maps hold units x partitions entries, and both grow with the
    corpus (at 110M sentences, 3,700 units x 920 partitions: 1.2 GB of Python lists in this process)."""

    def __init__(self) -> None:
        self.keys, self.units, self.batches = array("q"), array("q"), array("q")

    def add(self, unit: int, by_key: dict[str, list[int]]) -> None:
        for key, batch_indices in by_key.items():
            self.keys.extend([int(key)] * len(batch_indices))
            self.units.extend([unit] * len(batch_indices))
            self.batches.extend(batch_indices)

    def freeze(self) -> None:
        keys = np.frombuffer(self.keys, dtype=np.int64)
        order = np.argsort(keys, kind="stable")  # within a key: unit order, then each unit's own order
        self.sorted_keys = keys[order]
        self.sorted_units = np.frombuffer(self.units, dtype=np.int64)[order]
        self.sorted_batches = np.frombuffer(self.batches, dtype=np.int64)[order]

    def of(self, key: int) -> list[tuple[int, list[int]]]:
        """(unit, batch indices) of one key, in unit order."""
        lo, hi = np.searchsorted(self.sorted_keys, [key, key + 1])
        units, batches = self.sorted_units[lo:hi], self.sorted_batches[lo:hi]
        cuts = np.flatnonzero(np.diff(units)) + 1
        return [
            (int(u[0]), b.tolist()) for u, b in zip(np.split(units, cuts), np.split(batches, cuts)) if len(u)
        ]


def _dedup_phase(cfg: Config, plan: Plan, executor: _Executor) -> None:
    """Exact dedup of each key partition and, with near-duplicate removal on, the rule of each
    band-hash bucket: P + Q independent pieces (Q = P buckets), spread over the tasks alike."""
    split = [passes.split_paths(cfg.work, u) for u in range(len(plan.units))]
    _require(cfg, "split", split, read=False)
    pieces, bucket_pieces, sources = _Pieces(), _Pieces(), []
    for u, (_, json_path) in enumerate(split):  # one unit's map at a time: memory stays compact
        meta = passes.read_json(json_path)
        sources.append(meta["source"])
        pieces.add(u, meta["batches"])
        bucket_pieces.add(u, meta.get("band_batches", {}))
    pieces.freeze()
    bucket_pieces.freeze()
    num_buckets = plan.num_partitions if cfg.near_duplicates else 0
    mine = _mine(cfg, plan.num_partitions + num_buckets)
    parts = [p for p in mine if p < plan.num_partitions]
    buckets = [p - plan.num_partitions for p in mine if p >= plan.num_partitions]
    todo = [p for p in parts if not passes.is_done(*passes.dedup_paths(cfg.work, p))]
    todo_buckets = [q for q in buckets if not passes.is_done(*passes.bucket_paths(cfg.work, q))]
    _log_skipped("dedup", "partitions and buckets", len(mine), len(todo) + len(todo_buckets))

    def partition_pieces(p: int) -> list[tuple[str, list[int], int]]:
        return [(str(split[u][0]), batches, sources[u]) for u, batches in pieces.of(p)]

    def bucket_args(q: int) -> list[tuple[str, list[int]]]:
        return [(str(passes.bands_path(cfg.work, u)), batches) for u, batches in bucket_pieces.of(q)]

    # generators: each job's piece list is built when the job is handed out, not all of them up front
    jobs = itertools.chain(
        ((passes.dedup_partition, (cfg.work, p, partition_pieces(p), cfg.seed)) for p in todo),
        ((passes.near_dup_bucket, (cfg.work, q, bucket_args(q), plan.num_partitions)) for q in todo_buckets),
    )
    with _bar(cfg, "dedup", "row") as bar:
        for _ in executor.run(jobs, bar.update, len(todo) + len(todo_buckets)):
            pass


def _near_dup_drops(cfg: Config, plan: Plan) -> list[np.ndarray] | None:
    """Per key partition the keys near-duplicate removal dropped (None when it is off)."""
    if not cfg.near_duplicates:
        return None
    paths = [passes.bucket_paths(cfg.work, q) for q in range(plan.num_partitions)]
    return passes.near_dup_drops(cfg.work, _require(cfg, "dedup", paths), plan.num_partitions)


def _partition_rows(cfg: Config, plan: Plan, drops: list[np.ndarray] | None) -> list[int]:
    """Rows each partition contributes to the output: unique, less its near duplicates."""
    paths = [passes.dedup_paths(cfg.work, p) for p in range(plan.num_partitions)]
    metas = _require(cfg, "dedup", paths)
    if drops is None:
        return [m["unique"] for m in metas]
    return [m["unique"] - passes.removed_rows(d, m.get("shared_keys", {})) for m, d in zip(metas, drops)]


def _shard_ranges(
    cfg: Config, plan: Plan, drops: list[np.ndarray] | None = None, per_shard: int | None = None
) -> list[list[tuple[str, int, int]]]:
    """For each output shard, the (partition file, first row, end row) pieces it is cut from
    (``per_shard`` rows each; default ``cfg.sentences_per_shard``; the pairs stage passes its own)."""
    paths = [passes.dedup_paths(cfg.work, p) for p in range(plan.num_partitions)]
    rows = _partition_rows(cfg, plan, drops)
    total = sum(rows)
    size = per_shard or cfg.sentences_per_shard
    ranges: list[list[tuple[str, int, int]]] = [[] for _ in range(math.ceil(total / size))]
    offset = 0
    for (arrow, _), count in zip(paths, rows, strict=True):
        lo, end = offset, offset + count
        while lo < end:  # split this partition's global range [offset, end) at shard boundaries
            shard = lo // size
            hi = min(end, (shard + 1) * size)
            ranges[shard].append((str(arrow), lo - offset, hi - offset))
            lo = hi
        offset = end
    return ranges


def _shards_phase(cfg: Config, plan: Plan, executor: _Executor) -> None:
    drops = _near_dup_drops(cfg, plan)
    ranges = _shard_ranges(cfg, plan, drops)
    mine = _mine(cfg, len(ranges))
    todo = [
        s for s in mine if not passes.is_done(cfg.out / shard_name(s), passes.shard_entry_path(cfg.work, s))
    ]
    _log_skipped("shards", "shards", len(mine), len(todo))
    cfg.out.mkdir(parents=True, exist_ok=True)
    args = (cfg.out, cfg.work)
    jobs = [
        (
            passes.write_output_shard,
            (*args, s, ranges[s], cfg.rows_per_block, *_piece_drops(ranges[s], drops, cfg)),
        )
        for s in todo
    ]
    with _bar(cfg, "shards", "sent") as bar:
        for _ in executor.run(jobs, bar.update):
            pass


def _piece_drops(
    pieces: list[tuple[str, int, int]], drops: list[np.ndarray] | None, cfg: Config
) -> tuple[list[np.ndarray] | None, int]:
    """The dropped keys of each piece's partition (only those travel to the worker), and the seed."""
    if drops is None:
        return None, cfg.seed
    index = {str(passes.dedup_paths(cfg.work, p)[0]): p for p in range(len(drops))}
    return [drops[index[path]] for path, _, _ in pieces], cfg.seed


def _finalize(cfg: Config, plan: Plan, elapsed: float) -> None:
    split = [passes.split_paths(cfg.work, u) for u in range(len(plan.units))]
    _require(cfg, "split", split, read=False)
    units = []
    for _, json_path in split:  # keep what the manifest needs, not each unit's map of partitions
        meta = passes.read_json(json_path)
        units.append({key: meta[key] for key in ("counts", "audit", "examples") if key in meta})
    parts = _require(cfg, "dedup", [passes.dedup_paths(cfg.work, p) for p in range(plan.num_partitions)])
    drops = _near_dup_drops(cfg, plan)
    num_shards = len(_shard_ranges(cfg, plan, drops))
    shards = [(cfg.out / shard_name(s), passes.shard_entry_path(cfg.work, s)) for s in range(num_shards)]
    entries = _require(cfg, "shards", shards)
    near_duplicate = sum(p["unique"] for p in parts) - sum(_partition_rows(cfg, plan, drops))
    counts = summed_counts([u["counts"] for u in units], parts, near_duplicate)
    audit = merged_audit(units, parts)
    if drops is not None:
        audit["samples"]["near_duplicate"] = _near_dup_examples(cfg, plan)
    manifest = new_manifest("preprocess", output_config(cfg), entries, counts=counts, audit=audit)
    write_manifest(cfg.out, manifest)
    # The manifest is down: the intermediate files and any temporary file of a killed writer can go.
    shutil.rmtree(cfg.work, ignore_errors=True)
    for stale in cfg.out.glob(".shard-*.tmp-*"):  # a shard or the files write_shard puts beside it
        stale.unlink(missing_ok=True)
    dropped = ", ".join(f"{k} {v:,}" for k, v in counts["dropped"].items() if v) or "none"
    if counts["kept"] == 0:
        log.warning(
            "no sentence was kept: check --input_format/--text_fields and the filters (min_chars, "
            "max_chars, min_cjk_ratio) against the dropped counts below"
        )
    log.info(
        "preprocess done: kept %s of %s sentences from %s records; dropped: %s; %d shards, %.1f MB; "
        "%.1fs -> %s",
        f"{counts['kept']:,}",
        f"{counts['sentences_split']:,}",
        f"{counts['records']:,}",
        dropped,
        len(entries),
        manifest["totals"]["bytes"] / 1e6,
        elapsed,
        cfg.out,
    )
    rules = ", ".join(f"{k} {v:,}" for k, v in audit["rules"].items() if v) or "none"
    log.info("cleaning rules applied (fields changed): %s; examples in manifest.json audit.samples", rules)


def merged_audit(units: list[dict[str, Any]], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's ``audit``: per cleaning rule the fields it changed, and for every rule and drop
    reason the first few examples (units, then partitions, in order: the same for any worker count)."""
    rules: Counter = Counter({r: 0 for r in passes.CLEANING_RULES})
    samples: dict[str, list[Any]] = {}

    def add(name: str, examples: list[Any]) -> None:
        have = samples.setdefault(name, [])
        have.extend(examples[: passes.SAMPLES_PER_RULE - len(have)])

    for unit in units:
        audit = unit.get("audit", {})
        rules.update(audit.get("rules", {}))
        for name, examples in audit.get("samples", {}).items():
            add(name, examples)
        for example in unit.get("examples", []):  # bad records: "file:line: reason: detail"
            add(example.split(": ", 2)[1] if example.count(": ") >= 2 else "bad_record", [example])
    for part in parts:
        for name, examples in part.get("samples", {}).items():
            add(name, examples)
    return {"rules": dict(rules), "samples": dict(sorted(samples.items()))}


def _near_dup_examples(cfg: Config, plan: Plan) -> list[dict[str, str]]:
    """The first few near duplicates with the sentence each duplicates (buckets in order)."""
    pairs: list[tuple[int, int]] = []
    for q in range(plan.num_partitions):
        meta = passes.read_json(passes.bucket_paths(cfg.work, q)[1])
        pairs += [(d, m) for d, m in meta["examples"]][: passes.SAMPLES_PER_RULE - len(pairs)]
        if len(pairs) >= passes.SAMPLES_PER_RULE:
            break
    texts: dict[int, str] = {}
    for key in sorted({k for pair in pairs for k in pair}):
        part = int(passes.partition_of(np.array([key], np.uint64), plan.num_partitions)[0])
        table = passes.read_partition(str(passes.dedup_paths(cfg.work, part)[0]), None, cfg.seed)
        keys = passes.shuffle_keys(table["id"].to_numpy(), cfg.seed)
        texts[key] = table["text"][int(np.flatnonzero(keys == np.uint64(key))[0])].as_py()
    return [{"dropped": texts[d], "duplicates": texts[m]} for d, m in pairs]


def summed_counts(
    unit_counts: list[dict[str, int]], parts: list[dict[str, Any]], near_duplicate: int = 0
) -> dict[str, Any]:
    """Manifest counts: records, sentences_split, kept, dropped by reason (see shards/README.md)."""
    total: Counter = Counter()
    for counts in unit_counts:
        total.update(counts)
    rows_in = sum(p["rows_in"] for p in parts)
    kept = sum(p["unique"] for p in parts)
    total["duplicate"] = rows_in - kept
    total["near_duplicate"] = near_duplicate
    kept -= near_duplicate
    dropped = {r: total[r] for r in (*passes.RECORD_REASONS, *passes.SENTENCE_REASONS)}
    return {
        "records": total["records"],
        "records_with_text": total["records_with_text"],
        "control_chars": total["control_chars"],
        "sentences_split": total["sentences_split"],
        "kept": kept,
        "dropped": dropped,
    }


def _require(
    cfg: Config, phase: str, pieces: list[tuple[Path, Path]], read: bool = True
) -> list[dict[str, Any]]:
    """The ``.json`` of every (data file, json) piece of a phase (``read=False``: only check that they
    are there), or an error naming what is missing."""
    missing = [j for d, j in pieces if not passes.is_done(d, j)]
    if missing:
        raise InputError(
            f"phase {phase} is not finished in {cfg.work} ({len(missing)} of {len(pieces)} pieces missing, "
            f"e.g. {missing[0].name}); run --phase {phase} (every task) first"
        )
    return [passes.read_json(j) for _, j in pieces] if read else []


def _log_skipped(phase: str, what: str, mine: int, todo: int) -> None:
    if todo < mine:
        log.info("%s: %d of %d %s already done (skipped), %d to do", phase, mine - todo, mine, what, todo)
    else:
        log.info("%s: %d %s to do", phase, todo, what)


# --------------------------------------------------------------------------------------------- workers
_COUNTER: Any = None  # set in each worker process by _init_worker: the shared progress counter


def _init_worker(counter: Any) -> None:
    global _COUNTER
    _COUNTER = counter
    _use_system_allocator()


def _use_system_allocator() -> None:
    # Arrow's default mimalloc pool keeps freed pages mapped: a worker that handled one large piece
    # would keep that peak for the rest of the run. malloc returns them, and the passes allocate few,
    # large buffers, so it costs no measurable speed.
    pa.set_memory_pool(pa.system_memory_pool())


def _count(n: int) -> None:
    with _COUNTER.get_lock():
        _COUNTER.value += n


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    return fn(*args, progress=_count)


class _Executor:
    """Runs pieces in this process (``workers=1``) or in a pool of spawned processes.

    Results come back in completion order; a failing piece stops the phase with its error. Workers
    report progress through one shared counter that the parent polls into the progress bar.
    """

    def __init__(self, workers: int):
        self.workers = workers
        self.pool: Any = None

    def __enter__(self) -> _Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()

    def _start_pool(self) -> None:
        # spawn, not fork: forking a process that holds pyarrow/tqdm threads can deadlock. Started
        # on first use, so a phase with nothing (or one thing) to do pays no process start-up.
        ctx = mp.get_context("spawn")
        self.counter = ctx.Value("q", 0)
        self.pool = ctx.Pool(self.workers, initializer=_init_worker, initargs=(self.counter,))

    def run(
        self,
        jobs: Iterable[tuple[Callable[..., Any], tuple]],
        progress: Callable[[int], Any],
        count: int = -1,
    ) -> Iterator[Any]:
        """Results of ``jobs`` (``count`` of them, if ``jobs`` is an iterator). At most two jobs per
        worker are handed to the pool at a time, so a generator's arguments are built as they are needed."""
        if count < 0:
            jobs = list(jobs)
            count = len(jobs)
        jobs = iter(jobs)
        if self.pool is None and (self.workers == 1 or count <= 1):
            for fn, args in jobs:
                yield fn(*args, progress=progress)
            return
        if self.pool is None:
            self._start_pool()
        ahead = 2 * self.workers
        pending = [self.pool.apply_async(_call, job) for job in itertools.islice(jobs, ahead)]
        seen = self.counter.value
        while pending:
            done = [r for r in pending if r.ready()]
            pending = [r for r in pending if r not in done]
            value = self.counter.value
            progress(value - seen)
            seen = value
            pending += [self.pool.apply_async(_call, job) for job in itertools.islice(jobs, len(done))]
            for result in done:
                yield result.get()
            if not done:
                time.sleep(0.1)
