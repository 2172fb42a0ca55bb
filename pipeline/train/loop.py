"""The training loop: :func:`train` (steps, logging, evaluation, checkpoints) and :func:`train_step`.

No host sync on a step that does not log, evaluate or save: losses stay on the device and are read
back at log steps. The non-finite guard's verdict (two numbers: is the step finite on every rank, and
its loss) stays on the device too when the optimizer can skip its own step on a device flag (fused
AdamW, ``optim.fused``) and is read at the next log step (:func:`deferred`, :func:`settle`); with a
foreach AdamW, under DeepSpeed or with several micro-batches it is read at every step (one sync;
``guard.max_nonfinite_steps: 0`` removes it). ``tests/test_host_syncs.py`` counts them.

Collectives (the loss terms' gathers, queue enqueue, the guard's
all-reduce, the all-reduce of the logged loss, the checkpoint decision) happen at the same steps on
every rank because every decision depends only on the step counter or on a value all ranks agreed on.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline import distributed as dist
from pipeline import progress
from pipeline.data.collate import Batch
from pipeline.errors import ConfigError
from pipeline.evaluate.sts import score_pairs
from pipeline.run_layout import step_of
from pipeline.train.build import Trainer
from pipeline.train.checkpoint import save_model
from pipeline.train.gradcache import chunked_forward_backward
from pipeline.train.guard import (
    DeviceCheck,
    NonFiniteError,
    SpikeDetector,
    StepCheck,
    device_verdict,
    grad_norm,
    read_checks,
    step_verdict,
)
from pipeline.train.metrics import Throughput, alignment_uniformity, checksum
from pipeline.train.signals import EXIT_CODE_PREEMPTED, CheckpointPolicy

log = logging.getLogger(__name__)


def compute_objective(
    t: Trainer, encoded: torch.Tensor | tuple[torch.Tensor, torch.Tensor], batch: Batch
) -> dict[str, torch.Tensor]:
    """The loss's weighted total ``loss`` and each term's value over one micro-batch's step output
    (:class:`~pipeline.losses.terms.TrainLoss`: the terms lend their state, a queue, themselves).

    ``encoded`` is what the model's forward returned: the rows (N, H), or (rows, MLM logits (B, L, V))
    when the model has an MLM head.
    """
    return t.loss(encoded, Batch.of(batch), t.module.head).as_dict()


def forward(t: Trainer, inputs: dict[str, torch.Tensor], mb: Batch) -> Any:
    """The model's forward of one micro-batch: rows (N, H), with an MLM head also the logits (B, L, V)
    of the masked originals (in the same forward, so DDP sees each parameter used once per step)."""
    if t.module.mlm_head is None:
        return t.model(**inputs)
    return t.model(**inputs, mlm_input_ids=mb["mlm_input_ids"].to(t.accelerator.device, non_blocking=True))


def micro_batches(batch: Batch | dict[str, Any], parts: int) -> list[Batch]:
    """A rank's batch as ``parts`` micro-batches of whole sentences (:meth:`Batch.split`)."""
    return Batch.of(batch).split(parts)


def guarded(t: Trainer) -> bool:
    """Whether the non-finite guard decides each step (pipeline/train/guard.py): see :func:`guard_off`."""
    return guard_off(t) is None


def guard_off(t: Trainer) -> str | None:
    """Why the non-finite guard does not judge this run's steps, or None when it does.

    Not under fp16, whose GradScaler skips non-finite steps itself (and must see them to lower its
    scale). Under DeepSpeed, whose engine steps inside ``backward``, the guard judges the loss before
    that backward and reads the engine's own verdict on the gradients after it (see
    :func:`judged_engine_step`); it needs one micro-batch per step without GradCache there.
    """
    cfg = t.cfg
    if not cfg.guard.max_nonfinite_steps:
        return "guard.max_nonfinite_steps is 0"
    if cfg.train.mixed_precision == "fp16":
        return "under fp16 the GradScaler skips non-finite steps itself"
    if cfg.train.deepspeed_config and (cfg.train.grad_accum_steps > 1 or cfg.train.gradcache_chunk_size):
        return "DeepSpeed steps inside its backward: with several micro-batches nothing judges it first"
    return None


