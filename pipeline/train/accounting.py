"""The guard's reading of each step, after it is taken: a skipped step counted (and the run stopped
after too many in a row), deferred verdicts settled at log steps, an applied step's loss fed to the spike
detector, and the spike rollback to the newest checkpoint before the spike (pipeline/train/guard.py holds
the verdicts and the detector; docs/fault_tolerance.md)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline import distributed as dist
from pipeline.data.collate import Batch
from pipeline.errors import ConfigError
from pipeline.run_layout import step_of
from pipeline.train.build import Trainer
from pipeline.train.engines import guard_off
from pipeline.train.guard import DeviceCheck, NonFiniteError, SpikeDetector, StepCheck, read_checks

log = logging.getLogger(__name__)


def start_guard(t: Trainer) -> SpikeDetector | None:
    """The spike detector with its saved history when ``guard.spike_factor`` is set (its state and the
    guard's counters ride in the train state, so every checkpoint holds them).

    Spike detection reads the guard's verdict on each step (the step's loss, agreed on every rank), so it
    needs the guard: a run that asks for it where the guard is off is a ConfigError, not a silent no-op.
    """
    g = t.cfg.guard
    if not g.spike_factor:
        return None
    off = guard_off(t)
    if off is not None:
        raise ConfigError(
            f"guard.spike_factor reads the non-finite guard's verdict on each step, but the guard is off "
            f"here ({off}); set guard.spike_factor to 0 or run with the guard on"
        )
    spike = SpikeDetector(g.spike_factor, g.spike_steps, g.spike_history)
    if t.state.spike is not None:
        spike.load_state_dict(t.state.spike)
    return spike


APPLIED, SKIPPED, ROLLED_BACK, PENDING = "applied", "skipped", "rolled_back", "pending"


def account(
    t: Trainer,
    out: dict[str, Any],
    batch: Batch,
    pending: list[tuple[DeviceCheck, Any, Any]],
    spike: SpikeDetector | None,
) -> str:
    """The guard's reading of the step just taken: APPLIED, SKIPPED (nothing was updated), ROLLED_BACK
    (a loss spike: the state and the data cursor moved back), or PENDING (a deferred verdict, read with
    the others at the next log, eval or save step: :func:`settle`)."""
    if "verdict" in out:  # deferred: the verdicts are read at log, eval and save steps only
        pending.append((out["verdict"], batch.epoch, batch.batch))
        if not settle_due(t, t.state.step):
            return PENDING
        return settle(t, pending, spike)  # one host sync for the steps since the last one
    return judge(t, out.get("check"), batch.epoch, batch.batch, spike)


def judge(t: Trainer, check: StepCheck | None, epoch: Any, index: Any, spike: SpikeDetector | None) -> str:
    """Count a skipped step (raises NonFiniteError after too many in a row), or feed an applied step's loss
    to the spike detector, which may roll back. ``check`` None: no guard (and then no spike detector)."""
    if check is not None and not check.finite:
        skip_nonfinite(t, epoch, index)  # nothing was updated
        return SKIPPED
    t.state.nonfinite_streak = 0
    if spike is not None and observe_loss(t, spike, check.loss):  # a spike detector implies the guard
        roll_back(t, spike)
        return ROLLED_BACK
    return APPLIED


def settle_due(t: Trainer, step: int) -> bool:
    """Whether the deferred verdicts must be read after ``step``: a log, eval or save step, or the last
    (everything that reports or keeps the state needs the counters right)."""
    cfg = t.cfg
    return (
        step % cfg.train.log_every == 0
        or step >= t.total_steps
        or bool(cfg.train.eval_every and step % cfg.train.eval_every == 0)
        or bool(cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0)
    )


def settle(t: Trainer, pending: list[tuple[DeviceCheck, Any, Any]], spike: SpikeDetector | None) -> str:
    """Read the deferred verdicts of the steps since the last settle (one host sync) and do, in order,
    what the per-step guard does at each: a skipped step is counted and logged and taken back from the
    step and sample counters (its update never happened on the device), too many in a row raise
    :class:`NonFiniteError`, an applied step's loss feeds the spike detector, which may roll back.

    Returns whether the newest step was applied, skipped, or a rollback happened (the data iterator
    must then restart from the restored cursor). Compared with reading the verdict at every step: the
    run stops or rolls back up to ``train.log_every - 1`` steps later, the steps between a skip and its
    discovery ran with the learning rate of one step further on, and the queue's pointer moved past the
    skipped step's rows (which kept their older keys).
    """
    checks = read_checks([verdict for verdict, _, _ in pending])  # host sync
    where = [(epoch, batch) for _, epoch, batch in pending]
    pending.clear()
    per_step = t.cfg.train.global_batch_size
    t.state.step -= len(checks)
    t.state.samples_seen -= len(checks) * per_step
    outcome = APPLIED
    for check, (epoch, index) in zip(checks, where):
        if check.finite:
            t.state.step += 1
            t.state.samples_seen += per_step
        outcome = judge(t, check, epoch, index, spike)
        if outcome == ROLLED_BACK:
            return outcome
    return outcome


def skip_nonfinite(t: Trainer, epoch: Any, index: Any) -> None:
    """Count and log a skipped step (batch ``index`` of ``epoch``); stop the run after
    ``guard.max_nonfinite_steps`` in a row."""
    t.state.nonfinite_skipped += 1
    t.state.nonfinite_streak += 1
    where = f"epoch {epoch}, batch {index} of the epoch"
    log.warning(
        "non-finite loss or gradient at %s (after step %d): step skipped, nothing updated (%d skipped so "
        "far, %d in a row)", where, t.state.step, t.state.nonfinite_skipped, t.state.nonfinite_streak,
    )  # fmt: skip
    t.metrics.log(
        {
            "event": "nonfinite_skip",
            "step": t.state.step,
            "epoch": epoch,
            "batch": index,
            "skipped": t.state.nonfinite_skipped,
            "consecutive": t.state.nonfinite_streak,
        }
    )
    limit = t.cfg.guard.max_nonfinite_steps
    if t.state.nonfinite_streak >= limit:
        good = t.checkpointer.latest() if t.checkpointer is not None else None  # collective
        raise NonFiniteError(
            f"{limit} consecutive steps had a non-finite loss or gradient (the last at {where}, after step "
            f"{t.state.step}); stopped without saving. The last good checkpoint is "
            f"{good or 'none (no checkpoint was written)'}: resume from it with a lower optim.lr, or "
            "check the data at that position"
        )


def observe_loss(t: Trainer, spike: SpikeDetector, loss: float) -> bool:
    """Feed the step's loss to the spike detector; its state rides in the train state."""
    spiked = spike.observe(t.state.step, loss)
    t.state.spike = spike.state_dict()
    return spiked


