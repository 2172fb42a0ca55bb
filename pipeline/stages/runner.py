"""The shard-stage template: ``augment``, ``teacher`` and ``tokenize`` are each a :class:`ShardWork`
(what to do to one shard) and a ``finish`` (what their manifest adds), run by one :class:`ShardStage`.

:class:`Execution` is how any offline stage runs (preprocess and pairs too): local workers, its task of
a SLURM array, finalize-only, progress. The stages' configs inherit it, so the options, their checks and
their help are written once; being about how and not what, its fields stay out of every manifest.

A shard stage turns every input shard into an output shard of the same name. :meth:`ShardStage.run`
is its whole skeleton, the same for every such stage:

1. ``fingerprint``: what the output depends on (the config less :data:`EXECUTION_FIELDS`, the input
   manifest's sha256, and the stage's own ``depends_on``: a model's record, resource files' hashes).
   If ``out`` already holds a finished run of it, there is nothing to do; of another, it is refused.
2. claim: the work directory's ``run.json`` holds the fingerprint, so two different runs never mix in
   one output directory.
3. jobs: this task's shards (task t of a SLURM array takes the shards i with ``i % num_tasks == t``)
   that have no completion record yet. A finished shard leaves its record in the work directory,
   written after the shard (so a record means a complete shard), and is skipped on a rerun.
4. pool: the jobs run in this process (one worker, or one job) or in one pool of ``workers`` spawned
   processes; each process loads what the work needs once (``ShardWork.load``: a model, a tokenizer).
5. finalize: whichever task finds every record present calls ``finish(records)`` (the stage's counts
   and manifest fields; the teacher mines its negatives there), writes ``manifest.json`` (which carries
   the fingerprint) and removes the work directory; ``--finalize-only`` does only this step.

A stage's output is a function of its fingerprint alone, so workers, tasks and restarts do not change
a byte of it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import multiprocessing as mp
import queue
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.config import option, to_dict
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json, sha256_file
from pipeline.shards import MANIFEST, new_manifest, read_manifest, verify_shard, write_manifest

log = logging.getLogger(__name__)

Report = Callable[[int], Any]  # adds a number of done sentences to the progress bar
# records -> (the output shards' manifest entries, the manifest fields the stage adds: counts, ...)
Finish = Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], dict[str, Any]]]


@dataclass(kw_only=True)  # keyword-only: a stage's own fields may come without defaults
class Execution:
    """How an offline stage runs, not what it produces: the same output for any of these values."""

    workers: int = option(1, "Local worker processes; each takes whole units of work (shards).")
    task_index: int = option(0, "This task's index among --num-tasks (SLURM_ARRAY_TASK_ID).")
    num_tasks: int = option(1, "Number of tasks sharing the work (SLURM_ARRAY_TASK_COUNT).")
    finalize_only: bool = option(
        False, "Only write manifest.json from finished shards (fails if any is missing)."
    )
    progress: bool = option(
        True, "Show progress: a bar on a terminal, a line every 30 s in a log (PIPELINE_PROGRESS_SECONDS)."
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError("--workers must be >= 1")
        if self.num_tasks < 1 or not 0 <= self.task_index < self.num_tasks:
            raise ConfigError(
                f"task_index must be in [0, num_tasks), got {self.task_index} of {self.num_tasks}; "
                "for a SLURM array pass --task-index $SLURM_ARRAY_TASK_ID --num-tasks $SLURM_ARRAY_TASK_COUNT"
            )


# The fields a stage leaves out of its manifest and run fingerprint (with its output directory).
EXECUTION_FIELDS = ("out", *(f.name for f in fields(Execution)))


def record_path(record_dir: Path, shard_name: str) -> Path:
    return record_dir / (Path(shard_name).stem + ".json")


def read_record(record_dir: Path, shard_dir: Path, shard_name: str) -> dict[str, Any] | None:
    """The shard's completion record, or None if the shard must be (re)done."""
    try:
        record = json.loads(record_path(record_dir, shard_name).read_text(encoding="utf-8"))
    except FileNotFoundError:  # not done yet, or another task finalized and removed the work dir
        return None
    shard = shard_dir / shard_name
    if not shard.is_file() or shard.stat().st_size != record["entry"]["bytes"]:
        return None  # removed or replaced after its record: redo it
    return record


def shard_index(name: str, position: int) -> int:
    """The number in ``shard-NNNNNN.tar``, else the shard's position in the manifest."""
    match = re.fullmatch(r"shard-(\d+)\.tar", name)
    return int(match.group(1)) if match else position


def remove_stale_temps(out_dir: Path, shard_name: str) -> None:
    """Delete the temporary files a killed run of this shard left."""
    for stale in out_dir.glob(f".{shard_name}.tmp-*"):
        stale.unlink(missing_ok=True)


def own_shards(entries: Sequence[dict[str, Any]], task_index: int, num_tasks: int) -> list[int]:
    """Positions of the shards this task owns."""
    return [i for i in range(len(entries)) if i % num_tasks == task_index]


