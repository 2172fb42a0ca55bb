"""Guards against the faults that end long runs: a non-finite loss or gradient, and a loss spike.

Non-finite steps. With fp16 the GradScaler already skips a step whose gradients are not finite; with
bf16 and fp32 nothing would, and one NaN gradient makes AdamW's moments, every weight, the momentum
encoder and the queue NaN, and every later checkpoint with them. :func:`step_verdict` decides whether
the step that was just computed may be applied: its loss and its global gradient norm must be finite
on every rank. A skipped step leaves the optimizer, the LR schedule, the momentum encoder and the
queue untouched; only the data cursor moves on (the batch is consumed, as it would be by a resumed
run). After ``guard.max_nonfinite_steps`` consecutive skips the run stops with :class:`NonFiniteError`
(exit code :data:`EXIT_CODE_NONFINITE`) naming the last good checkpoint. Independently,
:func:`first_nonfinite` is run on everything a checkpoint would hold before it is written, so a
non-finite checkpoint is never written and never replaces a good one.

Cost: with more than one process, one all-reduce of two numbers per step (the verdict and the loss),
so that every rank takes the same branch. Where they are read: with fused AdamW, :func:`device_verdict`
keeps them on the device, the optimizer skips a non-finite step on its ``found_inf`` flag, and the loop
reads a window of verdicts at its next log step (``engines.deferred``/``accounting.settle``: no host sync in
between); otherwise :func:`step_verdict` reads them at every step, one device-to-host copy of two
numbers (free on CPU; on a GPU it waits for the step's kernels before the optimizer runs, as a fp16
GradScaler does). ``guard.max_nonfinite_steps: 0`` turns the guard (and its sync) off.

Loss spikes (``guard.spike_factor`` > 0, off by default): when the loss stays above ``spike_factor`` x
the median of the last ``spike_history`` applied steps' losses for ``spike_steps`` consecutive steps,
the loop rolls back to the newest checkpoint written before the spike began and skips the data from
that checkpoint's position to ``spike_skip_batches`` batches past the spike (as the OPT, PaLM and
BLOOM runs did by hand). The decision depends only on the losses, which an exact resume reproduces,
and is recorded in the train state of every later checkpoint.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pipeline import distributed as dist
from pipeline.errors import PipelineError

__all__ = [
    "EXIT_CODE_NONFINITE",
    "NonFiniteError",
    "SpikeDetector",
    "DeviceCheck",
    "StepCheck",
    "device_verdict",
    "first_nonfinite",
    "grad_norm",
    "read_checks",
    "step_verdict",
]

# sysexits.h EX_SOFTWARE, "internal software error": the run diverged. Not 75 (rerunning the same
# command would diverge again): resume from the named checkpoint with a change (lower lr, other data).
EXIT_CODE_NONFINITE = 70


class NonFiniteError(PipelineError):
    """The run produced non-finite values it cannot step over (too many skips, or at a checkpoint)."""

    exit_code = EXIT_CODE_NONFINITE


def grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the gradients, on the device (no sync); used when clipping is off."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, 2.0)


class StepCheck(NamedTuple):
    finite: bool  # loss and gradient norm finite on every rank: the update may be applied
    loss: float  # mean over ranks of the finite losses (for the spike check)


class DeviceCheck(NamedTuple):
    """A :class:`StepCheck` still on the device: read it with :func:`read_checks` (a host sync)."""

    finite: torch.Tensor  # () bool, the same on every rank
    loss: torch.Tensor  # () float64


def device_verdict(loss: torch.Tensor, norm: torch.Tensor | None) -> DeviceCheck:
    """Whether this step may be applied, and its loss, on the device (collective under a group, no sync).

    ``loss`` is this rank's loss (mean over micro-batches), ``norm`` the global gradient norm (identical
    on all ranks after DDP's all-reduce; None when the step has no gradient to check).
    """
    finite = torch.isfinite(loss) if norm is None else torch.isfinite(loss) & torch.isfinite(norm.to(loss))
    bad = (~finite).to(torch.float64)
    packed = torch.stack([bad, torch.where(finite, loss.detach().to(torch.float64), 0.0)])
    packed = dist.all_reduce_sum(packed)  # (2,): ranks with a non-finite step, sum of finite losses
    return DeviceCheck(packed[0] == 0, packed[1] / dist.world_size())


def read_checks(checks: list[DeviceCheck]) -> list[StepCheck]:
    """The verdicts of several steps on the host: one copy of 2 x len(checks) numbers (a host sync)."""
    if not checks:
        return []
    rows = torch.stack([torch.stack([c.finite.to(torch.float64), c.loss]) for c in checks]).tolist()
    return [StepCheck(finite == 1.0, loss) for finite, loss in rows]


def step_verdict(loss: torch.Tensor, norm: torch.Tensor | None) -> StepCheck:
    """:func:`device_verdict` read back at once: the guard's per-step host sync (one copy of two numbers)."""
    return read_checks([device_verdict(loss, norm)])[0]


def _tensors(obj: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{name}.{key}" if name else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{name}.{i}")


def first_nonfinite(states: Mapping[str, Any]) -> str | None:
    """The name of the first floating-point tensor in ``states`` (nested dicts/lists of state_dicts)
    with a NaN or inf, or None. One host sync for all tensors (a second to name the culprit)."""
    named = [(n, t) for n, t in _tensors(states, "") if t.is_floating_point() and t.numel()]
    if not named:
        return None
    flags = torch.stack([torch.isfinite(t).all().cpu() for _, t in named])
    if bool(flags.all()):
        return None
    return named[int((~flags).nonzero()[0])][0]


@dataclass
class SpikeDetector:
    """``factor`` x the running median of the last ``history`` losses, exceeded ``steps`` times in a row.

    Stateful (``state_dict``/``load_state_dict``): the history must survive a restart for a resumed run
    to make the decisions an uninterrupted one makes.
    """

    factor: float
    steps: int
    history: int
    losses: list[float] = field(default_factory=list)
    streak: int = 0  # consecutive steps above the threshold
    first: int | None = None  # step (1-based, as logged) at which the current streak began

    def observe(self, step: int, loss: float) -> bool:
        """Record the loss of applied step ``step``; True when the loss has spiked for ``steps`` steps."""
        full = len(self.losses) >= self.history
        if full and loss > self.factor * statistics.median(self.losses):
            self.streak += 1
            self.first = step if self.first is None else self.first
            return self.streak >= self.steps  # spike steps stay out of the history
        self.streak, self.first = 0, None
        self.losses = [*self.losses, loss][-self.history :]
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "streak": self.streak, "first": self.first}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.losses, self.streak, self.first = list(state["losses"]), state["streak"], state["first"]
