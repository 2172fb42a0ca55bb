"""The data plan: what every batch of a run carries, resolved once against the data it will read, before
any model is built.

:func:`plan_batches` holds the columns the loss's terms ask for (:meth:`pipeline.losses.terms.Loss.columns`:
views, teacher rows, text hashes, MLM masking, labels) and the ``data`` options against the shard set's
manifest (read once by :func:`pipeline.shards.read_shard_set`; None for a supervised file) and returns a
:class:`DataPlan`, with the teacher's width taken from the manifest. :func:`pipeline.data.build.build_stream`
builds the batches from it, and the projection head and the teacher queue take their width from it; nothing
after it asks the manifest again. The trainer's :func:`pipeline.train.plan.check_against_data` adds what
needs the world size and the loss (the global batch, the queue) and calls it. Every mistake here is one
:class:`ConfigError` line naming the field, the data and what to change.

The plan reads what the stages wrote through the formats only (:mod:`pipeline.shards`,
:mod:`pipeline.vectors`): it imports nothing from ``pipeline.stages``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pipeline.data.holdout import refuse_holdout
from pipeline.data.labelled import MANIFEST as PAIR_MANIFEST
from pipeline.data.labelled import PairTeacher, read_pair_teacher
from pipeline.data.sources import pair_batches, pair_dropout_views, refuse_pair_options
from pipeline.data.token_ids import ids_usable
from pipeline.errors import ConfigError
from pipeline.shards import MANIFEST, ShardSet, iter_blocks
from pipeline.vectors import describe, matches, stored_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataPlan:
    """What the run's batches carry, resolved from the config and the data (:func:`plan_batches`)."""

    source: str  # the loss's data: "shards", "pair_shards", "pairs" or "triples" (a supervised file)
    shard_set: ShardSet | None = field(default=None, repr=False)  # the manifest it was resolved against
    num_variants: int = 0  # k: cached EDA variants after each original (at most what the shards cache)
    num_dropout_views: int = 0  # d: dropout re-encodings of the original after the variants
    teacher: bool = False  # batches carry batch.teacher (pair batches: teacher_positive too)
    teacher_dim: int | None = None  # the teacher's width, from the manifest (None: the shards hold none)
    token_ids: bool = False  # pad the shards' stored token ids (their tokenizer hash is the model's)
    text_hashes: bool = False  # batches carry text hashes (a same_text false-negative rule reads them)
    num_hard_negatives: int = 0  # m: mined hard negatives after the views (at most what the shards cache)
    # Pair shards (``pipeline pairs``, docs/pairs.md): batches of (anchor, positive) with the columns
    # ``positive``, ``group``, ``source`` and, after the teacher stage, ``teacher_positive``.
    pairs: bool = False
    mlm_probability: float | None = None  # sentence shards: masked tokens drawn per batch (the mlm term)
    # A supervised file (source "pairs" or "triples"): its texts per record and its labels' dtype.
    num_texts: int = 0
    label_dtype: Any = None  # torch.dtype of the label column; None: the batches carry no labels
    pair_teacher: PairTeacher | None = None  # its teacher vectors (data.supervised_teacher): teacher is True

    @property
    def num_views(self) -> int:
        """n: views of each original in a sentence-shards batch (1 + k + d)."""
        return 1 + self.num_variants + self.num_dropout_views


