"""False-negative control for LUSE's candidates (the ``false_negatives`` field of luse and luse_bce).

A contrastive loss treats every candidate that is not a view of the anchor's sentence as a negative. Some
are not: the anchor's own sentence again (a queued key of an earlier step: the queue holds momentum keys,
and with a small corpus or several epochs a sentence comes back while its old key is still queued; or the
same sentence twice in the global batch, e.g. on two ranks), an exact duplicate of it under another id, or
a paraphrase. Pushing those away teaches the encoder to separate equal meanings. The rules, each a mask
over the (anchor, candidate) pairs that are not the anchor's positives:

- ``same_id`` (on by default): the candidate's 64-bit sentence id (the shards' ``id``) equals the anchor's.
- ``same_text`` (off): the hash of its normalised text equals the anchor's
  (:func:`pipeline.data.collate.text_hashes`: NFKC, case-folded, without whitespace and punctuation).
- ``teacher_margin`` (off: null): GIST's rule (Solatorio 2024, "GISTEmbed"; sentence-transformers'
  ``GISTEmbedLoss``): a guide model (the teacher) scores each candidate against the anchor, and a
  candidate it scores above the anchor's positive, minus the margin, is dropped. LUSE's positives are
  augmentations of the anchor's own sentence, whose teacher vector is the anchor's: the teacher's
  anchor-positive similarity is 1, so the rule drops candidates with teacher cosine > 1 - margin.

On batches of pair shards (luse on pairs, docs/pairs.md "Training on pairs") :func:`pair_guide` builds the
guide: the pair's ``group`` plays the sentence id (``same_id``: the other pairs of the anchor's record, and
queued keys of its group, are never negatives), and ``same_text`` masks a candidate whose text hashes like
either text of the anchor's pair, as the pairs term does. The views of one pair differ in text (the
positive is not the anchor), so the guide carries each candidate view's own tags (``view_tags``).

A masked candidate leaves the softmax (its logit becomes -inf; luse) or the mean (its pair weighs 0;
luse_bce, whose denominator stays the number of pairs so that the per-rank losses still average to the
global one). With no collision the masks are all False and the loss and its gradients are bit-identical
to the unmasked ones (``masked_fill`` of an all-False mask copies; a weight of 1 multiplies exactly):
tests/test_false_negatives.py checks this with ``torch.equal``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.errors import ConfigError


@dataclass
class FalseNegativeConfig:
    same_id: bool = option(True, "Never a negative with the anchor's sentence id (its stale queued key).")
    same_text: bool = option(False, "Never a negative whose normalised text hashes like the anchor's.")
    teacher_margin: float | None = option(
        None, "GIST: drop negatives the teacher scores above 1 - margin with the anchor (null = off)."
    )

    def __post_init__(self) -> None:
        if self.teacher_margin is not None and not 0.0 <= self.teacher_margin < 2.0:
            raise ConfigError("false_negatives.teacher_margin must be in [0, 2) or null (try 0.05)")

    @property
    def uses_tags(self) -> bool:
        return self.same_id or self.same_text


@dataclass
class Guide:
    """What the masks compare, for this rank's B sentences and the Q queued keys (any may be None)."""

    tags: torch.Tensor | None = None  # (B, T) int64: per sentence its id and/or text hash
    queue_tags: torch.Tensor | None = None  # (Q, T) int64, row for row with the queue
    teacher: torch.Tensor | None = None  # (B, D_t) teacher embeddings (the teacher_margin rule)
    queue_teacher: torch.Tensor | None = None  # (Q, D_t) teacher embeddings of the queued sentences
    teacher_margin: float | None = None
    # (n, B, T) int64: per candidate view its own tags (pair batches: the positive's text is not the
    # anchor's); None: every view carries its sentence's ``tags``.
    view_tags: torch.Tensor | None = None


def make_guide(
    config: FalseNegativeConfig,
    ids: torch.Tensor | None,
    text_hashes: torch.Tensor | None,
    queue_ids: torch.Tensor | None = None,
    queue_text_hashes: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
    queue_teacher: torch.Tensor | None = None,
) -> Guide | None:
    """The guide for ``config``'s rules from what the batch and the queue carry; None when no rule is on.

    ``same_id`` without ids (a step output built by hand) has nothing to compare and is skipped; the other
    rules without their inputs (text hashes, teacher embeddings) are errors.
    """
    wanted = [
        ("same_id", config.same_id and ids is not None, ids, queue_ids),
        ("same_text", config.same_text, text_hashes, queue_text_hashes),
    ]
    local, queued = [], []
    for name, on, values, queue_values in wanted:
        if not on:
            continue
        if values is None:
            raise ValueError(f"false_negatives.{name}: the batch carries no text hashes of its sentences")
        local.append(values.reshape(-1, 1))
        queued.append(queue_values)
    if config.teacher_margin is not None and teacher is None:
        raise ValueError("false_negatives.teacher_margin: the batch carries no teacher embeddings")
    if not local and config.teacher_margin is None:
        return None
    queue_tags = None
    if local and all(q is not None for q in queued):
        queue_tags = torch.stack([q.reshape(-1) for q in queued], dim=1)  # (Q, T)
    return Guide(
        tags=torch.cat(local, dim=1) if local else None,  # (B, T)
        queue_tags=queue_tags,
        teacher=teacher if config.teacher_margin is not None else None,
        queue_teacher=queue_teacher if config.teacher_margin is not None else None,
        teacher_margin=config.teacher_margin,
    )