def deferred(t: Trainer) -> bool:
    """Whether the guard's verdict stays on the device and is read only at log steps (no host sync on
    the steps between): under the guard, without DeepSpeed or several micro-batches, with an optimizer
    that skips its own step on a device flag (``found_inf``, as under a GradScaler: torch's fused
    AdamW, ``optim.fused``). A non-finite step then leaves weights, AdamW's moments and step count,
    the momentum encoder and the queue's rows untouched on the device; the loop learns of it at the
    next log step and takes it back from the step and sample counters there (see :func:`settle`).
    Otherwise (a foreach AdamW cannot skip on a device flag) the verdict is read at every step.
    """
    cfg = t.cfg
    inner = getattr(t.optimizer, "optimizer", t.optimizer)  # inside Accelerate's AcceleratedOptimizer
    return (
        guarded(t)
        and not cfg.train.deepspeed_config
        and cfg.train.grad_accum_steps == 1
        and bool(getattr(inner, "_step_supports_amp_scaling", False))
    )


def optimizer_step(t: Trainer, skip: torch.Tensor | None) -> None:
    """``optimizer.step()``; with ``skip`` (a () bool device tensor) the fused kernel skips on the device."""
    if skip is None:
        t.optimizer.step()
        return
    inner = getattr(t.optimizer, "optimizer", t.optimizer)
    inner.found_inf = skip.to(torch.float32)  # read by fused Adam/AdamW's step (torch.optim.adam)
    try:
        t.optimizer.step()
    finally:
        del inner.found_inf


@dataclass
class StepResult:
    """What every engine's :func:`backward_and_step` returns: the same small record for each."""

    parts: list[dict[str, torch.Tensor]]  # each micro-batch's detached loss parts (``loss`` the total)
    rows: torch.Tensor  # (N, H) the last micro-batch's encoded rows: n views, then m hard negatives
    last: Batch  # the last micro-batch
    check: StepCheck | None = None  # the guard's verdict, read on the host (None: no guard)
    verdict: DeviceCheck | None = None  # the guard's verdict left on the device (deferred)

    @property
    def applied(self) -> bool:
        """Whether the update happened, as far as the host knows (a deferred verdict is read later)."""
        return self.check is None or self.check.finite

    @property
    def apply(self) -> torch.Tensor | None:
        """The deferred verdict's () bool device flag, for updates that must follow it on the device."""
        return None if self.verdict is None else self.verdict.finite


def judge_and_step(t: Trainer, result: StepResult) -> None:
    """After the last micro-batch's backward, with the optimizer ours (plain and GradCache steps): clip,
    let the guard judge the step (its loss and gradient norm on every rank), and step the optimizer unless
    the guard refused (on the host) or with a device flag that makes the fused kernel skip (deferred)."""
    cfg = t.cfg
    norm = None
    if cfg.optim.grad_clip:
        norm = t.accelerator.clip_grad_norm_(t.model.parameters(), cfg.optim.grad_clip)
    if guarded(t):
        norm = grad_norm(t.model.parameters()) if norm is None else norm
        step_loss = torch.stack([p["loss"] for p in result.parts]).mean()
        if deferred(t):
            result.verdict = device_verdict(step_loss, norm)  # no sync: read at the next log step
        else:
            result.check = step_verdict(step_loss, norm)  # host sync
    if result.applied:
        optimizer_step(t, None if result.verdict is None else ~result.verdict.finite)


