"""The unpadded (varlen) encoder path: a BERT forward over flat tokens, on the HF model's own modules.

A batch of N sentences arrives as flat token ids (T,) with ``cu_seqlens`` (N + 1,) int32 (sentence i
is tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``), a host-side int ``max_seqlen`` and position ids (T,)
(``train.unpadded``, :func:`pipeline.data.collate.unpad`). Every GEMM, LayerNorm and activation then
runs on the T real tokens instead of N * L padded ones; only attention needs the segments:

- CUDA, fp16/bf16, no attention dropout in effect: torch's variable-length flash attention
  (``torch.nn.attention.varlen.varlen_attn``), no mask and no padding at all;
- otherwise (CPU, fp32, attention dropout > 0 while training): the reference. q, k and v are scattered
  into (N, max_seqlen) slots and go through SDPA with a key-padding mask, exactly the padded path's
  attention; the GEMMs around it stay unpadded.

The forward calls the backbone's own submodules (embeddings with explicit position ids, each layer's
query/key/value, attention output, intermediate and output), so the weights and state_dict keys are the
HF model's: export, evaluation and resume see no difference. Nothing here reads a tensor on the host:
the segment bookkeeping is computed on the device from ``cu_seqlens``, shapes from ``max_seqlen``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError

# model types whose modules this forward walks (BertModel's layout, absolute positions)
UNPADDED_ARCHITECTURES = ("bert",)


def check_unpadded(backbone: nn.Module) -> None:
    """A one-line ConfigError unless the backbone is an encoder this forward reproduces exactly."""
    config = backbone.config
    model_type = getattr(config, "model_type", type(backbone).__name__)
    if model_type not in UNPADDED_ARCHITECTURES:
        raise ConfigError(
            f"train.unpadded supports {', '.join(UNPADDED_ARCHITECTURES)} models, not {model_type!r}; "
            "set --train.unpadded=false"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "position_embedding_type", "absolute") not in (
        None,
        "absolute",
    ):
        raise ConfigError(
            "train.unpadded needs an encoder with absolute position embeddings; set --train.unpadded=false"
        )


@dataclass
class Segments:
    """Where each flat token sits in an (N, S) padded batch, computed once per forward on the device."""

    num_rows: int  # N sentences
    width: int  # S = max_seqlen
    lengths: torch.Tensor  # (N,) int64
    slot: torch.Tensor  # (T,) int64: row * S + position, the token's slot in the (N * S) padded layout
    key_mask: torch.Tensor  # (N, 1, 1, S) bool, True on real tokens

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, max_seqlen: int, num_tokens: int) -> Segments:
        cu = cu_seqlens.long()  # (N + 1,)
        n = cu.shape[0] - 1
        tokens = torch.arange(num_tokens, device=cu.device)  # (T,)
        # the sentence of each token: how many sentence ends lie at or before it (searchsorted(cu[1:],
        # tokens, right=True)), as a count of ends per slot summed up; an end at T (empty last
        # sentences) falls in the extra slot. Not searchsorted: inductor on CUDA (torch 2.11, H200)
        # failed to lower it on the slice cu[1:] ("NotImplementedError: SliceView").
        ends = cu[1:-1]
        starts = torch.zeros(num_tokens + 1, dtype=cu.dtype, device=cu.device)
        row = starts.index_add_(0, ends, torch.ones_like(ends)).cumsum(0)[:num_tokens]  # (T,)
        slot = row * max_seqlen + (tokens - cu[row])  # (T,)
        lengths = cu[1:] - cu[:-1]  # (N,)
        key_mask = torch.arange(max_seqlen, device=cu.device) < lengths[:, None]  # (N, S)
        return cls(n, max_seqlen, lengths, slot, key_mask[:, None, None, :])

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """(T, *rest) -> (N, S, *rest), zeros in the padding slots (differentiable)."""
        out = flat.new_zeros((self.num_rows * self.width, *flat.shape[1:]))
        return out.index_copy(0, self.slot, flat).view(self.num_rows, self.width, *flat.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """(N, S, *rest) -> (T, *rest)."""
        return padded.reshape(self.num_rows * self.width, *padded.shape[2:]).index_select(0, self.slot)


def _flash_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10 has no public varlen attention
        return None
    return varlen_attn


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    segments: Segments,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """Attention within each sentence: (T, heads, d) q, k, v -> (T, heads, d)."""
    flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0 and _flash_varlen()
    if flash:  # (importing it sets up inductor's environment: only where it can run)
        width = segments.width
        return flash(q, k, v, cu_seqlens, cu_seqlens, width, width, scale=scale)  # (T, heads, d)
    # the reference: the padded path's attention, (N, heads, S, d) with a key-padding mask
    qp, kp, vp = (segments.pad(x).transpose(1, 2) for x in (q, k, v))  # (N, heads, S, d)
    out = F.scaled_dot_product_attention(qp, kp, vp, segments.key_mask, dropout_p=dropout_p, scale=scale)
    return segments.unpad(out.transpose(1, 2))  # (T, heads, d)


def _layer(layer: nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor, segments: Segments) -> torch.Tensor:
    """One BertLayer over flat tokens (T, H) -> (T, H), through its own modules."""
    attention = layer.attention.self
    heads, size = attention.num_attention_heads, attention.attention_head_size
    q, k, v = (proj(x).view(-1, heads, size) for proj in (attention.query, attention.key, attention.value))
    dropout_p = attention.dropout.p if attention.training else 0.0
    context = varlen_attention(q, k, v, cu_seqlens, segments, dropout_p, attention.scaling)  # (T, heads, d)
    attended = layer.attention.output(context.reshape(x.shape[0], heads * size), x)  # dense, dropout, LN
    return layer.output(layer.intermediate(attended), attended)  # (T, H)


def unpadded_hidden_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    all_layers: bool = False,
) -> list[torch.Tensor]:
    """Token states (T, H) of flat ``input_ids`` (T,): the last layer's, or with ``all_layers`` the
    embeddings' and every layer's (as HF's ``hidden_states``)."""
    segments = Segments.of(cu_seqlens, max_seqlen, input_ids.shape[0])
    token_types = torch.zeros_like(input_ids)  # (T,) one segment type, as the padded path's default
    x = backbone.embeddings(
        input_ids=input_ids[None], token_type_ids=token_types[None], position_ids=position_ids[None]
    )[0]  # (T, H)
    states = [x]
    for layer in backbone.encoder.layer:
        x = _layer(layer, x, cu_seqlens, segments)
        states.append(x)
    return states if all_layers else [x]


def pool_unpadded(
    states: list[torch.Tensor], cu_seqlens: torch.Tensor, max_seqlen: int, pooling: str
) -> torch.Tensor:
    """One vector per sentence (N, H) from flat token states (T, H), as :func:`~pipeline.model.encoder.pool`
    pools padded ones (the mean sums each sentence's slots in the padded order: the same arithmetic)."""
    last = states[-1]  # (T, H)
    if pooling == "cls":
        return last.index_select(0, cu_seqlens[:-1].long())  # (N, H): each sentence's first token
    segments = Segments.of(cu_seqlens, max_seqlen, last.shape[0])

    def mean(x: torch.Tensor) -> torch.Tensor:
        lengths = segments.lengths.to(x.dtype).clamp(min=1.0)[:, None]  # (N, 1)
        return segments.pad(x).sum(1) / lengths  # (N, H)

    if pooling == "mean":
        return mean(last)
    if pooling == "first_last_avg":
        return (mean(states[1]) + mean(last)) / 2
    raise ValueError(f"unknown pooling {pooling!r}")
