"""The training loss as a list of weighted terms (as sentence-transformers' trainer sums a dict of losses).

A run's loss is ``sum_i weight_i * term_i(rows, batch)``, written in the training config as::

    loss:
      - luse: {temperature: 0.05, queue_size: 256, momentum: 0.995}
        weight: 1.0
      - mlm: {probability: 0.15}
        weight: 0.1

Each term is one class in its own file, a :class:`LossTerm` (an ``nn.Module``, as each
sentence-transformers loss is): class attributes and classmethods say what it is (its config dataclass,
what it reads: views, pairs, labels, teacher, hard negatives, queue, MLM logits; the batch columns and
state it needs, :class:`Needs`: an MLM head and masked originals, text hashes, a queue's size), its
``forward(rows, batch)`` is its formula, and its state (luse's negative queue and momentum encoder, kl's
teacher queue) is its submodules. In training the loss is built once per run and kept: :class:`TrainLoss`,
a ``ModuleDict`` of the terms, each called as ``term(rows, batch)``: :class:`Rows`, what the model gave
(the views and hard negatives, the MLM logits, the head), and the typed
:class:`~pipeline.data.collate.Batch`, from which the term reads its own columns. What one term reads of
another's state goes through one small record, :class:`Lent`; a term over others (matryoshka) is handed
them, built, and calls them on shortened rows. The trainer calls only :class:`TrainLoss`'s methods
(``compute``, ``after_micro_batch``, ``after_step``, ``states``) and never asks for a term by name.
``TERMS`` (pipeline/losses/__init__.py) is the registry, the one list of term classes: a new term is a new
file and one line there.

At most one term is a *main* term: it decides the data and the views of a batch (luse: original +
cached EDA variants + dropout views from the shards; simcse: two dropout views; sup_simcse, cosent,
sbert: the texts of a supervised file). Distillation, KL and MLM read the originals (view 0) of the
shards' batches; with no main term (distillation alone) a batch holds the originals only.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError, InputError
from pipeline.losses._precision import at_least_float32

if TYPE_CHECKING:
    from pipeline.data.collate import Batch
    from pipeline.losses.queue import NegativeQueue

# What a term reads (LossTerm.reads): the rows the model gave (the views, a pair's texts, the hard negatives,
# the MLM logits), the batch's labels and teacher rows, the run's negative queue (lent by the term that
# holds it, :class:`Lent`).
VIEWS, PAIRS, LABELS, TEACHER = "views", "pairs", "labels", "teacher"
HARD_NEGATIVES, QUEUE, MLM_LOGITS = "hard_negatives", "queue", "mlm_logits"


@dataclass(frozen=True)
class Prefix:
    """A matryoshka prefix the rows were cut to: every embedding a term compares with them (a queue's
    keys) is cut the same way (:meth:`Rows.cut`); ``temperature`` is what a teacher term's in-batch
    similarity distillation takes there (pipeline/losses/matryoshka.py)."""

    dim: int
    temperature: float


Encoded = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # the model's rows (N, H), or (rows, MLM logits)


@dataclass(frozen=True)
class Rows:
    """What the model gave for one micro-batch, laid out as the :class:`Batch` (pipeline/data/collate.py)
    says (``num_views`` and ``num_hard_negatives``): what every term reads beside the batch's columns."""

    views: torch.Tensor  # (n, B, H) L2-normalised: view v of sentence b at [v, b] (a pair: anchor, positive)
    hard_negatives: torch.Tensor | None = None  # (m, B, H): negative j of sentence b at [j, b]
    mlm_logits: torch.Tensor | None = None  # (M, V) at the selected positions, or (B, L, V)
    head: nn.Module | None = None  # the trainable head (sbert classifier or the teacher projection)
    gather: bool = True  # gather candidates across ranks (a collective)
    prefix: Prefix | None = None  # the rows are a matryoshka prefix (None: the full width)
    # Counts a term reports besides its value (luse's ``false_negatives``: candidates it masked); the loss
    # returns them beside the parts, so they are logged with them.
    counts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(encoded: Encoded, batch: Batch, head: nn.Module | None) -> Rows:
        """What the model's forward returned, the rows (N, H) or (rows, MLM logits (M, V)), laid out
        by ``batch``: rows [0, n*B) are the n views, rows [n*B, (n+m)*B) the m hard negatives."""
        rows, mlm_logits = encoded if isinstance(encoded, tuple) else (encoded, None)
        n, m = batch.num_views, batch.num_hard_negatives
        b, h = rows.shape[0] // (n + m), rows.shape[-1]
        hard_negatives = rows[n * b :].view(m, b, h) if m else None  # (m, B, H)
        return Rows(rows[: n * b].view(n, b, h), hard_negatives, mlm_logits, head)  # views (n, B, H)

    def cut(self, keys: torch.Tensor) -> torch.Tensor:
        """Student embeddings of elsewhere (a queue's (Q, H) keys) as these rows are: the same prefix."""
        return keys if self.prefix is None else prefix_of(keys, self.prefix.dim)

    def shortened(self, dim: int, temperature: float) -> Rows:
        """These rows cut to their re-normalised ``dim``-prefix, without the head (no projection of a
        prefix); the counts stay shared."""
        negatives = self.hard_negatives  # (m, B, H) -> (m, B, dim)
        negatives = None if negatives is None else prefix_of(negatives, dim)
        return dataclasses.replace(
            self,
            views=prefix_of(self.views, dim),  # (n, B, dim)
            hard_negatives=negatives,
            head=None,
            prefix=Prefix(dim, temperature),
        )