def local_backward_and_step(
    t: Trainer,
    mbs: list[Batch],
    forward_backward: Callable[[Trainer, dict[str, torch.Tensor], Batch], tuple[dict, torch.Tensor]],
) -> StepResult:
    """The micro-batches' forward and backward (gradients accumulate; DDP all-reduces at the last), then
    :func:`judge_and_step`. Each micro-batch enqueues its keys before the verdict is known: with several
    micro-batches under the guard the queues are copied first and put back when the step is refused."""
    acc = t.accelerator
    snapshot = t.loss.snapshot() if guarded(t) and len(mbs) > 1 else []
    result: StepResult | None = None
    for mb in mbs:
        inputs = mb.inputs(acc.device)
        with acc.accumulate(t.model):
            part, rows = forward_backward(t, inputs, mb)
            parts = [*(result.parts if result else []), {k: v.detach() for k, v in part.items()}]
            result = StepResult(parts, rows, mb)
            if acc.sync_gradients:
                judge_and_step(t, result)
            t.optimizer.zero_grad(set_to_none=True)
        if result.applied:
            t.loss.after_micro_batch(rows, inputs, mb, result.apply)  # e.g. enqueue (collectives)
    if not result.applied:
        for queue, state in snapshot:
            queue.load_state_dict(state)
    return result


