"""Unsupervised SimCSE (Gao, Yao and Chen 2021, "SimCSE: Simple Contrastive Learning of Sentence
Embeddings", eq. 1).

The same sentences are encoded twice with different dropout masks, giving h_i (view 0) and h_i^+
(view 1). For anchor i of view 0::

    loss_i = -log( exp(sim(h_i, h_i^+) / tau) / sum_j exp(sim(h_i, h_j^+) / tau) )

with j over the *other view* of the (global) batch only, and the loss is the mean over anchors. This
is one-directional, as in the paper and in the official code (anchors are the first view, candidates
the second; same-view sentences are never negatives). ``sim`` is the cosine similarity; the inputs
are L2-normalised (SentenceEncoder's output), so it is a dot product.

Relation to :mod:`pipeline.losses.multi_positive` with n_views = 2: *not* identical. The
multi-positive loss makes both views anchors and also uses the other sentences' same-view embeddings
as negatives (the SimCLR / NT-Xent form), so its denominator has 2 * W * B - 1 terms per anchor
against W * B here.

Temperature tau divides the cosine similarities (0.05 in the paper); smaller is sharper.

Distributed: anchors are local, candidates are gathered from all ranks with gradient, so the mean of
the per-rank losses is the global-batch loss and DDP's averaged gradient is the single-process one.
(The official code instead computes the full global loss on every rank with only the local slice
attached to the graph, which scales the gradient by 1/world_size.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_with_grad, rank
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import LossTerm, Rows

if TYPE_CHECKING:
    from pipeline.data.collate import Batch


def compute_loss(embeddings: torch.Tensor, temperature: float = 0.05, gather: bool = True) -> torch.Tensor:
    """SimCSE's eq. 1 over (2, B_local, H) L2-normalised embeddings; the mean over local anchors."""
    if embeddings.dim() != 3 or embeddings.shape[0] != 2:
        raise ValueError(f"embeddings must be (2, B, H), got {tuple(embeddings.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch = embeddings.shape[1]
    anchors = at_least_float32(embeddings[0])  # (B, H)
    positives = at_least_float32(embeddings[1])  # (B, H)
    candidates = all_gather_with_grad(positives) if gather else positives  # (W * B, H)
    offset = rank() * batch if gather else 0
    logits = anchors @ candidates.T / temperature  # (B, W * B)
    target = offset + torch.arange(batch, device=embeddings.device)  # (B,)
    return F.cross_entropy(logits, target)


@dataclass
class SimCSEConfig:
    temperature: float = option(0.05, "tau: logits = cos / tau.")

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError("simcse.temperature must be > 0 (try 0.05)")


class SimCSE(LossTerm):
    """unsupervised SimCSE, 2 dropout views (shards)"""

    name = "simcse"
    config_class = SimCSEConfig
    data = "shards"

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        return 2  # two dropout encodings of the original

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        return compute_loss(rows.views, self.config.temperature, gather=rows.gather)  # views (2, B, H)
