"""Matryoshka embeddings (Kusupati et al. 2022, "Matryoshka Representation Learning"): the run's terms
re-evaluated on prefixes of the embedding, so that the first k dimensions, re-normalised, are an
embedding of their own (stored and searched at k/H of the cost).

sentence-transformers' ``MatryoshkaLoss`` wraps one base loss and sums ``w_k * base(prefix_k)`` over
its dims. Here the base is the run's own list of terms: the ``matryoshka`` term names the terms it
re-evaluates (``of``; default every term of the run that compares embeddings) and holds them, built
(:class:`Matryoshka`), and adds, for each prefix width k of ``dims``::

    matryoshka = sum_k w_k * sum_{i in of} weight_i * term_i(prefix_k(rows), batch)
    prefix_k(x) = x[..., :k] / ||x[..., :k]||

The full width is trained by the terms themselves (the matryoshka term is added to them, never replaces
them), so ``dims`` usually lists the smaller widths only; listing the model's width adds its terms once
more. Every student embedding a term compares is truncated: the rows (views and hard negatives,
:meth:`~pipeline.losses.terms.Rows.shortened`) and the queue's keys, which a term cuts as its rows are
(:meth:`~pipeline.losses.terms.Rows.cut`; a prefix of a unit key, re-normalised, is the key the
truncated encoder would have produced). A term's own forward is its value on the shortened rows: the
teacher terms read :attr:`~pipeline.losses.terms.Rows.prefix` and take the formula below there.

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

Terms that cannot be taken on a prefix say so themselves
(:attr:`~pipeline.losses.terms.LossTerm.prefix_refusal`: the MLM term has no embedding, sbert's classifier
reads 3H inputs) and are refused, as is a term that compares full-width vectors with the teacher (luse's
``teacher_positive``).

Distributed: each prefix loss is its own term's formula on truncated tensors (gathers included), so
its rank-mean and DDP gradient equal the single-process ones exactly when the term's do
(``tests/test_matryoshka_gloo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.losses._precision import at_least_float32
from pipeline.losses.terms import VIEWS, LossTerm, Rows, TermContext, WeightedTerm

if TYPE_CHECKING:
    from pipeline.data.collate import Batch

DEFAULT_DIMS = [256, 128, 64]  # prefix widths trained besides the full one (e5-small: 384)


def compute_loss(
    rows: Rows,
    batch: Batch,
    terms: list[LossTerm],
    dims: list[int],
    weights: list[float],
    temperature: float = 0.05,
) -> torch.Tensor:
    """``sum_k w_k sum_i weight_i term_i(prefix_k(rows), batch)`` over ``dims`` and the built ``terms``."""
    width = rows.views.shape[-1]
    if max(dims) > width:
        raise ConfigError(f"matryoshka.dims {dims}: the embeddings are {width}-d; keep dims <= {width}")
    total = rows.views.new_zeros((), dtype=at_least_float32(rows.views).dtype)
    for dim, w in zip(dims, weights):
        for t in terms:  # each term on its own cut (., dim): one graph per term, as each term alone has
            total = total + w * t.weight * t(rows.shortened(dim, temperature), batch)
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


class Matryoshka(LossTerm):
    """the run's terms again on re-normalised prefixes of the embedding (Matryoshka dims)

    In training it holds the run's built terms it re-evaluates (not as submodules: they are the run's,
    with their own state) and calls each on the shortened rows."""

    name = "matryoshka"
    config_class = MatryoshkaConfig
    part = "matryoshka"
    prefix_refusal = "it is the matryoshka term"

    @classmethod
    def reads(cls, config: MatryoshkaConfig) -> frozenset[str]:
        return frozenset({VIEWS})  # and what its terms read, which are in the run themselves

    @classmethod
    def check_width(cls, config: MatryoshkaConfig, width: int) -> None:
        """Refuse prefixes wider than the encoder (before training, when the model is built)."""
        if max(config.dims) > width:
            raise ConfigError(
                f"matryoshka.dims {config.dims}: the model's embeddings are {width}-d; keep every dim "
                f"<= {width}"
            )

    @classmethod
    def wraps(cls, config: MatryoshkaConfig, run: list[WeightedTerm]) -> list[str]:
        """The names of the run's terms it re-evaluates (``of``); a ConfigError if one does not fit."""
        names = [t.term.name for t in run]
        if config.of:
            missing = [n for n in config.of if n not in names]
            if missing:
                raise ConfigError(
                    f"matryoshka.of names {', '.join(missing)}, not a term of this run ({', '.join(names)})"
                )
            refused = [f"{t.term.name} ({t.term.prefix_refusal})" for t in run
                       if t.term.name in config.of and t.term.prefix_refusal]  # fmt: skip
            if refused:
                raise ConfigError(f"matryoshka.of: cannot take {', '.join(refused)} on a prefix")
            inner = [t for t in run if t.term.name in config.of]
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
        return [t.term.name for t in inner]

    @classmethod
    def describe(cls, fields: dict[str, Any]) -> dict[str, Any]:
        return {"prefix_dims": fields.get("dims") or DEFAULT_DIMS, "cite": ["matryoshka"]}

    def __init__(self, weighted: WeightedTerm, context: TermContext):
        super().__init__(weighted, context)
        names = self.wraps(self.config, [t.weighted for t in context.terms.values()])
        self.inner = [context.terms[name] for name in names]  # a list: not registered twice

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:
        c: MatryoshkaConfig = self.config
        return compute_loss(rows, batch, self.inner, c.dims, c.weights, c.temperature)
