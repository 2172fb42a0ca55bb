"""Matryoshka embeddings (Kusupati et al. 2022, "Matryoshka Representation Learning"): the run's terms
re-evaluated on prefixes of the embedding, so that the first k dimensions, re-normalised, are an
embedding of their own (stored and searched at k/H of the cost).

sentence-transformers' ``MatryoshkaLoss`` wraps one base loss and sums ``w_k * base(prefix_k)`` over
its dims. Here the base is the run's own list of terms: the ``matryoshka`` term names the terms it
re-evaluates (``of``; default every term of the run that compares embeddings) and adds, for each prefix
width k of ``dims``::

    matryoshka = sum_k w_k * sum_{i in of} weight_i * term_i(prefix_k(step output))
    prefix_k(x) = x[..., :k] / ||x[..., :k]||

The full width is trained by the terms themselves (the matryoshka term is added to them, never replaces
them), so ``dims`` usually lists the smaller widths only; listing the model's width adds its terms once
more. Every embedding of the step output is truncated: the views, the hard negatives and the queue's
keys (a prefix of a unit key, re-normalised, is the key the truncated encoder would have produced).

**Distillation on a prefix.** The teacher (multilingual-e5-small, 384-d) is not Matryoshka-trained: its
own first k dimensions are not a k-d embedding of anything, and the student's k-d prefix lives in a
different space from the teacher's 384-d vector, so ``1 - cos(prefix_k(s_b), t_b)`` is not defined (the
widths differ) and a projection per width would be a head the export never carries. What is comparable
is the geometry: for a ``distill`` or ``kl`` term the prefix is trained with in-batch similarity
distillation (the ``kl`` formula, :func:`pipeline.losses.distill.kl_loss`): the student prefix's
softmax over the cosines to the other sentences of the global batch is matched to the teacher's over
its full-width cosines::

    p_t(c | b) = softmax_c(t_b . t_c / tau),   p_s^k(c | b) = softmax_c(prefix_k(s_b) . prefix_k(s_c) / tau)
    prefix loss = mean_b KL(p_t(. | b) || p_s^k(. | b))

with tau = ``temperature`` for a distill term and the kl term's own temperatures for a kl term. Matching
the similarity distribution rather than the raw cosines (an MSE of the two cosine matrices) keeps the
gradient at the scale of the other terms: e5's cosines crowd into [0.7, 1], and their squared
differences are ~1e-3.

Terms that cannot be taken on a prefix are refused: ``mlm`` (no embedding), ``sbert`` (its classifier
reads 3H inputs) and ``luse`` with ``teacher_positive`` when a projection compares student and teacher.

Distributed: each prefix loss is its own term's formula on truncated tensors (gathers included), so
its rank-mean and DDP gradient equal the single-process ones exactly when the term's do
(``tests/test_matryoshka_gloo.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import VIEWS, StepOutput, Term, WeightedTerm

DEFAULT_DIMS = [256, 128, 64]  # prefix widths trained besides the full one (e5-small: 384)
def prefix(x: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """The first ``dim`` dimensions of (..., H) embeddings, re-normalised: (..., dim)."""
    if x is None:
        return None
    return F.normalize(at_least_float32(x[..., :dim]), dim=-1)


def truncate(out: StepOutput, dim: int) -> StepOutput:
    """The step output with every student embedding cut to its re-normalised ``dim``-prefix."""
    return dataclasses.replace(
        out,
        views=prefix(out.views, dim),  # (n, B, dim)
        hard_negatives=prefix(out.hard_negatives, dim),  # (m, B, dim)
        queue=prefix(out.queue, dim),  # (Q, dim)
        head=None,  # no projection of a prefix (refused in bind)
    )


def prefix_term_loss(t: WeightedTerm, out: StepOutput, dim: int, temperature: float) -> torch.Tensor:
    """Term ``t`` on the ``dim``-prefix of the step output (unweighted)."""
    short = truncate(out, dim)
    if t.term.prefix_loss is not None:  # a term with a formula of its own there (distill, kl)
        return t.term.prefix_loss(t.config, short, out, temperature)
    return t.term.loss(t.config, short)


def compute_loss(
    out: StepOutput,
    terms: list[WeightedTerm],
    dims: list[int],
    weights: list[float],
    temperature: float = 0.05,
) -> torch.Tensor:
    """``sum_k w_k sum_i weight_i term_i(prefix_k(out))`` over ``dims`` and the run's ``terms``."""
    width = out.views.shape[-1]
    if max(dims) > width:
        raise ConfigError(f"matryoshka.dims {dims}: the embeddings are {width}-d; keep dims <= {width}")
    total = out.views.new_zeros((), dtype=at_least_float32(out.views).dtype)
    for dim, w in zip(dims, weights):
        for t in terms:
            total = total + w * t.weight * prefix_term_loss(t, out, dim, temperature)
    return total