def plan_batches(
    loss: Any, columns: Any, d: Any, shard_set: ShardSet | None, tokenizer: Any = None, prefix: str = ""
) -> DataPlan:
    """What every batch carries: the ``columns`` the loss's terms ask for
    (:class:`~pipeline.losses.terms.Columns`) and ``loss``'s main term (:class:`~pipeline.losses.terms.Loss`)
    held against ``d`` (the ``data`` options) and the shard set's manifest (None: the supervised file).

    ``tokenizer`` and ``prefix`` are the encoder's: shards that hold token ids are used only when their
    tokenizer hash equals theirs. They may be left out for shards without ids.
    """
    if shard_set is None:
        refuse_pair_options(d, False)
        vectors = check_pair_teacher(d) if d.supervised_teacher is not None else None  # its teacher's
        width = None if vectors is None else vectors.dim
        refuse_holdout(d, vectors is not None, False)  # data.holdout_rows reads teacher vectors
        return DataPlan(source=columns.source, num_texts=columns.num_texts, label_dtype=columns.label_dtype,
                        teacher=vectors is not None, teacher_dim=width, pair_teacher=vectors)  # fmt: skip
    pairs = pair_batches(loss, shard_set)  # pair shards vs the loss (pipeline/data/sources.py)
    variants = loss.main is not None and loss.main.uses_variants and not pairs  # pairs: no variants
    if variants and d.num_variants > shard_set.num_variants:
        raise ConfigError(
            f"data.num_variants={d.num_variants} but the shards in {d.shards} cache "
            f"{shard_set.num_variants} variants per sentence; set --data.num_variants <= "
            f"{shard_set.num_variants} or re-run augment with more variants"
        )
    refuse_pair_options(d, pairs)  # data.one_source_per_batch and pair_max_rank need pair shards
    if pairs and d.num_hard_negatives:  # a user's pairs list their own; the teacher stage mines none
        check_listed_negatives(d, shard_set)
    mined = 0 if pairs else d.num_hard_negatives
    teacher, teacher_dim = resolve_teacher(d, columns.teacher, shard_set, mined)
    refuse_holdout(d, teacher, pairs)
    if variants and d.num_variants + d.num_dropout_views < 1 and not loss.needs.teacher_positive:
        raise ConfigError(  # on pair shards the partner is a positive (config.py checks the other terms)
            f"{loss.main.name} needs at least one positive: set data.num_variants or num_dropout_views "
            ">= 1 (or luse.teacher_positive), or train on pair shards (docs/pairs.md)"
        )
    k, views = columns.num_variants, columns.num_dropout_views
    if pairs:  # (anchor, positive) and, with luse, d dropout re-encodings of the anchor
        k, views = 0, pair_dropout_views(loss, d)
    return DataPlan(
        source=columns.source,
        shard_set=shard_set,
        num_variants=k,
        num_dropout_views=views,
        teacher=teacher,
        teacher_dim=teacher_dim,
        token_ids=not pairs and usable_token_ids(shard_set, tokenizer, prefix, d.max_length),
        text_hashes=columns.text_hashes,
        num_hard_negatives=d.num_hard_negatives,
        pairs=pairs,
        mlm_probability=columns.mlm_probability,
    )


def check_listed_negatives(d: Any, shard_set: ShardSet) -> None:
    """``data.num_hard_negatives`` on pair shards: their rows must list negatives (``pipeline pairs
    --format flag|columns`` over files with negatives; the teacher stage keeps the column). Read from the
    first block's columns: one block, whatever the size of the set."""
    first = shard_set.manifest["shards"][0]["name"] if shard_set.manifest.get("shards") else None
    columns = next((t.column_names for _, t in iter_blocks(shard_set.directory / first)), []) if first else []
    if "hard_negatives" not in columns:
        raise ConfigError(
            f"data.num_hard_negatives={d.num_hard_negatives} but the pairs in {d.shards} list no hard "
            "negatives; convert pairs that list them (`python -m pipeline pairs --format flag|columns "
            "FILES`: FlagEmbedding's neg, or negative columns; docs/pairs.md, 'Your own pairs'), or set it "
            "to 0"
        )


def check_pair_teacher(d: Any) -> PairTeacher:
    """``data.supervised_teacher`` against ``data.supervised_file``, ``data.teacher`` and
    ``data.teacher_dim``; every mismatch one ConfigError naming both sides."""
    found = read_pair_teacher(d.supervised_teacher, d.supervised_file)
    if d.teacher is not None and not matches(found.teacher, d.teacher):
        raise ConfigError(
            f"data.teacher={d.teacher!r} but {d.supervised_teacher} was encoded with "
            f"{describe(found.teacher)}; set --data.teacher to that name or hash, or encode the file again"
        )
    if d.teacher_dim and d.teacher_dim != found.dim:
        raise ConfigError(
            f"data.teacher_dim={d.teacher_dim} but the teacher in {d.supervised_teacher / PAIR_MANIFEST} has "
            f"{found.dim} dimensions; drop data.teacher_dim (the width is read from the manifest)"
        )
    return found


