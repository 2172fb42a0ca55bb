"""Preemption signals and the checkpoint schedule, agreed on by every rank.

A scheduler (SLURM ``--signal=B:USR1@120``, a time limit's SIGTERM, ``scancel --signal``) asks the job
to stop. The handler only sets a flag: all real work happens at the next step boundary, where
:meth:`PreemptionHandler.should_stop` turns the per-rank flags into one decision (a signal may reach
rank 3 and not rank 0), the loop saves a checkpoint with every rank and exits with
:data:`EXIT_CODE_PREEMPTED`. A second signal during the save only sets the flag again, so it cannot
interrupt the write.

:class:`Cadence` decides when the periodic checkpoints and evaluations fall due. The time rule reads
rank 0's clock and broadcasts the answer: clocks (and step timings) differ between ranks, and a rank that
decides alone to save would wait forever in the checkpointer's barrier.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch

from pipeline import distributed

__all__ = ["EXIT_CODE_COLLECTIVE_TIMEOUT", "EXIT_CODE_PREEMPTED", "Cadence", "PreemptionHandler"]

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL, "temporary failure, retry later": the run saved a checkpoint and wants to be
# restarted. Not 143 (128 + SIGTERM), which a shell also reports for a process killed by SIGTERM
# without saving anything, and not 124, which `timeout` uses.
EXIT_CODE_PREEMPTED = 75
# A collective did not complete within train.collective_timeout (or lost its peer): another rank is
# hung, stopped, dead or cut off. Every surviving rank exits with this status and one line starting
# "collective timeout:" (pipeline/train/hangs.py) that names the collective and the silent rank(s).
# Nothing was saved at that moment; a requeue resumes from the newest checkpoint.
EXIT_CODE_COLLECTIVE_TIMEOUT = 76
DEFAULT_SIGNALS = distributed.PREEMPTION_SIGNALS


class PreemptionHandler:
    """Turns SIGTERM/SIGUSR1 into a flag that the training loop checks at step boundaries.

    ``install()`` must run in the main thread (Python delivers signals there). The previous handlers
    are restored by ``uninstall()``.
    """

    def __init__(self, signals: Iterable[signal.Signals | int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.requested = False  # set by the handler; read by should_stop()
        self.received: list[str] = []  # names of the signals seen, for the log line
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must be called from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: no logging or I/O here, the interrupted code may hold the locks they need.
        self.requested = True
        self.received.append(signal.Signals(signum).name)

    def request(self) -> None:
        """Ask for a stop from code (tests, a wall-clock budget) exactly as a signal would."""
        self.requested = True

    def should_stop(self) -> bool:
        """True on every rank if any rank got a signal (collective: every rank calls it each time).

        One all_reduce of one number: cheap, but a collective, so call it at the same step boundaries
        on all ranks (every step, or every N steps with the same N everywhere).
        """
        flag = torch.tensor([1.0 if self.requested else 0.0], device=distributed.collective_device())
        stop = bool(distributed.all_reduce_sum(flag).item() > 0)  # host sync, once per check
        if stop and not self.requested:
            self.requested = True  # another rank was signalled; remember it here too
        if stop:
            seen = ",".join(self.received) or "another rank"
            log.info("preemption requested (%s): saving a checkpoint and exiting", seen)
        return stop


class Cadence:
    """A periodic event (a checkpoint, an evaluation) every ``every_steps`` steps and/or every
    ``every_minutes`` minutes.

    ``due`` is a collective when ``every_minutes`` is set (one broadcast from rank 0, and a host sync),
    so call it on every rank at every step boundary; the clock is read only at steps that are multiples
    of ``check_every`` (the loop's log steps, which sync anyway), so a time-based event may come up to
    ``check_every - 1`` steps late. A value of 0 switches a rule off.
    """

    def __init__(
        self, every_steps: int = 0, every_minutes: float = 0.0, now: float | None = None, check_every: int = 1
    ) -> None:
        if every_steps < 0 or every_minutes < 0 or check_every < 1:
            raise ValueError("every_steps and every_minutes must be >= 0, check_every >= 1")
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.check_every = check_every
        self.last = time.monotonic() if now is None else now

    def due(self, step: int, now: float | None = None) -> bool:
        """Whether the event falls due after optimizer step ``step``; the same answer on every rank."""
        by_steps = self.every_steps > 0 and step > 0 and step % self.every_steps == 0
        if self.every_minutes > 0 and step % self.check_every == 0:
            now = time.monotonic() if now is None else now
            local = by_steps or (now - self.last) >= self.every_minutes * 60
            # rank 0's clock decides; the broadcast makes every rank take the same branch.
            flag = torch.tensor([1 if local else 0], device=distributed.collective_device())
            decision = bool(distributed.broadcast(flag, src=0).item())
        else:
            decision = by_steps
        if decision:
            self.happened(now)
        return decision

    def happened(self, now: float | None = None) -> None:
        """Restart the time rule (also call it after an unscheduled event, e.g. a save on preemption)."""
        self.last = time.monotonic() if now is None else now
