"""InfoNCE over the corpus's structure pairs (title <-> body, question <-> answer, zh <-> en), in both
directions, with in-batch and cross-device negatives and group masking (docs/pairs.md,
"Training on pairs").

A batch of pair shards (``pipeline pairs``) holds B_local pairs per rank: anchors a_i and positives p_i,
L2-normalised, ``views = (anchor, positive)`` (2, B, H). Gathered over the W ranks (with gradient) the
global batch has N = W * B pairs; the local pair i is global pair I = rank * B + i. With
``s(x, y) = x . y / tau``:

    anchor -> positive:  l_ap(I) = -log( exp s(a_I, p_I) / sum_{j in C(I)} exp s(a_I, p_j) )
    positive -> anchor:  l_pa(I) = -log( exp s(p_I, a_I) / sum_{j in C(I)} exp s(p_I, a_j) )

    loss = mean_i ( l_ap(I) + l_pa(I) ) / 2        (symmetric: true, the default)
    loss = mean_i   l_ap(I)                          (symmetric: false)

C(I) is every global pair j but the *false negatives* of I: j != I with the same ``group`` (the pairs
of one record, e.g. the other answers to the same question) or, with ``same_text`` (default on), a
candidate text whose normalised-text hash (:func:`pipeline.data.collate.text_hashes`) equals the hash
of either text of pair I (a generic answer such as "谢谢" under two questions, or the same question in
two records). The candidate text is p_j in the first direction, a_j in the second. A masked candidate
leaves the softmax (logit -inf); the anchor's own partner never does. ``counts["false_negatives"]``
is the number of (anchor, candidate) pairs masked over both directions (one with symmetric off).

Listed hard negatives (a user's pairs, ``pipeline pairs --format flag|columns``; ``data.num_hard_negatives``
m): pair i's negatives n_{i,1..m}, encoded with gradient, gathered as the pairs are, join the candidates of
*every* anchor in the anchor -> positive direction (as FlagEmbedding and sentence-transformers'
MultipleNegativesRankingLoss take every passage of the batch)::

    l_ap(I) = -log( exp s(a_I, p_I) / (sum_{j in C(I)} exp s(a_I, p_j) + sum_{n in H(I)} exp s(a_I, n)) )

H(I) is every listed negative of the global batch but the empty slots of pairs that list fewer than m
(``batch.hard_negative_mask``) and, with ``same_text``, one whose text hashes like either text of pair I
(another query's negative may be this query's positive); those masked by text are counted in
``false_negatives``. The positive -> anchor direction keeps the anchors as its candidates.

Distributed semantics as luse and sup_simcse: each rank's value is the mean over its B anchors, so
with equal local batches the mean over ranks is the global-batch loss and DDP's averaged gradient is
the single-process gradient over the concatenated batch (tests/test_pairs_train.py, gloo).

No MoCo queue: the queue machinery (pipeline/losses/queue.py) enqueues view 0 (the anchors), while
this loss's candidates are the partner side in each direction; queued negatives would need a queue
of positives and one of anchors with their groups and hashes. In-batch and cross-device negatives
only (global batches of thousands on GPUs, as BGE and e5 train).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_no_grad, all_gather_with_grad, rank
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import HARD_NEGATIVES, VIEWS, LossTerm, Needs, Rows

if TYPE_CHECKING:
    from pipeline.data.collate import Batch


def _false_negatives(
    groups: torch.Tensor | None,
    groups_all: torch.Tensor | None,
    own_hashes: torch.Tensor | None,
    candidate_hashes: torch.Tensor | None,
    own: torch.Tensor,
    columns: int,
) -> torch.Tensor:
    """(B, N) bool: candidate j of local anchor i is a false negative (never the anchor's partner
    ``own[i]``). ``groups`` (B,), ``groups_all`` (N,); ``own_hashes`` (B, 2) the hashes of pair i's two
    texts, ``candidate_hashes`` (N,) of the candidate texts. Any of them None: that rule is off."""
    b = own.shape[0]
    mask = torch.zeros(b, columns, dtype=torch.bool, device=own.device)  # (B, N)
    if groups is not None and groups_all is not None:
        mask |= groups[:, None] == groups_all[None, :]
    if own_hashes is not None and candidate_hashes is not None:
        mask |= (own_hashes[:, :, None] == candidate_hashes[None, None, :]).any(dim=1)
    mask[torch.arange(b, device=own.device), own] = False  # the partner stays the positive
    return mask


def compute_loss(
    anchor: torch.Tensor,
    positive: torch.Tensor,
    temperature: float = 0.05,
    symmetric: bool = True,
    gather: bool = True,
    groups: torch.Tensor | None = None,
    anchor_hashes: torch.Tensor | None = None,
    positive_hashes: torch.Tensor | None = None,
    counts: dict[str, torch.Tensor] | None = None,
    hard_negatives: torch.Tensor | None = None,
    negative_mask: torch.Tensor | None = None,
    negative_hashes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pair InfoNCE (module docstring) over (B_local, H) L2-normalised anchors and positives.

    Args:
        groups: (B,) int64 group ids of the pairs; candidates of the anchor's group are masked.
        anchor_hashes, positive_hashes: (B,) int64 normalised-text hashes of the two sides; both or
            neither: a candidate whose text hashes like either side of the anchor's pair is masked.
        gather: gather all ranks' pairs as candidates (a collective: every rank must call it).
        counts: filled with ``false_negatives``, the number of masked (anchor, candidate) pairs (float).
        hard_negatives: (m, B_local, H) L2-normalised listed negatives, negative j of pair i at [j, i]:
            candidates of every anchor in the anchor -> positive direction (gathered with gradient).
        negative_mask: (B, m) bool, the slots that hold a listed negative (None: all of them).
        negative_hashes: (B, m) int64 their texts' hashes; with the sides' hashes, a negative whose text
            hashes like either side of the anchor's pair is masked.
    """
    if anchor.dim() != 2 or anchor.shape != positive.shape:
        raise ValueError(
            f"anchor and positive must both be (B, H); got {tuple(anchor.shape)}, {tuple(positive.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if (anchor_hashes is None) != (positive_hashes is None):
        raise ValueError("anchor_hashes and positive_hashes must be given together")
    batch = anchor.shape[0]
    device = anchor.device
    a, p = at_least_float32(anchor), at_least_float32(positive)  # (B, H) each
    both = torch.cat([a, p], dim=1)  # (B, 2H): one gather for both sides
    both_all = all_gather_with_grad(both) if gather else both  # (N, 2H), rank-major
    a_all, p_all = both_all.chunk(2, dim=1)  # (N, H) each
    own = (rank() * batch if gather else 0) + torch.arange(batch, device=device)  # (B,) partner column

    def tags(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        x = x.to(device).reshape(-1)
        return all_gather_no_grad(x) if gather else x  # (N,)

    groups_all = tags(groups)
    a_hash_all, p_hash_all = tags(anchor_hashes), tags(positive_hashes)
    own_hashes = None
    if anchor_hashes is not None:
        own_hashes = torch.stack([anchor_hashes.to(device), positive_hashes.to(device)], dim=1)  # (B, 2)
    group_local = None if groups is None else groups.to(device).reshape(-1)

    directions = [(a, p_all, p_hash_all)] + ([(p, a_all, a_hash_all)] if symmetric else [])
    losses, masked = [], torch.zeros((), device=device)
    for query, keys, key_hashes in directions:
        logits = query @ keys.T / temperature  # (B, N)
        fn = _false_negatives(group_local, groups_all, own_hashes, key_hashes, own, keys.shape[0])
        masked = masked + fn.sum()
        logits = logits.masked_fill(fn, float("-inf"))  # all-False: bit for bit the plain logits
        if not losses and hard_negatives is not None and hard_negatives.numel():  # anchor -> positive
            negative_logits, negatives_masked = _negative_logits(
                a, hard_negatives, negative_mask, negative_hashes, own_hashes, temperature, gather
            )
            logits = torch.cat([logits, negative_logits], dim=1)  # (B, N + W * m * B)
            masked = masked + negatives_masked
        losses.append(F.cross_entropy(logits, own))
    if counts is not None:
        counts["false_negatives"] = masked.float()
    return losses[0] if len(losses) == 1 else (losses[0] + losses[1]) / 2


def _negative_logits(
    anchors: torch.Tensor,
    hard_negatives: torch.Tensor,
    mask: torch.Tensor | None,
    hashes: torch.Tensor | None,
    own_hashes: torch.Tensor | None,
    temperature: float,
    gather: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W * m * B) logits of the anchors against every listed negative of the global batch, empty slots
    and (with hashes) negatives that hash like a side of the anchor's pair at -inf; and how many of the
    latter were masked (a () tensor)."""
    m, b, h = hard_negatives.shape
    negatives = at_least_float32(hard_negatives).reshape(m * b, h)  # (m * B, H), row j * B + i
    negatives = all_gather_with_grad(negatives) if gather else negatives  # (W * m * B, H)
    logits = anchors @ negatives.T / temperature  # (B, W * m * B)

    def slots(x: torch.Tensor) -> torch.Tensor:  # (B, m) per pair -> (W * m * B,) in the negatives' order
        x = x.to(anchors.device).T.reshape(-1)  # (m * B,)
        return all_gather_no_grad(x) if gather else x

    masked = torch.zeros((), device=anchors.device)
    empty = torch.zeros(logits.shape[1], dtype=torch.bool, device=anchors.device)  # (W * m * B,)
    if mask is not None:
        empty = ~slots(mask)
    if hashes is not None and own_hashes is not None:
        same = (own_hashes[:, :, None] == slots(hashes)[None, None, :]).any(dim=1) & ~empty  # (B, W * m * B)
        masked = same.sum()
        logits = logits.masked_fill(same, float("-inf"))
    return logits.masked_fill(empty[None, :], float("-inf")), masked


@dataclass
class PairsConfig:
    temperature: float = option(0.05, "tau: logits = cos / tau (MNRL's scale 20 is tau 0.05).")
    symmetric: bool = option(True, "Both directions (anchor->positive and positive->anchor), averaged.")
    same_text: bool = option(
        True, "Also never a negative whose normalised text hashes like either text of the anchor's pair."
    )

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError("pairs.temperature must be > 0 (try 0.05)")


class Pairs(LossTerm):
    """InfoNCE over structure pairs, both directions, group-masked in-batch negatives (pair shards)"""

    name = "pairs"
    config_class = PairsConfig
    data = "pair_shards"

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        return 2  # anchor, positive

    @classmethod
    def reads(cls, config: PairsConfig) -> frozenset[str]:
        return frozenset({VIEWS, HARD_NEGATIVES})  # the listed negatives of a user's pairs, when given

    @classmethod
    def needs(cls, config: PairsConfig) -> Needs:
        return Needs(text_hashes=config.same_text)  # both sides' hashes, hashed in the loader workers

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        c: PairsConfig = self.config
        views = rows.views  # (2, B, H) anchor, positive
        if views.shape[0] != 2:
            raise ValueError(f"pairs: views must be (2, B, H) (anchor, positive), got {tuple(views.shape)}")
        if batch.groups is None:
            raise ValueError("pairs: the batch carries no group ids (batches of pair shards do)")
        if c.same_text and (batch.text_hashes is None or batch.positive_text_hashes is None):
            raise ValueError("pairs.same_text: the batch carries no text hashes of both sides")
        hashes: Any = batch.text_hashes if c.same_text else None
        return compute_loss(
            views[0],
            views[1],
            c.temperature,
            c.symmetric,
            gather=rows.gather,
            groups=batch.groups,
            anchor_hashes=hashes,
            positive_hashes=batch.positive_text_hashes if hashes is not None else None,
            counts=rows.counts,
            hard_negatives=rows.hard_negatives,  # (m, B, H) or None
            negative_mask=batch.hard_negative_mask,  # (B, m)
            negative_hashes=batch.hard_negative_text_hashes if hashes is not None else None,  # (B, m)
        )
