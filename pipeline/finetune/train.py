"""One cell of the fine-tuning evaluation: a (task, regime, seed, lr) run, trained for a fixed budget,
then scored once on dev (to choose the lr) and once on test.

``train`` (TrainBERT): the encoder's weights are reset to the loaded model's before every cell, then
all of them are trained with the head. ``freeze`` (FreezeBERT): the encoder is never run here; the
cell gets its pooled outputs, computed once per task (:func:`encode_pooled`), and trains a small MLP.

Both regimes use the encoder's own pooling rule, before L2 normalisation (the seed's heads also sit on
the unnormalised pooled vector); similarity then takes the cosine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.finetune.heads import freeze_mlp, similarity_loss
from pipeline.finetune.tasks import Split, Task
from pipeline.model.encoder import SentenceEncoder, pool

Tick = Callable[[int, int], None]  # (step, total_steps): progress reporting


@dataclass(frozen=True)
class Budget:
    epochs: int
    batch_size: int
    lr: float
    seed: int
    head_lr: float = 1e-3  # TrainBERT: the new classifier starts from random, so it gets its own lr
    warmup: float = 0.1  # share of the steps with a linear warmup, then linear decay to 0
    weight_decay: float = 0.01
    sim_head: str = "bce"


def lr_factor(step: int, total: int, warmup: float) -> float:
    """Linear warmup over ``warmup * total`` steps, then linear decay to 0 at ``total``."""
    warm = max(1, math.ceil(warmup * total))
    if step < warm:
        return (step + 1) / warm
    return max(0.0, (total - step) / max(1, total - warm))


def pooled(encoder: SentenceEncoder, texts: Sequence[str]) -> torch.Tensor:
    """The encoder's pooled sentence vectors, not normalised: (B, H)."""
    batch = encoder.tokenize(list(texts))
    device = next(encoder.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    need_all = encoder.pooling == "first_last_avg"
    out = encoder.backbone(**batch, output_hidden_states=need_all, return_dict=True)
    states = out.hidden_states if need_all else (out.last_hidden_state,)
    return pool(states, batch["attention_mask"], encoder.pooling)  # (B, H)


@torch.no_grad()
def encode_pooled(
    encoder: SentenceEncoder, texts: Sequence[str], batch_size: int = 64, tick: Tick | None = None
) -> np.ndarray:
    """Pooled vectors of ``texts`` in eval mode, float32 (N, H); sorted by length to pad little."""
    was_training = encoder.training
    encoder.eval()
    order = np.argsort([-len(t) for t in texts], kind="stable")
    out = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    total = math.ceil(len(texts) / batch_size)
    for n, start in enumerate(range(0, len(texts), batch_size)):
        idx = order[start : start + batch_size]
        out[idx] = pooled(encoder, [texts[i] for i in idx]).float().cpu().numpy()
        if tick:
            tick(n + 1, total)
    encoder.train(was_training)
    return out


def split_scores(task: Task, split: Split, outputs: Any) -> dict[str, float]:
    """Classification: accuracy and macro F1 (x100) from logits; similarity: Spearman x100 of cosines."""
    from sklearn.metrics import accuracy_score, f1_score

    from pipeline.evaluate.sts import spearman100

    if task.kind == "classification":
        predicted = np.asarray(outputs).argmax(axis=1)
        gold = split.labels.astype(int)
        return {
            "accuracy": float(accuracy_score(gold, predicted) * 100),
            "macro_f1": float(f1_score(gold, predicted, average="macro") * 100),
        }
    return {"spearman": spearman100(np.asarray(outputs, dtype=np.float64), split.labels)}


def primary_metric(task: Task) -> str:
    return "accuracy" if task.kind == "classification" else "spearman"


def _batches(n: int, batch_size: int, generator: torch.Generator) -> list[np.ndarray]:
    order = torch.randperm(n, generator=generator).numpy()
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def _label_max(task: Task) -> float:
    return float(max(1.0, task.splits["train"].labels.max()))


def _optimizer(groups: list[dict[str, Any]], budget: Budget) -> torch.optim.Optimizer:
    for g in groups:
        g["initial_lr"] = g["lr"]
    return torch.optim.AdamW(groups, weight_decay=budget.weight_decay)


def _set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = g["initial_lr"] * factor


def run_train_cell(
    encoder: SentenceEncoder,
    initial_state: dict[str, torch.Tensor],
    task: Task,
    budget: Budget,
    tick: Tick | None = None,
) -> dict[str, Any]:
    """TrainBERT: every weight trained. ``initial_state`` is the loaded encoder's state (reset first)."""
    start = (time.perf_counter(), time.process_time())
    encoder.load_state_dict(initial_state)
    torch.manual_seed(budget.seed)
    generator = torch.Generator().manual_seed(budget.seed)
    head = nn.Linear(encoder.dim, task.num_classes) if task.kind == "classification" else None
    groups = [{"params": [p for p in encoder.parameters() if p.requires_grad], "lr": budget.lr}]
    if head is not None:
        groups.append({"params": list(head.parameters()), "lr": budget.head_lr})
    optimizer = _optimizer(groups, budget)
    train, label_max = task.splits["train"], _label_max(task)
    steps_per_epoch = math.ceil(len(train) / budget.batch_size)
    total, step, epoch_losses = budget.epochs * steps_per_epoch, 0, []
    encoder.train()
    for _ in range(budget.epochs):
        loss_sum = torch.zeros(())
        for idx in _batches(len(train), budget.batch_size, generator):
            _set_lr(optimizer, lr_factor(step, total, budget.warmup))
            labels = torch.as_tensor(train.labels[idx])
            if head is not None:
                logits = head(pooled(encoder, [train.texts_a[i] for i in idx]))  # (B, C)
                loss = F.cross_entropy(logits, labels.long())
            else:
                texts = [train.texts_a[i] for i in idx] + [train.texts_b[i] for i in idx]
                vectors = F.normalize(pooled(encoder, texts), dim=-1)  # (2B, H)
                a, b = vectors[: len(idx)], vectors[len(idx) :]
                loss = similarity_loss(budget.sim_head, (a * b).sum(-1), labels.float(), label_max)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
            optimizer.step()
            loss_sum += loss.detach()
            step += 1
            if tick:
                tick(step, total)
        epoch_losses.append(float(loss_sum) / steps_per_epoch)  # one host sync per epoch
    encoder.eval()
    scores = {}
    with torch.no_grad():
        for name in ("dev", "test"):
            split = task.splits[name]
            if head is not None:
                outputs = head(torch.from_numpy(encode_pooled(encoder, split.texts_a))).numpy()
            else:
                a = F.normalize(torch.from_numpy(encode_pooled(encoder, split.texts_a)), dim=-1)
                b = F.normalize(torch.from_numpy(encode_pooled(encoder, split.texts_b)), dim=-1)
                outputs = (a * b).sum(-1).numpy()
            scores[name] = split_scores(task, split, outputs)
    return _record(scores, epoch_losses, total, len(train), start)


def run_freeze_cell(
    features: np.ndarray, row: dict[str, int], task: Task, budget: Budget, tick: Tick | None = None
) -> dict[str, Any]:
    """FreezeBERT: an MLP over the cached pooled vectors ``features`` (one row per unique text)."""
    start = (time.perf_counter(), time.process_time())
    torch.manual_seed(budget.seed)
    generator = torch.Generator().manual_seed(budget.seed)
    x = torch.from_numpy(features)  # (U, H)
    dim = x.shape[1]
    out = task.num_classes if task.kind == "classification" else dim
    mlp = freeze_mlp(dim, out)
    optimizer = _optimizer([{"params": list(mlp.parameters()), "lr": budget.lr}], budget)

    def rows(texts: list[str]) -> torch.Tensor:
        return torch.as_tensor([row[t] for t in texts])

    def forward(split: Split, idx: np.ndarray | slice) -> torch.Tensor:
        a = rows([split.texts_a[i] for i in np.arange(len(split))[idx]])
        if task.kind == "classification":
            return mlp(x[a])  # (B, C) logits
        b = rows([split.texts_b[i] for i in np.arange(len(split))[idx]])
        return F.cosine_similarity(mlp(x[a]), mlp(x[b]), dim=-1)  # (B,)

    train, label_max = task.splits["train"], _label_max(task)
    steps_per_epoch = math.ceil(len(train) / budget.batch_size)
    total, step, epoch_losses = budget.epochs * steps_per_epoch, 0, []
    for _ in range(budget.epochs):
        loss_sum = torch.zeros(())
        for idx in _batches(len(train), budget.batch_size, generator):
            _set_lr(optimizer, lr_factor(step, total, budget.warmup))
            labels = torch.as_tensor(train.labels[idx])
            output = forward(train, idx)
            if task.kind == "classification":
                loss = F.cross_entropy(output, labels.long())
            else:
                loss = similarity_loss(budget.sim_head, output, labels.float(), label_max)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            step += 1
            if tick:
                tick(step, total)
        epoch_losses.append(float(loss_sum) / steps_per_epoch)
    with torch.no_grad():
        scores = {
            name: split_scores(task, task.splits[name], forward(task.splits[name], slice(None)).numpy())
            for name in ("dev", "test")
        }
    return _record(scores, epoch_losses, total, len(train), start)


def _record(
    scores: dict[str, dict[str, float]],
    losses: list[float],
    steps: int,
    examples: int,
    start: tuple[float, float],
) -> dict[str, Any]:
    """``start``: (wall, CPU) clocks at the cell's start; CPU time counts all threads (steadier than
    wall time on a shared machine)."""
    return {
        "dev": scores["dev"],
        "test": scores["test"],
        "epoch_losses": losses,
        "steps": steps,
        "train_examples": examples,
        "seconds": round(time.perf_counter() - start[0], 2),
        "cpu_seconds": round(time.process_time() - start[1], 2),
    }