def prefix_of(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The first ``dim`` dimensions of (..., H) embeddings, re-normalised: (..., dim)."""
    return F.normalize(at_least_float32(x[..., :dim]), dim=-1)


@dataclass
class Lent:
    """The state one term holds and others read, lent for the run: the negative queue (luse's: its keys,
    ids and text hashes, read by kl and the teacher terms on a prefix) and the teacher rows of the same
    queued sentences (kl's, read by luse's teacher_margin rule). The terms that hold them put them here
    when they are built (:class:`TermContext`); None: the run has none."""

    queue: NegativeQueue | None = None
    teacher_queue: NegativeQueue | None = None


@dataclass(frozen=True)
class Needs:
    """What a term needs from the trainer besides the step output, given its config: the state the
    trainer builds, checkpoints and updates for it, and the batch columns the collator adds for it.
    A run's needs are its terms' merged (:attr:`Loss.needs`); the trainer reads only these."""

    queue_size: int = 0  # a negative queue of this many keys of earlier steps (0: none)
    momentum: float = 0.0  # the EMA momentum of the queue's key encoder (0: keys are the online view 0)
    teacher_queue: bool = False  # beside a queue: the teacher embeddings of the queued sentences
    mlm_probability: float | None = None  # an MLM head, and originals masked with it in the loader
    text_hashes: bool = False  # batches carry hashes of the normalised texts (a same_text rule)
    teacher_positive: bool = False  # the teacher's embedding is a positive: one view suffices

    def merge(self, other: Needs) -> Needs:
        """Both terms' needs; one queue (and momentum) per run, so two terms that size it differently
        are a ConfigError."""
        queue, other_queue = (self.queue_size, self.momentum), (other.queue_size, other.momentum)
        if self.queue_size and other.queue_size and queue != other_queue:
            raise ConfigError(
                f"loss: two terms ask for different negative queues (size, momentum) {queue} and "
                f"{other_queue}; give them one"
            )
        masks = {p for p in (self.mlm_probability, other.mlm_probability) if p is not None}
        if len(masks) > 1:
            raise ConfigError(f"loss: two terms mask the originals at {sorted(masks)}; give them one")
        queued = self if self.queue_size else other
        return Needs(
            queue_size=queued.queue_size,
            momentum=queued.momentum,
            teacher_queue=self.teacher_queue or other.teacher_queue,
            mlm_probability=masks.pop() if masks else None,
            text_hashes=self.text_hashes or other.text_hashes,
            teacher_positive=self.teacher_positive or other.teacher_positive,
        )


class LossTerm(nn.Module):
    """One term of the loss, one class in its own file (as each sentence-transformers loss is one
    ``nn.Module``); the first paragraph of a term's docstring is its one line in ``--help``.

    The class says what the term is, before anything is built: class attributes (``name``, the key in the
    config's ``loss`` list; ``config_class``, its config dataclass; ``part``, ``data``, ...) and
    classmethods of its config (``reads``, ``needs``, ``num_views``, ...). The config checks, the data plan
    and build read only these. An instance is the term in training, built once per run by
    :class:`TrainLoss` from its :class:`WeightedTerm` and the run's :class:`TermContext`: ``forward(rows,
    batch)`` is its formula on what the model gave (:class:`Rows`) and the typed batch; state of its own (a
    negative queue, a momentum encoder) is its submodules and buffers, so it is in its ``state_dict``, and
    what another term reads of it is lent through the run's :class:`Lent` when it is built. The trainer
    knows that state only through the hooks below, never by name: :meth:`after_micro_batch` (enqueue),
    :meth:`after_step` (the momentum update), :meth:`states` (what a checkpoint holds, under the names
    checkpoints have always used), :meth:`report` (logged values), :meth:`dump` (the debug dump).

    A new term is a subclass in a new file and one line in ``TERMS`` (pipeline/losses/__init__.py);
    tests/toy_term.py is the smallest.
    """

    name: ClassVar[str]  # the key in the config's ``loss`` list
    config_class: ClassVar[type]  # its config dataclass (fields documented with ``option``)
    part: ClassVar[str] = "contrastive"  # the logged name of its value (``{part}_loss``)
    # A main term decides where batches come from: "shards", "pair_shards", "pairs" or "triples" (a
    # supervised file); None: it reads the originals of whatever the main term (or no term) gives.
    data: ClassVar[str | None] = None
    uses_variants: ClassVar[bool] = False  # its views are the original, k cached variants, d dropout views
    # A sentence-shard main term that also trains on pair shards (luse; :meth:`pair_views`); False: a
    # ConfigError on pair shards (pipeline/data/sources.py).
    trains_on_pairs: ClassVar[bool] = False
    label_dtype: ClassVar[torch.dtype | None] = None  # labels of a supervised file (None: no label column)
    # Why it cannot be taken on a re-normalised prefix of the embedding (None: it can, and its forward on
    # shortened rows, :attr:`Rows.prefix`, is its value there; pipeline/losses/matryoshka.py).
    prefix_refusal: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in ("name", "config_class") if not hasattr(cls, name)]
        if missing:  # a term the registry could not key or parse: said where it is defined, not later
            raise TypeError(
                f"loss term {cls.__qualname__} sets no {' and no '.join(missing)} (class attributes)"
            )

    @classmethod
    def summary(cls) -> str:
        """Its one line for ``--help`` and the docs: the first paragraph of the class docstring."""
        return " ".join((inspect.getdoc(cls) or cls.name).split("\n\n")[0].split())

    @classmethod
    def reads(cls, config: Any) -> frozenset[str]:
        """What it reads, given its config: ``VIEWS``, ``PAIRS``, ``LABELS``, ``TEACHER``, ...."""
        return frozenset({VIEWS})

    @classmethod
    def num_views(cls, num_variants: int, num_dropout_views: int) -> int:
        """A main term's views per sentence, given k cached variants and d dropout views."""
        return 1

    @classmethod
    def pair_views(cls, config: Any, num_dropout_views: int) -> int:
        """Views per pair on pair shards of a term that :attr:`trains_on_pairs`; a ConfigError for an option
        of its config that does not apply to pairs."""
        return 2

    @classmethod
    def needs(cls, config: Any) -> Needs:
        """Its state and batch columns (:class:`Needs`), given its config."""
        return Needs()

    @classmethod
    def projects(cls, config: Any) -> bool:
        """Whether it compares student and teacher vectors (a projection when their widths differ)."""
        return False

    @classmethod
    def make_head(cls, config: Any, dim: int) -> nn.Module | None:
        """A trainable head of its own (sbert's classifier), given the encoder's width; None: none."""
        return None

    @classmethod
    def check_width(cls, config: Any, width: int) -> None:
        """A ConfigError when its config does not fit the encoder's width (checked when the model is
        built)."""

    @classmethod
    def wraps(cls, config: Any, run: list[WeightedTerm]) -> list[str] | None:
        """A term over the run's other terms (matryoshka): the names of those it wraps, or a ConfigError
        when they do not fit; its instance is handed them, built (:attr:`TermContext.terms`). None: it
        wraps none."""
        return None

    @classmethod
    def describe(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """What the model card says of it, from its fields as config.yaml saved them: ``{"rows": [(what,
        value)], "cite": [citation keys], "prefix_dims": [widths it trained]}``, each optional."""
        return {}

    def __init__(self, weighted: WeightedTerm, context: TermContext):
        super().__init__()
        self.weighted = weighted
        self.config, self.weight = weighted.config, weighted.weight
        self.lent = context.lent  # what the run's terms lend each other (a plain record, not a submodule)

    def forward(self, rows: Rows, batch: Batch) -> torch.Tensor:  # () the term's unweighted value
        raise NotImplementedError(f"loss term {self.name} defines no forward")

    def after_micro_batch(self, rows: torch.Tensor, inputs: dict[str, torch.Tensor], batch: Any,
                          apply: torch.Tensor | None) -> None:  # fmt: skip
        """After a micro-batch's backward, when its step is applied (as far as the host knows; ``apply``
        the device verdict): e.g. enqueue its keys. ``rows`` (N, H) as the model gave them."""

    def after_step(self, online: nn.Module, apply: torch.Tensor | None) -> None:
        """After an applied optimizer step: e.g. the momentum encoder follows ``online``."""

    def states(self) -> dict[str, nn.Module]:
        """This term's checkpointed states by checkpoint name; the trainer saves and restores them."""
        return {}

    def per_micro_batch(self) -> list[nn.Module]:
        """The states :meth:`after_micro_batch` changes (copied before a multi-micro-batch step and put
        back when the guard refuses it)."""
        return []

    def copies(self) -> list[nn.Module]:
        """Encoder copies this term runs (a momentum encoder), for the trainer's precision set-up."""
        return []

    def report(self) -> dict[str, Any]:
        """Values the loop logs at log steps (host values only, e.g. a queue's fill fraction)."""
        return {}

    def dump(self) -> dict[str, Any]:
        """Checksums of the state for the debug dump (train.debug_dump)."""
        return {}


@dataclass(frozen=True)
class WeightedTerm:
    term: type[LossTerm]
    config: Any  # an instance of term.config_class
    weight: float


@dataclass(frozen=True)
class Columns:
    """What a run's terms ask every batch to carry, said in one place (:meth:`Loss.columns`); the data plan
    holds it against the shards' manifest (:func:`pipeline.data.plan.plan_batches`)."""

    source: str  # where batches come from: "shards", "pair_shards", "pairs" or "triples" (a supervised file)
    num_variants: int  # k: cached EDA variants after each original (shards; the config's, at most)
    num_dropout_views: int  # d: dropout re-encodings after them (all n - 1 views when no term reads variants)
    teacher: bool  # a term reads the teacher's rows (the shards must hold them)
    text_hashes: bool  # hashes of the normalised texts (a same_text false-negative rule)
    mlm_probability: float | None  # originals masked at this rate (the MLM head's labels); None: none
    num_texts: int  # a supervised file's texts per record
    label_dtype: torch.dtype | None  # a supervised file's label column (None: no labels)


class Loss:
    """A run's weighted terms as the config gave them, before anything is built: where the batches come
    from, their views and columns (:meth:`columns`), the head. :class:`TrainLoss` is built from it."""

    def __init__(self, terms: list[WeightedTerm]):
        self.terms = terms
        main = [t.term for t in terms if t.term.data is not None]
        self.main: type[LossTerm] | None = main[0] if main else None
        self.needs = Needs()  # what the trainer builds for the terms: the one place it learns of them
        for t in terms:
            self.needs = self.needs.merge(t.term.needs(t.config))
        if not self.needs.queue_size:  # a teacher queue mirrors the negative queue's rows
            self.needs = dataclasses.replace(self.needs, teacher_queue=False)

    @property
    def data(self) -> str:
        """Where the batches come from: "shards", "pairs" or "triples"."""
        return self.main.data if self.main is not None else "shards"

    @property
    def unsupervised(self) -> bool:
        return self.data in ("shards", "pair_shards")  # both read data.shards

    def reads(self, what: str) -> bool:
        return any(what in t.term.reads(t.config) for t in self.terms)

    def num_views(self, num_variants: int, num_dropout_views: int) -> int:
        """Views per sentence n: the main term's; the originals alone without one."""
        if self.main is None:
            return 1
        return self.main.num_views(num_variants, num_dropout_views)

    def shard_views(self, num_variants: int, num_dropout_views: int) -> tuple[int, int]:
        """(cached variants, dropout re-encodings) a shards batch carries after each original."""
        if self.main is not None and self.main.uses_variants:
            return num_variants, num_dropout_views
        return 0, self.num_views(num_variants, num_dropout_views) - 1

    def check_batch(self, keys_per_micro_batch: int) -> None:
        """A ConfigError when the terms' state does not fit the batches: a negative queue holds a whole
        number of micro-batches' keys (``keys_per_micro_batch``: gathered from every rank)."""
        if self.needs.queue_size:
            from pipeline.losses.queue import validate_queue_size

            validate_queue_size(self.needs.queue_size, keys_per_micro_batch)

    def columns(self, num_variants: int, num_dropout_views: int) -> Columns:
        """What every batch carries for these terms, given the config's views (``data.num_variants`` and
        ``num_dropout_views``)."""
        k, d = self.shard_views(num_variants, num_dropout_views)
        return Columns(
            source=self.data,
            num_variants=k,
            num_dropout_views=d,
            teacher=self.reads(TEACHER),
            text_hashes=self.needs.text_hashes,  # they cost the loader workers and a gather per step
            mlm_probability=self.needs.mlm_probability,
            num_texts=self.num_views(0, 0),
            label_dtype=self.main.label_dtype if self.main is not None else None,
        )

    def build_head(self, dim: int, teacher_dim: int) -> nn.Module | None:
        """The trainable head: the main term's own (sbert), else the student->teacher projection when a
        term compares student and teacher vectors of different widths (trained, never exported)."""
        from pipeline.model.heads import projection_head

        for t in self.terms:  # the one place the loss meets the encoder's width, before training
            t.term.check_width(t.config, dim)
        for t in self.terms:
            head = t.term.make_head(t.config, dim)
            if head is not None:
                return head
        projects = any(t.term.projects(t.config) for t in self.terms)
        if projects and teacher_dim and teacher_dim != dim:
            return projection_head(dim, teacher_dim)
        return None


# ---------------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class LossOut:
    """What the loss gives for one micro-batch: the weighted total, each term's value by its ``part``
    name (contrastive, distill, kl, mlm, matryoshka), and the counts a term reports (not losses). Parts
    and counts stay apart: the step logs a part as ``{part}_loss`` (mean over micro-batches) and a count
    as ``{name}_count`` (summed), and a count cannot overwrite a part of the same name."""

    total: torch.Tensor  # () the weighted sum the backward starts from
    parts: dict[str, torch.Tensor]  # () each term's unweighted value
    counts: dict[str, torch.Tensor]  # () e.g. luse's false_negatives: candidates it masked

    def detach(self) -> LossOut:
        """The same values cut from the graph (what a step keeps of each micro-batch)."""
        return LossOut(
            self.total.detach(),
            {k: v.detach() for k, v in self.parts.items()},
            {k: v.detach() for k, v in self.counts.items()},
        )


@dataclass(frozen=True)
class TermContext:
    """What a term module may build its state from: the online encoder (a momentum copy), its width,
    the teacher's width (the shards' manifest; 0: none), the run's merged :class:`Needs`, the
    :class:`Lent` record the terms share their state through, and (for a term over others, matryoshka)
    the run's other terms, built."""

    encoder: nn.Module
    dim: int
    teacher_dim: int
    needs: Needs
    lent: Lent = dataclasses.field(default_factory=Lent)
    terms: dict[str, LossTerm] = dataclasses.field(default_factory=dict)


class TrainLoss(nn.Module):
    """The run's loss, built once and kept by the trainer: a ``ModuleDict`` of its weighted terms (each a
    :class:`LossTerm`, holding its own state). :meth:`compute` calls each term on one micro-batch and
    gives their weighted sum (:class:`LossOut`); :meth:`after_micro_batch` and :meth:`after_step` let each
    term update its state; :meth:`states` is what the checkpoint holds of them."""

    def __init__(self, plan: Loss, context: TermContext):
        super().__init__()
        self.plan = plan  # the stateless description (data, views, needs) the config checks read
        context = dataclasses.replace(context, lent=Lent(), terms={})  # one record the run's terms share
        built: dict[str, LossTerm] = {}
        over = {t.term.name for t in plan.terms if t.term.wraps(t.config, plan.terms) is not None}
        for t in plan.terms:  # the terms over others (matryoshka) last: they are handed the others, built
            if t.term.name not in over:
                built[t.term.name] = t.term(t, context)
        for t in plan.terms:
            if t.term.name in over:
                built[t.term.name] = t.term(t, dataclasses.replace(context, terms=dict(built)))
        self.terms = nn.ModuleDict({t.term.name: built[t.term.name] for t in plan.terms})  # config order

    @property
    def parts(self) -> set[str]:
        return {t.part for t in self.terms.values()}

    def compute(self, rows: Rows, batch: Batch) -> LossOut:
        """The loss over one micro-batch: each term on its rows and batch, and their weighted sum. The
        batch's per-sentence columns are on the rows' device (the engine moves them with the model's
        inputs, :meth:`~pipeline.data.collate.Batch.sentences_to`)."""
        self.check(batch)
        terms = list(self.terms.values())
        parts = {t.part: t(rows, batch) for t in terms}
        total: Any = sum(t.weight * parts[t.part] for t in terms)
        return LossOut(total, parts, rows.counts)

    def check(self, batch: Batch) -> None:
        """An InputError when the batch lacks what a term reads, or holds what none reads."""
        if batch.teacher is None and self.plan.reads(TEACHER):
            raise InputError(
                "loss: a term reads teacher embeddings but the batch has no teacher embeddings; add a "
                "`teacher` column to the shards (the teacher stage) or remove the distill/kl terms and "
                "luse.teacher_positive"
            )
        if batch.num_hard_negatives and not self.plan.reads(HARD_NEGATIVES):
            raise InputError("loss: hard negatives in the batch but no term reads them; use luse")

    def after_micro_batch(self, rows: torch.Tensor, inputs: dict[str, torch.Tensor], batch: Any,
                          apply: torch.Tensor | None = None) -> None:  # fmt: skip
        for t in self.terms.values():
            t.after_micro_batch(rows, inputs, batch, apply)

    def after_step(self, online: nn.Module, apply: torch.Tensor | None = None) -> None:
        for t in self.terms.values():
            t.after_step(online, apply)

    def states(self) -> dict[str, nn.Module]:
        return {name: s for t in self.terms.values() for name, s in t.states().items()}

    def snapshot(self) -> list[tuple[nn.Module, dict[str, torch.Tensor]]]:
        """Copies of the per-micro-batch states, put back when a step of several micro-batches is refused."""
        changing = [s for t in self.terms.values() for s in t.per_micro_batch()]
        return [(s, {k: v.clone() for k, v in s.state_dict().items()}) for s in changing]

    def copies(self) -> list[nn.Module]:
        return [c for t in self.terms.values() for c in t.copies()]

    def report(self) -> dict[str, Any]:
        return {k: v for t in self.terms.values() for k, v in t.report().items()}

    def dump(self) -> dict[str, Any]:
        return {k: v for t in self.terms.values() for k, v in t.dump().items()}


# ------------------------------------------------------------------------------------------- config
def parse_terms(entries: list[dict[str, Any]], registry: dict[str, type[LossTerm]]) -> list[WeightedTerm]:
    """The config's ``loss`` list as weighted terms; every mistake a ConfigError naming the entry."""
    from pipeline.config import from_dict

    form = "each entry is {TERM: {fields}, weight: W}, TERM one of " + ", ".join(registry)
    if not entries:
        raise ConfigError(f"loss: no terms; {form} (docs/objectives.md)")
    out: list[WeightedTerm] = []
    for i, entry in enumerate(entries):
        key = f"loss[{i}]"
        names = [k for k in entry if k != "weight"] if isinstance(entry, dict) else []
        if len(names) != 1:
            raise ConfigError(f"{key}: expected one term and a weight, got {entry!r}; {form}")
        name = names[0]
        if name not in registry:
            raise ConfigError(f"{key}: unknown term {name!r}; {form}")
        fields = entry[name] or {}
        if not isinstance(fields, dict):
            raise ConfigError(f"{key}.{name}: expected a mapping of fields, got {fields!r}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ConfigError(
                f"{key}.weight of term {name} must be a number > 0, got {weight!r}; "
                "remove the term to turn it off"
            )
        term = registry[name]
        config = from_dict(term.config_class, fields, prefix=f"{key}.{name}.")
        out.append(WeightedTerm(term, config, float(weight)))
    seen = [t.term.name for t in out]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"loss: a term appears twice ({', '.join(seen)}); merge the entries")
    main = [t.term.name for t in out if t.term.data is not None]
    if len(main) > 1:
        raise ConfigError(
            f"loss: {' and '.join(main)} each decide the batch's data and views; keep one of them"
        )
    for t in out:
        t.term.wraps(t.config, out)  # a term over the others (matryoshka) checks that they fit
    return out


def as_entries(terms: list[WeightedTerm]) -> list[dict[str, Any]]:
    """The weighted terms back as config entries, every field resolved (what config.yaml records)."""
    from pipeline.config import to_dict

    return [{t.term.name: to_dict(t.config), "weight": t.weight} for t in terms]