@dataclass
class MatryoshkaConfig:
    dims: list[int] = option(
        DEFAULT_DIMS, "Prefix widths trained besides the full one, largest first (each <= the model's)."
    )
    weights: list[float] = option([], "One weight per dim (empty: 1 each).")
    of: list[str] = option(
        [], "The run's terms re-evaluated on prefixes (empty: every term but mlm and sbert)."
    )
    temperature: float = option(
        0.05, "tau of the in-batch similarity distillation a distill term becomes on a prefix."
    )

    def __post_init__(self) -> None:
        if not self.dims:
            raise ConfigError("matryoshka.dims is empty; list prefix widths such as [256, 128, 64]")
        if any(d < 1 for d in self.dims):
            raise ConfigError(f"matryoshka.dims {self.dims}: every width must be >= 1")
        if list(self.dims) != sorted(set(self.dims), reverse=True):
            raise ConfigError(
                f"matryoshka.dims {self.dims} must be distinct and sorted largest first, e.g. "
                f"{sorted(set(self.dims), reverse=True)}"
            )
        if not self.weights:
            self.weights = [1.0] * len(self.dims)
        if len(self.weights) != len(self.dims):
            raise ConfigError(
                f"matryoshka.weights has {len(self.weights)} values for {len(self.dims)} dims; give one "
                "per dim or none (1 each)"
            )
        if any(w <= 0 for w in self.weights):
            raise ConfigError(f"matryoshka.weights {self.weights} must all be > 0; drop a dim instead of 0")
        if self.temperature <= 0:
            raise ConfigError("matryoshka.temperature must be > 0 (try 0.05)")


def check_width(c: MatryoshkaConfig, width: int) -> None:
    """Refuse prefixes wider than the encoder (before training, when the model is built)."""
    if max(c.dims) > width:
        raise ConfigError(
            f"matryoshka.dims {c.dims}: the model's embeddings are {width}-d; keep every dim <= {width}"
        )


def bind(c: MatryoshkaConfig, run: list[WeightedTerm]) -> Term:
    """The term bound to the run's terms it re-evaluates (``of``); a ConfigError if one does not fit."""
    names = [t.term.name for t in run]
    if c.of:
        missing = [n for n in c.of if n not in names]
        if missing:
            raise ConfigError(
                f"matryoshka.of names {', '.join(missing)}, not a term of this run ({', '.join(names)})"
            )
        refused = [f"{t.term.name} ({t.term.prefix_refusal})" for t in run
                   if t.term.name in c.of and t.term.prefix_refusal]  # fmt: skip
        if refused:
            raise ConfigError(f"matryoshka.of: cannot take {', '.join(refused)} on a prefix")
        inner = [t for t in run if t.term.name in c.of]
    else:
        inner = [t for t in run if t.term.prefix_refusal is None]
        if not inner:
            raise ConfigError(f"matryoshka: no term of this run ({', '.join(names)}) compares embeddings")
    for t in inner:
        if t.term.needs(t.config).teacher_positive:
            raise ConfigError(
                "matryoshka.of: luse with teacher_positive compares full-width vectors with the teacher; "
                "drop teacher_positive or leave luse out of matryoshka.of"
            )
    reads = frozenset().union(*(_reads_on_prefix(t) for t in inner))
    return dataclasses.replace(
        TERM,
        loss=lambda c, out: compute_loss(out, inner, c.dims, c.weights, c.temperature),
        reads=lambda c: reads,
        bind=None,
    )


def _reads_on_prefix(t: WeightedTerm) -> frozenset[str]:
    return t.term.prefix_reads if t.term.prefix_reads is not None else t.term.reads(t.config)


def _unbound(c: MatryoshkaConfig, out: StepOutput) -> torch.Tensor:
    raise RuntimeError("the matryoshka term is evaluated once bound to the run's terms (parse_terms)")


TERM = Term(
    name="matryoshka",
    summary="the run's terms again on re-normalised prefixes of the embedding (Matryoshka dims)",
    config=MatryoshkaConfig,
    loss=_unbound,
    reads=lambda c: frozenset({VIEWS}),
    part="matryoshka",
    bind=bind,
    check_width=check_width,
    prefix_refusal="it is the matryoshka term",
    describe=lambda fields: {"prefix_dims": fields.get("dims") or DEFAULT_DIMS, "cite": ["matryoshka"]},
)
