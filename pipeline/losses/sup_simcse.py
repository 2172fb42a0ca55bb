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

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_with_grad, rank
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import PAIRS, Term


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


TERM = Term(
    name="sup_simcse",
    summary="supervised SimCSE with hard negatives (triples file)",
    config=SupSimCSEConfig,
    # views (3, B, H): anchor, positive, negative
    loss=lambda c, rows, batch, lent: compute_loss(*rows.views, c.temperature, gather=rows.gather),
    reads=lambda c: frozenset({PAIRS}),
    part="contrastive",
    data="triples",
    num_views=lambda k, d: 3,
    describe=lambda fields: {"cite": ["simcse"]},  # the model card cites its paper
)
