"""Embedding distillation from a teacher encoder's cached embeddings (Reimers and Gurevych 2020, "Making
Monolingual Sentence Embeddings Multilingual using Knowledge Distillation"): a 12-layer
multilingual-e5-small teacher, a 3-6-layer student; any teacher whose vectors the teacher stage cached.

The ``distill`` term reads the originals (view 0) and the batch's teacher embeddings, so ``loss:
[{distill: {}}]`` is distillation alone. It pulls each student embedding s_b towards the teacher's t_b,
both L2-normalised (the student first mapped to the teacher's width by a learned linear projection when
the widths differ, :func:`pipeline.model.heads.projection_head`)::

    cosine:  1 - cos(s_b, t_b)           mse:  ||s_b - t_b||^2 / D

averaged over the local sentences. On a batch of pair shards (views anchor, positive; the teacher stage's
``teacher`` and ``teacher_positive``) both sides are distilled, each to its own teacher vector: the mean
of the anchors' and the positives' values (docs/pairs.md, "Training on pairs"). On a matryoshka prefix it
becomes in-batch similarity distillation (:mod:`pipeline.losses.kl`; pipeline/losses/matryoshka.py says
why).

Distributed: no gather; each rank's value is the mean over its sentences, so with equal local batches the
mean over ranks is the global-batch loss and DDP's averaged gradient is the single-process one
(``tests/test_distributed_gloo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.losses._precision import at_least_float32
from pipeline.losses.kl import KLConfig, similarities
from pipeline.losses.terms import TEACHER, VIEWS, LossTerm, Rows

if TYPE_CHECKING:
    from pipeline.data.collate import Batch

DISTILL_LOSSES = ("cosine", "mse")


def embedding_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str = "cosine") -> torch.Tensor:
    """1 - cos (``cosine``) or the MSE of the normalised vectors (``mse``) of (B, D) student and teacher
    embeddings of the same width; the mean over the B sentences."""
    if student.shape != teacher.shape or student.dim() != 2:
        raise ValueError(
            f"student and teacher must both be (B, D); got {tuple(student.shape)}, {tuple(teacher.shape)} "
            "(the trainer projects the student to the teacher width the shards' manifest records; a caller "
            "outside it must project first)"
        )
    s = F.normalize(at_least_float32(student), dim=-1)  # (B, D)
    t = F.normalize(teacher.to(s.dtype), dim=-1)  # (B, D)
    if kind == "cosine":
        return (1 - (s * t).sum(-1)).mean()
    if kind == "mse":
        return F.mse_loss(s, t)
    raise ValueError(f"distill loss must be one of {DISTILL_LOSSES}, got {kind!r}")


@dataclass
class DistillConfig:
    loss: Literal["cosine", "mse"] = option("cosine", "cosine (1 - cos) or mse (of the unit vectors).")


def _distill_loss(c: DistillConfig, rows: Rows, batch: Batch) -> torch.Tensor:
    views = rows.views  # (n, B, H)
    if batch.teacher_positive is not None:  # a batch of pair shards: both sides, each to its own teacher
        sides = (_student(rows, views[0]), _student(rows, views[1]))  # (B, D_t) each
        anchor = embedding_loss(sides[0], batch.teacher, c.loss)
        return (anchor + embedding_loss(sides[1], batch.teacher_positive, c.loss)) / 2
    return embedding_loss(_student(rows, views[0]), batch.teacher, c.loss)  # the originals


def _student(rows: Rows, student: torch.Tensor) -> torch.Tensor:
    """(B, H) student rows, projected to the teacher's width (the manifest's) when there is a head."""
    if rows.head is not None:
        student = F.normalize(rows.head(student.to(rows.head.weight.dtype)), dim=-1)  # (B, D_t)
    return student


class Distill(LossTerm):
    """embedding distillation to the shards' teacher embeddings (cosine or mse)"""

    name = "distill"
    config_class = DistillConfig
    part = "distill"

    @classmethod
    def reads(cls, config: DistillConfig) -> frozenset[str]:
        return frozenset({VIEWS, TEACHER})

    @classmethod
    def projects(cls, config: DistillConfig) -> bool:
        return True

    @classmethod
    def describe(cls, fields: dict[str, Any]) -> dict[str, Any]:
        return {"cite": ["distill"]}  # the model card cites its paper

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        """Its formula on full-width rows; on a matryoshka prefix in-batch similarity distillation at
        matryoshka's temperature (with the run's queue pair, lent, when it keeps one)."""
        if rows.prefix is not None:
            tau = rows.prefix.temperature
            return similarities(KLConfig(tau, tau), rows, batch, self.lent)
        return _distill_loss(self.config, rows, batch)
