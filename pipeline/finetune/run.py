"""``python -m pipeline finetune MODEL --out DIR``: TrainBERT / FreezeBERT on small labelled tasks.

For every task, regime, seed and learning rate of the grid, one *cell* is trained for a fixed budget
and scored on dev and test; each finished cell is written to ``DIR/cells/`` at once (atomically), so
a rerun after a kill skips it. Per seed, the lr with the best dev score is chosen and its test score
kept; the table reports mean ± std over the seeds. FreezeBERT's encoder outputs are computed once per
task and cached in ``DIR/cache/``. Writes ``finetune.json``, ``finetune.md`` and ``finetune.png``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline.config import option, to_dict
from pipeline.errors import ConfigError, InputError
from pipeline.finetune.cells import Cell, cells_of, read_cell, task_digest
from pipeline.finetune.tasks import BUILTIN, Task, TaskSpec, load_task, parse_task_file

log = logging.getLogger(__name__)

REGIMES = ("train", "freeze")
SETTING_FILE = "finetune_config.json"
# What changes a cell's result besides its (task, regime, seed, lr): a rerun into the same --out must
# keep these, or its recorded cells would be mixed with cells of another setting.
SETTING_KEYS = (
    "max_train",
    "max_dev",
    "max_test",
    "split_seed",
    "batch_size",
    "train_epochs",
    "freeze_epochs",
    "head_lr",
    "warmup",
    "max_length",
    "sim_head",
)


def _split_commas(values: list[Any] | str) -> list[str]:
    items = values if isinstance(values, list) else [values]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


@dataclass
class Config:
    model: str = option("", "MODEL: model folder, checkpoint, run dir or Hub name (as `eval` takes).")
    out: Path | None = option(None, "Output directory: cells, cache, finetune.{json,md,png}. Required.")
    tasks: list[str] = option(list(BUILTIN), f"Tasks to run, of {', '.join(BUILTIN)} (comma list).")
    task_files: list[str] = option(
        factory=list,
        help="Your own tasks: NAME=classification:FILE (label<TAB>text, with that header) or "
        "NAME=similarity:FILE (pairs) or ...:TRAIN,DEV,TEST; a single file is split here.",
    )
    regimes: list[str] = option(list(REGIMES), "train (TrainBERT: all weights) and/or freeze (FreezeBERT).")
    seeds: list[int] | str = option([0, 1, 2], "Training seeds (head init, data order, dropout).")
    max_train: int = option(1000, "Labelled training examples per task at most (low-resource setting).")
    max_dev: int = option(500, "Dev examples per task at most (lr selection only).")
    max_test: int = option(1000, "Test examples per task at most (the reported score).")
    split_seed: int = option(0, "Seed of the train/dev/test split of single-file tasks (fixed across seeds).")
    train_lrs: list[float] | str = option([3e-5, 1e-4], "TrainBERT encoder lr grid (chosen on dev).")
    train_epochs: int = option(1, "TrainBERT epochs over the training split (the fixed budget).")
    head_lr: float = option(1e-3, "TrainBERT: lr of the new linear classifier.")
    freeze_lrs: list[float] | str = option([1e-4, 3e-4, 1e-3], "FreezeBERT MLP lr grid (chosen on dev).")
    freeze_epochs: int = option(20, "FreezeBERT epochs over the cached training embeddings.")
    batch_size: int = option(32, "Training batch size (examples; a pair is one example).")
    warmup: float = option(0.1, "Share of the steps with linear warmup; then linear decay to 0.")
    max_length: int = option(48, "Tokens per sentence at most (capped by the model's own limit).")
    sim_head: Literal["bce", "cosent"] = option(
        "bce", "Similarity loss: bce = the seed's (1+cos)/2 binary cross-entropy; cosent = CoSENT."
    )
    checkpoint: Literal["latest", "best"] = option("latest", "For a run directory: which checkpoint.")
    pooling: Literal["cls", "mean", "first_last_avg"] | None = option(
        None, "Override the model's pooling (empty = the folder's rule)."
    )
    prefix: str | None = option(None, "Override the text prefix (empty = the folder's rule).")
    device: str = option("cpu", "torch device (cpu, cuda).")
    progress: bool = option(True, "Progress bars on a terminal (log lines every 30 s otherwise).")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("name a MODEL (model folder, checkpoint, run directory or Hub name)")
        if self.out is None:
            raise ConfigError("--out DIR is required: finished cells are recorded there (rerun to resume)")
        self.tasks = _split_commas(self.tasks)
        self.regimes = _split_commas(self.regimes)
        self.task_files = _split_commas(self.task_files) if self.task_files else []
        # a task file spec holds commas itself (TRAIN,DEV,TEST): rejoin pieces without '='
        joined: list[str] = []
        for piece in self.task_files:
            if "=" in piece or not joined:
                joined.append(piece)
            else:
                joined[-1] += "," + piece
        self.task_files = joined
        try:
            self.seeds = [int(s) for s in _split_commas(self.seeds)]
            self.train_lrs = [float(v) for v in _split_commas(self.train_lrs)]
            self.freeze_lrs = [float(v) for v in _split_commas(self.freeze_lrs)]
        except ValueError as exc:
            raise ConfigError(f"--seeds / --train-lrs / --freeze-lrs: {exc}; give comma lists") from None
        own = [parse_task_file(s)[0] for s in self.task_files]
        unknown = [t for t in self.tasks if t not in BUILTIN and t not in own]
        if unknown:
            raise ConfigError(f"--tasks: unknown {unknown}; choose from {', '.join(BUILTIN)} or --task-files")
        if self.task_files and self.tasks == list(BUILTIN):
            self.tasks = list(own)  # own tasks given and --tasks left at its default: run only those
        bad = [r for r in self.regimes if r not in REGIMES]
        if bad or not self.regimes:
            raise ConfigError(f"--regimes {bad or '[]'}: choose train and/or freeze")
        if not self.seeds or not self.train_lrs or not self.freeze_lrs:
            raise ConfigError("--seeds, --train-lrs and --freeze-lrs need at least one value each")
        for name in ("max_train", "max_dev", "max_test", "batch_size", "max_length"):
            if getattr(self, name) < 2:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 2")
        if self.train_epochs < 1 or self.freeze_epochs < 1:
            raise ConfigError("--train-epochs and --freeze-epochs must be >= 1")
        if not 0.0 <= self.warmup < 1.0:
            raise ConfigError("--warmup must be in [0, 1)")


# ---------------------------------------------------------------------------------------- progress
class Progress:
    """A bar per cell on a terminal; otherwise a log line every ``every`` seconds and one per cell."""

    def __init__(self, enabled: bool, every: float = 30.0):
        self.bars = enabled and sys.stderr.isatty()
        self.every = every
        self._bar: Any = None
        self._last = 0.0

    def start(self, desc: str) -> Any:
        self._desc, self._last = desc, time.monotonic()
        if self.bars:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=desc, unit="step", leave=False)
        return self.tick

    def tick(self, step: int, total: int) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = step
            self._bar.refresh()
        elif time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            log.info("%s: step %d/%d", self._desc, step, total)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def setting_of(cfg: Config, model_info: dict[str, Any]) -> dict[str, Any]:
    return {"model": model_info["model_dir"], **{k: getattr(cfg, k) for k in SETTING_KEYS}}


def check_setting(out: Path, setting: dict[str, Any]) -> None:
    """Record the setting in ``out``, or refuse to mix cells of another one there."""
    from pipeline.io import atomic_write_json

    path = out / SETTING_FILE
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{path} is unreadable ({exc}); remove it or use a new --out") from None
        for key, value in setting.items():
            if old.get(key) != value:
                raise ConfigError(
                    f"{out} holds cells of another setting ({key}: {old.get(key)!r} there, {value!r} now); "
                    "use a new --out, or the same settings to resume"
                )
        return
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, setting)


# ------------------------------------------------------------------------------------------ model
class Model:
    """The encoder, loaded on first need (a rerun with every cell recorded never loads it)."""

    def __init__(self, cfg: Config, resolved: Any):
        self.cfg, self.resolved = cfg, resolved
        self._encoder: Any = None
        self._initial: dict[str, Any] | None = None

    @property
    def encoder(self) -> Any:
        if self._encoder is None:
            from pipeline.evaluate import resolve

            encoder = resolve.load_encoder(self.resolved, self.cfg.device, self.cfg.pooling, self.cfg.prefix)
            encoder.max_length = min(encoder.max_length, self.cfg.max_length)
            self._encoder = encoder
        return self._encoder

    def as_loaded(self) -> Any:
        """The encoder with the loaded weights: a TrainBERT cell before has changed them."""
        if self._initial is not None:
            self.encoder.load_state_dict(self._initial)
        return self.encoder

    @property
    def initial_state(self) -> dict[str, Any]:
        """The loaded weights, kept to reset the encoder before every TrainBERT cell."""
        if self._initial is None:
            self._initial = {k: v.detach().clone() for k, v in self.encoder.state_dict().items()}
        return self._initial


def frozen_features(
    model: Model, task: Task, out: Path, progress: Progress
) -> tuple[np.ndarray, dict[str, int]]:
    """FreezeBERT's inputs: the pooled vector of every unique text of the task, computed once, cached."""
    from pipeline.finetune.train import encode_pooled
    from pipeline.io import atomic_write

    texts = task.unique_texts()
    row = {t: i for i, t in enumerate(texts)}
    path = out / "cache" / f"{task.name}-{task_digest(task)}.npy"
    if path.is_file():
        features = np.load(path)
        if features.shape[0] == len(texts):
            return features, row
        log.warning("cache %s has %d rows for %d texts; recomputing it", path, features.shape[0], len(texts))
    start, cpu = time.perf_counter(), time.process_time()
    tick = progress.start(f"{task.name}: encode {len(texts)} texts once (FreezeBERT)")
    try:
        features = encode_pooled(model.as_loaded(), texts, tick=tick)
    finally:
        progress.stop()
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, features)

    atomic_write(path, write)
    seconds = round(time.perf_counter() - start, 2)
    from pipeline.io import atomic_write_json

    timing = {"texts": len(texts), "seconds": seconds, "cpu_seconds": round(time.process_time() - cpu, 2)}
    atomic_write_json(path.with_suffix(".json"), timing)
    log.info(
        "%s: encoded %d texts for FreezeBERT in %.1f s (cached in %s)", task.name, len(texts), seconds, path
    )
    return features, row


