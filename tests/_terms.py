"""The run's loss on hand-made tensors: the rows and the batch a step would give its terms, and the queue
rows a state-holding term would lend (what the loss tests feed the terms)."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.data.collate import Batch
from pipeline.losses.queue import NegativeQueue
from pipeline.losses.terms import Loss, Rows, TermContext, TrainLoss


def _queue(keys: torch.Tensor, ids: torch.Tensor | None = None, hashes: torch.Tensor | None = None):
    """A negative queue holding exactly ``keys`` (Q, D), in their dtype, with their ids and text hashes."""
    queue = NegativeQueue(keys.shape[0], keys.shape[1], dtype=keys.dtype)
    queue.enqueue(keys, ids, hashes)
    return queue


def evaluate(
    loss: Loss,
    views: torch.Tensor,
    hard_negatives: torch.Tensor | None = None,
    queue: torch.Tensor | None = None,
    teacher_queue: torch.Tensor | None = None,
    queue_ids: torch.Tensor | None = None,
    queue_text_hashes: torch.Tensor | None = None,
    head: torch.nn.Module | None = None,
    gather: bool = True,
    **columns: Any,
) -> dict[str, torch.Tensor]:
    """``loss`` built (:class:`TrainLoss`) and evaluated on views (n, B, H) and hard negatives (m, B, H)
    laid out as the model gives rows, a batch with ``columns`` (teacher, labels, ids, text_hashes, groups,
    ...), and, as the run's lent queue, exactly the rows ``queue`` (with ``teacher_queue``; None: no
    queue, as a loss evaluated outside a run). ``{"loss": total, **parts, **counts}``."""
    n, b, h = views.shape
    m = 0 if hard_negatives is None else hard_negatives.shape[0]
    batch = Batch(
        input_ids=torch.zeros((n + m) * b, 1, dtype=torch.long),
        attention_mask=torch.ones((n + m) * b, 1, dtype=torch.long),
        num_views=n,
        num_hard_negatives=m,
        **columns,
    )
    teacher = columns.get("teacher")
    built = TrainLoss(
        loss, TermContext(torch.nn.Identity(), h, 0 if teacher is None else teacher.shape[1], loss.needs)
    )
    lent = next(iter(built.terms.values())).lent
    lent.queue = None if queue is None else _queue(queue, queue_ids, queue_text_hashes)
    lent.teacher_queue = None if teacher_queue is None else _queue(teacher_queue)
    out = built.compute(Rows(views, hard_negatives, head=head, gather=gather), batch)
    return {"loss": out.total, **out.parts, **out.counts}
