"""Auxiliary masked-language-model loss (Devlin et al. 2019, "BERT", section 3.1), added to a contrastive
objective as in SimCSE (Gao, Yao and Chen 2021, appendix: "MLM auxiliary objective").

Contrastive training looks only at pooled sentence vectors and tends to erode token-level knowledge;
a weighted masked-token loss on the batch's original sentences keeps the backbone predicting tokens:

    loss: [{luse: {...}}, {mlm: {probability: 0.15}, weight: lambda}]   # total = luse + lambda * mlm

Masking is data preparation (:mod:`pipeline.data.masking`, BERT's recipe): each non-special,
non-padding token is selected with probability ``mask_prob`` (0.15); of the selected, 80% become
``[MASK]``, 10% a random ordinary token, 10% stay unchanged. Labels are the original ids at selected
positions and -100 elsewhere.

Masks are drawn in the data-loader workers (:class:`pipeline.data.collate.MLMCollator`) from a
generator seeded by the run seed and the ids of the batch's sentences, so they are a pure function of
the data position: no host sync in the step, and an exact resume redraws exactly the same masks.

:class:`pipeline.model.heads.MLMHead` is BERT's prediction head (dense -> GELU -> LayerNorm ->
decoder). The decoder's weight is *tied* to the backbone's word embeddings (as in BERT): it adds only
H*H + 3H + V parameters and the masked-token gradient reaches the input embeddings directly. The head
is trained and checkpointed but never exported with the encoder.

The head runs on the selected positions only: the step hands the model their flat indices
(``mlm_positions``, found on the host from the labels) and the model gathers those M token states before
the head, so the decoder's (M, H) x (H, V) replaces (B * L, H) x (H, V) at ~15 % of the positions (most
of a row's tokens are never selected, and padding never is). The loss and its gradients are those of the
head at every position (``tests/test_mlm.py`` checks both in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.data.masking import IGNORE_INDEX
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import MLM_LOGITS, LossTerm, Needs, Rows

if TYPE_CHECKING:
    from pipeline.data.collate import Batch


def compute_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over positions whose label is not -100, labels (B, L); logits at every position
    (B, L, V), or at the selected positions alone (M, V), row-major (the head on masked positions only:
    :meth:`pipeline.model.heads.TrainModule.forward` with ``mlm_positions``). Both give the same loss.

    A batch with no selected token gives 0 (not NaN): the sum is divided by max(count, 1), the count
    counted on the device (B, L, V) or the host int M (M, V), never read back to the host.
    """
    if logits.dim() == 2:  # (M, V): the labels of the M selected positions, in the same row-major order
        flat = labels.reshape(-1)  # (B * L,)
        # nonzero_static: the size (M, from the logits' shape) is known, so no device-to-host read
        picked = torch.nonzero_static(flat != IGNORE_INDEX, size=logits.shape[0]).squeeze(1)  # (M,)
        target = flat.index_select(0, picked)  # (M,)
        total = F.cross_entropy(at_least_float32(logits), target, reduction="sum")
        return total / max(logits.shape[0], 1)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    flat = at_least_float32(logits).reshape(-1, logits.shape[-1])  # (B * L, V)
    target = labels.reshape(-1)  # (B * L,)
    total = F.cross_entropy(flat, target, ignore_index=IGNORE_INDEX, reduction="sum")
    count = (target != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


@dataclass
class MLMConfig:
    probability: float = option(
        0.15, "Share of a sentence's tokens selected for the MLM loss (BERT: 0.15; split 80/10/10)."
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.probability < 1.0:
            raise ConfigError("mlm.probability must be in (0, 1) (BERT uses 0.15)")


class MLM(LossTerm):
    """auxiliary masked-token loss on the originals (an MLM head tied to the word embeddings)"""

    name = "mlm"
    config_class = MLMConfig
    part = "mlm"
    prefix_refusal = "it has no embedding"

    @classmethod
    def reads(cls, config: MLMConfig) -> frozenset[str]:
        return frozenset({MLM_LOGITS})

    @classmethod
    def needs(cls, config: MLMConfig) -> Needs:
        return Needs(mlm_probability=config.probability)  # an MLM head; masks drawn in the loader

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        if rows.mlm_logits is None or batch.mlm_labels is None:
            raise ValueError("the mlm term needs the step's MLM logits and labels (batches from MLMCollator)")
        return compute_loss(rows.mlm_logits, batch.mlm_labels)  # logits (M, V) or (B, L, V), labels (B, L)
