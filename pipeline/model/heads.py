"""Trainable heads beside the encoder, and ``TrainModule``, what the launcher wraps.

The heads are trained and checkpointed but never exported with the encoder: the sbert objective's
classifier (:class:`SoftmaxHead`, pipeline/losses/sbert_softmax.py), the distillation projection
(:func:`projection_head`, pipeline/losses/terms.py) and the auxiliary MLM head (:class:`MLMHead`,
pipeline/losses/mlm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.encoder import SentenceEncoder, prebuilt_mask


class SoftmaxHead(nn.Module):
    """Linear(3H -> num_labels) over [u, v, |u - v|]."""

    def __init__(self, dim: int, num_labels: int = 3):
        super().__init__()
        if num_labels < 2:
            raise ValueError(f"num_labels must be >= 2, got {num_labels}")
        self.classifier = nn.Linear(3 * dim, num_labels)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        features = torch.cat([u, v, (u - v).abs()], dim=-1)  # (B, 3H)
        return self.classifier(features)  # (B, num_labels)


def projection_head(dim: int, teacher_dim: int) -> nn.Linear:
    """The student -> teacher projection of distillation when the widths differ: (B, H) -> (B, D_t)."""
    return nn.Linear(dim, teacher_dim, bias=False)


class MLMHead(nn.Module):
    """BERT's LM prediction head with the decoder tied to the word embeddings (passed to forward)."""

    def __init__(self, hidden_size: int, vocab_size: int, layer_norm_eps: float = 1e-12):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size))  # the decoder's own bias (not tied)

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        """(..., H) token states, (V, H) embedding matrix -> (..., V) logits: (B, L, H) -> (B, L, V), or
        the masked positions' states alone (M, H) -> (M, V)."""
        x = self.norm(F.gelu(self.dense(hidden)))  # (..., H)
        return F.linear(x, word_embeddings, self.bias)  # (..., V)


class TrainModule(nn.Module):
    """What DDP/DeepSpeed wrap: the encoder plus, for the sbert objective, its classifier head, and
    with an ``mlm`` loss term the MLM head (:class:`MLMHead`; trained, never exported)."""

    def __init__(
        self, encoder: SentenceEncoder, head: nn.Module | None = None, mlm_head: nn.Module | None = None
    ):
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.mlm_head = mlm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        mlm_input_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        position_ids: torch.Tensor | None = None,
        mlm_positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Padded rows (``attention_mask``) or the unpadded layout (``cu_seqlens``, ``max_seqlen``,
        ``position_ids``: :meth:`SentenceEncoder.forward`) -> (N, H) embeddings.

        With ``mlm_input_ids`` (B, L) also the MLM head's logits: at every position (B, L, V), or with
        ``mlm_positions`` (M,) int64, the flat indices into (B, L) of the tokens the loss reads (labels not
        -100, row-major: :meth:`pipeline.data.collate.Batch.inputs`), at those alone (M, V). The decoder is
        the head's cost (H x V per position, V = 99k on the main job's student) and ~85 % of positions
        carry no label, so the head runs on the M gathered states; the loss is the same."""
        emb = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            position_ids=position_ids,
        )  # (N, H)
        if mlm_input_ids is None:
            if mlm_positions is not None:
                raise ValueError("mlm_positions without mlm_input_ids: pass the masked originals too")
            return emb
        if attention_mask is None:
            raise ValueError("the mlm head reads padded originals; train.unpadded does not support it")
        # One extra backbone forward of the B masked originals (their padding equals view 0's), inside
        # this forward so DDP sees every parameter used once per step.
        b = mlm_input_ids.shape[0]
        backbone = self.encoder.backbone
        mask = attention_mask[:b]
        if self.encoder.static_mask:
            mask = prebuilt_mask(backbone, mask)  # no host sync in transformers' mask code
        hidden = backbone(input_ids=mlm_input_ids, attention_mask=mask, return_dict=True).last_hidden_state
        if mlm_positions is not None:  # a gather of M rows, its size known on the host: no device read
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mlm_positions)  # (M, H)
        return emb, self.mlm_head(hidden, backbone.get_input_embeddings().weight)  # (N, H), (B, L | M, V)
