"""The unit of the fine-tuning evaluation: one (task, regime, seed, lr) cell, its record on disk, and the
digest of the task data a record is valid for. Shared by the runner (run.py) and the summary."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import InputError
from pipeline.finetune.tasks import SPLITS, Task


@dataclass(frozen=True)
class Cell:
    task: str
    regime: str
    seed: int
    lr: float

    @property
    def name(self) -> str:
        return f"{self.task} {self.regime} seed {self.seed} lr {self.lr:g}"

    def path(self, out: Path) -> Path:
        return out / "cells" / self.task / f"{self.regime}-seed{self.seed}-lr{self.lr:g}.json"


def task_digest(task: Task) -> str:
    """A hash of the task's splits (texts and labels): a recorded cell is reused only on the same data."""
    h = hashlib.sha256()
    for s in SPLITS:
        split = task.splits[s]
        h.update(
            json.dumps([s, split.texts_a, split.texts_b, split.labels.tolist()], ensure_ascii=False).encode()
        )
    return h.hexdigest()[:16]


def read_cell(path: Path, digest: str) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"recorded cell {path} is unreadable ({exc}); delete it to recompute it") from None
    if record.get("data") != digest:
        raise InputError(
            f"recorded cell {path} was computed on other data (the task files changed); use a new --out"
        )
    return record


def cells_of(cfg: Any, task: str, regime: str) -> Iterator[Cell]:
    lrs = cfg.train_lrs if regime == "train" else cfg.freeze_lrs
    for seed in cfg.seeds:
        for lr in lrs:
            yield Cell(task, regime, seed, lr)
