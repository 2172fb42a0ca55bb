"""Training metrics: the JSONL log, tensorboard scalars and batch statistics (STS: pipeline.evaluate.sts)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON object per log step to RUN_DIR/metrics.jsonl and mirrors scalars to tensorboard.

    Only the main process writes (``enabled``); other ranks get a no-op logger.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:  # tensorboard is a dependency, but logging must never stop training
                log.warning("tensorboard is not importable; writing metrics.jsonl only")

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        if self.writer is not None and step is not None:
            for key, value in record.items():
                if key not in ("step", "event") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{record.get('event', 'train')}/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@torch.no_grad()
def alignment_uniformity(embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wang & Isola (2020) on one batch of (n_views, B, H) L2-normalised embeddings.

    alignment: mean squared distance between view 0 and view 1 of the same sentence (lower = closer
    positives); uniformity: log of the mean of exp(-2 * squared distance) over pairs of distinct
    originals (lower = more spread out).
    """
    x = embeddings.detach().float()
    align = (x[0] - x[1]).pow(2).sum(-1).mean()  # scalar
    sq = torch.pdist(x[0]).pow(2)  # (B * (B - 1) / 2,)
    uniform = sq.mul(-2).exp().mean().log()
    return align, uniform


class Throughput:
    """Sentences per second between two log steps (wall clock)."""

    def __init__(self) -> None:
        self.t0, self.samples0 = time.perf_counter(), 0

    def rate(self, samples_seen: int) -> float:
        now = time.perf_counter()
        rate = (samples_seen - self.samples0) / max(now - self.t0, 1e-9)
        self.t0, self.samples0 = now, samples_seen
        return rate
