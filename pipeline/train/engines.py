"""The engines of one optimizer step over a rank's micro-batches: plain (one process or DDP), GradCache
and DeepSpeed, each returning the same :class:`StepResult`, and the non-finite guard's part in them.

Every micro-batch goes the same short way: ``rows = forward(...)``; ``out = t.loss.compute(rows, batch)``
(the terms, :class:`~pipeline.losses.terms.TrainLoss`); the engine's backward and step; and, when the step is
applied, ``t.loss.after_micro_batch(...)`` (the terms' queues). Hooks (:mod:`pipeline.train.callbacks`)
see the loss before its backward and the guard's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.data.collate import Batch
from pipeline.losses.terms import Encoded, LossOut, Rows
from pipeline.train.build import Trainer
from pipeline.train.gradcache import chunked_forward_backward
from pipeline.train.guard import DeviceCheck, StepCheck, device_verdict, grad_norm, step_verdict


def term_loss(t: Trainer, encoded: Encoded, mb: Batch) -> LossOut:
    """The loss over one micro-batch (the run's built :class:`~pipeline.losses.terms.TrainLoss` on the
    :class:`~pipeline.losses.terms.Rows` the model gave and the batch: the weighted total, each term's
    value and the counts terms report), as the hooks leave it (``Callbacks.on_loss``). ``encoded`` is what
    the model's forward returned: the rows (N, H), or (rows, MLM logits (M, V)) with an MLM head."""
    return t.callbacks.on_loss(t, mb, t.loss.compute(Rows.of(encoded, mb, t.module.head), mb))


def forward(t: Trainer, inputs: dict[str, torch.Tensor], mb: Batch) -> Any:
    """The model's forward of one micro-batch: rows (N, H), with an MLM head also the logits (M, V) at
    the M selected positions of the masked originals (``mlm_positions`` in the inputs), in the same
    forward, so DDP sees each parameter used once per step."""
    if t.module.mlm_head is None:
        return t.model(**inputs)
    return t.model(**inputs, mlm_input_ids=mb.mlm_input_ids.to(t.accelerator.device, non_blocking=True))


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
        t.callbacks.defer_verdicts
        and guarded(t)
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
    """What every engine (:class:`Engine`) returns: the same small record for each."""

    parts: list[LossOut]  # each micro-batch's loss, detached
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


@dataclass(frozen=True)
class GuardPolicy:
    """How the non-finite guard takes part in a run's steps, decided once (:func:`guard_policy`) and handed
    to the engine: whether it judges each step, and whether its verdict stays on the device."""

    judges: bool  # the guard decides each step (guard_off says why not)
    defers: bool  # its verdict stays on the device, read at the next log step (deferred)


def guard_policy(t: Trainer) -> GuardPolicy:
    return GuardPolicy(judges=guarded(t), defers=deferred(t))


def judge_and_step(t: Trainer, result: StepResult, guard: GuardPolicy) -> None:
    """After the last micro-batch's backward, with the optimizer ours (plain and GradCache steps): clip,
    let the guard judge the step (its loss and gradient norm on every rank), and step the optimizer unless
    the guard refused (on the host) or with a device flag that makes the fused kernel skip (deferred)."""
    cfg = t.cfg
    norm = None
    if cfg.optim.grad_clip:
        norm = t.accelerator.clip_grad_norm_(t.model.parameters(), cfg.optim.grad_clip)
    if guard.judges:
        norm = grad_norm(t.model.parameters()) if norm is None else norm
        step_loss = torch.stack([p.total for p in result.parts]).mean()
        if guard.defers:
            result.verdict = device_verdict(step_loss, norm)  # no sync: read at the next log step
        else:
            result.check = t.callbacks.on_verdict(t, step_verdict(step_loss, norm))  # host sync
    if result.applied:
        optimizer_step(t, None if result.verdict is None else ~result.verdict.finite)