# The train state's fields that record the run's history, not its position: a rollback keeps them.
RUN_HISTORY = ("rollbacks", "nonfinite_skipped", "nonfinite_streak")


class KeepHistory:
    """The train state as a rollback loads it: step, samples, best score and the spike detector's state
    from the checkpoint, the run's history (:data:`RUN_HISTORY`) as it is now."""

    def __init__(self, state: Any):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.load_state_dict({**saved, **{k: getattr(self.state, k) for k in RUN_HISTORY}})


def roll_back(t: Trainer, spike: SpikeDetector) -> None:
    """Back to the newest checkpoint written before the spike began, past the data up to the spike and
    ``guard.spike_skip_batches`` more (collective). The decision is kept in ``t.state.rollbacks``."""
    began, step, cursor = spike.first, t.state.step, t.stream.cursor
    per_epoch = t.stream.batches_per_epoch
    skip_to = cursor.epoch * per_epoch + cursor.batches + t.cfg.guard.spike_skip_batches
    target = None
    if t.checkpointer is not None and dist.is_main_process():
        before = [p for p in t.checkpointer.checkpoints() if step_of(p.name) < began]
        target = str(before[-1]) if before else None
    target = dist.broadcast_object(target)
    if target is None:
        log.warning("loss spike from step %d to %d, but no checkpoint before it: training on", began, step)
        spike.streak, spike.first = 0, None
        t.state.spike = spike.state_dict()
        return
    # Every state the checkpointer holds goes back, the train state's run history (RUN_HISTORY) excepted.
    states = {**t.states(), "train_state": KeepHistory(t.state)}
    t.checkpointer.load(target, t.encoder, states, t.rank_states())
    record = {"detected_at_step": step, "spike_began": began, "resumed_from": Path(target).name}
    record["skipped_to"] = list(divmod(skip_to, per_epoch))  # [epoch, batch]: the data cursor after the skip
    t.state.rollbacks = [*t.state.rollbacks, record]
    t.stream.cursor.epoch, t.stream.cursor.batches = record["skipped_to"]
    spike.load_state_dict(t.state.spike if t.state.spike else spike.state_dict())
    spike.streak, spike.first = 0, None
    t.state.spike = spike.state_dict()
    log.warning(
        "loss spike from step %d to %d (> %.1f x the running median): rolled back to %s, data skipped to "
        "epoch %d batch %d", began, step, spike.factor, record["resumed_from"], *record["skipped_to"],
    )  # fmt: skip
    t.metrics.log({"event": "spike_rollback", "step": t.state.step, **record})