def same_tag(anchor_tags: torch.Tensor, candidate_tags: torch.Tensor) -> torch.Tensor:
    """(A, C) bool: candidate c shares any tag (id, text hash) with anchor a. (A, T) and (C, T) int64."""
    return (anchor_tags[:, None, :] == candidate_tags[None, :, :]).any(dim=-1)  # (A, C)


def teacher_close(
    anchor_teacher: torch.Tensor, candidate_teacher: torch.Tensor, margin: float
) -> torch.Tensor:
    """(A, C) bool: the teacher's cosine of a and c exceeds its anchor-positive cosine (1) minus margin."""
    a = F.normalize(anchor_teacher.float(), dim=-1)  # (A, D_t)
    c = F.normalize(candidate_teacher.float().to(a.device), dim=-1)  # (C, D_t)
    return a @ c.T > 1.0 - margin  # (A, C)


def sentence_mask(
    guide: Guide, anchor_sentence: torch.Tensor, tags: torch.Tensor | None, teacher: torch.Tensor | None
) -> torch.Tensor | None:
    """(A, C) bool over candidates given per candidate by their sentence's ``tags`` (C, T) and ``teacher``
    (C, D_t); anchors are given by their local sentence index ``anchor_sentence`` (A,). None: no rule."""
    mask = None
    if guide.tags is not None and tags is not None:
        mask = same_tag(guide.tags[anchor_sentence], tags.to(guide.tags.device))
    if guide.teacher_margin is not None and guide.teacher is not None and teacher is not None:
        close = teacher_close(guide.teacher[anchor_sentence], teacher, guide.teacher_margin)
        mask = close if mask is None else mask | close
    return mask


def pair_guide(
    config: FalseNegativeConfig,
    groups: torch.Tensor,
    text_hashes: torch.Tensor | None,
    positive_text_hashes: torch.Tensor | None,
    num_views: int,
    queue_groups: torch.Tensor | None = None,
    queue_text_hashes: torch.Tensor | None = None,
) -> Guide | None:
    """The guide of a batch of B pairs whose views are (anchor, positive, num_views - 2 re-encodings of
    the anchor); None when no rule is on. The queue holds anchors' keys with their groups and hashes.

    ``same_id``: tag column ``group``, on every view. ``same_text``: two columns, the pair's anchor hash
    and positive hash, against each candidate view's own text hash in both, so a candidate whose text
    hashes like either side of the pair matches (tags compare column by column, :func:`same_tag`).
    ``teacher_margin`` compares with the anchor's teacher vector as a positive's: not for pairs.
    """
    if config.teacher_margin is not None:
        raise ValueError("false_negatives.teacher_margin: not on pair batches (a positive is not the anchor)")
    if num_views < 2:
        raise ValueError(f"a pair batch has at least 2 views (anchor, positive), got {num_views}")
    g = groups.reshape(-1)
    own: list[torch.Tensor] = []  # (B,) columns of the pairs' tags
    per_view: list[list[torch.Tensor]] = [[] for _ in range(num_views)]  # each view's columns
    queued: list[torch.Tensor | None] = []
    if config.same_id:
        own.append(g)
        for columns in per_view:
            columns.append(g)
        queued.append(queue_groups)
    if config.same_text:
        if text_hashes is None or positive_text_hashes is None:
            raise ValueError("false_negatives.same_text: the batch carries no text hashes of both sides")
        a, p = text_hashes.reshape(-1), positive_text_hashes.reshape(-1)
        own += [a, p]
        for v, columns in enumerate(per_view):
            columns += [p, p] if v == 1 else [a, a]  # the view's text, against both sides of the pair
        queued += [queue_text_hashes, queue_text_hashes]  # queued keys are anchors
    if not own:
        return None
    queue_tags = None
    if all(q is not None for q in queued):
        queue_tags = torch.stack([q.reshape(-1) for q in queued], dim=1)  # (Q, T)
    return Guide(
        tags=torch.stack(own, dim=1),  # (B, T)
        queue_tags=queue_tags,
        view_tags=torch.stack([torch.stack(c, dim=1) for c in per_view]),  # (n, B, T)
    )
