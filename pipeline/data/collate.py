"""Collators: rows of the shards (or of a pairs file) -> one :class:`Batch`.

Every collator runs in the loader workers, so it holds only picklable state (and a Batch pickles).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.data.masking import IGNORE_INDEX, MASK_PROB, batch_generator, mask_tokens
from pipeline.data.token_ids import TEXT_COLUMNS, TOKEN_ID_COLUMNS, pad_ids
from pipeline.normalize import normalize_text

# How Batch.split cuts a field into micro-batches (every field declares one, so none can be dropped).
# LAYOUT: the unpadded layout's cu_seqlens and max_seqlen, recomputed for the rows a micro-batch keeps.
ROWS, SENTENCES, SCALAR, LAYOUT = "rows", "sentences", "scalar", "layout"


def _rows() -> Any:
    return dataclasses.field(metadata={"split": ROWS})


def _per_sentence() -> Any:
    return dataclasses.field(default=None, metadata={"split": SENTENCES})


def _scalar(default: Any = None) -> Any:
    return dataclasses.field(default=default, metadata={"split": SCALAR})


def _optional_rows() -> Any:
    return dataclasses.field(default=None, metadata={"split": ROWS})


def _layout() -> Any:
    return dataclasses.field(default=None, metadata={"split": LAYOUT})


@dataclass
class Batch:
    """One rank's batch (or a micro-batch of it): what every collator returns and the step reads.

    Rows are view-major: row ``v * B + i`` is view v of sentence i (v < n, ``num_views``), then row
    ``n * B + j * B + i`` is hard negative j of sentence i (j < m, ``num_hard_negatives``). Per-sentence
    fields hold B rows (or labels) in sentence order; None where the run has no such column.

    In the unpadded layout (``train.unpadded``, :func:`unpad`) the rows are flat instead: ``input_ids`` and
    ``position_ids`` (T,) hold every row's real tokens one row after another, row r at
    ``cu_seqlens[r]:cu_seqlens[r + 1]``, ``max_seqlen`` the longest row, ``attention_mask`` None.

    Fields are read as attributes only (no access by name: a misspelt field is an AttributeError, and a
    type checker sees every read).
    """

    input_ids: torch.Tensor = _rows()  # ((n + m) * B, L) int64; unpadded: (T,) the rows' tokens
    attention_mask: torch.Tensor | None = _rows()  # ((n + m) * B, L) int64; unpadded: None
    num_views: int = _scalar()  # n
    num_hard_negatives: int = _scalar(0)  # m
    ids: torch.Tensor | None = _per_sentence()  # (B,) int64 sentence ids (pair files: record index)
    text_hashes: torch.Tensor | None = _per_sentence()  # (B,) int64 hashes of the normalised texts
    labels: torch.Tensor | None = _per_sentence()  # (B,) scores or class ids (a supervised file)
    teacher: torch.Tensor | None = _per_sentence()  # (B, D_t) float32 cached teacher embeddings
    mlm_input_ids: torch.Tensor | None = _per_sentence()  # (B, L) the originals, masked (the mlm term)
    mlm_labels: torch.Tensor | None = _per_sentence()  # (B, L) ids at the masked positions, -100 elsewhere
    groups: torch.Tensor | None = _per_sentence()  # (B,) int64 pair groups (pair shards)
    teacher_positive: torch.Tensor | None = _per_sentence()  # (B, D_t) the positives' teacher rows
    positive_text_hashes: torch.Tensor | None = _per_sentence()  # (B,) int64 the positives' text hashes
    # Pair shards with listed negatives: which of the m slots hold one (a pair lists fewer: the slot's row is
    # a filler the terms leave out), and their texts' hashes (with text_hashes)
    hard_negative_mask: torch.Tensor | None = _per_sentence()  # (B, m) bool
    hard_negative_text_hashes: torch.Tensor | None = _per_sentence()  # (B, m) int64
    epoch: int | None = _scalar()  # where the stream took it: the epoch and the batch's index in it
    batch: int | None = _scalar()
    position_ids: torch.Tensor | None = _optional_rows()  # unpadded: (T,) int64, each token's position
    cu_seqlens: torch.Tensor | None = _layout()  # unpadded: ((n + m) * B + 1,) int32 row starts, then T
    max_seqlen: int | None = _layout()  # unpadded: the longest row, a host int (no device read for it)

    @property
    def rows_per_sentence(self) -> int:
        """n views plus m hard negatives: the rows are (n + m) blocks of B."""
        return self.num_views + self.num_hard_negatives

    @property
    def num_rows(self) -> int:
        """(n + m) * B: the encoder's rows, padded or flat."""
        return self.input_ids.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    @property
    def num_sentences(self) -> int:
        return self.num_rows // self.rows_per_sentence  # B

    def at(self, epoch: int, batch: int) -> Batch:
        """This batch, marked with its position in the stream (the stream sets it)."""
        self.epoch, self.batch = epoch, batch
        return self

    def split(self, parts: int) -> list[Batch]:
        """``parts`` micro-batches of whole sentences: row fields cut view-major (each keeps its sentences'
        n views and m hard negatives, in the same block order), per-sentence fields cut in sentence order,
        scalars copied. Every field is cut by its declared kind, so a new field cannot be dropped."""
        if parts == 1:
            return [self]
        blocks, b = self.rows_per_sentence, self.num_sentences
        if b % parts:
            raise ValueError(f"a batch of {b} sentences does not split into {parts} equal micro-batches")
        size = b // parts
        out = []
        for p in range(parts):
            rows = torch.cat([torch.arange(v * b + p * size, v * b + (p + 1) * size) for v in range(blocks)])
            values = {}
            if self.cu_seqlens is not None:  # flat rows: the kept rows' tokens, and their layout anew
                values["cu_seqlens"], values["max_seqlen"], tokens = _kept_rows(self.cu_seqlens, rows)
                rows = tokens
            for f in dataclasses.fields(self):
                value, kind = getattr(self, f.name), f.metadata["split"]
                if kind == LAYOUT:
                    values.setdefault(f.name, None)
                elif value is None or kind == SCALAR:
                    values[f.name] = value
                elif kind == ROWS:
                    values[f.name] = value[rows]
                else:
                    values[f.name] = value[p * size : (p + 1) * size]
            out.append(Batch(**values))
        return out

    def sentences_to(self, device: torch.device | str) -> Batch:
        """This batch with its per-sentence columns (ids, labels, teacher rows, ...) on ``device``
        (asynchronous from pinned memory), what the loss's terms read; the rows stay where they are."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if f.metadata["split"] == SENTENCES and getattr(self, f.name) is not None
        }
        return dataclasses.replace(self, **moved)

    def inputs(self, device: torch.device | str) -> dict[str, Any]:
        """The encoder's inputs on ``device`` (asynchronous from pinned memory): ``input_ids`` and
        ``attention_mask``, or in the unpadded layout ``input_ids``, ``position_ids``, ``cu_seqlens`` and
        the host int ``max_seqlen``.

        With the mlm term's masks also ``mlm_positions`` (M,) int64: the flat indices into (B, L) of the
        tokens whose label is not -100, row-major, where :class:`~pipeline.model.heads.TrainModule` runs
        its MLM head (and :func:`pipeline.losses.mlm.compute_loss` takes the labels in the same order).
        Found on the loader's host copy of the labels, so M is a host int and no device value is read
        (on labels already on a GPU the nonzero would be a sync)."""
        if self.cu_seqlens is None:
            names = ("input_ids", "attention_mask")
            out = {k: getattr(self, k).to(device, non_blocking=True) for k in names}
            if self.mlm_labels is not None:
                selected = (self.mlm_labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
                out["mlm_positions"] = selected.to(device, non_blocking=True)
            return out
        names = ("input_ids", "position_ids", "cu_seqlens")
        flat = {k: getattr(self, k).to(device, non_blocking=True) for k in names}
        return {**flat, "max_seqlen": self.max_seqlen}  # a host int: shapes without a device read

    def pin_memory(self) -> Batch:
        """Every tensor in page-locked memory; torch's pin-memory thread calls this (DataLoader
        ``pin_memory=True``) as it does for a tensor."""
        values = {name: getattr(self, name) for name in _FIELDS}
        return dataclasses.replace(
            self, **{k: v.pin_memory() for k, v in values.items() if isinstance(v, torch.Tensor)}
        )


_FIELDS = tuple(f.name for f in dataclasses.fields(Batch))


def _kept_rows(cu_seqlens: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The layout of some rows of a flat batch: (cu_seqlens (R + 1,) int32, max_seqlen, their token
    indices (T_kept,)). Host tensors (the loader's or the step's CPU copy): no device read."""
    starts, ends = cu_seqlens[:-1].long()[rows], cu_seqlens[1:].long()[rows]  # (R,)
    lengths = ends - starts
    tokens = torch.cat([torch.arange(s, e) for s, e in zip(starts.tolist(), ends.tolist())])
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return cu, int(lengths.max()), tokens