class Engine:
    """One optimizer step over a rank's batch, ``engine.run(t, batch, guard)``: the one micro-batch loop every
    engine shares, over ``train.grad_accum_steps`` micro-batches of whole sentences
    (:meth:`~pipeline.data.collate.Batch.split`), each moved to the device with what the loss reads of it.
    Each micro-batch: :meth:`forward_backward` (rows = forward(batch); out = loss.compute(rows, batch);
    backward), then at the last :meth:`step`; when the step is applied (as far as the host knows) the loss's
    terms update their state (``t.loss.after_micro_batch``: enqueue, a collective). Each micro-batch enqueues
    before the verdict is known: with several micro-batches under the guard the terms' queues are copied first
    and put back when the step is refused."""

    def run(self, t: Trainer, batch: Batch, guard: GuardPolicy | None = None) -> StepResult:
        guard = guard_policy(t) if guard is None else guard
        acc, parts = t.accelerator, t.cfg.train.grad_accum_steps
        snapshot = t.loss.snapshot() if guard.judges and parts > 1 else []
        result: StepResult | None = None
        for mb in batch.split(parts):
            inputs, mb = mb.inputs(acc.device), mb.sentences_to(acc.device)  # what the loss reads too
            with acc.accumulate(t.model):
                part, rows, check = self.forward_backward(t, inputs, mb, guard)
                parts = [*(result.parts if result else []), part.detach()]
                result = StepResult(parts, rows, mb, check)
                if acc.sync_gradients:
                    self.step(t, result, guard)
                self.zero_grad(t)
            if result.applied:
                t.loss.after_micro_batch(rows, inputs, mb, result.apply)  # e.g. enqueue (collectives)
        if not result.applied:
            for queue, state in snapshot:
                queue.load_state_dict(state)
        return result

    def forward_backward(
        self, t: Trainer, inputs: dict[str, torch.Tensor], mb: Batch, guard: GuardPolicy
    ) -> tuple[LossOut, torch.Tensor, StepCheck | None]:
        """One micro-batch: its loss parts, its rows (N, H), and the verdict where the backward steps too."""
        encoded = forward(t, inputs, mb)
        out = term_loss(t, encoded, mb)
        t.accelerator.backward(out.total)
        return out, encoded[0] if isinstance(encoded, tuple) else encoded, None

    def step(self, t: Trainer, result: StepResult, guard: GuardPolicy) -> None:
        """After the last micro-batch's backward: clip, judge, step (:func:`judge_and_step`)."""
        judge_and_step(t, result, guard)

    def zero_grad(self, t: Trainer) -> None:
        t.optimizer.zero_grad(set_to_none=True)  # Accelerate's: a no-op while accumulating


class GradCacheEngine(Engine):
    """GradCache (``train.gradcache_chunk_size``; one micro-batch: the config refuses accumulation): the
    same loss over rows encoded chunk by chunk (pipeline/train/gradcache.py)."""

    def forward_backward(
        self, t: Trainer, inputs: dict[str, torch.Tensor], mb: Batch, guard: GuardPolicy
    ) -> tuple[LossOut, torch.Tensor, StepCheck | None]:
        part, rows = chunked_forward_backward(
            t.model, t.accelerator.backward, inputs, t.cfg.train.gradcache_chunk_size,
            lambda rows: term_loss(t, rows, mb),
        )  # fmt: skip
        return part, rows, None


class DeepSpeedEngine(Engine):
    """The DeepSpeed engine steps inside ``accelerator.backward`` (clipping, accumulation and its own
    overflow check are its own; Accelerate's optimizer step and zero_grad are no-ops around it). Under
    the guard (one micro-batch) :func:`judged_engine_step` gives the verdict."""

    def forward_backward(
        self, t: Trainer, inputs: dict[str, torch.Tensor], mb: Batch, guard: GuardPolicy
    ) -> tuple[LossOut, torch.Tensor, StepCheck | None]:
        encoded = forward(t, inputs, mb)
        out = term_loss(t, encoded, mb)
        check = None
        if guard.judges:
            check = judged_engine_step(t, out.total)
        else:
            t.accelerator.backward(out.total)  # the engine's backward, and its step at the last micro-batch
        return out, encoded[0] if isinstance(encoded, tuple) else encoded, check

    def step(self, t: Trainer, result: StepResult, guard: GuardPolicy) -> None:
        """Nothing: the engine stepped inside its backward."""

    def zero_grad(self, t: Trainer) -> None:
        """Nothing: the engine zeroes its own gradients."""


plain_backward_and_step = Engine()  # one process or DDP
gradcache_backward_and_step = GradCacheEngine()
deepspeed_backward_and_step = DeepSpeedEngine()


def backward_and_step(t: Trainer) -> Engine:
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
        check = t.callbacks.on_verdict(t, step_verdict(loss.detach(), None))  # host sync, after its own check
        return StepCheck(check.finite and bool(t.model.was_step_applied()), check.loss)
    check = t.callbacks.on_verdict(t, step_verdict(loss.detach(), None))  # host sync: every rank's loss
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
