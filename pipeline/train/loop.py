"""The training loop: :func:`train` (steps, logging, evaluation, checkpoints) and :func:`train_step`.

A step: the run's engine (pipeline/train/engines.py, chosen once) runs each micro-batch as ``rows =
forward(batch)``, ``out = t.loss.compute(rows, batch)`` (the terms, pipeline/losses/terms.py), backward, and
the optimizer step; then the terms update their state (queues, momentum encoder). What the guard makes of the
step is pipeline/train/accounting.py's, checkpoints pipeline/train/checkpointing.py's, hooks
pipeline/train/callbacks.py's.

No host sync on a step that does not log, evaluate or save: losses stay on the device and are read
back at log steps. The non-finite guard's verdict (two numbers: is the step finite on every rank, and
its loss) stays on the device too when the optimizer can skip its own step on a device flag (fused
AdamW, ``optim.fused``) and is read at the next log step (``engines.deferred``, ``accounting.settle``); with a
foreach AdamW, under DeepSpeed or with several micro-batches it is read at every step (one sync;
``guard.max_nonfinite_steps: 0`` removes it). ``tests/test_host_syncs.py`` counts them.

Collectives (the loss terms' gathers, queue enqueue, the guard's
all-reduce, the all-reduce of the logged loss, the checkpoint decision) happen at the same steps on
every rank because every decision depends only on the step counter or on a value all ranks agreed on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pipeline import distributed as dist
from pipeline import progress
from pipeline.data.collate import Batch
from pipeline.train.accounting import APPLIED, ROLLED_BACK, account, start_guard
from pipeline.train.build import Trainer
from pipeline.train.callbacks import Callbacks, as_callbacks
from pipeline.train.checkpointing import RunCheckpoints, finish
from pipeline.train.engines import Engine, StepResult, backward_and_step, guard_policy
from pipeline.train.evaluation import evaluate
from pipeline.train.guard import DeviceCheck
from pipeline.train.metrics import Throughput, alignment_uniformity
from pipeline.train.signals import EXIT_CODE_PREEMPTED, Cadence

__all__ = ["train", "train_step"]

log = logging.getLogger(__name__)


def train_step(t: Trainer, batch: Batch) -> dict[str, Any]:
    """One optimizer step over this rank's slice of a global batch; returns detached device tensors.

    Under the guard, ``out["check"]`` is the step's :class:`~pipeline.train.guard.StepCheck`; when it
    is not finite nothing was updated (parameters, optimizer, schedule position, momentum encoder,
    queue, step and sample counters): the loop counts the skip and moves on to the next batch.
    Deferred, ``out["verdict"]`` is the verdict still on the device (``engines.deferred``).
    """
    t.schedule.apply(t.state.step)  # before backward: DeepSpeed steps inside accelerator.backward
    engine: Engine = t.engine or backward_and_step(t)  # chosen once by train(); a bare call chooses here
    result = engine.run(t, batch, t.guard)  # over train.grad_accum_steps micro-batches
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
    out["loss"] = torch.stack([p.total for p in parts]).mean()
    if len(parts[0].parts) > 1:  # more than one term: log each (contrastive, distill, kl, mlm)
        for key in parts[0].parts:
            out[f"{key}_loss"] = torch.stack([p.parts[key] for p in parts]).mean()
    for key in parts[0].counts:  # a count a term reports (luse's false_negatives), over micro-batches
        out[f"{key}_count"] = torch.stack([p.counts[key] for p in parts]).sum()
    if result.check is not None:
        out["check"] = result.check
    if result.verdict is not None:
        out["verdict"] = result.verdict
    return out


def log_step(t: Trainer, out: dict[str, torch.Tensor], throughput: Throughput, bar: Any) -> None:
    """Collective (one all-reduce of every logged value); rank 0 writes. The values reach the host in one
    transfer: the loop's host syncs besides the guard's verdict."""
    means = ["loss", *sorted(k for k in out if k.endswith("_loss"))]  # the total; each part with >1 term
    sums = sorted(k for k in out if k.endswith("_count"))  # e.g. false negatives masked, over all ranks
    scalars = [out[k].detach().double().reshape(1) for k in means + sums]
    reduced = dist.all_reduce_sum(torch.cat(scalars))  # (len(means) + len(sums),) float64
    reduced[: len(means)] /= dist.world_size()
    local = []  # this rank's values, not reduced
    if out["embeddings"].shape[0] >= 2:
        local = [x.double().reshape(1) for x in alignment_uniformity(out["embeddings"])]
    values = torch.cat([reduced, *local]).tolist()  # the one device-to-host transfer
    record: dict[str, Any] = {
        "step": t.state.step,
        "samples_seen": t.state.samples_seen,
        "loss": values[0],  # the weighted total; with more than one term each part is logged below
        "lr": t.schedule.lr(t.state.step - 1),
        "epoch": t.stream.cursor.epoch,
    }
    record.update(zip(means[1:], values[1 : len(means)], strict=True))
    record.update((k, int(v)) for k, v in zip(sums, values[len(means) : len(means) + len(sums)], strict=True))
    loss = values[0]
    rate = throughput.rate(t.state.samples_seen)
    record["sentences_per_s"] = rate
    record["sequences_per_s"] = rate * out["embeddings"].shape[0]
    if local:
        record["alignment"], record["uniformity"] = values[-2:]
    record.update(t.loss.report())  # e.g. the queue's fill fraction
    t.metrics.log(record, t.state.step)
    if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}", refresh=False)


def train(t: Trainer, callbacks: Callbacks | Callable[[Trainer, Any], None] | None = None) -> int:
    """Run until ``total_steps``; returns an exit code (0, or the preemption code after a save).

    ``callbacks`` (:class:`~pipeline.train.callbacks.Callbacks`, or a function: ``on_batch(trainer, batch)``)
    see each batch before its step, each loss, each verdict and each score (tests record or poison
    batches with them).
    """
    cfg, acc = t.cfg, t.accelerator
    t.callbacks = as_callbacks(callbacks)
    t.engine, t.guard = backward_and_step(t), guard_policy(t)  # the engine and the guard's part, once
    t.model.train()
    show = acc.is_main_process and cfg.train.progress
    bar = progress.bar(total=t.total_steps, initial=t.state.step, desc="train", disable=not show)
    throughput = Throughput()
    checkpoints = RunCheckpoints(t)
    # STS-B valid by steps and/or by wall time; like the checkpoints' clock, read at log steps only
    evaluations = Cadence(cfg.train.eval_every, cfg.train.eval_every_minutes, check_every=cfg.train.log_every)
    throughput.samples0 = t.state.samples_seen
    spike = start_guard(t)
    pending: list[tuple[DeviceCheck, Any, Any]] = []  # deferred verdicts not read yet, with their batch
    # Closed on every way out, an exception included, so the loader workers stop with the loop, not at
    # interpreter exit (where the stream closes whatever iterator is still open: pipeline/data/stream.py).
    batches = iter(t.stream)
    try:
        scored = cfg.train.eval_every or cfg.train.eval_every_minutes or cfg.train.final_model == "best"
        if t.state.step == 0 and t.state.best_step is None and scored:
            # The initial model's score starts the eval curve and is the first best candidate: from a strong
            # init every later step may be worse, and then the initial weights are what gets exported.
            t.state.best_metric, t.state.best_step = evaluate(t), 0
            if checkpoints.enabled:
                checkpoints.save(is_best=True)
        while t.state.step < t.total_steps:
            batch = next(batches)
            t.callbacks.on_batch(t, batch)
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
            if evaluations.due(step) or step == t.total_steps:
                score = evaluate(t)
                if t.state.best_metric is None or score > t.state.best_metric:
                    t.state.best_metric, t.state.best_step, is_best = score, step, True
            saved = checkpoints.due(step, is_best)
            if saved:
                checkpoints.save(is_best)
            check_now = step % cfg.train.log_every == 0 or step == t.total_steps
            if t.preemption is not None and check_now and t.preemption.should_stop():
                if checkpoints.enabled and not saved:
                    checkpoints.save()
                log.warning("preemption requested: checkpoint saved at step %d, exiting", step)
                return EXIT_CODE_PREEMPTED
        bar.close()
        finish(t)
        return 0
    finally:
        batches.close()