def already_done(out: Path, fingerprint: dict[str, Any], differs: str) -> bool:
    """True if ``out`` holds a finished run of this fingerprint; refuses a finished run of another."""
    if not (out / MANIFEST).is_file():
        return False
    existing = read_manifest(out)
    if {k: existing.get(k) for k in fingerprint} == fingerprint:
        log.info("%s is already complete; nothing to do", out)
        return True
    raise InputError(f"{out / MANIFEST} exists from a different {differs}; use another --out")


def claim_out_dir(out: Path, work_dir: str, fingerprint: dict[str, Any], stage: str, differs: str) -> None:
    """Refuse to mix two different runs in one output directory (``run.json`` holds the fingerprint)."""
    work = out / work_dir
    work.mkdir(parents=True, exist_ok=True)
    run_file = work / "run.json"
    if run_file.is_file():
        if json.loads(run_file.read_text(encoding="utf-8")) != fingerprint:
            raise InputError(
                f"{out} holds an unfinished {stage} run with a different {differs} ({run_file}); "
                "use another --out or delete that directory"
            )
    else:
        atomic_write_json(run_file, fingerprint)


def finished_records(
    out: Path, record_dir: Path, shard_dir: Path, names: list[str], finalize_only: bool, stage: str
) -> list[dict[str, Any]] | None:
    """Every shard's record, or None while some are missing (then another task finalizes, unless
    ``finalize_only``, which refuses naming the first missing shard)."""
    records = [read_record(record_dir, shard_dir, n) for n in names]
    missing = [n for n, r in zip(names, records) if r is None]
    if not missing:
        return records
    if (out / MANIFEST).is_file():  # another array task finalized while we looked
        return None
    if finalize_only:
        raise InputError(
            f"{len(missing)} shard(s) of {out} are not finished (first: {missing[0]}); "
            f"run the {stage} tasks that own them first"
        )
    log.info("%d of %d shards done; the task that finishes last finalizes", len(names) - len(missing),
             len(names))  # fmt: skip
    return None


