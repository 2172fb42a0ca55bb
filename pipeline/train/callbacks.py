"""Hooks into a training run (as Lightning's and the HF Trainer's callbacks): the one way for tests,
benchmarks and tools to watch or steer a run without patching the loop's functions.

``train(trainer, callbacks)`` calls them; a plain function given instead is ``on_batch``. Each hook's
default changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.data.collate import Batch
from pipeline.losses.terms import LossOut
from pipeline.train.guard import StepCheck


class Callbacks:
    """Subclass and override what you need."""

    defer_verdicts: bool = True  # False: the guard's verdict is read at every step, never deferred

    def on_batch(self, t: Any, batch: Batch) -> None:
        """Each batch before its step (tests record the sample ids or poison a batch with it)."""

    def on_loss(self, t: Any, batch: Batch, out: LossOut) -> LossOut:
        """One micro-batch's loss before its backward: what is returned is backpropagated."""
        return out

    def on_verdict(self, t: Any, check: StepCheck) -> StepCheck:
        """The non-finite guard's verdict on a step, read on the host: what is returned decides."""
        return check

    def on_evaluate(self, t: Any, score: float) -> float:
        """The STS-B valid score of an evaluation (every rank): what is returned is kept as the score."""
        return score


class OnBatch(Callbacks):
    """A function ``on_batch(trainer, batch)`` as callbacks."""

    def __init__(self, on_batch: Callable[[Any, Batch], None]):
        self.function = on_batch

    def on_batch(self, t: Any, batch: Batch) -> None:
        self.function(t, batch)


def as_callbacks(hooks: Callbacks | Callable[[Any, Batch], None] | None) -> Callbacks:
    """Callbacks as given, a function as ``on_batch``, None as the defaults."""
    if hooks is None:
        return Callbacks()
    return hooks if isinstance(hooks, Callbacks) else OnBatch(hooks)
