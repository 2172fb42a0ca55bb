"""CoSENT (Su Jianlin, 2022): a ranking loss on cosine similarities for scored sentence pairs.

For pairs (u_i, v_i) with labels y_i (graded, e.g. STS scores 0..5, or 0/1) and cos_i = cos(u_i, v_i)::

    loss = log(1 + sum_{(i, j): y_i > y_j} exp(scale * (cos_j - cos_i)))

Every pair with a higher label should have a higher cosine than every pair with a lower label; only
the order of labels matters, not their values. ``scale`` (lambda = 20, i.e. a temperature of 0.05)
sharpens the soft maximum over violated orderings.

The loss is a single log-sum-exp over all pairs of the batch, not a mean over anchors. With
``gather=True`` the cosines and labels of all ranks are gathered (with gradient) and every rank
computes the same global-batch loss; after DDP averages gradients the update equals the
single-process one over the concatenated batch. With ``gather=False`` each rank ranks its own pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_no_grad, all_gather_with_grad
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import LABELS, PAIRS, LossTerm, Rows

if TYPE_CHECKING:
    from pipeline.data.collate import Batch


def compute_loss(
    u: torch.Tensor,
    v: torch.Tensor,
    labels: torch.Tensor,
    scale: float = 20.0,
    gather: bool = True,
) -> torch.Tensor:
    """CoSENT over (B_local, H) embeddings of pair sides ``u``/``v`` and their (B_local,) labels."""
    if u.shape != v.shape or u.dim() != 2 or labels.shape != u.shape[:1]:
        raise ValueError(
            f"u, v must be (B, H) and labels (B,); got {tuple(u.shape)}, {tuple(v.shape)}, "
            f"{tuple(labels.shape)}"
        )
    u, v = at_least_float32(u), at_least_float32(v)
    cos = (F.normalize(u, dim=-1) * F.normalize(v, dim=-1)).sum(-1)  # (B,)
    labels = labels.to(cos.device)
    if gather:
        cos = all_gather_with_grad(cos)  # (W * B,)
        labels = all_gather_no_grad(labels)  # (W * B,)
    # diff[i, j] = scale * (cos_j - cos_i), counted only where label_i > label_j.
    diff = scale * (cos[None, :] - cos[:, None])  # (N, N)
    ordered = labels[:, None] > labels[None, :]  # (N, N)
    diff = diff.masked_fill(~ordered, float("-inf"))  # (N, N)
    zero = torch.zeros(1, dtype=diff.dtype, device=diff.device)  # (1,): the "1 +" inside the log
    return torch.logsumexp(torch.cat([zero, diff.flatten()]), dim=0)


@dataclass
class CosentConfig:
    scale: float = option(20.0, "lambda, the scale of cosine differences (20 = a temperature of 0.05).")


class CoSENT(LossTerm):
    """CoSENT ranking of scored pairs (pairs file)"""

    name = "cosent"
    config_class = CosentConfig
    data = "pairs"
    label_dtype = torch.float32

    @classmethod
    def reads(cls, config: Any) -> frozenset[str]:
        return frozenset({PAIRS, LABELS})

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        return 2  # the two sides u, v

    @classmethod
    def describe(cls, fields: dict[str, Any]) -> dict[str, Any]:
        return {"cite": ["cosent"]}  # the model card cites its paper

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        u, v = rows.views  # (2, B, H); labels (B,) float scores
        return compute_loss(u, v, batch.labels, self.config.scale, gather=rows.gather)
