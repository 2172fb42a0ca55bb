"""A loss term whole, in one file: what a new term takes besides one line in ``TERMS``
(pipeline/losses/__init__.py; the tests add that line with ``monkeypatch.setitem(TERMS, "uniformity",
Uniformity)``).

Uniformity (Wang and Isola 2020, "Understanding Contrastive Representation Learning through Alignment and
Uniformity on the Hypersphere", eq. 4 over the batch): how evenly the originals spread on the sphere, the
log of the mean Gaussian potential over the pairs of distinct sentences of the local batch::

    uniformity = log( 1 / (B (B - 1)) * sum_{i != j} exp(-t ||x_i - x_j||^2) )

with ||x_i - x_j||^2 = 2 - 2 x_i . x_j for L2-normalised x. Lower is more uniform; ``t`` (2 in the
paper) sets how local the potential is. It keeps a counter of the optimizer steps it was applied in as a
buffer (state of its own, in its ``state_dict``: a checkpoint holds it under ``uniformity`` and a resume
restores it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config import option
from pipeline.data.collate import Batch
from pipeline.errors import ConfigError
from pipeline.losses.terms import LossTerm, Rows, TermContext, WeightedTerm


@dataclass
class UniformityConfig:
    t: float = option(2.0, "The Gaussian potential's scale t in exp(-t ||x - y||^2).")

    def __post_init__(self) -> None:
        if self.t <= 0:
            raise ConfigError("uniformity.t must be > 0 (the paper uses 2)")


class Uniformity(LossTerm):
    """Wang and Isola's uniformity of the originals over the local batch (a toy term)"""

    name = "uniformity"
    config_class = UniformityConfig
    part = "uniformity"  # logged as uniformity_loss

    def __init__(self, weighted: WeightedTerm, context: TermContext):
        super().__init__(weighted, context)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # optimizer steps it was applied in

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        x = rows.views[0].float()  # (B, H) the originals
        b = x.shape[0]
        squared = 2 - 2 * x @ x.T  # (B, B) squared distances of unit vectors
        distinct = ~torch.eye(b, dtype=torch.bool, device=x.device)  # (B, B)
        return torch.logsumexp(-self.config.t * squared[distinct], dim=0) - math.log(b * (b - 1))

    def after_step(self, online: torch.nn.Module, apply: torch.Tensor | None) -> None:
        self.steps += 1 if apply is None else apply.to(self.steps.dtype)  # the guard's verdict, no sync

    def states(self) -> dict[str, torch.nn.Module]:
        return {"uniformity": self}

    def dump(self) -> dict[str, Any]:
        return {"uniformity_steps": int(self.steps)}
