"""Learning-rate schedule: linear warmup, then linear or cosine decay, as a pure function of the step.

Because the rate depends only on the optimizer step, the schedule needs no state of its own to
resume: restoring the step counter restores the rate. :class:`LRSchedule` writes it into the
optimizer's parameter groups before each step (instead of a torch LR scheduler, which Accelerate
would step once per process).
"""

from __future__ import annotations

import math
from typing import Any


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float = 0.0) -> float:
    """The multiplier of the peak rate for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}")


class LRSchedule:
    """Sets every parameter group's ``lr`` to ``peak * lr_factor(step)``. Stateful only for checking."""

    def __init__(
        self,
        optimizer: Any,
        peak_lr: float,
        warmup_steps: int,
        total_steps: int,
        schedule: str,
        min_ratio: float = 0.0,
    ):
        self.optimizer, self.peak_lr = optimizer, peak_lr
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.schedule, self.min_ratio = schedule, min_ratio

    def lr(self, step: int) -> float:
        return self.peak_lr * lr_factor(
            step, self.warmup_steps, self.total_steps, self.schedule, self.min_ratio
        )

    def apply(self, step: int) -> float:
        lr = self.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "peak_lr": self.peak_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "schedule": self.schedule,
            "min_ratio": self.min_ratio,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the rate is a function of the step and of the config (whose changes the
        checkpoint's config check reports); the saved shape is only a record."""
