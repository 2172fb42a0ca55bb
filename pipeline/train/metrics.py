"""Training metrics: the JSONL log, tensorboard scalars and batch statistics (STS: pipeline.evaluate.sts)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.io import is_disk_full

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON object per log step to RUN_DIR/metrics.jsonl and mirrors scalars to tensorboard.

    Only the main process writes (``enabled``); other ranks get a no-op logger.

    Logging never stops training. On a full disk the records that could not be written are kept in
    memory (a few hundred bytes each) and written, in order, at the next log step that finds space: a
    failed append is cut back to the last whole line, so the file never holds a torn record. One warning
    names the directory. If the space does not come back, the next checkpoint stops the run with its
    own one-line disk-full error (exit 74), and the records still held are lost with the process.
    TensorBoard is a mirror of the JSONL file: its writer is closed at the first disk-full error, with
    one warning, and not reopened (the curves can be redrawn from metrics.jsonl).
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.pending: list[str] = []  # lines not yet on disk (a full disk), oldest first
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
        self.pending.append(json.dumps(record, ensure_ascii=False) + "\n")
        self._flush_lines()
        if self.writer is not None and step is not None:
            try:
                for key, value in record.items():
                    if (
                        key not in ("step", "event")
                        and isinstance(value, (int, float))
                        and math.isfinite(value)
                    ):
                        self.writer.add_scalar(f"{record.get('event', 'train')}/{key}", value, step)
            except Exception as exc:  # the writer thread's error surfaces here
                self._drop_tensorboard(exc)

    def _flush_lines(self) -> None:
        """Append the pending lines; on a full disk keep them and cut the file back to whole lines."""
        data = "".join(self.pending).encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:  # unbuffered: nothing is left in a buffer to fail again at close
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                os.ftruncate(fd, start)  # a partly written record would be a torn line; all of them retry
                if len(self.pending) == 1:  # the first record held back: say so once per episode
                    log.warning(
                        "disk full in %s: metrics.jsonl records are kept in memory and written when space "
                        "returns (free space there; the next checkpoint needs it too)",
                        self.path.parent,
                    )
                return
        finally:
            os.close(fd)
        if len(self.pending) > 1:
            log.info("metrics.jsonl: %d records held back by a full disk are written", len(self.pending))
        self.pending.clear()

    def _drop_tensorboard(self, exc: BaseException) -> None:
        if not is_disk_full(exc):
            raise exc
        log.warning(
            "disk full in %s: tensorboard mirroring stopped (metrics.jsonl has every record)",
            self.path.parent,
        )
        writer, self.writer = self.writer, None
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - closing a writer that already failed re-raises its error
            pass

    def close(self) -> None:
        if self.pending:
            self._flush_lines()
            if self.pending:
                log.warning("disk full: %d metrics.jsonl records could not be written", len(self.pending))
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as exc:
                self._drop_tensorboard(exc)
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

