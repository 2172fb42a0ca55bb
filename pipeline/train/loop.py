"""The training loop: :func:`train` (steps, logging, evaluation, checkpoints) and :func:`train_step`.

No host sync in the hot loop: losses stay on the device and are read back only at log steps.
Collectives (loss gather in the objective, queue enqueue, the all-reduce of the logged loss, the
checkpoint decision) happen at the same steps on every rank because every decision depends only on
the step counter or on a value broadcast from rank 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from typing import Any

import torch
from tqdm.auto import tqdm

from pipeline import distributed as dist
from pipeline.config import to_dict
from pipeline.evaluate.sts import score_pairs
from pipeline.losses.mlm import compute_loss as mlm_loss
from pipeline.train.build import Trainer
from pipeline.train.gradcache import chunked_forward_backward
from pipeline.train.metrics import Throughput, alignment_uniformity
from pipeline.train.signals import EXIT_CODE_PREEMPTED, CheckpointPolicy

log = logging.getLogger(__name__)


def compute_objective(t: Trainer, emb: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """The configured loss over embeddings (n_views, B, H) of one micro-batch."""
    o, name = t.cfg.objective, t.cfg.objective.name
    if name == "luse":
        negatives = t.queue.negatives() if t.queue is not None else None  # (filled, H)
        return t.objective.compute_loss(emb, o.temperature, queue=negatives)
    if name == "simcse":
        return t.objective.compute_loss(emb, o.temperature)
    if name == "sup_simcse":
        return t.objective.compute_loss(emb[0], emb[1], emb[2], o.temperature)
    if name == "cosent":
        return t.objective.compute_loss(emb[0], emb[1], batch["labels"], o.cosent_scale)
    return t.objective.compute_loss(emb[0], emb[1], batch["labels"], t.module.head)


def micro_batches(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split a rank's batch (view-major rows) into ``parts`` micro-batches of whole sentences."""
    if parts == 1:
        return [batch]
    n = batch["num_views"]
    b = batch["input_ids"].shape[0] // n
    size = b // parts
    out = []
    for p in range(parts):
        rows = torch.cat([torch.arange(v * b + p * size, v * b + (p + 1) * size) for v in range(n)])
        mb = {
            "num_views": n,
            "input_ids": batch["input_ids"][rows],
            "attention_mask": batch["attention_mask"][rows],
        }
        for key in ("labels", "mlm_input_ids", "mlm_labels"):  # one row (or label) per sentence
            if key in batch:
                mb[key] = batch[key][p * size : (p + 1) * size]
        out.append(mb)
    return out


