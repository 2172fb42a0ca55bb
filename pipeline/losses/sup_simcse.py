"""Supervised SimCSE with hard negatives (Gao, Yao and Chen 2021, eq. 5).

Training triples from NLI data: a premise h_i, its entailment h_i^+ and its contradiction h_i^-.
For anchor i::

    loss_i = -log( exp(sim(h_i, h_i^+)/tau) / sum_j [exp(sim(h_i, h_j^+)/tau) + exp(sim(h_i, h_j^-)/tau)] )

with j over every positive and every hard negative of the global batch (gathered from all ranks with
gradient). sim is cosine similarity (inputs are L2-normalised); tau (0.05) divides it before the
softmax. The loss is the mean over local anchors, so DDP's averaged gradient equals the
single-process gradient over the concatenated batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_with_grad, rank
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import PAIRS, LossTerm, Rows

if TYPE_CHECKING:
    from pipeline.data.collate import Batch


def compute_loss(
    anchor: torch.Tensor,
    positive: torch.Tensor,
    negative: torch.Tensor,
    temperature: float = 0.05,
    gather: bool = True,
) -> torch.Tensor:
    """SimCSE eq. 5 over (B_local, H) L2-normalised anchor/positive/hard-negative embeddings."""
    if not (anchor.shape == positive.shape == negative.shape) or anchor.dim() != 2:
        raise ValueError(
            "anchor, positive and negative must all be (B, H); got "
            f"{tuple(anchor.shape)}, {tuple(positive.shape)}, {tuple(negative.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch = anchor.shape[0]
    pairs = at_least_float32(torch.cat([positive, negative], dim=1))  # (B, 2H): one gather for both
    if gather:
        pairs = all_gather_with_grad(pairs)  # (W * B, 2H)
    positives, negatives = pairs.chunk(2, dim=1)  # (W * B, H) each
    candidates = torch.cat([positives, negatives], dim=0)  # (2 * W * B, H)
    logits = at_least_float32(anchor) @ candidates.T / temperature  # (B, 2 * W * B)
    target = (rank() * batch if gather else 0) + torch.arange(batch, device=anchor.device)  # (B,)
    return F.cross_entropy(logits, target)


@dataclass
class SupSimCSEConfig:
    temperature: float = option(0.05, "tau: logits = cos / tau.")

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError("sup_simcse.temperature must be > 0 (try 0.05)")


class SupSimCSE(LossTerm):
    """supervised SimCSE with hard negatives (triples file)"""

    name = "sup_simcse"
    config_class = SupSimCSEConfig
    data = "triples"

    @classmethod
    def reads(cls, config: Any) -> frozenset[str]:
        return frozenset({PAIRS})

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        return 3  # anchor, positive, negative

    @classmethod
    def describe(cls, fields: dict[str, Any]) -> dict[str, Any]:
        return {"cite": ["simcse"]}  # the model card cites its paper

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        anchor, positive, negative = rows.views  # (3, B, H)
        return compute_loss(anchor, positive, negative, self.config.temperature, gather=rows.gather)