def usable_token_ids(shard_set: ShardSet, tokenizer: Any, prefix: str, max_length: int) -> bool:
    """Whether to pad the shards' stored ids; ids of another tokenizer are a ConfigError naming both
    hashes (:func:`pipeline.data.token_ids.ids_usable`)."""
    if shard_set.tokenizer is not None and tokenizer is None:
        raise ValueError(f"{shard_set.directory} holds token ids: plan_batches needs the tokenizer")
    return ids_usable(shard_set.tokenizer, shard_set.directory, tokenizer, prefix, max_length)


def recorded_teacher(
    shard_set: ShardSet, wanted: str | None, num_hard_negatives: int = 0
) -> dict[str, Any] | None:
    """The shard set's recorded teacher, checked against ``data.teacher`` and ``data.num_hard_negatives``.

    Returns None when the shards hold no teacher and none is asked for. Every mismatch is one
    ConfigError naming both sides and the command that fixes it.
    """
    teacher, shards = shard_set.teacher, shard_set.directory
    rerun = f"python -m pipeline teacher --shards AUGMENTED --out NEW_DIR --model {wanted or 'TEACHER'}"
    if teacher is None:
        if wanted is not None or num_hard_negatives:
            what = "teacher embeddings" if wanted is not None else "hard negatives"
            raise ConfigError(
                f"data.shards {shards} has no {what} (stage {shard_set.stage!r}); "
                f"encode them with `{rerun}` and train on NEW_DIR"
            )
        return None
    stored_dtype(teacher, shards)
    if wanted is not None and not matches(teacher, wanted):
        raise ConfigError(
            f"data.teacher={wanted!r} but {shards} was encoded with {describe(teacher)}; set "
            f"--data.teacher to that name or hash, or re-encode with `{rerun}`"
        )
    cached = shard_set.hard_negatives
    if num_hard_negatives > cached:
        raise ConfigError(
            f"data.num_hard_negatives={num_hard_negatives} but {shards} caches {cached} per sentence; "
            f"lower it or rerun the teacher stage with --hard_negatives {num_hard_negatives}"
        )
    return teacher


def resolve_teacher(
    d: Any, read: bool, shard_set: ShardSet, mined: int | None = None
) -> tuple[bool, int | None]:
    """(whether batches carry the teacher's vectors, the teacher's width from the manifest).

    They carry them when ``data.teacher`` names the shards' teacher, or when a loss term reads teacher
    vectors (``read``, :attr:`~pipeline.losses.terms.Columns.teacher`) and the shards hold some (logged).
    A term that reads them from shards without any is refused here rather than at the first step.
    ``data.teacher_dim``, when set, must equal the recorded width. ``mined``: the hard negatives per
    sentence the teacher stage must have mined (default ``data.num_hard_negatives``; 0 on pair shards).
    """
    mined = d.num_hard_negatives if mined is None else mined
    recorded = recorded_teacher(shard_set, d.teacher, mined)
    width = None if recorded is None or recorded.get("dim") is None else int(recorded["dim"])
    manifest = shard_set.directory / MANIFEST
    if d.teacher_dim and d.teacher_dim != width:
        has = f"has {width} dimensions" if width is not None else "records no teacher"
        raise ConfigError(
            f"data.teacher_dim={d.teacher_dim} but the teacher in {manifest} {has}; drop "
            "data.teacher_dim (the width is read from the manifest)"
        )
    if d.teacher is not None:
        return True, width
    if read:
        if recorded is None:
            raise ConfigError(
                f"a loss term reads teacher embeddings but {manifest} records no teacher; encode the "
                "shards with `python -m pipeline teacher --shards AUGMENTED --out NEW_DIR --model TEACHER` "
                "and train on NEW_DIR, or remove the distill/kl terms and luse.teacher_positive"
            )
        log.info("using the shards' teacher %s; set data.teacher to pin it", describe(recorded))
        return True, width
    return False, width
