"""Heads and losses of the fine-tuning evaluation.

Similarity, the seed's recipe (DunZhang/LUSE eval/: ``SimVecModel`` + ``BCELoss``): the two sentences
are encoded separately, their cosine is mapped into (0, 1) as p = (1 + cos) / 2 and read as the
probability that the pair is a paraphrase; the loss is the binary cross-entropy of p against the label
(a graded score is first scaled to [0, 1], a soft target). No temperature or scale: cos = 0 means
p = 0.5. CoSENT (Su 2022) is the second option, for graded scores: only the order of the cosines
matters, log(1 + sum over pairs (i, j) with y_i > y_j of exp(lambda (cos_j - cos_i))), lambda = 20.

FreezeBERT's trained part, as in the seed: for classification Linear(H, H) -> ReLU -> Linear(H, C);
for similarity Linear(H, H) -> ReLU -> Linear(H, H) applied to both sentences before the cosine.
TrainBERT (all weights trained) has a linear classifier and no similarity head (the seed's
``use_fc=False``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

COSENT_SCALE = 20.0


def bce_cosine_loss(cos: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """BCE of p = (1 + cos) / 2 against ``target`` in [0, 1]; cos, target: (B,)."""
    prob = ((1.0 + cos) / 2.0).clamp(1e-7, 1.0 - 1e-7)  # (B,)
    return F.binary_cross_entropy(prob, target)


def cosent_loss(cos: torch.Tensor, score: torch.Tensor, scale: float = COSENT_SCALE) -> torch.Tensor:
    """CoSENT over a batch of pairs; cos, score: (B,). Pairs with equal scores add nothing."""
    diff = scale * (cos[None, :] - cos[:, None])  # (B, B): entry (i, j) = s (cos_j - cos_i)
    ordered = score[:, None] > score[None, :]  # (B, B): y_i > y_j
    terms = diff[ordered]  # (P,)
    zero = torch.zeros(1, dtype=cos.dtype, device=cos.device)
    return torch.logsumexp(torch.cat([zero, terms]), dim=0)  # log(1 + sum exp)


def similarity_loss(head: str, cos: torch.Tensor, label: torch.Tensor, label_max: float) -> torch.Tensor:
    if head == "bce":
        return bce_cosine_loss(cos, (label / label_max).clamp(0.0, 1.0))
    if head == "cosent":
        return cosent_loss(cos, label)
    raise ValueError(f"unknown similarity head {head!r}")


def freeze_mlp(dim: int, out: int) -> nn.Module:
    """The small trained network over frozen embeddings (FreezeBERT)."""
    return nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, out))
