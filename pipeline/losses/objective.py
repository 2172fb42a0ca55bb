"""The one face every training objective shows the trainer (as sentence-transformers' losses all take
``forward(features, labels)``).

An :class:`Objective` says what data it reads, how many views a sentence has, whether it keeps a queue
or a head, and computes its loss in one call::

    parts = objective.loss(embeddings, LossInputs(config, labels=..., queue=..., teacher=...))
    parts["loss"].backward()  # the weighted total; the other keys are the detached-able parts

The trainer and GradCache call only this; no code outside ``pipeline/losses`` knows an objective by
name. The formulas stay in one file per loss (``compute_loss(...)``); each file ends with its
``OBJECTIVE``, and ``pipeline.losses.OBJECTIVES`` is the registry (the only list of names).

Distillation (:mod:`pipeline.losses.distill`) lives here, not in the individual losses: any objective
over the unsupervised shards gets the embedding and in-batch-similarity terms from the batch's teacher
embeddings, weighted against its own contrastive loss::

    loss = contrastive_weight * contrastive + distill_weight * distill + kl_weight * kl
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import InputError
from pipeline.losses import distill
from pipeline.model.heads import projection_head

# The losses sit below pipeline/train in the import graph, so the config type is named, not imported:
# ``ObjectiveConfig`` below is pipeline.train.config.ObjectiveConfig (any object with its fields).
ObjectiveConfig = Any


@dataclass
class LossInputs:
    """Everything besides the embeddings that a loss may read, for one (micro-)batch of this rank."""

    config: ObjectiveConfig
    labels: torch.Tensor | None = None  # (B,) scores or class ids (the pair objectives)
    head: nn.Module | None = None  # the objective's trainable head (sbert classifier, distill projection)
    queue: torch.Tensor | None = None  # (Q, H) student keys of earlier steps, identical on every rank
    teacher: torch.Tensor | None = None  # (B, D_t) teacher embeddings of the view-0 sentences
    teacher_queue: torch.Tensor | None = None  # (Q, D_t) teacher embeddings of the queued sentences
    hard_negatives: torch.Tensor | None = None  # (m, B, H): negative j of sentence b at [j, b]
    gather: bool = True  # gather candidates across ranks (a collective)


@dataclass(frozen=True)
class Objective:
    """One training objective: its data, its views, its head and its loss."""

    name: str
    summary: str  # one line for --help
    input: str  # what ``compute_loss`` consumes: views, two_views, triples, scored_pairs, labeled_pairs
    data: str  # "shards" (unsupervised, views per sentence), "pairs" or "triples" (a supervised file)
    compute_loss: Callable[..., torch.Tensor]  # the formula, in its own file
    contrastive: Callable[[torch.Tensor, LossInputs], torch.Tensor]  # (n, B, H) + inputs -> scalar
    uses_variants: bool = False  # views = original + cached EDA variants + dropout views (else 2 dropout)
    uses_queue: bool = False  # takes queue negatives (objective.queue_size)
    uses_teacher_positive: bool = False  # can add the teacher embedding as one more positive
    uses_hard_negatives: bool = False  # takes mined hard negatives (m, B, H) as extra candidates
    num_texts: int = 2  # texts per record of a supervised file (the views of a pair objective)
    label_dtype: torch.dtype | None = None  # labels of a supervised file (None: no label column)
    make_head: Callable[[int, ObjectiveConfig], nn.Module] | None = None  # the objective's own head

    @property
    def unsupervised(self) -> bool:
        return self.data == "shards"

    def num_views(self, num_variants: int, num_dropout_views: int) -> int:
        """Views per sentence n: 1 + k + d with variants, 2 dropout views otherwise, else its texts."""
        if self.uses_variants:
            return 1 + num_variants + num_dropout_views
        return 2 if self.unsupervised else self.num_texts

    def build_head(self, config: ObjectiveConfig, dim: int) -> nn.Module | None:
        """The trainable head: the objective's own, or the student->teacher projection of distillation
        when the teacher's width differs (trained and checkpointed, never exported)."""
        if self.make_head is not None:
            return self.make_head(dim, config)
        needs_projection = config.distill_weight > 0 or config.teacher_positive
        if needs_projection and config.teacher_dim and config.teacher_dim != dim:
            return projection_head(dim, config.teacher_dim)
        return None

    def loss(self, embeddings: torch.Tensor, x: LossInputs) -> dict[str, torch.Tensor]:
        """The weighted total ``loss`` and each active part, over (n_views, B, H) embeddings."""
        o = x.config
        needs_teacher = o.distill_weight > 0 or o.kl_weight > 0 or o.teacher_positive
        if needs_teacher and x.teacher is None:
            raise InputError(
                "objective: distillation is on but the batch has no teacher embeddings; add a `teacher` "
                "column to the shards (the teacher stage) or set distill_weight/kl_weight to 0 and "
                "teacher_positive to false"
            )
        if x.hard_negatives is not None and not self.uses_hard_negatives:
            raise InputError(f"objective.name: {self.name} does not use hard negatives; use luse")
        parts: dict[str, torch.Tensor] = {}
        if o.contrastive_weight:
            parts["contrastive"] = self.contrastive(embeddings, x)
        if o.distill_weight:
            student = embeddings[0]  # (B, H) the originals
            if x.head is not None:
                student = F.normalize(x.head(student.to(x.head.weight.dtype)), dim=-1)  # (B, D_t)
            parts["distill"] = distill.embedding_loss(student, x.teacher, o.distill_loss)
        if o.kl_weight:
            parts["kl"] = distill.kl_loss(
                embeddings[0],
                x.teacher,
                o.kl_student_temperature,
                o.kl_teacher_temperature,
                queue=x.queue,
                teacher_queue=x.teacher_queue,
                gather=x.gather,
            )
        weights = {"contrastive": o.contrastive_weight, "distill": o.distill_weight, "kl": o.kl_weight}
        total: Any = sum(weights[k] * v for k, v in parts.items())
        return {"loss": total, **parts}
