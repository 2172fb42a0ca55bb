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