def enqueue_keys(t: Trainer, emb: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
    """Keys of this micro-batch's originals into the queue (gathered from all ranks: a collective)."""
    if t.queue is None:
        return
    if t.momentum_encoder is not None:
        b = emb.shape[1]
        keys = t.momentum_encoder.encode(
            input_ids=inputs["input_ids"][:b], attention_mask=inputs["attention_mask"][:b]
        )
    else:
        keys = emb[0].detach()  # momentum 0: a memory bank of the online view-0 embeddings
    t.queue.enqueue_gathered(keys)  # (B, H) per rank -> (W * B, H) on every rank


def train_step(t: Trainer, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's slice of a global batch; returns detached device tensors."""
    acc, cfg = t.accelerator, t.cfg
    t.schedule.apply(t.state.step)  # before backward: DeepSpeed steps inside accelerator.backward
    losses, parts = [], []
    for mb in micro_batches(batch, cfg.train.grad_accum_steps):
        inputs = {k: mb[k].to(acc.device, non_blocking=True) for k in ("input_ids", "attention_mask")}
        labels = mb["labels"].to(acc.device) if "labels" in mb else None
        with acc.accumulate(t.model):
            if cfg.train.gradcache_chunk_size:
                loss, emb = chunked_forward_backward(t, inputs, mb["num_views"], {"labels": labels})
            elif t.module.mlm_head is not None:
                loss, emb, part = mlm_forward_backward(t, inputs, mb)
                parts.append(part)
            else:
                emb = t.model(**inputs).view(mb["num_views"], -1, t.encoder.dim)  # (n, B, H)
                loss = compute_objective(t, emb, {"labels": labels})
                acc.backward(loss)
            if acc.sync_gradients and cfg.optim.grad_clip and acc.distributed_type.value != "DEEPSPEED":
                acc.clip_grad_norm_(t.model.parameters(), cfg.optim.grad_clip)
            t.optimizer.step()
            t.optimizer.zero_grad(set_to_none=True)
        enqueue_keys(t, emb, inputs)
        losses.append(loss.detach())
    if t.momentum_encoder is not None:
        t.momentum_encoder.update(t.module.encoder, cfg.objective.momentum)
    t.state.step += 1
    t.state.samples_seen += cfg.train.global_batch_size
    out = {"loss": torch.stack(losses).mean(), "embeddings": emb.detach()}
    if parts:
        out["contrastive_loss"], out["mlm_loss"] = torch.stack(parts).mean(0)
    return out


def mlm_forward_backward(
    t: Trainer, inputs: dict[str, torch.Tensor], mb: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """contrastive + lambda * MLM on one micro-batch (luse/simcse); one backward of the sum.

    Returns the total loss, the (n, B, H) embeddings and the detached (contrastive, mlm) pair.
    """
    device = t.accelerator.device
    emb, logits = t.model(**inputs, mlm_input_ids=mb["mlm_input_ids"].to(device, non_blocking=True))
    emb = emb.view(mb["num_views"], -1, t.encoder.dim)  # (n, B, H)
    contrastive = compute_objective(t, emb, {"labels": None})
    mlm = mlm_loss(logits, mb["mlm_labels"].to(device, non_blocking=True))  # logits (B, L, V)
    loss = contrastive + t.cfg.objective.mlm_weight * mlm
    t.accelerator.backward(loss)
    return loss, emb, torch.stack([contrastive.detach(), mlm.detach()])


def log_step(t: Trainer, out: dict[str, torch.Tensor], throughput: Throughput, bar: Any) -> None:
    """Collective (loss all-reduce); rank 0 writes. The only host syncs of the loop are here."""
    loss = dist.all_reduce_mean(out["loss"]).item()
    record: dict[str, Any] = {
        "step": t.state.step,
        "samples_seen": t.state.samples_seen,
        "loss": loss,  # with objective.mlm_weight: contrastive + lambda * mlm, both parts logged below
        "lr": t.schedule.lr(t.state.step - 1),
        "epoch": t.stream.cursor.epoch,
    }
    for key in ("contrastive_loss", "mlm_loss"):
        if key in out:
            record[key] = dist.all_reduce_mean(out[key]).item()
    rate = throughput.rate(t.state.samples_seen)
    record["sentences_per_s"] = rate
    record["sequences_per_s"] = rate * out["embeddings"].shape[0]
    if out["embeddings"].shape[0] >= 2:
        align, uniform = alignment_uniformity(out["embeddings"])
        record["alignment"], record["uniformity"] = align.item(), uniform.item()
    if t.queue is not None:
        record["queue_fill"] = t.queue.fill_fraction
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
        to_dict(t.cfg),
        is_best=is_best,
        metrics={"best_metric": t.state.best_metric},
        samples_seen=t.state.samples_seen,
    )


def train(t: Trainer) -> int:
    """Run until ``total_steps``; returns an exit code (0, or the preemption code after a save)."""
    cfg, acc = t.cfg, t.accelerator
    t.model.train()
    bar = tqdm(total=t.total_steps, initial=t.state.step, desc="train", disable=not acc.is_main_process)
    throughput = Throughput()
    c = cfg.checkpoint
    # The stop flag and the time rule are read at log steps only, where logging syncs with the host
    # anyway: a signal is acted on up to log_every - 1 steps late (SLURM's --signal lead time covers it).
    policy = CheckpointPolicy(c.every_steps, c.every_minutes, check_every=cfg.train.log_every)
    throughput.samples0 = t.state.samples_seen
    batches = iter(t.stream)
    if t.state.step == 0 and cfg.train.eval_every:
        evaluate(t)  # the untrained model's score: where the eval curve starts (not a best candidate)
    while t.state.step < t.total_steps:
        out = train_step(t, next(batches))
        bar.update(1)
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
        check = step % cfg.train.log_every == 0 or step == t.total_steps
        if t.preemption is not None and check and t.preemption.should_stop():
            if t.checkpointer is not None and not saved:
                save_checkpoint(t)
            log.warning("preemption requested: checkpoint saved at step %d, exiting", step)
            return EXIT_CODE_PREEMPTED
    bar.close()
    finish(t)
    return 0


def finish(t: Trainer) -> None:
    """The final model in RUN_DIR/model (rank 0), and the debug dump every rank writes if asked.

    With ``train.final_model: best`` the model is the best checkpoint's (by STS-B valid); the last
    step's weights stay in the newest checkpoint.
    """
    if t.accelerator.is_main_process:
        target = t.cfg.run_dir / "model"
        best = t.checkpointer.best() if t.cfg.train.final_model == "best" and t.checkpointer else None
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
            t.encoder.save_pretrained(target)
            log.info("final model saved to %s", target)
    if t.cfg.train.debug_dump:
        write_debug_dump(t)
    dist.barrier()


def _checksum(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for x in tensors:
        h.update(x.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


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
        "param_checksum": _checksum(params),
        "param_sum": float(sum(p.detach().double().sum() for p in params)),
        "queue_checksum": _checksum([t.queue.keys]) if t.queue is not None else None,
        "queue_fill": t.queue.fill if t.queue is not None else None,
    }
    (folder / f"rank{dist.rank()}.json").write_text(json.dumps(dump, indent=2) + "\n", encoding="utf-8")