def run_cell(cell: Cell, cfg: Config, task: Task, model: Model, features: Any, tick: Any) -> dict[str, Any]:
    from pipeline.finetune.train import Budget, run_freeze_cell, run_train_cell

    budget = Budget(
        epochs=cfg.train_epochs if cell.regime == "train" else cfg.freeze_epochs,
        batch_size=cfg.batch_size,
        lr=cell.lr,
        seed=cell.seed,
        head_lr=cfg.head_lr,
        warmup=cfg.warmup,
        sim_head=cfg.sim_head,
    )
    if cell.regime == "train":
        return run_train_cell(model.encoder, model.initial_state, task, budget, tick)
    return run_freeze_cell(features[0], features[1], task, budget, tick)


# -------------------------------------------------------------------------------------------- run
def load_tasks(cfg: Config) -> list[Task]:
    specs: dict[str, TaskSpec] = dict(BUILTIN)
    specs.update(dict(parse_task_file(s) for s in cfg.task_files))
    return [
        load_task(n, specs[n], cfg.max_train, cfg.max_dev, cfg.max_test, cfg.split_seed) for n in cfg.tasks
    ]


def run(cfg: Config) -> int:
    from pipeline.evaluate import resolve
    from pipeline.finetune.summary import summarise, write_outputs
    from pipeline.io import atomic_write_json

    start = time.perf_counter()
    out = Path(cfg.out)
    tasks = load_tasks(cfg)  # every bad task file is reported before any training
    resolved = resolve.resolve(cfg.model, cfg.checkpoint)
    model_info = resolve.describe(resolved)
    check_setting(out, setting_of(cfg, model_info))
    model = Model(cfg, resolved)
    progress = Progress(cfg.progress)
    planned = [(t, r) for t in tasks for r in cfg.regimes]
    total = sum(len(list(cells_of(cfg, t.name, r))) for t, r in planned)
    records: dict[Cell, dict[str, Any]] = {}
    done = skipped = 0
    for task, regime in planned:
        digest = task_digest(task)
        features = None
        for cell in cells_of(cfg, task.name, regime):
            done += 1
            record = read_cell(cell.path(out), digest)
            if record is not None:
                records[cell] = record
                skipped += 1
                continue
            if regime == "freeze" and features is None:
                features = frozen_features(model, task, out, progress)
            tick = progress.start(f"[{done}/{total}] {cell.name}")
            try:
                result = run_cell(cell, cfg, task, model, features, tick)
            finally:
                progress.stop()
            record = {
                "task": cell.task,
                "regime": cell.regime,
                "seed": cell.seed,
                "lr": cell.lr,
                "data": digest,
            }
            record |= result
            cell.path(out).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cell.path(out), record)  # recorded at once: a kill after this loses nothing
            records[cell] = record
            log.info(
                "[%d/%d] %s: dev %s, test %s (%.1f s)",
                done,
                total,
                cell.name,
                _short(record["dev"]),
                _short(record["test"]),
                record["seconds"],
            )
    if skipped:
        log.info("%d of %d cells were recorded in %s already; not recomputed", skipped, total, out)
    model_info.update(setting_of(cfg, model_info))
    summary = summarise(cfg, tasks, records, out)
    result = {
        "model": model_info,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": to_dict(cfg),
        "cells": {"total": total, "recorded_before": skipped},
        "tasks": summary,
        "seconds": round(time.perf_counter() - start, 1),
    }
    text = write_outputs(result, out)
    print(text)
    print(f"wrote {out / 'finetune.json'}, finetune.md and finetune.png in {result['seconds']} s")
    return 0


def _short(scores: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in scores.items())