def plain_forward_backward(
    t: Trainer, inputs: dict[str, torch.Tensor], mb: Batch
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    encoded = forward(t, inputs, mb)
    part = compute_objective(t, encoded, mb)
    t.accelerator.backward(part["loss"])
    return part, encoded[0] if isinstance(encoded, tuple) else encoded  # rows (N, H)


def gradcache_forward_backward(
    t: Trainer, inputs: dict[str, torch.Tensor], mb: Batch
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same loss over rows encoded chunk by chunk (pipeline/train/gradcache.py)."""
    return chunked_forward_backward(
        t.model, t.accelerator.backward, inputs, t.cfg.train.gradcache_chunk_size,
        lambda rows: compute_objective(t, rows, mb),
    )  # fmt: skip


def plain_backward_and_step(t: Trainer, mbs: list[Batch]) -> StepResult:
    """One process or DDP: forward and backward per micro-batch, then clip, judge and step."""
    return local_backward_and_step(t, mbs, plain_forward_backward)


def gradcache_backward_and_step(t: Trainer, mbs: list[Batch]) -> StepResult:
    """GradCache (``train.gradcache_chunk_size``; one micro-batch: the config refuses accumulation)."""
    return local_backward_and_step(t, mbs, gradcache_forward_backward)


def deepspeed_backward_and_step(t: Trainer, mbs: list[Batch]) -> StepResult:
    """The DeepSpeed engine steps inside ``accelerator.backward`` (clipping, accumulation and its own
    overflow check are its own; Accelerate's optimizer step and zero_grad are no-ops around it). Under
    the guard (one micro-batch) :func:`judged_engine_step` gives the verdict."""
    acc = t.accelerator
    result: StepResult | None = None
    for mb in mbs:
        inputs = mb.inputs(acc.device)
        with acc.accumulate(t.model):
            encoded = forward(t, inputs, mb)
            part = compute_objective(t, encoded, mb)
            check = None
            if guarded(t):
                check = judged_engine_step(t, part["loss"])
            else:
                acc.backward(part["loss"])  # the engine's backward, and its step at the last micro-batch
            rows = encoded[0] if isinstance(encoded, tuple) else encoded  # (N, H): n views, m negatives
            parts = [*(result.parts if result else []), {k: v.detach() for k, v in part.items()}]
            result = StepResult(parts, rows, mb, check)
        if result.applied:
            t.loss.after_micro_batch(rows, inputs, mb)
    return result


def backward_and_step(t: Trainer) -> Callable[[Trainer, list[Batch]], StepResult]:
    """The run's engine: DeepSpeed, GradCache or plain (one process or DDP)."""
    if t.accelerator.distributed_type.value == "DEEPSPEED":
        return deepspeed_backward_and_step
    if t.cfg.train.gradcache_chunk_size:
        return gradcache_backward_and_step
    return plain_backward_and_step


def judged_engine_step(t: Trainer, loss: torch.Tensor) -> StepCheck:
    """Backward and step of the DeepSpeed engine under the guard; the verdict on the step.

    When the engine checks the gradients itself (bf16 with ``check_grad_overflow``, fp16:
    :func:`engine_skips_overflow`) the loss is read after its backward and step, so nothing waits
    between forward and backward. Otherwise the loss is judged on every rank first (a non-finite one
    anywhere: no backward, no engine step, so nothing moves). After the backward, the engine says
    whether it applied its step: DeepSpeed skips a
    step whose gradients overflow under bf16 (``bf16.check_grad_overflow``, on by default since
    0.16; the DeepSpeed configs here set it) and fp16. Under fp32 ZeRO nothing checks the gradients of
    a finite loss (DeepSpeed has no overflow check there): such a step is applied, and the checkpoint
    check (:func:`~pipeline.train.guard.first_nonfinite`) still refuses to save its result.
    """
    if engine_skips_overflow(t.model):
        # No sync between forward and backward: a non-finite loss anywhere makes non-finite gradients on
        # every rank (they are all-reduced), which the engine refuses to apply. Read after its step.
        t.accelerator.backward(loss)
        check = step_verdict(loss.detach(), None)  # host sync, after the engine's own overflow check
        return StepCheck(check.finite and bool(t.model.was_step_applied()), check.loss)
    check = step_verdict(loss.detach(), None)  # host sync: the loss of every rank
    if not check.finite:
        return check
    t.accelerator.backward(loss)  # the engine's backward and step
    return StepCheck(bool(t.model.was_step_applied()), check.loss)


def engine_skips_overflow(engine: Any) -> bool:
    """Whether the DeepSpeed engine skips a step with non-finite gradients by itself: bf16 with
    ``bf16.check_grad_overflow`` (which the trainer sets under the guard) under ZeRO-1/2, or fp16."""
    try:
        if engine.fp16_enabled():
            return True
        return bool(
            engine.bfloat16_enabled()
            and engine.zero_optimization_stage() in (1, 2)
            and engine._config.bfloat16_config.check_grad_overflow
        )
    except AttributeError:  # not a DeepSpeed engine, or another version's layout: judge the loss first
        return False


def train_step(t: Trainer, batch: Batch) -> dict[str, Any]:
    """One optimizer step over this rank's slice of a global batch; returns detached device tensors.

    Under the guard, ``out["check"]`` is the step's :class:`~pipeline.train.guard.StepCheck`; when it
    is not finite nothing was updated (parameters, optimizer, schedule position, momentum encoder,
    queue, step and sample counters): the loop counts the skip and moves on to the next batch.
    Deferred, ``out["verdict"]`` is the verdict still on the device (:func:`deferred`).
    """
    t.schedule.apply(t.state.step)  # before backward: DeepSpeed steps inside accelerator.backward
    result = backward_and_step(t)(t, micro_batches(batch, t.cfg.train.grad_accum_steps))
    if result.applied:
        t.loss.after_step(t.module.encoder, result.apply)  # e.g. the momentum encoder follows
        t.state.step += 1  # deferred: provisional, a skip found at the next log step is taken back
        t.state.samples_seen += t.cfg.train.global_batch_size
    return step_record(t, result)


def step_record(t: Trainer, result: StepResult) -> dict[str, Any]:
    """What the loop logs of a step: the total loss (mean over micro-batches), each term's value with
    more than one term, the counts a term reports, the last micro-batch's views, and the verdict."""
    rows, mb, parts = result.rows, result.last, result.parts
    n, b = mb.num_views, rows.shape[0] // mb.rows_per_sentence
    out: dict[str, Any] = {"embeddings": rows[: n * b].detach().view(n, b, -1)}  # (n, B, H), last micro-batch
    out["loss"] = torch.stack([p["loss"] for p in parts]).mean()
    term_parts = t.loss.parts
    for key in parts[0].keys() - {"loss"}:
        values = torch.stack([p[key] for p in parts])
        if key not in term_parts:  # a count a term reports (luse's false_negatives), over micro-batches
            out[f"{key}_count"] = values.sum()
        elif len(term_parts) > 1:  # more than one term: log each (contrastive, distill, kl, mlm)
            out[f"{key}_loss"] = values.mean()
    if result.check is not None:
        out["check"] = result.check
    if result.verdict is not None:
        out["verdict"] = result.verdict
    return out


def log_step(t: Trainer, out: dict[str, torch.Tensor], throughput: Throughput, bar: Any) -> None:
    """Collective (loss all-reduce); rank 0 writes. The loop's host syncs besides the guard's verdict."""
    loss = dist.all_reduce_mean(out["loss"]).item()
    record: dict[str, Any] = {
        "step": t.state.step,
        "samples_seen": t.state.samples_seen,
        "loss": loss,  # the weighted total; with more than one term each part is logged below
        "lr": t.schedule.lr(t.state.step - 1),
        "epoch": t.stream.cursor.epoch,
    }
    for key in sorted(k for k in out if k.endswith("_loss")):  # contrastive, distill, kl, mlm
        record[key] = dist.all_reduce_mean(out[key]).item()
    for key in sorted(k for k in out if k.endswith("_count")):  # e.g. false negatives masked, all ranks
        record[key] = int(dist.all_reduce_sum(out[key]).item())
    rate = throughput.rate(t.state.samples_seen)
    record["sentences_per_s"] = rate
    record["sequences_per_s"] = rate * out["embeddings"].shape[0]
    if out["embeddings"].shape[0] >= 2:
        align, uniform = alignment_uniformity(out["embeddings"])
        record["alignment"], record["uniformity"] = align.item(), uniform.item()
    record.update(t.loss.report())  # e.g. the queue's fill fraction
    t.metrics.log(record, t.state.step)
    if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}", refresh=False)


def evaluate(t: Trainer) -> float:
    """STS-B valid Spearman x100 on rank 0, broadcast to all (collective)."""
    score = None
    if t.accelerator.is_main_process:
        score, _ = score_pairs(t.encoder.encode, t.sts_valid)
        t.metrics.log({"event": "eval", "step": t.state.step, "sts_b_valid_spearman": score}, t.state.step)
        log.info("step %d: STS-B valid Spearman %.2f", t.state.step, score)
    return float(dist.broadcast_object(score))


def save_checkpoint(t: Trainer, is_best: bool = False) -> None:
    """Checkpoint ``t.state.step`` (collective: every rank writes its part)."""
    t.checkpointer.save(
        t.state.step,
        t.encoder,
        t.states(),
        t.rank_states(),
        t.run_config,
        is_best=is_best,
        metrics={"best_metric": t.state.best_metric},
        samples_seen=t.state.samples_seen,
    )


def train(t: Trainer, on_batch: Callable[[Trainer, dict[str, Any]], None] | None = None) -> int:
    """Run until ``total_steps``; returns an exit code (0, or the preemption code after a save).

    ``on_batch(trainer, batch)`` sees each batch before its step (tests record or poison batches with it).
    """
    cfg, acc = t.cfg, t.accelerator
    t.model.train()
    show = acc.is_main_process and cfg.train.progress
    bar = progress.bar(total=t.total_steps, initial=t.state.step, desc="train", disable=not show)
    throughput = Throughput()
    c = cfg.checkpoint
    # The stop flag and the time rule are read at log steps only, where logging syncs with the host
    # anyway: a signal is acted on up to log_every - 1 steps late (SLURM's --signal lead time covers it).
    policy = CheckpointPolicy(c.every_steps, c.every_minutes, check_every=cfg.train.log_every)
    throughput.samples0 = t.state.samples_seen
    spike = start_guard(t)
    pending: list[tuple[DeviceCheck, Any, Any]] = []  # deferred verdicts not read yet, with their batch
    # Closed on every way out, an exception included: the loader workers ignore SIGTERM (preemption
    # signals are the main process's), so a worker left running would hang the interpreter's exit.
    batches = iter(t.stream)
    try:
        scored = cfg.train.eval_every or cfg.train.final_model == "best"
        if t.state.step == 0 and t.state.best_step is None and scored:
            # The initial model's score starts the eval curve and is the first best candidate: from a strong
            # init every later step may be worse, and then the initial weights are what gets exported.
            t.state.best_metric, t.state.best_step = evaluate(t), 0
            if t.checkpointer is not None:
                save_checkpoint(t, is_best=True)
                policy.saved()
        while t.state.step < t.total_steps:
            batch = next(batches)
            if on_batch is not None:
                on_batch(t, batch)
            out = train_step(t, batch)
            outcome = account(t, out, batch, pending, spike)  # skipped, rolled back, applied or pending
            bar.update(t.state.step - bar.n)
            if outcome == ROLLED_BACK:  # the rollback moved the data cursor: a new iterator starts from it
                batches.close()
                batches = iter(t.stream)
            if outcome != APPLIED:
                continue
            step = t.state.step
            if step % cfg.train.log_every == 0 or step == t.total_steps:
                log_step(t, out, throughput, bar)
            is_best = False
            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == t.total_steps:
                score = evaluate(t)
                if t.state.best_metric is None or score > t.state.best_metric:
                    t.state.best_metric, t.state.best_step, is_best = score, step, True
            saved = t.checkpointer is not None and (policy.due(step) or is_best or step == t.total_steps)
            if saved:
                save_checkpoint(t, is_best)
                policy.saved()
            check_now = step % cfg.train.log_every == 0 or step == t.total_steps
            if t.preemption is not None and check_now and t.preemption.should_stop():
                if t.checkpointer is not None and not saved:
                    save_checkpoint(t)
                log.warning("preemption requested: checkpoint saved at step %d, exiting", step)
                return EXIT_CODE_PREEMPTED
        bar.close()
        finish(t)
        return 0
    finally:
        batches.close()


# ------------------------------------------------------------------------------------------- guard
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


def finish(t: Trainer) -> None:
    """The final model in RUN_DIR/model (rank 0), and the debug dump every rank writes if asked.

    With ``train.final_model: best`` the model is the best checkpoint's (by STS-B valid, the initial
    model's step-0 score included: if no step beat it, the initial weights); the last step's weights
    stay in the newest checkpoint. An ``event: final_model`` record in metrics.jsonl says which.
    """
    if t.accelerator.is_main_process:
        target = t.cfg.run_dir / "model"
        best = t.checkpointer.best() if t.cfg.train.final_model == "best" and t.checkpointer else None
        initial = best is not None and t.state.best_step == 0
        if initial:
            log.warning(
                "no step beat the initial model (STS-B valid %.2f); exporting the initial weights",
                t.state.best_metric,
            )
        t.metrics.log(
            {
                "event": "final_model",
                "selected": "best" if best is not None else "last",
                "step": t.state.best_step if best is not None else t.state.step,
                "sts_b_valid_spearman": t.state.best_metric if best is not None else None,
                "initial_weights": initial,  # no step beat the step-0 evaluation
            }
        )
        if best is not None:
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(best / "model", tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
            log.info(
                "final model = best checkpoint %s (STS-B valid %.2f at step %s), saved to %s",
                best.name, t.state.best_metric, t.state.best_step, target,
            )  # fmt: skip
        else:
            if t.cfg.train.final_model == "best":
                log.warning(
                    "train.final_model=best but no best checkpoint exists: saving the last step's weights"
                )
            save_model(t.encoder, target)  # float32, also when DeepSpeed keeps the module in bf16/fp16
            log.info("final model saved to %s", target)
    if t.cfg.train.debug_dump:
        write_debug_dump(t)
    dist.barrier()


def write_debug_dump(t: Trainer) -> None:
    """RUN_DIR/debug/rank{r}.json: checksums the multi-process tests compare across ranks."""
    folder = t.cfg.run_dir / "debug"
    folder.mkdir(parents=True, exist_ok=True)
    params = [p for _, p in sorted(t.module.named_parameters())]
    dump = {
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "distributed_type": t.accelerator.distributed_type.value,
        "step": t.state.step,
        "samples_seen": t.state.samples_seen,
        "cursor": t.stream.state_dict(),
        "param_checksum": checksum(params),
        "param_sum": float(sum(p.detach().double().sum() for p in params)),
        "queue_checksum": None,
        "queue_fill": None,
        **t.loss.dump(),  # a queue's checksum and fill, from the term that holds it
    }
    (folder / f"rank{dist.rank()}.json").write_text(json.dumps(dump, indent=2) + "\n", encoding="utf-8")
