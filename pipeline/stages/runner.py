"""The per-shard stage machinery shared by ``augment``, ``teacher`` and ``tokenize``.

:class:`Execution` is how any offline stage runs (preprocess too): local workers, its task of a SLURM
array, finalize-only, progress. The stages' configs inherit it, so the options, their checks and their
help are written once; being about how and not what, its fields stay out of every manifest.

Such a stage turns every input shard into an output shard of the same name. Its units of work are
shards: local worker processes and SLURM array tasks (task t takes the shards i with
``i % num_tasks == t``) split them. A finished shard leaves a completion record in the stage's work
directory (written after the shard, so a record means a complete shard) and is skipped on a rerun; the
work directory's ``run.json`` holds the run's fingerprint so that two different runs never mix in one
output directory; whichever task finds every record present writes ``manifest.json`` and removes the
work directory.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import multiprocessing as mp
import queue
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipeline.config import option
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json
from pipeline.shards import MANIFEST, read_manifest

log = logging.getLogger(__name__)


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


def process_shards(
    jobs: Sequence[Any],
    workers: int,
    total: int,
    desc: str,
    show_progress: bool,
    run_here: Callable[[Sequence[Any], Callable[[int], Any]], None],
    initializer: Callable[..., None],
    initargs: tuple,
    run_in_worker: Callable[[Any], Any],
) -> None:
    """Run ``jobs`` with a progress bar of ``total`` sentences: ``run_here(jobs, report)`` in this
    process for one worker (or one job), else a pool of ``workers`` spawned processes, each set up by
    ``initializer(*initargs, progress)`` (``progress``: a queue of sentence counts) and running
    ``run_in_worker(job)``. A worker's error is re-raised here and the queued shards are not started."""
    from pipeline import progress

    bar = progress.bar(total=total, unit="sent", unit_scale=True, disable=not show_progress, desc=desc)
    try:
        if workers == 1 or len(jobs) == 1:
            run_here(jobs, bar.update)
            return
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (tqdm, pyarrow, torch)
        progress = ctx.Queue()
        pool = cf.ProcessPoolExecutor(
            min(workers, len(jobs)), mp_context=ctx, initializer=initializer, initargs=(*initargs, progress)
        )
        try:
            pending = {pool.submit(run_in_worker, job) for job in jobs}
            while pending:
                done, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
                _drain(progress, bar)
                for future in done:
                    future.result()  # re-raises a worker's InputError naming the shard
            _drain(progress, bar)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        bar.close()


def _drain(progress: Any, bar: Any) -> None:
    while True:
        try:
            bar.update(progress.get_nowait())
        except queue.Empty:
            return
