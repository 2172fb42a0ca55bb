"""The Sentence-BERT classification objective (Reimers and Gurevych 2019, section 3).

A linear classifier reads the concatenation (u, v, |u - v|) of the two sentence embeddings and is
trained with cross entropy on class labels (NLI: contradiction / entailment / neutral)::

    o = softmax(W_t [u; v; |u - v|]),   W_t in R^{k x 3H}

The head (:class:`pipeline.model.heads.SoftmaxHead`) is trainable state: the trainer must give its
parameters to the optimizer and keep its ``state_dict`` in the checkpoint, but it is *not* part of the
exported encoder (the sentence-transformers export holds only the encoder).

Labels are class indices 0..k-1 (a float tensor of whole numbers, as the pair reader returns, is
converted with ``.long()``). The loss is a per-pair mean, so no gathering is needed: with equal local
batch sizes the mean of per-rank losses is the global-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import LABELS, PAIRS, LossTerm, Rows
from pipeline.model.heads import SoftmaxHead

if TYPE_CHECKING:
    from pipeline.data.collate import Batch


def compute_loss(u: torch.Tensor, v: torch.Tensor, labels: torch.Tensor, head: SoftmaxHead) -> torch.Tensor:
    """Cross entropy of ``head(u, v)`` against class-index ``labels`` (B,); mean over the local batch."""
    if u.shape != v.shape or u.dim() != 2 or labels.shape != u.shape[:1]:
        raise ValueError(
            f"u, v must be (B, H) and labels (B,); got {tuple(u.shape)}, {tuple(v.shape)}, "
            f"{tuple(labels.shape)}"
        )
    logits = head(u, v)  # (B, num_labels)
    return F.cross_entropy(at_least_float32(logits), labels.to(logits.device).long())


@dataclass
class SbertConfig:
    num_labels: int = option(3, "Number of classes in the labelled pair file.")

    def __post_init__(self) -> None:
        if self.num_labels < 2:
            raise ConfigError("sbert.num_labels must be >= 2")


class SbertSoftmax(LossTerm):
    """Sentence-BERT softmax classifier over labelled pairs (pairs file)"""

    name = "sbert"
    config_class = SbertConfig
    data = "pairs"
    label_dtype = torch.long
    prefix_refusal = "its classifier reads [u, v, |u - v|] of the full width"

    @classmethod
    def reads(cls, config: Any) -> frozenset[str]:
        return frozenset({PAIRS, LABELS})

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        return 2  # the two sides u, v

    @classmethod
    def make_head(cls, config: SbertConfig, dim: int) -> SoftmaxHead:
        return SoftmaxHead(dim, config.num_labels)

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        u, v = rows.views  # (2, B, H); labels (B,) class indices
        return compute_loss(u, v, batch.labels, rows.head)