def unpad(batch: Batch) -> Batch:
    """A padded batch in the unpadded layout (``train.unpadded``): each row's real tokens one row after
    another, flat ``input_ids`` and ``position_ids`` (T,), ``cu_seqlens`` (rows + 1,) int32 and the host
    int ``max_seqlen``; ``attention_mask`` None. Runs in the loader workers, on host tensors."""
    if batch.mlm_input_ids is not None:
        raise ValueError("the unpadded layout has no padded originals for the mlm term")
    mask = batch.attention_mask.bool()  # (N, L)
    lengths = mask.sum(1)  # (N,)
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids[mask],  # (T,) row by row, each row's tokens in order
        attention_mask=None,
        position_ids=(mask.cumsum(1) - 1)[mask],  # (T,) 0.. within each row (rows are padded on the right)
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()),
    )


def bucket_width(longest: int, multiple: int, max_length: int) -> int:
    """The padded width of a batch whose longest row is ``longest``: the next multiple of ``multiple``,
    at most ``max_length`` (or ``longest`` itself beyond it), so a run sees about max_length / multiple
    shapes."""
    return max(longest, min(-(-longest // multiple) * multiple, max_length))


def pad_to_width(batch: Batch, width: int, pad_id: int) -> Batch:
    """A padded batch padded on the right to ``width`` columns: ids ``pad_id``, mask 0, MLM labels -100."""
    extra = width - batch.input_ids.shape[1]
    if extra <= 0:
        return batch

    def widen(x: torch.Tensor | None, value: int) -> torch.Tensor | None:
        return None if x is None else torch.nn.functional.pad(x, (0, extra), value=value)  # (N, width)

    return dataclasses.replace(
        batch,
        input_ids=widen(batch.input_ids, pad_id),
        attention_mask=widen(batch.attention_mask, 0),
        mlm_input_ids=widen(batch.mlm_input_ids, pad_id),
        mlm_labels=widen(batch.mlm_labels, -100),
    )


class TokenLayout:
    """Wraps a collator: its padded batch laid out as the step wants it, in the loader workers.

    ``unpadded``: :func:`unpad` (``train.unpadded``). ``pad_to_multiple_of`` m > 0: the width padded up to
    the next multiple of m (at most ``max_length``; ``train.pad_to_multiple_of``), so that a run sees a
    handful of shapes (compile without recompiles, CUDA graphs) instead of one per longest sentence.
    """

    def __init__(
        self,
        collate: Callable[[dict[str, list[Any]]], Batch],
        pad_id: int,
        max_length: int,
        unpadded: bool = False,
        pad_to_multiple_of: int = 0,
    ):
        self.collate, self.pad_id, self.max_length = collate, pad_id, max_length
        self.unpadded, self.multiple = unpadded, pad_to_multiple_of
        self.columns = getattr(collate, "columns", None)

    def __call__(self, rows: dict[str, list[Any]]) -> Batch:
        batch = self.collate(rows)
        if self.unpadded:
            return unpad(batch)
        if self.multiple:
            width = bucket_width(batch.input_ids.shape[1], self.multiple, self.max_length)
            return pad_to_width(batch, width, self.pad_id)
        return batch


def token_layout(collate: Any, pad_id: int, max_length: int, train: Any) -> Any:
    """``collate`` wrapped in :class:`TokenLayout` as ``train`` (the TrainConfig) asks; itself when it
    asks for the default layout (padded to each batch's longest row)."""
    if not (train.unpadded or train.pad_to_multiple_of):
        return collate
    return TokenLayout(collate, pad_id, max_length, train.unpadded, train.pad_to_multiple_of)


def teacher_rows(vectors: Any) -> torch.Tensor:
    """The teacher column as (B, D) float32: the loader's (rows, D) array taken as it is (no second copy),
    or a list of (D,) rows stacked."""
    return torch.from_numpy(np.asarray(vectors, dtype=np.float32))


def text_hashes(texts: Sequence[Any]) -> torch.Tensor:
    """(B,) int64: the first 8 bytes of blake2b of each normalised text, little-endian, as a signed int.

    Equal for texts equal after :func:`~pipeline.normalize.normalize_text` (NFKC, case-folded,
    without whitespace and punctuation): the key of the ``same_text`` false-negative rule. Pre-tokenised
    rows carry token ids instead of text: their hash is of the ids (int64 bytes), so it matches texts that
    tokenise alike (the tokenizer's own normalisation) rather than after normalize_text.
    """
    out = np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        data = (
            normalize_text(text).encode() if isinstance(text, str) else np.asarray(text, np.int64).tobytes()
        )
        out[i] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    return torch.from_numpy(out)


class FastEncoder:
    """Tokenise a list of texts to padded (N, L) int64 arrays with the Rust tokenizer directly.

    Gives the same ids and mask as ``tokenizer(texts, padding=True, truncation=True, max_length=L)``
    (tested) at about twice the speed: transformers' conversion of the encodings to tensors costs as
    much as the tokenisation itself. The backend is copied, so the caller's tokenizer is untouched.
    ``prefix`` (the encoder's, e.g. e5's "query: ") goes before every text, as in ``SentenceEncoder``.
    """

    def __init__(self, tokenizer: Any, max_length: int, prefix: str = ""):
        from tokenizers import Tokenizer

        self.prefix = prefix

        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.backend.enable_truncation(max_length=max_length)
        self.backend.enable_padding(pad_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token)

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # encode_batch_fast skips character offsets, which we never use (tokenizers >= 0.20)
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encodings = encode([self.prefix + t for t in texts])
        ids = np.array([e.ids for e in encodings], dtype=np.int64)  # (N, L), L = longest in the batch
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)  # (N, L)
        return torch.from_numpy(ids), torch.from_numpy(mask)


class ViewCollator:
    """Rows of the shards -> one tokenised batch of n = 1 + k + d views per sentence (LUSE, SimCSE).

    View 0 is the original, views 1..k its first k cached variants (a sentence with fewer than k
    variants repeats its original in the missing slots, which then acts as one more dropout view),
    views k+1..k+d repeat the original for dropout. All n*B texts share one padding length so the
    model encodes them in one forward. Rows are ordered view-major: row v*B + i is view v of sentence i.

    With ``num_hard_negatives`` m the m mined negatives follow the views: row n*B + j*B + i is negative
    j of sentence i (a sentence with fewer than m cached takes the next sentence's original in the
    missing slots: an in-batch negative anyway), and ``batch.num_hard_negatives = m``. With
    ``teacher`` the batch carries ``batch.teacher``, the cached teacher vectors (B, D) float32.

    ``batch.ids`` holds the sentences' 64-bit ids and, with ``hash_texts`` (a ``same_text`` rule is
    on), ``batch.text_hashes`` the hashes of their normalised texts (:func:`text_hashes`), both (B,)
    int64: what the false-negative rules compare.

    With ``pretokenized`` the rows carry the shards' token ids (``pipeline tokenize``, hash checked by
    :func:`pipeline.data.token_ids.shards_have_ids`) and are padded instead of tokenised: the same
    tensors, without the Rust tokenizer in the loader.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        num_variants: int,
        num_dropout_views: int,
        prefix: str = "",
        teacher: bool = False,
        num_hard_negatives: int = 0,
        pretokenized: bool = False,
        hash_texts: bool = False,
    ):
        self.pretokenized = pretokenized
        self.hash_texts = hash_texts  # only a false_negatives.same_text rule reads the hashes
        if pretokenized:
            self.pad_id = tokenizer.pad_token_id
        else:
            self.encode = FastEncoder(tokenizer, max_length, prefix)
        self.k, self.d = num_variants, num_dropout_views
        self.teacher, self.m = teacher, num_hard_negatives
        # (text, variants, hard negatives) as strings, or as their stored ids
        self.sources = TOKEN_ID_COLUMNS if pretokenized else TEXT_COLUMNS
        # a column is read (decoded per block) only when a view uses it: no variants at num_variants 0
        extra = ("teacher",) * teacher + (self.sources[2],) * (num_hard_negatives > 0)
        self.columns = ("id", self.sources[0]) + (self.sources[1],) * (num_variants > 0) + extra

    def __call__(self, rows: dict[str, list[Any]]) -> Batch:
        text_column, variants_column, negatives_column = self.sources
        texts = rows[text_column]  # strings, or id arrays: the view logic is the same
        b = len(texts)
        views = [texts]
        for j in range(self.k):
            views.append([v[j] if j < len(v) else t for t, v in zip(texts, rows[variants_column])])
        for j in range(self.m):  # after the views in the one tokenisation: a common padding length
            negatives = rows[negatives_column]
            views.append([h[j] if j < len(h) else texts[(i + 1) % b] for i, h in enumerate(negatives)])
        flat = [t for view in views for t in view]  # (1 + k + m) * B rows
        ids, mask = pad_ids(flat, self.pad_id) if self.pretokenized else self.encode(flat)
        if self.d:  # dropout views: the original's tokens again; dropout makes them differ
            cut = (1 + self.k) * b
            ids = torch.cat([ids[:cut], ids[:b].repeat(self.d, 1), ids[cut:]])
            mask = torch.cat([mask[:cut], mask[:b].repeat(self.d, 1), mask[cut:]])
        return Batch(
            ids=torch.tensor(np.asarray(rows["id"], dtype=np.uint64).view(np.int64)),
            input_ids=ids,  # ((n + m) * B, L)
            attention_mask=mask,  # ((n + m) * B, L)
            num_views=1 + self.k + self.d,
            num_hard_negatives=self.m,
            teacher=teacher_rows(rows["teacher"]) if self.teacher else None,  # (B, D) float32
            text_hashes=text_hashes(texts) if self.hash_texts else None,  # (B,) int64, in the loader workers
        )


class PairCollator:
    """Supervised records -> tokenised columns (sentence1/2[/3]) and labels, one tensor set per column;
    with ``teacher`` (a pair file's teacher vectors, pipeline/data/labelled.py) the teacher rows of text 1
    and text 2 as ``teacher`` and ``teacher_positive``, as a batch of pair shards carries them."""

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        text_columns: Sequence[str],
        label_dtype: Any = None,
        prefix: str = "",
        teacher: bool = False,
    ):
        self.encode = FastEncoder(tokenizer, max_length, prefix)
        self.text_columns, self.label_dtype, self.teacher = list(text_columns), label_dtype, teacher

    def __call__(self, rows: dict[str, list[Any]]) -> Batch:
        ids, mask = self.encode([t for col in self.text_columns for t in rows[col]])
        labels = None if self.label_dtype is None else torch.tensor(rows["label"], dtype=self.label_dtype)
        return Batch(
            ids=torch.tensor(rows["index"], dtype=torch.int64),
            input_ids=ids,  # (n * B, L), column-major like the views
            attention_mask=mask,
            num_views=len(self.text_columns),
            labels=labels,  # (B,)
            teacher=teacher_rows(rows["teacher"]) if self.teacher else None,  # (B, D) text 1's
            teacher_positive=teacher_rows(rows["teacher_positive"]) if self.teacher else None,  # text 2's
        )


class MLMCollator:
    """Wraps a view collator: fills ``mlm_input_ids`` / ``mlm_labels`` (B, L), view 0 masked
    (:func:`pipeline.data.masking.mask_tokens`, seeded by :func:`pipeline.data.masking.batch_generator`).

    Runs in the loader workers (picklable: only ints and the wrapped collator). View 0 is the first B
    rows of the view-major batch, the original sentences.
    """

    def __init__(
        self,
        collate: Callable[[dict[str, list[Any]]], Batch],
        tokenizer: Any,
        seed: int,
        mask_prob: float = MASK_PROB,
    ):
        self.collate, self.seed, self.mask_prob = collate, seed, mask_prob
        self.columns = getattr(collate, "columns", None)
        self.special_ids = sorted({int(i) for i in tokenizer.all_special_ids})
        self.mask_id = int(tokenizer.mask_token_id)
        self.vocab_size = len(tokenizer)

    def __call__(self, rows: dict[str, list[Any]]) -> Batch:
        out = self.collate(rows)
        b = len(rows["id"])
        generator = batch_generator(self.seed, np.asarray(rows["id"], dtype=np.uint64).tolist())
        out.mlm_input_ids, out.mlm_labels = mask_tokens(
            out.input_ids[:b],
            out.attention_mask[:b],
            self.special_ids,
            self.mask_id,
            self.vocab_size,
            generator,
            self.mask_prob,
        )
        return out


class PairShardCollator:
    """Rows of pair shards (``pipeline pairs``, shards/README.md "Pair shards") -> one tokenised batch of
    the anchors (``text``) then the positives, view-major as :class:`PairCollator`: row i is anchor i,
    row B + i its positive, ``num_views`` 2, one padding length for both.

    ``batch.groups`` (B,) int64: the pairs' ``group`` (a record's pairs share it; the pairs term never
    uses one as another's negative); ``batch.ids`` the pair ids. With ``hash_texts`` (pairs.same_text)
    ``batch.text_hashes`` and ``batch.positive_text_hashes`` (B,) int64 hash both sides
    (:func:`text_hashes`). With ``teacher`` the teacher stage's vectors of both sides: ``batch.teacher``
    and ``batch.teacher_positive`` (B, D) float32 (the distill term distils both).

    With ``dropout_views`` d (luse on pairs) the anchors' tokens follow again d times, rows (2 + j) B + i
    (``num_views`` 2 + d): dropout makes their encodings differ, as :class:`ViewCollator`'s dropout views.

    With ``num_hard_negatives`` m (a user's pairs with listed negatives, ``pipeline pairs --format``) the
    first m of each pair's ``hard_negatives`` follow the views, row (2 + d + j) B + i negative j of pair i
    (``batch.num_hard_negatives`` m). A pair that lists fewer fills its other slots with an empty text, and
    ``batch.hard_negative_mask`` (B, m) says which slots hold a listed negative (the terms leave the others
    out); with ``hash_texts`` ``batch.hard_negative_text_hashes`` (B, m) hashes them.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        prefix: str = "",
        teacher: bool = False,
        hash_texts: bool = False,
        dropout_views: int = 0,
        num_hard_negatives: int = 0,
    ):
        self.encode = FastEncoder(tokenizer, max_length, prefix)
        self.teacher, self.hash_texts, self.d, self.m = teacher, hash_texts, dropout_views, num_hard_negatives
        self.columns = (
            ("id", "text", "positive", "group")
            + ("teacher", "teacher_positive") * teacher
            + ("hard_negatives",) * (num_hard_negatives > 0)
        )

    def __call__(self, rows: dict[str, list[Any]]) -> Batch:
        anchors, positives = rows["text"], rows["positive"]
        b = len(anchors)
        listed = [list(n[: self.m]) for n in rows["hard_negatives"]] if self.m else []
        by_slot = [n[j] if j < len(n) else "" for j in range(self.m) for n in listed]  # (m * B,) view-major
        ids, mask = self.encode(list(anchors) + list(positives) + by_slot)  # ((2 + m) B, L)
        if self.d:  # dropout views: the anchors' tokens again, before the negatives
            ids = torch.cat([ids[: 2 * b], ids[:b].repeat(self.d, 1), ids[2 * b :]])  # ((2 + d + m) B, L)
            mask = torch.cat([mask[: 2 * b], mask[:b].repeat(self.d, 1), mask[2 * b :]])
        out = {
            "ids": torch.tensor(np.asarray(rows["id"], dtype=np.uint64).view(np.int64)),
            "groups": torch.tensor(np.asarray(rows["group"], dtype=np.uint64).view(np.int64)),
            "input_ids": ids,
            "attention_mask": mask,
            "num_views": 2 + self.d,
        }
        if self.teacher:
            out["teacher"] = teacher_rows(rows["teacher"])  # (B, D) float32
            out["teacher_positive"] = teacher_rows(rows["teacher_positive"])  # (B, D)
        if self.hash_texts:
            out["text_hashes"] = text_hashes(anchors)  # (B,) int64
            out["positive_text_hashes"] = text_hashes(positives)  # (B,) int64
        if self.m:
            out["num_hard_negatives"] = self.m
            counts = torch.tensor([len(n) for n in listed])  # (B,)
            out["hard_negative_mask"] = torch.arange(self.m)[None, :] < counts[:, None]  # (B, m)
            if self.hash_texts:
                hashes = text_hashes(by_slot).view(self.m, b)  # (m, B)
                out["hard_negative_text_hashes"] = hashes.T.contiguous()  # (B, m)
        return Batch(**out)
