"""``python -m pipeline train`` and ``launch/pretrain.py``: build, train, close (one body for both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.train.config import Config

__all__ = ["Config", "run"]


def run(cfg: Config, on_batch: Callable[[Any, dict[str, Any]], None] | None = None) -> int:
    """Train ``cfg``; returns the exit code (0, or EXIT_CODE_PREEMPTED after a preemption checkpoint).

    ``on_batch(trainer, batch)`` sees each batch before its step (tests record the sample ids with it).
    """
    from pipeline.train.build import build
    from pipeline.train.loop import train

    trainer = build(cfg)
    try:
        return train(trainer, on_batch)
    finally:
        trainer.close()
