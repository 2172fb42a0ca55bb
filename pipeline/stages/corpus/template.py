"""The corpus-stage template: ``preprocess`` and ``pairs`` are each a :class:`CorpusConfig` (their own
options on top of the shared ones) and a :class:`CorpusStage` (their three passes and their
finalize), run by one :func:`run`.

Phases (``--phase all`` runs them in order; a SLURM array runs one phase per array, docs/preprocess.md):

  split     pass 1 over input units   (parallel: --workers processes, --task-index/--num-tasks)
  dedup     pass 2 over partitions, and over band-hash buckets with --near_duplicates (same)
  shards    pass 3 over output shards (same)
  finalize  manifest.json, then the work directory is removed (one process: task 0)

The work units and the partition count are fixed when a run starts (``plan.json`` in the work
directory, with the output config and the sizes and times of the input files and of the stage's
``side_inputs``: the evaluation files) and checked when it resumes. Each piece of each phase is
written atomically and skipped when a rerun finds it (``passes.is_done``),
so a killed run resumes where it stopped and produces the same bytes as an uninterrupted one; task t of
an array takes every num_tasks-th piece from t. A corpus stage's units of work are not one shard in,
one shard out, so it does not run :class:`pipeline.stages.runner.ShardStage`; it shares its
:class:`~pipeline.stages.runner.Execution` options.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
import pyarrow as pa
from tqdm.contrib.logging import logging_redirect_tqdm

from pipeline import progress
from pipeline.config import option, to_dict
from pipeline.errors import ConfigError, InputError
from pipeline.shards import MANIFEST, shard_name, write_manifest
from pipeline.stages.corpus import passes
from pipeline.stages.corpus.neardup import NearDupParams
from pipeline.stages.corpus.passes import Progress
from pipeline.stages.corpus.readers import Unit, expand_inputs, plan_units
from pipeline.stages.runner import EXECUTION_FIELDS, Execution

log = logging.getLogger(__name__)

Phase = Literal["all", "split", "dedup", "shards", "finalize"]
InputFormat = Literal[
    "auto", "plain", "wiki_zh", "news2016zh", "baike2018qa", "webtext2019zh", "translation2019zh"
]
ShardPieces = list[tuple[str, int, int]]  # one output shard: (partition file, first row, end row) pieces

# Options that say how to run, not what to produce: left out of the manifest (so it is identical for
# any --workers/--num-tasks) and free to change when a stopped run is resumed.
EXECUTION_KEYS = (*EXECUTION_FIELDS, "work_dir", "phase", "overwrite", "strict")
WORK_DIR_NAME = ".work"
PARTITION_TARGET_BYTES = 16 << 20  # auto num_partitions: about this much input per partition


@dataclass
class CorpusConfig(Execution):
    """The options every corpus stage has: its inputs and output, the phases, how input is read and
    cut into units, near-duplicate removal, partitions, blocks, the shuffle seed. A stage redefines
    ``inputs`` and ``out`` (their defaults and help) and gives ``rows_per_shard``."""

    example: ClassVar[str] = "STAGE data/*.json.gz"  # a command line, for the no-inputs error

    inputs: list[Path] = option(factory=list, help="Input files, directories or globs.")
    out: Path = option(Path("data/out"), "Output directory for shard-*.tar and manifest.json.")
    work_dir: Path | None = option(None, "Intermediate files (default OUT/.work); removed when finished.")
    phase: Phase = option(
        "all",
        "all | split | dedup | shards | finalize (arrays run one phase each; --finalize-only = finalize).",
    )
    input_format: InputFormat = option("auto", "Input format; auto detects it per file from its first lines.")
    to_simplified: bool = option(False, "Convert traditional to simplified Chinese (OpenCC t2s).")
    near_duplicates: bool = option(
        False,
        "Remove near duplicates (MinHash-LSH over character shingles: of a sentence, of both sides of a "
        "pair; near_duplicate).",
    )
    near_dup_shingle: int = option(3, "Characters per shingle for near-duplicate detection.")
    near_dup_bands: int = option(10, "LSH bands; two rows sharing one band's hash are near duplicates.")
    near_dup_rows: int = option(6, "MinHash values per band (threshold about (1/bands)^(1/rows) = 0.68).")
    max_record_bytes: int = option(4 << 20, "Longer input lines are dropped and counted (too_long_record).")
    chunk_bytes: int = option(4 << 20, "Uncompressed files are split into units of this many bytes.")
    num_partitions: int = option(0, "Hash partitions for dedup (0 = about one per 16 MB of input).")
    rows_per_block: int = option(1000, "Rows (sentences, pairs) per block (tar member) inside a shard.")
    seed: int = option(0, "Seed of the global shuffle.")
    strict: bool = option(False, "Stop at the first bad record with its file:line instead of counting it.")
    overwrite: bool = option(False, "Delete a previous output in --out first.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.finalize_only:  # the offline stages' common option: a corpus stage's last phase
            if self.phase not in ("all", "finalize"):
                raise ConfigError(f"--finalize-only contradicts --phase {self.phase}; pass one of them")
            self.phase = "finalize"
        if not self.inputs:
            raise ConfigError(f"no inputs: pass input files or globs, e.g. `{self.example}`")
        at_least_one(self, "rows_per_block")
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
    def rows_per_shard(self) -> int:
        """Rows per output shard (the stage's sentences_per_shard, pairs_per_shard)."""
        raise NotImplementedError

    def side_inputs(self) -> list[Path]:
        """Files besides the inputs that decide the output (the evaluation sets a stage filters
        against): stamped in the plan with the inputs, so a resume after they changed is refused."""
        return []

    @property
    def neardup(self) -> NearDupParams | None:
        if not self.near_duplicates:
            return None
        return NearDupParams(self.near_dup_shingle, self.near_dup_bands, self.near_dup_rows)

    @property
    def work(self) -> Path:
        return self.work_dir if self.work_dir is not None else self.out / WORK_DIR_NAME


def at_least_one(cfg: Any, *names: str) -> None:
    """The check of a count option (rows per shard, minimum lengths): a one-line error below 1."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(cfg, name)}")


def output_config(cfg: CorpusConfig) -> dict[str, Any]:
    """The resolved config as recorded in the manifest and the work plan (execution keys left out)."""
    data = to_dict(cfg)
    return {k: v for k, v in data.items() if k not in EXECUTION_KEYS}


@dataclass
class Plan:
    units: list[Unit]
    num_partitions: int


@dataclass
class Finished:
    """What finalize reads back from the work directory: every piece's record."""

    units: list[dict[str, Any]]  # pass 1, less each unit's map of batches: source, counts, audit, examples
    parts: list[dict[str, Any]]  # pass 2, one per key partition
    shards: list[dict[str, Any]]  # pass 3, one per output shard (its manifest entry and the stage's own)
    near_duplicate: int  # rows that near-duplicate removal dropped (0 when it is off)
    drops: list[np.ndarray] | None  # per key partition, the keys near-duplicate removal dropped


class CorpusPasses(Protocol):
    """A corpus stage's passes module: module-level functions (a spawned worker imports them), each
    called with its arguments and ``progress=`` (a callable that adds done rows to the bar)."""

    def split_unit(self, work: Path, index: int, unit: Unit, params: Any, progress: Progress) -> dict:
        """Pass 1 over one unit; ``params``: ``CorpusStage.split_params``; the record of
        ``passes.unit_result``."""

    def dedup_partition(
        self, work: Path, part: int, pieces: list[tuple[str, list[int], Any]], seed: int, progress: Progress
    ) -> dict:
        """Pass 2 over one partition: (unit file, batch indices, the unit record's ``source``) in unit
        order; the record of ``passes.write_partition``."""

    def write_output_shard(self, job: passes.OutputShard, progress: Progress) -> dict:
        """Pass 3: one output shard; the record of ``OutputShard.done``."""


@dataclass(frozen=True)
class CorpusStage:
    """What a corpus stage adds to the template: its passes, and how to build pass 1's parameters
    (``split_params(cfg, num_partitions)``: small and picklable) and the manifest
    (``finalize(cfg, plan, finished, elapsed)``, through :func:`write_and_clean`)."""

    name: str  # the manifest's ``stage``
    unit: str  # what the progress bars count: "sent", "pair"
    passes: CorpusPasses
    split_params: Callable[[Any, int], Any]
    finalize: Callable[[Any, Plan, Finished, float], None]


# --------------------------------------------------------------------------------------------- run
def run(cfg: CorpusConfig, stage: CorpusStage) -> int:
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
                _split_phase(cfg, stage, plan, executor)
            elif phase == "dedup":
                _dedup_phase(cfg, stage, plan, executor)
            elif phase == "shards":
                _shards_phase(cfg, stage, plan, executor)
            elif cfg.task_index == 0:
                stage.finalize(cfg, plan, _finished(cfg, plan), time.perf_counter() - started)
            else:
                log.info("finalize: task %d has nothing to do (task 0 writes the manifest)", cfg.task_index)
    return 0


def _is_ours(path: Path, cfg: CorpusConfig) -> bool:
    name = path.name
    return (
        (name == WORK_DIR_NAME and cfg.work_dir is None)
        or name.startswith("shard-")  # shard-*.tar and whatever write_shard writes beside it
        or (name.startswith(".shard-") or name.startswith(f".{MANIFEST}.tmp-"))
        or name == MANIFEST
    )


def _already_finished(cfg: CorpusConfig) -> bool:
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
def _file_stamp(files: list[Path]) -> list[dict[str, Any]]:
    return [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]


def _load_or_make_plan(cfg: CorpusConfig, files: list[Path]) -> Plan:
    """The work units and partition count, fixed when a run starts and checked when it resumes."""
    path = cfg.work / "plan.json"
    stamp = _file_stamp([*files, *cfg.side_inputs()])
    if path.exists():
        saved = passes.read_json(path)
        if saved["config"] != output_config(cfg):
            raise InputError(
                f"{cfg.work} holds an unfinished run with a different config; rerun with the same options "
                "or pass --overwrite to start over"
            )
        if saved["files"] != stamp:
            raise InputError(
                f"the input files (or the evaluation files of --eval_dir) changed since the run in "
                f"{cfg.work} started; pass --overwrite to start over"
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


def _mine(cfg: CorpusConfig, count: int) -> list[int]:
    """This task's share of ``count`` pieces: every num_tasks-th, starting at task_index."""
    return list(range(cfg.task_index, count, cfg.num_tasks))


# --------------------------------------------------------------------------------------------- phases
def _bar(cfg: CorpusConfig, desc: str, unit: str) -> Any:
    return progress.bar(desc=desc, unit=unit, unit_scale=True, mininterval=1.0, disable=not cfg.progress)


def _split_phase(cfg: CorpusConfig, stage: CorpusStage, plan: Plan, executor: _Executor) -> None:
    params = stage.split_params(cfg, plan.num_partitions)
    mine = _mine(cfg, len(plan.units))
    todo = [u for u in mine if not passes.is_done(*passes.split_paths(cfg.work, u))]
    _log_skipped("split", "units", len(mine), len(todo))
    jobs = [(stage.passes.split_unit, (cfg.work, u, plan.units[u], params)) for u in todo]
    with _bar(cfg, "split", stage.unit) as bar:
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


def _dedup_phase(cfg: CorpusConfig, stage: CorpusStage, plan: Plan, executor: _Executor) -> None:
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

    def partition_pieces(p: int) -> list[tuple[str, list[int], Any]]:
        return [(str(split[u][0]), batches, sources[u]) for u, batches in pieces.of(p)]

    def bucket_args(q: int) -> list[tuple[str, list[int]]]:
        return [(str(passes.bands_path(cfg.work, u)), batches) for u, batches in bucket_pieces.of(q)]

    # generators: each job's piece list is built when the job is handed out, not all of them up front
    jobs = itertools.chain(
        ((stage.passes.dedup_partition, (cfg.work, p, partition_pieces(p), cfg.seed)) for p in todo),
        ((passes.near_dup_bucket, (cfg.work, q, bucket_args(q), plan.num_partitions)) for q in todo_buckets),
    )
    with _bar(cfg, "dedup", stage.unit) as bar:
        for _ in executor.run(jobs, bar.update, len(todo) + len(todo_buckets)):
            pass


def _near_dup_drops(cfg: CorpusConfig, plan: Plan) -> list[np.ndarray] | None:
    """Per key partition the keys near-duplicate removal dropped (None when it is off)."""
    if not cfg.near_duplicates:
        return None
    paths = [passes.bucket_paths(cfg.work, q) for q in range(plan.num_partitions)]
    return passes.near_dup_drops(cfg.work, _require(cfg, "dedup", paths), plan.num_partitions)


def _partition_rows(metas: list[dict[str, Any]], drops: list[np.ndarray] | None) -> list[int]:
    """Rows each partition contributes to the output: unique, less its near duplicates."""
    if drops is None:
        return [m["unique"] for m in metas]
    return [m["unique"] - passes.removed_rows(d, m.get("shared_keys", {})) for m, d in zip(metas, drops)]


def _shard_ranges(cfg: CorpusConfig, plan: Plan, drops: list[np.ndarray] | None) -> list[ShardPieces]:
    """For each output shard (``cfg.rows_per_shard`` rows each), the pieces it is cut from."""
    paths = [passes.dedup_paths(cfg.work, p) for p in range(plan.num_partitions)]
    rows = _partition_rows(_require(cfg, "dedup", paths), drops)
    total = sum(rows)
    size = cfg.rows_per_shard
    ranges: list[ShardPieces] = [[] for _ in range(math.ceil(total / size))]
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


def _shards_phase(cfg: CorpusConfig, stage: CorpusStage, plan: Plan, executor: _Executor) -> None:
    drops = _near_dup_drops(cfg, plan)
    ranges = _shard_ranges(cfg, plan, drops)
    mine = _mine(cfg, len(ranges))
    todo = [
        s for s in mine if not passes.is_done(cfg.out / shard_name(s), passes.shard_entry_path(cfg.work, s))
    ]
    _log_skipped("shards", "shards", len(mine), len(todo))
    cfg.out.mkdir(parents=True, exist_ok=True)
    index = {str(passes.dedup_paths(cfg.work, p)[0]): p for p in range(plan.num_partitions)}

    def piece_drops(pieces: ShardPieces) -> list[np.ndarray] | None:
        """The dropped keys of each piece's partition: only those travel to the worker."""
        return None if drops is None else [drops[index[path]] for path, _, _ in pieces]

    def job(s: int) -> passes.OutputShard:
        drops_of = piece_drops(ranges[s])
        return passes.OutputShard(cfg.out, cfg.work, s, ranges[s], cfg.rows_per_block, drops_of, cfg.seed)

    jobs = [(stage.passes.write_output_shard, (job(s),)) for s in todo]
    with _bar(cfg, "shards", stage.unit) as bar:
        for _ in executor.run(jobs, bar.update):
            pass


def _finished(cfg: CorpusConfig, plan: Plan) -> Finished:
    """Every piece's record, or an error naming the first phase that is not finished."""
    split = [passes.split_paths(cfg.work, u) for u in range(len(plan.units))]
    _require(cfg, "split", split, read=False)
    units = []
    for _, json_path in split:  # keep what the manifest needs, not each unit's map of partitions
        meta = passes.read_json(json_path)
        units.append({key: meta[key] for key in ("source", "counts", "audit", "examples") if key in meta})
    parts = _require(cfg, "dedup", [passes.dedup_paths(cfg.work, p) for p in range(plan.num_partitions)])
    drops = _near_dup_drops(cfg, plan)
    num_shards = len(_shard_ranges(cfg, plan, drops))
    paths = [(cfg.out / shard_name(s), passes.shard_entry_path(cfg.work, s)) for s in range(num_shards)]
    shards = _require(cfg, "shards", paths)
    near_duplicate = sum(p["unique"] for p in parts) - sum(_partition_rows(parts, drops))
    return Finished(units, parts, shards, near_duplicate, drops)


def write_and_clean(cfg: CorpusConfig, manifest: dict[str, Any]) -> None:
    """Write the manifest; then the intermediate files and any temporary file of a killed writer go."""
    write_manifest(cfg.out, manifest)
    shutil.rmtree(cfg.work, ignore_errors=True)
    for stale in cfg.out.glob(".shard-*.tmp-*"):  # a shard or the files write_shard puts beside it
        stale.unlink(missing_ok=True)


def _require(
    cfg: CorpusConfig, phase: str, pieces: list[tuple[Path, Path]], read: bool = True
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
