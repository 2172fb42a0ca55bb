"""LUSE's pairwise binary cross-entropy loss (DunZhang/LUSE, code/Train.py, ``loss_type="bce"``, the
default of its later training code).

The views of a batch are the same as the listwise loss's (:mod:`pipeline.losses.multi_positive`):
every sentence arrives as n L2-normalised views (the original, cached EDA variants, dropout views). Every
pair of views (a, c) is scored independently: its cosine mapped into (0, 1) is the probability that a and
c are views of the same sentence, and the loss is the binary cross entropy against that label::

    p(a, c) = (1 + cos(a, c)) / 2,        y(a, c) = 1 if a and c are views of one sentence, else 0
    loss = -mean_{a, c} [ y log p + (1 - y) log(1 - p) ]

over all pairs, each view paired with itself included. LUSE replaces the self-similarity (always 1, a
probability of exactly 1) by 0.99999 before the mapping: the diagonal adds the constant -log(0.999995)
to each row and no gradient. There is no temperature: LUSE's ``score_scale`` (15) multiplies the
similarities of its listwise ``mpmn`` loss only, never the BCE's; and no queue (LUSE's is a stub).

Unlike the softmax losses, each pair is its own two-class problem: the loss does not compare a positive
with the negatives of the same anchor, and with unit vectors every negative pair with cos > -1 costs
something, so it pushes unrelated sentences towards opposite directions rather than merely apart.

Distributed: anchors are this rank's n * B views, candidates the (n * W * B) views of the global batch
(gathered with gradient); the loss is the mean over this rank's rows of the full (n * B, W * n * B)
matrix, so with equal local batch sizes the mean over ranks is the global-batch loss and DDP's averaged
gradient is the single-process one (``tests/test_distributed_gloo.py``).

False negatives (:mod:`pipeline.losses.false_negatives`, the term's ``false_negatives`` field): a pair
whose candidate shares the anchor's sentence id (another occurrence of the same sentence in the global
batch; this loss has no queue), optionally its text hash, or that the teacher scores as close as a
positive, is not a negative: it weighs 0 in the mean, whose denominator stays the number of pairs (so the
per-rank losses still average to the global loss); a view of the anchor's own sentence keeps label 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_no_grad, all_gather_with_grad, rank
from pipeline.losses._precision import at_least_float32
from pipeline.losses.false_negatives import FalseNegativeConfig, Guide, make_guide, sentence_mask
from pipeline.losses.terms import TEACHER, VIEWS, LossTerm, Rows

if TYPE_CHECKING:
    from pipeline.data.collate import Batch

SELF_SIMILARITY = 0.99999  # LUSE's value on the diagonal (a probability of exactly 1 would be log(0))


def compute_loss(
    embeddings: torch.Tensor,
    gather: bool = True,
    guide: Guide | None = None,
    counts: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """LUSE's pairwise BCE over (n_views, B_local, H) L2-normalised embeddings; a scalar.

    With ``guide`` the pairs of false negatives weigh 0 (a collective gathers its tags), and ``counts``
    gets ``false_negatives``, the number of pairs dropped.
    """
    if embeddings.dim() != 3:
        raise ValueError(f"embeddings must be (n_views, B, H), got {tuple(embeddings.shape)}")
    n_views, batch, dim = embeddings.shape
    device = embeddings.device
    anchors = at_least_float32(embeddings.reshape(n_views * batch, dim))  # (n * B, H), row v * B + b
    candidates = all_gather_with_grad(anchors) if gather else anchors  # (W * n * B, H), rank-major
    offset = rank() * n_views * batch if gather else 0  # where this rank's rows start among candidates

    scores = anchors @ candidates.T  # (n * B, W * n * B) cosines
    local = torch.arange(n_views * batch, device=device)  # (n * B,)
    is_self = torch.zeros_like(scores, dtype=torch.bool)  # (n * B, W * n * B)
    is_self[local, offset + local] = True
    scores = scores.masked_fill(is_self, SELF_SIMILARITY)  # no gradient through a view and itself
    probability = (1 + scores) / 2  # (n * B, W * n * B) in (0, 1)

    # label 1 where the candidate is a view of the anchor's sentence: same rank, same sentence index b
    column = torch.arange(candidates.shape[0], device=device)  # (W * n * B,)
    same_rank = (column >= offset) & (column < offset + n_views * batch)  # (W * n * B,)
    same_sentence = (local % batch)[:, None] == ((column - offset) % batch)[None, :]  # (n * B, W * n * B)
    positive = same_sentence & same_rank[None, :]  # (n * B, W * n * B), the anchor itself included
    labels = positive.to(probability.dtype)  # (n * B, W * n * B)
    if guide is None:
        return F.binary_cross_entropy(probability, labels)
    world = candidates.shape[0] // (n_views * batch)
    per_view = [  # each candidate view's sentence's tags and teacher vector, rank-major (collectives)
        None if x is None else (all_gather_no_grad(x) if gather else x.detach()).reshape(world, 1, batch, -1)
        for x in (guide.tags, guide.teacher)
    ]
    tags, teacher = [
        None if x is None else x.expand(-1, n_views, -1, -1).reshape(world * n_views * batch, -1)
        for x in per_view
    ]
    fn = sentence_mask(guide, local % batch, tags, teacher)  # (n * B, W * n * B) or None
    fn = torch.zeros_like(positive) if fn is None else fn & ~positive
    if counts is not None:
        counts["false_negatives"] = fn.sum().float()
    # A weight of exactly 1 where nothing is dropped: the loss and gradients are the unweighted ones.
    return F.binary_cross_entropy(probability, labels, weight=(~fn).to(probability.dtype))


@dataclass
class PairwiseBCEConfig:
    """LUSE's BCE has no temperature, scale or queue; only the false-negative rules."""

    false_negatives: FalseNegativeConfig = option(
        factory=FalseNegativeConfig,
        help="Pairs never used as negatives: {same_id, same_text, teacher_margin} (docs/objectives.md).",
    )


class PairwiseBCE(LossTerm):
    """LUSE's pairwise BCE of (1 + cos) / 2 over all pairs of views (same sentence = 1) (shards)"""

    name = "luse_bce"
    config_class = PairwiseBCEConfig
    data = "shards"
    uses_variants = True

    @classmethod
    def reads(cls, config: PairwiseBCEConfig) -> frozenset[str]:
        teacher = config.false_negatives.teacher_margin is not None
        return frozenset({VIEWS} | ({TEACHER} if teacher else set()))

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        return 1 + num_variants + num_dropout_views  # original, EDA variants, dropout views (as luse)

    @classmethod
    def describe(cls, fields: dict[str, Any]) -> dict[str, Any]:
        return {"cite": ["luse"]}  # the model card cites its paper

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        guide = make_guide(self.config.false_negatives, batch.ids, batch.text_hashes, teacher=batch.teacher)
        return compute_loss(rows.views, gather=rows.gather, guide=guide, counts=rows.counts)  # (n, B, H)
