"""LUSE's multi-positive listwise contrastive loss, the default pretraining objective.

Every sentence of a batch arrives as ``n_views`` L2-normalised embeddings: view 0 is the original
sentence, the others are its positives (cached EDA variants and extra dropout re-encodings of the
original). Each *local* view is an anchor. Its candidates are every view of the *global* batch
(gathered from all ranks with gradient) except the anchor itself, plus the rows of the negative queue.
The target distribution puts probability 1/(n_views-1) on each of the anchor's other views::

    loss(a) = -1/(n-1) * sum_{p in views(a), p != a} log softmax_c(sim(a, c) / tau)[p]

and the loss is the mean over local anchors. Everything else in the global batch, including the
other views of other sentences, is a negative.

Differences from LUSE's own code: LUSE keeps the self-similarity sim(a, a) = 1 in the softmax
denominator, where it is always the largest logit (1/tau = 20 at tau=0.05) and only adds a constant
pull towards the anchor itself; we drop it from numerator and denominator. LUSE's MoCo queue is an
empty stub; here the queue (:mod:`pipeline.losses.queue`) supplies real extra negatives.

Distillation and mining extras (docs/objectives.md): with ``teacher`` each anchor gains its sentence's
teacher embedding as one more positive (target 1/n on each of the n positives) and the global batch's
teacher vectors join the candidates; ``hard_negatives`` (m, B, H) join every anchor's candidates.

False negatives (:mod:`pipeline.losses.false_negatives`): with a ``guide`` a candidate that shares the
anchor's sentence id (a stale queued key of its own sentence, or its sentence again elsewhere in the global
batch), optionally its normalised-text hash, or that the teacher scores as close as a positive, leaves the
softmax (logit -inf); the anchor's own positives never do. Hard negatives carry no ids and are not masked.

Pair batches (pair shards, ``pipeline pairs``; docs/pairs.md "Training on pairs"): the views of pair i are
its anchor (view 0), its positive (view 1) and ``data.num_dropout_views`` re-encodings of the anchor, so
each anchor's target puts 1/(n-1) on its partner and its dropout views, and every other view of the global
batch (the other pairs' anchors *and* positives) plus the queue (keys of earlier anchors) are candidates.
The pair's ``group`` plays the sentence id of the false-negative rules (:func:`pair_guide`: with
``same_id``, on by default, no pair of the anchor's group, in the batch or queued, is a negative), and
``same_text`` masks a candidate whose text hashes like either side of the pair, as the pairs term does.
``teacher_positive`` and ``teacher_margin`` take the teacher vector of the anchor's sentence for a
positive's, which a pair's positive is not: refused on pair shards.

Temperature ``tau`` divides the cosine similarities before the softmax. Small tau (0.05, as in
SimCSE) sharpens the distribution so that the hardest negatives dominate the gradient; large tau
spreads it over all negatives. The logits range over [-1/tau, 1/tau].

Distributed semantics: the returned value is the mean over this rank's anchors. With equal local
batch sizes, the mean of the per-rank losses equals the loss over the global batch, and after DDP
averages gradients the update equals the single-process update over the concatenated batch
(``tests/test_distributed_gloo.py`` checks both with two gloo processes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.distributed import all_gather_no_grad, all_gather_with_grad, rank
from pipeline.errors import ConfigError
from pipeline.io import tensor_checksum
from pipeline.losses._precision import at_least_float32
from pipeline.losses.false_negatives import (
    FalseNegativeConfig,
    Guide,
    make_guide,
    pair_guide,
    sentence_mask,
)
from pipeline.losses.terms import (
    HARD_NEGATIVES,
    QUEUE,
    TEACHER,
    VIEWS,
    LossTerm,
    Needs,
    Rows,
    TermContext,
    WeightedTerm,
)

if TYPE_CHECKING:
    from pipeline.data.collate import Batch
    from pipeline.losses.queue import NegativeQueue


def compute_loss(
    embeddings: torch.Tensor,
    temperature: float = 0.05,
    queue: torch.Tensor | None = None,
    gather: bool = True,
    teacher: torch.Tensor | None = None,
    hard_negatives: torch.Tensor | None = None,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
    guide: Guide | None = None,
    counts: dict[str, torch.Tensor] | None = None,
    hard_negative_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-positive listwise loss over (n_views, B, H) L2-normalised embeddings.

    Args:
        embeddings: (n_views, B_local, H), view 0 the original sentence, the rest its positives.
        temperature: tau, the divisor of cosine similarities (see the module docstring).
        queue: (Q, H) extra negatives, identical on every rank; never receives gradient.
        gather: gather all ranks' views as candidates (a collective: every rank must call it).
        teacher: (B_local, D_t) teacher embeddings of the sentences: one more positive per anchor, and
            the global batch's teacher vectors join the candidates (no gradient). Lets n_views be 1.
        hard_negatives: (m, B_local, H) mined negatives (with gradient); the global batch's join every
            anchor's candidates, never as positives.
        project: maps anchors (., H) to the teacher's width when D_t != H (the distillation head).
        guide: ids / text hashes / teacher vectors of the sentences and the queue: candidates that match
            the anchor's are masked (false negatives); gathered across ranks (collectives).
        counts: filled with ``false_negatives``, the number of (anchor, candidate) pairs masked (float).
        hard_negative_mask: (B, m) bool, the slots of ``hard_negatives`` that hold a negative (pair shards
            whose pairs list fewer than m); the others leave every softmax. None: all of them.

    Returns:
        A scalar, the mean over the n_views * B_local local anchors.
    """
    min_views = 1 if teacher is not None else 2
    if embeddings.dim() != 3 or embeddings.shape[0] < min_views:
        raise ValueError(f"embeddings must be (n_views >= {min_views}, B, H), got {tuple(embeddings.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n_views, batch, dim = embeddings.shape
    device = embeddings.device

    # Row v * B + b is view v of sentence b. Similarities in at least float32: at tau=0.05 half-precision
    # logits lose the differences between close negatives.
    anchors = at_least_float32(embeddings.reshape(n_views * batch, dim))  # (n * B, H)
    candidates = all_gather_with_grad(anchors) if gather else anchors  # (W * n * B, H), rank-major
    offset = rank() * n_views * batch if gather else 0  # where this rank's rows start among candidates

    logits = anchors @ candidates.T / temperature  # (n * B, W * n * B)
    local = torch.arange(n_views * batch, device=device)  # (n * B,)
    is_self = torch.zeros_like(logits, dtype=torch.bool)  # (n * B, W * n * B)
    is_self[local, offset + local] = True
    sentence = local % batch  # (n * B,) the anchor's sentence
    masked = []  # the false-negative masks, one per block of candidates
    if guide is not None:
        # Per candidate view, its sentence's tags and teacher vector (no gradient; collectives).
        world = candidates.shape[0] // (n_views * batch)
        tags_all = _gathered(guide.tags, gather)  # (W * B, T)
        teacher_all = _gathered(guide.teacher, gather)  # (W * B, D_t)
        view_tags = _per_view(tags_all, world, n_views)  # (W * n * B, T)
        if guide.view_tags is not None:  # each view its own tags (pair batches), in the candidates' order
            view_tags = _gathered(guide.view_tags.reshape(n_views * batch, -1), gather)
        fn = sentence_mask(guide, sentence, view_tags, _per_view(teacher_all, world, n_views))
        if fn is not None:
            column = torch.arange(candidates.shape[0], device=device)  # (W * n * B,)
            own_rank = (column >= offset) & (column < offset + n_views * batch)  # (W * n * B,)
            positive_or_self = own_rank[None, :] & (sentence[:, None] == (column % batch)[None, :])
            fn = fn & ~positive_or_self  # (n * B, W * n * B)
            masked.append(fn)
            is_self = is_self | fn  # an all-False fn leaves the logits bit for bit as they were
    columns = [logits.masked_fill(is_self, float("-inf"))]  # (n * B, W * n * B)
    if hard_negatives is not None and hard_negatives.numel():
        m = hard_negatives.shape[0]
        negatives = at_least_float32(hard_negatives.reshape(m * batch, dim))  # (m * B, H)
        negatives = all_gather_with_grad(negatives) if gather else negatives  # (W * m * B, H)
        negative_logits = anchors @ negatives.T / temperature  # (n * B, W * m * B)
        if hard_negative_mask is not None:  # a user's pairs: the slots a pair leaves empty
            listed = hard_negative_mask.to(device).T.reshape(-1)  # (m * B,) in the negatives' order
            listed = all_gather_no_grad(listed) if gather else listed  # (W * m * B,)
            negative_logits = negative_logits.masked_fill(~listed[None, :], float("-inf"))
        columns.append(negative_logits)
    teacher_start = sum(c.shape[1] for c in columns)
    if teacher is not None:
        t = F.normalize(teacher.to(anchors.dtype), dim=-1)  # (B, D_t)
        t_all = all_gather_no_grad(t) if gather else t  # (W * B, D_t)
        a = anchors if project is None else F.normalize(project(anchors).to(anchors.dtype), dim=-1)
        teacher_logits = a @ t_all.T / temperature  # (n * B, W * B)
        if guide is not None:
            fn = sentence_mask(guide, sentence, tags_all, teacher_all)
            if fn is not None:
                own = (rank() * batch if gather else 0) + sentence  # (n * B,) the anchor's teacher column
                fn[local, own] = False  # a positive
                masked.append(fn)
                teacher_logits = teacher_logits.masked_fill(fn, float("-inf"))
        columns.append(teacher_logits)  # (n * B, W * B)
    if queue is not None and queue.shape[0] > 0:
        queue_logits = anchors @ queue.detach().to(anchors.dtype).T / temperature  # (n * B, Q)
        if guide is not None:
            fn = sentence_mask(guide, sentence, guide.queue_tags, guide.queue_teacher)
            if fn is not None:
                masked.append(fn)
                queue_logits = queue_logits.masked_fill(fn, float("-inf"))
        columns.append(queue_logits)  # (n * B, Q)
    if counts is not None and guide is not None:
        counts["false_negatives"] = sum((m.sum() for m in masked), torch.zeros((), device=device)).float()
    log_prob = F.log_softmax(torch.cat(columns, dim=1), dim=1)  # (n * B, all candidates)

    # Positives of anchor (v, b): views (v + k) % n of sentence b for k = 1 .. n-1 (and its teacher).
    view = local // batch  # (n * B,)
    shift = torch.arange(1, n_views, device=device)  # (n - 1,)
    positive_view = (view[:, None] + shift[None, :]) % n_views  # (n * B, n - 1)
    positive = offset + positive_view * batch + sentence[:, None]  # (n * B, n - 1)
    if teacher is not None:
        own_teacher = teacher_start + (rank() * batch if gather else 0) + sentence[:, None]  # (n * B, 1)
        positive = torch.cat([positive, own_teacher], dim=1)  # (n * B, n)
    positive_log_prob = log_prob.gather(1, positive)  # (n * B, n - 1 [+ 1])
    return -positive_log_prob.mean(dim=1).mean()


def _gathered(x: torch.Tensor | None, gather: bool) -> torch.Tensor | None:
    """Every rank's rows of a per-sentence tensor, rank-major, detached (a collective when gathering)."""
    if x is None:
        return None
    return all_gather_no_grad(x) if gather else x.detach()


def _per_view(x: torch.Tensor | None, world: int, n_views: int) -> torch.Tensor | None:
    """(W * B, ...) per sentence -> (W * n * B, ...) per candidate view, in the candidates' order."""
    if x is None:
        return None
    per_rank = x.reshape(world, 1, -1, *x.shape[1:])  # (W, 1, B, ...)
    return per_rank.expand(world, n_views, *per_rank.shape[2:]).reshape(-1, *x.shape[1:])


@dataclass
class LuseConfig:
    temperature: float = option(0.05, "tau: logits = cos / tau.")
    queue_size: int = option(0, "Negatives kept from earlier steps (0 = no queue); a multiple of the batch.")
    momentum: float = option(
        0.0, "EMA momentum of the key encoder (e.g. 0.999); 0 = keys are the detached online view 0."
    )
    teacher_positive: bool = option(
        False, "The teacher embedding of each sentence is one more positive (and a candidate)."
    )
    false_negatives: FalseNegativeConfig = option(
        factory=FalseNegativeConfig,
        help="Candidates never used as negatives: {same_id, same_text, teacher_margin} (docs/objectives.md).",
    )

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError("luse.temperature must be > 0 (try 0.05)")
        if self.queue_size < 0:
            raise ConfigError("luse.queue_size must be >= 0 (0 = no queue)")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("luse.momentum must be in [0, 1) (0 = no momentum encoder)")


def guide_of(
    c: FalseNegativeConfig,
    batch: Batch,
    num_views: int,
    queue: NegativeQueue | None,
    teacher_queue: NegativeQueue | None,
) -> Guide | None:
    """The false-negative guide of a step: the originals' and the queue's ids, text hashes, teacher; on a
    batch of pair shards the pairs' groups and both sides' hashes (:func:`pair_guide`)."""
    queued = queue is not None
    if batch.groups is not None:  # pair shards: the queue keeps the anchors' groups as their ids
        return pair_guide(
            c,
            batch.groups,
            batch.text_hashes,
            batch.positive_text_hashes,
            num_views,
            queue.negative_ids() if queued else None,
            queue.negative_text_hashes() if queued else None,
        )
    return make_guide(
        c,
        batch.ids,
        batch.text_hashes,
        queue.negative_ids() if queued else None,
        queue.negative_text_hashes() if queued else None,
        batch.teacher,
        teacher_queue.negatives() if queued and teacher_queue is not None else None,
    )


class Luse(LossTerm):
    """multi-positive listwise over original + EDA variants + dropout views, queue (shards)

    Its state in training: the negative queue (``queue_size``) of earlier steps' keys, their sentence ids
    and text hashes, and the momentum (EMA) encoder that makes the keys (``momentum`` > 0; with 0 the keys
    are the detached online view 0). Both live here, so they are in this term's ``state_dict``; a
    checkpoint holds them as ``queue`` and ``momentum_encoder``, the names checkpoints have always used, so
    a checkpoint of an earlier version resumes as it is."""

    name = "luse"
    config_class = LuseConfig
    data = "shards"
    uses_variants = True
    trains_on_pairs = True  # the partner is one more positive (pair_views)

    @classmethod
    def reads(cls, config: LuseConfig) -> frozenset[str]:
        teacher = config.teacher_positive or config.false_negatives.teacher_margin is not None
        return frozenset({VIEWS, HARD_NEGATIVES, QUEUE} | ({TEACHER} if teacher else set()))

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        return 1 + num_variants + num_dropout_views  # original, EDA variants, dropout views

    @classmethod
    def pair_views(cls, config: LuseConfig, num_dropout_views: int) -> int:
        """Views of a pair on pair shards: anchor, positive, the anchor's dropout re-encodings."""
        if config.teacher_positive or config.false_negatives.teacher_margin is not None:
            raise ConfigError(
                "luse.teacher_positive and luse.false_negatives.teacher_margin take the teacher's vector of "
                "the anchor for a positive's, and a pair's positive is another text: unset them on pair "
                "shards (docs/pairs.md, 'Training on pairs')"
            )
        return 2 + num_dropout_views

    @classmethod
    def needs(cls, config: LuseConfig) -> Needs:
        return Needs(
            queue_size=config.queue_size,
            momentum=config.momentum,
            text_hashes=config.false_negatives.same_text,  # hashing costs the loader and a gather per step
            teacher_positive=config.teacher_positive,
        )

    @classmethod
    def projects(cls, config: LuseConfig) -> bool:
        return config.teacher_positive

    @classmethod
    def describe(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """What the model card says of a luse term (its saved fields): its queue and momentum rows, its
        paper among the citations, and MoCo when it kept a queue or a momentum encoder."""
        queue, momentum = fields.get("queue_size"), fields.get("momentum")
        rows = [("negative queue size", queue), ("momentum encoder", momentum)]
        cite = ["luse", "moco"] if queue or momentum else ["luse"]
        return {"rows": rows, "cite": cite, "queue_size": queue, "momentum": momentum}

    def __init__(self, weighted: WeightedTerm, context: TermContext):
        from pipeline.losses.queue import MomentumEncoder, NegativeQueue, needs_forward

        super().__init__(weighted, context)
        c: LuseConfig = self.config
        self.queue = NegativeQueue(c.queue_size, context.dim) if c.queue_size else None
        keyed = self.queue is not None and needs_forward(c.momentum)
        self.momentum_encoder = MomentumEncoder(context.encoder) if keyed else None
        self.lent.queue = self.queue  # its formula reads it there, as kl and the teacher terms on a prefix do

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        """Over the views and hard negatives of ``rows`` (cut to a matryoshka prefix when they are), the
        run's queue (its own, lent) with its keys cut as the rows are, and the rules' ids, hashes and
        teacher rows of the batch."""
        c: LuseConfig = self.config
        lent = self.lent
        if batch.groups is not None and c.teacher_positive:
            raise ValueError("luse.teacher_positive: not on pair batches (the positive is not the anchor)")
        views = rows.views  # (n, B, H)
        return compute_loss(
            views,
            c.temperature,
            queue=None if lent.queue is None else rows.cut(lent.queue.negatives()),  # (filled, H)
            gather=rows.gather,
            teacher=batch.teacher if c.teacher_positive else None,
            hard_negatives=rows.hard_negatives,  # (m, B, H)
            project=rows.head,
            guide=guide_of(c.false_negatives, batch, views.shape[0], lent.queue, lent.teacher_queue),
            counts=rows.counts,
            hard_negative_mask=batch.hard_negative_mask,  # (B, m) a user's pairs; else None
        )

    def after_micro_batch(self, rows: torch.Tensor, inputs: dict[str, torch.Tensor], batch: Any,
                          apply: torch.Tensor | None) -> None:  # fmt: skip
        """Keys of this micro-batch's originals into the queue with their sentence ids and text hashes
        (gathered from all ranks: a collective)."""
        if self.queue is None:
            return
        b = rows.shape[0] // batch.rows_per_sentence
        if self.momentum_encoder is not None:
            keys = self.momentum_encoder.encode(
                input_ids=inputs["input_ids"][:b], attention_mask=inputs["attention_mask"][:b]
            )
        else:
            keys = rows[:b].detach()  # momentum 0: a memory bank of the online view-0 embeddings
        # (B, H) per rank -> (W * B, H) on every rank, with each key's sentence id and text hash (B,)
        ids = batch.ids if batch.groups is None else batch.groups  # pair shards: the rules compare groups
        self.queue.enqueue_gathered(keys, ids, batch.text_hashes, apply)

    def after_step(self, online: torch.nn.Module, apply: torch.Tensor | None) -> None:
        if self.momentum_encoder is not None:
            self.momentum_encoder.update(online, self.config.momentum, apply)

    def states(self) -> dict[str, torch.nn.Module]:
        out = {"queue": self.queue} if self.queue is not None else {}
        if self.momentum_encoder is not None:
            out["momentum_encoder"] = self.momentum_encoder
        return out

    def per_micro_batch(self) -> list[torch.nn.Module]:
        return [self.queue] if self.queue is not None else []

    def copies(self) -> list[torch.nn.Module]:
        return [self.momentum_encoder] if self.momentum_encoder is not None else []

    def report(self) -> dict[str, Any]:
        return {"queue_fill": self.queue.fill_fraction} if self.queue is not None else {}

    def dump(self) -> dict[str, Any]:
        if self.queue is None:
            return {}
        return {"queue_checksum": tensor_checksum([self.queue.keys]), "queue_fill": self.queue.fill}
