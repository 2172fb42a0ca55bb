"""In-batch similarity distillation, the ``kl`` term: the KL term of e.g. Hinton et al. 2015 applied to
the similarity distribution, as in "relational" distillation, from a teacher's cached embeddings.

For each local original b, the teacher and the student each give a softmax over the *other* sentences c
of the global batch (and the queue, when there is one)::

    p_t(c | b) = softmax_c(t_b . t_c / tau_t),   p_s(c | b) = softmax_c(s_b . s_c / tau_s)
    kl(b) = sum_c p_t(c | b) (log p_t(c | b) - log p_s(c | b))

averaged over local anchors. The student learns *how* the teacher ranks the batch, not only which one
sentence is the positive. tau_t sets how peaked the target is (small: only the teacher's nearest
neighbours count; e5's cosines crowd into [0.7, 1], so a small tau_t is needed to spread them); tau_s is
the student's own temperature (equal to tau_t by default, so matching similarities matches
distributions). Self-similarities are removed from both distributions. A ``distill`` term on a
matryoshka prefix takes this formula too (:func:`similarities`).

Distributed: student candidates are gathered with gradient, teacher ones without (they are constants);
each rank's value is the mean over its anchors, so the mean over ranks is the global-batch loss and DDP's
averaged gradient is the single-process one (``tests/test_distributed_gloo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_no_grad, all_gather_with_grad, rank
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import (
    QUEUE,
    TEACHER,
    VIEWS,
    Lent,
    LossTerm,
    Needs,
    Rows,
    TermContext,
    WeightedTerm,
)

if TYPE_CHECKING:
    from pipeline.data.collate import Batch


def _without_self(logits: torch.Tensor, offset: int) -> torch.Tensor:
    """Drop column ``offset + i`` from row i of (B, N) logits: (B, N - 1)."""
    b, n = logits.shape
    keep = torch.ones(b, n, dtype=torch.bool, device=logits.device)  # (B, N)
    keep[torch.arange(b, device=logits.device), offset + torch.arange(b, device=logits.device)] = False
    return logits[keep].view(b, n - 1)


def kl_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    student_temperature: float = 0.05,
    teacher_temperature: float = 0.05,
    queue: torch.Tensor | None = None,
    teacher_queue: torch.Tensor | None = None,
    gather: bool = True,
) -> torch.Tensor:
    """KL(teacher softmax || student softmax) over the other sentences of the global batch (+ queue).

    Args:
        student: (B_local, H) L2-normalised student embeddings of the originals.
        teacher: (B_local, D_t) teacher embeddings of the same sentences.
        queue, teacher_queue: (Q, H) student keys and (Q, D_t) teacher embeddings of the same queued
            sentences, row for row; both or neither. Never receive gradient.
        gather: gather the candidates of all ranks (a collective).
    """
    if student.dim() != 2 or teacher.dim() != 2 or student.shape[0] != teacher.shape[0]:
        raise ValueError(f"student (B, H) and teacher (B, D_t) expected, got {student.shape} {teacher.shape}")
    if (queue is None) != (teacher_queue is None) or (queue is not None and len(queue) != len(teacher_queue)):
        raise ValueError("queue and teacher_queue must be given together and hold the same rows")
    if student_temperature <= 0 or teacher_temperature <= 0:
        raise ValueError("temperatures must be > 0")
    batch = student.shape[0]
    s = at_least_float32(student)  # (B, H)
    t = F.normalize(teacher.to(s.dtype), dim=-1)  # (B, D_t)
    s_all = all_gather_with_grad(s) if gather else s  # (W * B, H)
    t_all = all_gather_no_grad(t) if gather else t  # (W * B, D_t)
    offset = rank() * batch if gather else 0
    s_logits = _without_self(s @ s_all.T, offset) / student_temperature  # (B, W * B - 1)
    t_logits = _without_self(t @ t_all.T, offset) / teacher_temperature  # (B, W * B - 1)
    if queue is not None and queue.shape[0] > 0:
        s_queue = s @ queue.detach().to(s.dtype).T / student_temperature  # (B, Q)
        t_queue = t @ F.normalize(teacher_queue.detach().to(s.dtype), dim=-1).T / teacher_temperature
        s_logits = torch.cat([s_logits, s_queue], dim=1)  # (B, W * B - 1 + Q)
        t_logits = torch.cat([t_logits, t_queue], dim=1)  # (B, W * B - 1 + Q)
    log_ps = F.log_softmax(s_logits, dim=1)  # (B, C)
    log_pt = F.log_softmax(t_logits, dim=1)  # (B, C)
    return (log_pt.exp() * (log_pt - log_ps)).sum(dim=1).mean()


@dataclass
class KLConfig:
    teacher_temperature: float = option(0.05, "tau_t: temperature of the teacher's softmax.")
    student_temperature: float = option(0.05, "tau_s: temperature of the student's softmax.")

    def __post_init__(self) -> None:
        if self.teacher_temperature <= 0 or self.student_temperature <= 0:
            raise ConfigError("kl.teacher_temperature and kl.student_temperature must be > 0 (try 0.05)")


def similarities(kl: KLConfig, rows: Rows, batch: Batch, lent: Lent) -> torch.Tensor:
    """KL(teacher || student) over the in-batch (+ queue) similarities of the originals (view 0): the kl
    term, and a teacher term on a matryoshka prefix, whose student is the prefix of the rows and whose
    teacher the full one (pipeline/losses/matryoshka.py says why). The queue's keys are cut as the rows
    are; the queue pair is used when the run keeps one (luse's keys, kl's teacher rows)."""
    queued = lent.queue is not None and lent.teacher_queue is not None
    return kl_loss(
        rows.views[0],  # (B, H) or (B, dim) the originals
        batch.teacher,  # (B, D_t) the full teacher
        kl.student_temperature,
        kl.teacher_temperature,
        queue=rows.cut(lent.queue.negatives()) if queued else None,  # (filled, H)
        teacher_queue=lent.teacher_queue.negatives() if queued else None,  # (filled, D_t)
        gather=rows.gather,
    )


class KL(LossTerm):
    """KL(teacher || student) over in-batch (+ queue) similarities

    Its state in training, when the run has a negative queue, is the teacher embeddings of the queued
    sentences, row for row with the queue's keys (enqueued with them, gathered from all
    ranks; lent to the run: its formula and luse's teacher_margin rule read them there, beside the queue's
    keys luse lends). A checkpoint holds its rows as ``teacher_queue``."""

    name = "kl"
    config_class = KLConfig
    part = "kl"

    @classmethod
    def reads(cls, config: KLConfig) -> frozenset[str]:
        return frozenset({VIEWS, TEACHER, QUEUE})

    @classmethod
    def needs(cls, config: KLConfig) -> Needs:
        return Needs(teacher_queue=True)  # the queued sentences' teacher rows, with a queue

    def __init__(self, weighted: WeightedTerm, context: TermContext):
        from pipeline.losses.queue import NegativeQueue

        super().__init__(weighted, context)
        size = context.needs.queue_size  # the run's negative queue (luse's), mirrored row for row
        self.teacher_queue = NegativeQueue(size, context.teacher_dim or context.dim) if size else None
        self.lent.teacher_queue = self.teacher_queue

    def after_micro_batch(self, rows: torch.Tensor, inputs: dict[str, torch.Tensor], batch: Any,
                          apply: torch.Tensor | None) -> None:  # fmt: skip
        if self.teacher_queue is not None:  # (B, D_t) -> (W * B, D_t) in the queue (a collective)
            self.teacher_queue.enqueue_gathered(batch.teacher.to(rows.device), apply=apply)

    def states(self) -> dict[str, torch.nn.Module]:
        return {"teacher_queue": self.teacher_queue} if self.teacher_queue is not None else {}

    def per_micro_batch(self) -> list[torch.nn.Module]:
        return [self.teacher_queue] if self.teacher_queue is not None else []

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        return similarities(self.config, rows, batch, self.lent)  # the same formula on a prefix