# --------------------------------------------------------------------------------------------- the template
@dataclass(frozen=True)
class ShardJob:
    """One input shard, and where its output shard and its completion record go."""

    in_dir: Path
    entry: dict[str, Any]  # the input manifest's entry for this shard
    out_dir: Path  # where the output shard goes (OUT, or the work dir while it waits for finalize)
    record_dir: Path
    shard_index: int  # written into the output shard (shard_index())

    @property
    def name(self) -> str:
        return self.entry["name"]

    def open(self) -> Path:
        """The input shard, verified; the temporary files a killed run of this shard left are deleted."""
        in_path = verify_shard(self.in_dir, self.entry)
        remove_stale_temps(self.out_dir, self.name)
        return in_path

    def write_record(self, entry: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
        """The completion record of the shard just written (``entry``: what write_shard returned); called
        after the shard, so that a record means a complete shard (one without a record is redone)."""
        record = {"entry": entry, "counts": counts}
        atomic_write_json(record_path(self.record_dir, self.name), record)
        return record


class ShardWork:
    """What a stage does to each of its shards, in this process or in each worker of a pool (which gets
    a pickled copy): ``shard(job, loaded, report)`` writes one output shard and its record and returns
    the record, where ``loaded`` is what ``load(processes)`` built once in that process.

    ``loaded`` may be set beforehand (the teacher loads its model for the manifest's record): it is then
    used when the shards run here, and dropped before a pool starts, whose workers load their own.
    """

    loaded: Any = None
    progress_per_sentence: int = 1  # progress units a shard reports per input sentence

    def load(self, processes: int) -> Any:
        """What every shard needs (a model, a tokenizer), once per process; ``processes`` is how many
        share this machine (1 when the shards run in the calling process)."""
        return None

    def shard(self, job: ShardJob, loaded: Any, report: Report) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class ShardStage:
    """One run of a shard stage over ``cfg.shards`` into ``cfg.out``: the skeleton in the module
    docstring. A stage builds it with what its output depends on and calls :meth:`run`."""

    name: str  # the stage: the manifest's ``stage``, the progress bar, the messages
    cfg: Any  # the stage's Config: an Execution with ``shards`` and ``out``
    in_manifest: dict[str, Any]
    work_dir: str  # name of the work directory in ``out`` (records, run.json; removed at finalize)
    depends_on: dict[str, Any] = field(default_factory=dict)  # fingerprint entries besides config, input
    left_out: tuple[str, ...] = ()  # config fields kept out of the fingerprint besides EXECUTION_FIELDS
    differs: str = "config or input"  # what may differ between two runs, for the refusal
    shard_dir: Path | None = None  # where finished shards wait for finalize (default: out)
    record_dir: Path | None = None  # where their records go (default: the work directory)

    def __post_init__(self) -> None:
        self.out: Path = self.cfg.out
        self.work = self.out / self.work_dir
        self.shard_dir = self.out if self.shard_dir is None else self.shard_dir
        self.record_dir = self.work if self.record_dir is None else self.record_dir
        left_out = (*EXECUTION_FIELDS, *self.left_out)
        self.fingerprint = {
            "config": {k: v for k, v in to_dict(self.cfg).items() if k not in left_out},
            "input_manifest_sha256": sha256_file(self.cfg.shards / MANIFEST),
            **self.depends_on,
        }

    def run(self, work: ShardWork, finish: Finish) -> int:
        if already_done(self.out, self.fingerprint, self.differs):
            return 0
        claim_out_dir(self.out, self.work_dir, self.fingerprint, self.name, self.differs)
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.record_dir.mkdir(parents=True, exist_ok=True)
        if not self.cfg.finalize_only:
            jobs = self.jobs()
            if jobs:
                self.process(jobs, work)
        self.finalize(finish)
        return 0

    def jobs(self) -> list[ShardJob]:
        """This task's shards that have no completion record yet."""
        cfg, entries = self.cfg, self.in_manifest["shards"]
        mine = own_shards(entries, cfg.task_index, cfg.num_tasks)
        jobs = []
        for i in mine:
            entry = entries[i]
            if read_record(self.record_dir, self.shard_dir, entry["name"]) is None:
                index = shard_index(entry["name"], i)
                jobs.append(ShardJob(cfg.shards, entry, self.shard_dir, self.record_dir, index))
        log.info("task %d/%d: %d shard(s), %d to do", cfg.task_index, cfg.num_tasks, len(mine), len(jobs))
        return jobs

    def process(self, jobs: Sequence[ShardJob], work: ShardWork) -> None:
        """Run ``jobs`` here (one worker, or one job) or in a pool of spawned processes, with a progress
        bar of sentences. A worker's error is re-raised here and the queued shards are not started."""
        from pipeline import progress

        total = work.progress_per_sentence * sum(job.entry["sentences"] for job in jobs)
        bar = progress.bar(total=total, unit="sent", unit_scale=True, disable=not self.cfg.progress,
                           desc=self.name)  # fmt: skip
        processes = min(self.cfg.workers, len(jobs))
        try:
            if processes == 1:
                loaded = work.loaded if work.loaded is not None else work.load(1)
                for job in jobs:
                    work.shard(job, loaded, bar.update)
                return
            work.loaded = None  # the workers load their own; this process's copy is not kept meanwhile
            ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (tqdm, pyarrow, torch)
            done_sentences = ctx.Queue()
            pool = cf.ProcessPoolExecutor(processes, mp_context=ctx, initializer=_start_worker,
                                          initargs=(work, processes, done_sentences))  # fmt: skip
            try:
                pending = {pool.submit(_run_in_worker, job) for job in jobs}
                while pending:
                    done, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
                    _drain(done_sentences, bar)
                    for future in done:
                        future.result()  # re-raises a worker's InputError naming the shard
                _drain(done_sentences, bar)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        finally:
            bar.close()

    def finalize(self, finish: Finish) -> bool:
        """Write manifest.json if every shard has its record; return whether ``out`` is finished."""
        names = [e["name"] for e in self.in_manifest["shards"]]
        records = finished_records(self.out, self.record_dir, self.shard_dir, names, self.cfg.finalize_only,
                                   self.name)  # fmt: skip
        if records is None:
            return (self.out / MANIFEST).is_file()
        entries, added = finish(records)
        inputs = {k: v for k, v in self.fingerprint.items() if k != "config"}  # so already_done finds them
        manifest = new_manifest(self.name, self.fingerprint["config"], entries, **inputs, **added)
        write_manifest(self.out, manifest)
        shutil.rmtree(self.work, ignore_errors=True)  # the manifest now records everything in it
        counts = added.get("counts", {})
        log.info("wrote %s: %s", self.out / MANIFEST,
                 ", ".join(f"{v} {k}" for k, v in counts.items() if isinstance(v, int)))  # fmt: skip
        return True


def read_input(cfg: Any, stage: str, accepts: Sequence[str], reads: str) -> dict[str, Any]:
    """``cfg.shards``'s manifest; refuses one written by a stage not in ``accepts`` (``reads`` says what
    the stage reads) and an ``out`` that is the input."""
    manifest = read_manifest(cfg.shards)
    if manifest.get("stage") not in accepts:
        raise InputError(f"{cfg.shards / MANIFEST} was written by stage {manifest.get('stage')!r}; {reads}")
    if cfg.out.resolve() == cfg.shards.resolve():
        raise ConfigError(f"out must differ from shards: the {stage} stage never writes over its input")
    return manifest


_worker: dict[str, Any] = {}  # a pool worker's work, what it loaded, and where it reports progress


def _start_worker(work: ShardWork, processes: int, done_sentences: Any) -> None:
    _worker.update(work=work, loaded=work.load(processes), report=done_sentences.put)


def _run_in_worker(job: ShardJob) -> dict[str, Any]:
    return _worker["work"].shard(job, _worker["loaded"], _worker["report"])


def _drain(done_sentences: Any, bar: Any) -> None:
    while True:
        try:
            bar.update(done_sentences.get_nowait())
        except queue.Empty:
            return
