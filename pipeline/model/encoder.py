"""The sentence encoder: a ``transformers`` backbone, a pooling rule and L2 normalisation.

On disk an encoder is an ordinary Hugging Face folder (``config.json``, ``model.safetensors``, the
tokenizer files) plus ``encoder.json`` with the pooling rule, maximum length and text prefix (e5 wants
``"query: "`` before every text), so that any ``from_pretrained`` name or local folder (``hfl/rbt3``,
one of our checkpoints' ``model/`` folders, a sentence-transformers folder: see
:mod:`pipeline.model.rules`) loads the same way.

An encoder may end in a linear ``dense`` map after pooling (a sentence-transformers ``Dense`` module,
e.g. the BERT-whitening ``export --whitening`` writes): pooled -> [L2-normalise] -> dense -> L2-normalise.
Such encoders come from sentence-transformers folders only; :meth:`SentenceEncoder.save_pretrained`
refuses them (``python -m pipeline export`` writes them).

:meth:`SentenceEncoder.save_pretrained` also writes the sentence-transformers module files of the same
rule (``modules.json``, Pooling, Normalize, the prefix as default prompt), so that
``SentenceTransformer(folder)`` on a training or checkpoint folder returns our vectors. The weights
stay the trainer's (no pooler); ``sentence_bert_config.json`` asks sentence-transformers to build the
model without one (``model_args: {"add_pooling_layer": false}``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError, InputError
from pipeline.model.rules import ENCODER_FILE, POOLING_HELP, read_dense_weights, read_rule
from pipeline.model.varlen import pool_unpadded, unpadded_hidden_states

Pooling = Literal["cls", "mean", "first_last_avg"]
POOLINGS: tuple[str, ...] = ("cls", "mean", "first_last_avg")
# transformers models whose constructor takes add_pooling_layer (the pooler we never use)
POOLER_ARCHITECTURES = ("bert", "roberta", "xlm-roberta")
__all__ = ["ENCODER_FILE", "POOLINGS", "SentenceEncoder", "pool", "truncate_normalise"]


def truncate_normalise(vectors: np.ndarray, dim: int | None) -> np.ndarray:
    """The first ``dim`` columns of (N, H) embeddings, rows re-normalised: a Matryoshka prefix, as
    sentence-transformers' ``truncate_dim`` gives it followed by normalisation. ``None``: unchanged."""
    if dim is None:
        return vectors
    if not 1 <= dim <= vectors.shape[-1]:
        raise ConfigError(
            f"truncate_dim {dim}: the embeddings are {vectors.shape[-1]}-d; pick 1..{vectors.shape[-1]}"
        )
    cut = vectors[..., :dim]
    norm = np.linalg.norm(cut, axis=-1, keepdims=True)
    return (cut / np.maximum(norm, 1e-12)).astype(vectors.dtype, copy=False)


def _masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B, H)


def pool(hidden_states: Sequence[torch.Tensor], attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool token states into one vector per sentence (not yet normalised).

    ``first_last_avg`` averages the mean-pooled output of the first transformer layer and of the
    last one (hidden_states[1] and [-1]; hidden_states[0] is the embedding layer), as SimCSE does.
    """
    last = hidden_states[-1]  # (B, L, H)
    if pooling == "cls":
        return last[:, 0]
    if pooling == "mean":
        return _masked_mean(last, attention_mask)
    if pooling == "first_last_avg":
        return (_masked_mean(hidden_states[1], attention_mask) + _masked_mean(last, attention_mask)) / 2
    raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLINGS}")


def prebuilt_mask(backbone: nn.Module, attention_mask: torch.Tensor) -> torch.Tensor:
    """The (B, L) padding mask as the (B, 1, 1, L) attention mask transformers would build from it.

    transformers' BERT family builds its mask every forward and first asks ``padding_mask.all()`` (to
    drop an all-ones mask): a host-device sync per forward. A 4-D mask is taken as given, so building it
    here keeps the step free of syncs; the attention is the same (a boolean key mask for SDPA, an
    additive one for eager). Other architectures and implementations get the 2-D mask unchanged.
    """
    config = backbone.config
    decoder = getattr(config, "is_decoder", False)
    if getattr(config, "model_type", None) not in POOLER_ARCHITECTURES or decoder:
        return attention_mask
    keep = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == "sdpa":
        return keep
    if implementation == "eager":
        dtype = backbone.get_input_embeddings().weight.dtype
        additive = torch.zeros(keep.shape, dtype=dtype, device=keep.device)  # (B, 1, 1, L)
        return additive.masked_fill_(~keep, torch.finfo(dtype).min)
    return attention_mask


def _has_pooler_weights(folder: Path) -> bool:
    """Whether a local folder's safetensors weights hold a ``pooler.`` layer (read from the header only)."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return any(key.startswith("pooler.") for key in f.keys())


def load_backbone(source: str | Path, **kwargs: Any) -> nn.Module:
    """``AutoModel.from_pretrained`` without BERT's pooler, and without a load report about it.

    The pooler is unused (DDP also fails on parameters that get no gradient). A local folder that
    holds pooler weights (our exports and fetched models carry an identity pooler so that other
    loaders see no missing weights) is loaded as saved and the pooler dropped; elsewhere the model is
    built without one and transformers' report of the checkpoint's unused ``pooler.*`` weights is
    filtered out. Reports of missing or mismatched weights still reach the user.
    """
    from transformers import AutoModel

    if _has_pooler_weights(Path(source) / kwargs.get("subfolder", "")):
        backbone = AutoModel.from_pretrained(str(source), **kwargs)
        backbone.pooler = None
        return backbone
    with _without_unused_pooler_report():
        try:
            return AutoModel.from_pretrained(str(source), add_pooling_layer=False, **kwargs)
        except TypeError:  # architectures without a pooler do not take the argument
            return AutoModel.from_pretrained(str(source), **kwargs)


class _UnusedPoolerReport(logging.Filter):
    """Drops a transformers LOAD REPORT whose only entries are UNEXPECTED ``pooler.*`` weights."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())  # the report is styled with ANSI codes
        if "LOAD REPORT" not in text:
            return True
        rows = [line.split("|") for line in text.splitlines() if line.count("|") >= 2]
        statuses = [(row[0].strip(), row[1].strip()) for row in rows if row[1].strip().isupper()]
        only_pooler = all(status == "UNEXPECTED" and key.startswith("pooler.") for key, status in statuses)
        return not (statuses and only_pooler)


@contextlib.contextmanager
def _without_unused_pooler_report():
    # transformers 5 logs the report from modeling_utils; older releases log nothing of the kind
    logger = logging.getLogger("transformers.modeling_utils")
    report_filter = _UnusedPoolerReport()
    logger.addFilter(report_filter)
    try:
        yield
    finally:
        logger.removeFilter(report_filter)


class SentenceEncoder(nn.Module):
    """Maps token ids to L2-normalised sentence embeddings of shape (B, H).

    ``prefix`` goes before every text exactly once, in :meth:`tokenize` (hence :meth:`encode`, the
    evaluation and the search index) and in the training collators (given it by the trainer).
    """

    # Hand transformers a prepared 4-D attention mask (:func:`prebuilt_mask`: no host sync per forward).
    # Off by default, so the default CPU step is unchanged; a CUDA device, train.pad_to_multiple_of and
    # train.compile turn it on (pipeline.model.compile.prepare_encoder).
    static_mask: bool = False

    def __init__(
        self,
        backbone: nn.Module,
        tokenizer: Any,
        pooling: str = "cls",
        max_length: int = 64,
        prefix: str = "",
        dense: nn.Linear | None = None,
        dense_activation: Literal["identity", "tanh"] = "identity",
        normalize_before_dense: bool = True,
    ):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLINGS}")
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_length = max_length
        self.prefix = prefix
        self.dense = dense
        self.dense_activation = dense_activation
        self.normalize_before_dense = normalize_before_dense

    @property
    def dim(self) -> int:
        if self.dense is not None:
            return int(self.dense.out_features)
        return int(self.backbone.config.hidden_size)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled (B, H) -> the sentence embedding (B, dim): [normalise -> dense ->] L2-normalise."""
        if self.dense is not None:
            if self.normalize_before_dense:
                pooled = F.normalize(pooled, dim=-1)
            pooled = self.dense(pooled.to(self.dense.weight.dtype))  # (B, dim)
            if self.dense_activation == "tanh":
                pooled = torch.tanh(pooled)
        return F.normalize(pooled, dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Padded (B, L) ``input_ids`` and ``attention_mask``, or the unpadded layout (``train.unpadded``):
        flat (T,) ``input_ids`` and ``position_ids``, ``cu_seqlens`` (B + 1,) int32 and a host-side int
        ``max_seqlen`` (:mod:`pipeline.model.varlen`). Either way (B, dim) embeddings."""
        need_all = self.pooling == "first_last_avg"
        if cu_seqlens is not None:
            if max_seqlen is None or position_ids is None:
                raise ValueError("the unpadded layout needs cu_seqlens, max_seqlen and position_ids together")
            states = unpadded_hidden_states(
                self.backbone, input_ids, position_ids, cu_seqlens, max_seqlen, all_layers=need_all
            )  # [(T, H)]
            return self.head(pool_unpadded(states, cu_seqlens, max_seqlen, self.pooling))  # (B, dim)
        if attention_mask is None:
            raise ValueError("the padded layout needs attention_mask")
        mask = prebuilt_mask(self.backbone, attention_mask) if self.static_mask else attention_mask
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=mask,
            token_type_ids=token_type_ids,
            output_hidden_states=need_all,
            return_dict=True,
        )
        states = out.hidden_states if need_all else (out.last_hidden_state,)
        return self.head(pool(states, attention_mask, self.pooling))  # (B, dim)

    def tokenize(self, texts: Sequence[str], pad: bool = True) -> dict[str, Any]:
        """The prefixed, truncated token ids of ``texts``: padded (B, L) tensors, or with ``pad=False`` one
        unpadded list of ids per text (what :meth:`encode` sorts by length before padding each batch)."""
        return self.tokenizer(
            [self.prefix + t for t in texts],
            padding=pad,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt" if pad else None,
        )

    @torch.inference_mode()
    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 128,
        progress: bool = False,
        desc: str = "encode",
        truncate_dim: int | None = None,
        bf16: bool = False,
        report: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Embed ``texts`` in eval mode; returns float32 (N, H), rows L2-normalised.

        The texts are tokenised once, sorted by token count (longest first) so that each batch pads to
        almost nothing, and the vectors are put back in input order. A sentence's vector does not depend
        on its batch beyond float rounding.
        ``truncate_dim``: keep the first k dimensions and re-normalise (a Matryoshka prefix), (N, k).
        ``bf16``: run under bfloat16 autocast on the CPU (a ConfigError on another device); the rows are
        re-normalised in float32. ``report(n)`` is called after each batch with its number of texts.
        """
        from pipeline import progress as progress_bars

        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        if bf16 and device.type != "cpu":
            raise ConfigError(f"bf16 autocast is a CPU option; the encoder is on {device}")
        if not len(texts):
            return truncate_normalise(np.zeros((0, self.dim), dtype=np.float32), truncate_dim)
        tokens = self.tokenize(texts, pad=False)
        keys = list(tokens.keys())
        lengths = np.asarray([len(ids) for ids in tokens["input_ids"]], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        reduced = next(self.parameters()).dtype != torch.float32  # e.g. the teacher's fp16 weights on a GPU
        batches = range(0, len(texts), batch_size)
        with autocast:
            for start in progress_bars.bar(iterable=batches, desc=desc, disable=not progress, unit="batch"):
                idx = order[start : start + batch_size]
                rows = {k: [tokens[k][i] for i in idx] for k in keys}
                batch = self.tokenizer.pad(rows, return_tensors="pt")  # as the tokenizer pads: side, pad id
                batch = {k: v.to(device) for k, v in batch.items()}
                emb = self(**batch).float()  # (b, dim)
                if bf16 or reduced:
                    emb = F.normalize(emb, dim=-1)  # renormalised after reduced-precision compute
                out[idx] = emb.cpu().numpy()
                if report is not None:
                    report(len(idx))
        self.train(was_training)
        return truncate_normalise(out, truncate_dim)

    # ------------------------------------------------------------------------------------------ disk
    def save_pretrained(self, directory: str | Path) -> None:
        if self.dense is not None:
            raise ConfigError(
                "this encoder ends in a Dense module, which encoder.json cannot hold; write it with "
                "`python -m pipeline export` (a sentence-transformers folder)"
            )
        from pipeline.model.st_folder import write_module_files

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config, flag = self.backbone.config, self.backbone.config.output_hidden_states
        # first_last_avg as sentence-transformers modules reads every layer: only if the saved config
        # asks the model to return them (our forward passes the flag itself, so we are unaffected)
        config.output_hidden_states = self.pooling == "first_last_avg"
        try:
            self.backbone.save_pretrained(directory, safe_serialization=True)
        finally:
            config.output_hidden_states = flag
        self.tokenizer.save_pretrained(directory)
        meta = {
            "pooling": self.pooling,
            "max_length": self.max_length,
            "normalize": True,
            "prefix": self.prefix,
        }
        (directory / ENCODER_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        # The same rule as sentence-transformers modules, so that SentenceTransformer(directory) gives
        # our vectors (prefix as the default prompt, our pooling, max length) instead of silently
        # building mean pooling without the prefix. encoder.json stays what our reader uses.
        prompts = {"query": self.prefix} if self.prefix else {}
        # The weights hold no pooler (resume compares keys strictly): ask sentence-transformers to build
        # BERT without one too, rather than report it as missing and newly initialised.
        no_pooler = (
            config.model_type in POOLER_ARCHITECTURES and getattr(self.backbone, "pooler", None) is None
        )
        write_module_files(
            directory, self.pooling, int(config.hidden_size), int(config.num_hidden_layers), self.max_length,
            prompts, "query" if prompts else None,
            model_args={"add_pooling_layer": False} if no_pooler else None,
        )  # fmt: skip

    @classmethod
    def from_pretrained(
        cls,
        name_or_dir: str | Path,
        pooling: str | None = None,
        max_length: int | None = None,
        prefix: str | None = None,
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> SentenceEncoder:
        """Load a backbone and tokenizer by Hub name or local folder.

        ``pooling``/``max_length``/``prefix`` given here win; else the folder's rule applies
        (``encoder.json``, else the sentence-transformers module files); a folder without a pooling
        rule and no ``pooling`` is a :class:`ConfigError`, never a silent default. ``max_length``
        falls back to 64, ``prefix`` to none. The backbone is built without its pooler: the pooler is
        unused, and DDP fails on parameters that get no gradient. ``tokenizer``: the folder's, already
        loaded by :func:`load_tokenizer` (the trainer checks the data against it first).
        """
        from transformers import AutoConfig

        rule, source, where = _transformer_source(name_or_dir)
        try:
            if not (pooling or rule.pooling):
                # a model that does not exist is reported as such, not as a missing rule
                AutoConfig.from_pretrained(source, **where)
                raise ConfigError(
                    f"{name_or_dir} has no pooling rule (no {ENCODER_FILE}, no sentence-transformers "
                    f"modules.json); {POOLING_HELP}"
                )
            if tokenizer is None:
                tokenizer, _ = load_tokenizer(name_or_dir)
            backbone = load_backbone(source, **where, **kwargs)
        except OSError as exc:
            raise InputError(f"cannot load model {name_or_dir!r}: {exc}".splitlines()[0]) from None
        encoder = cls(
            backbone,
            tokenizer,
            pooling=pooling or rule.pooling,
            max_length=max_length or rule.max_length or 64,
            prefix=(rule.prefix or "") if prefix is None else prefix,
            **_dense_kwargs(name_or_dir, rule),
        )
        hidden = int(backbone.config.hidden_size)
        if encoder.dense is not None and encoder.dense.in_features != hidden:
            raise InputError(
                f"{name_or_dir}/{rule.dense_dir}: the Dense module takes {encoder.dense.in_features} "
                f"features but the transformer gives {hidden}"
            )
        return encoder


def _transformer_source(name_or_dir: str | Path) -> tuple[Any, str, dict[str, Any]]:
    """(the folder's rule, where its transformer lies, transformers' extra arguments for it)."""
    local = Path(name_or_dir)
    if str(name_or_dir).startswith((".", "/")) and not local.exists():
        raise InputError(f"model folder {name_or_dir} does not exist")
    rule = read_rule(name_or_dir)
    source, where = str(name_or_dir), {}
    if rule.transformer_dir:  # an old sentence-transformers layout: the transformer in 0_Transformer/
        if local.is_dir():
            source = str(local / rule.transformer_dir)
        else:
            where = {"subfolder": rule.transformer_dir}
    return rule, source, where


def load_tokenizer(name_or_dir: str | Path, prefix: str | None = None) -> tuple[Any, str]:
    """(tokenizer, text prefix) of a Hub name or local folder, as :meth:`SentenceEncoder.from_pretrained`
    resolves them, without loading the weights: ``prefix`` given wins, else the folder's rule, else none."""
    from transformers import AutoTokenizer

    rule, source, where = _transformer_source(name_or_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **where)
    except OSError as exc:
        raise InputError(f"cannot load model {name_or_dir!r}: {exc}".splitlines()[0]) from None
    return tokenizer, (rule.prefix or "") if prefix is None else prefix


def _dense_kwargs(name_or_dir: str | Path, rule: Any) -> dict[str, Any]:
    """The ``dense``/activation/normalise-first arguments for a folder whose modules end in a Dense."""
    if not rule.dense_dir:
        return {}
    weight, bias = read_dense_weights(name_or_dir, rule)  # (out, in), (out,)
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        dense.weight.copy_(weight)
        if bias is not None:
            dense.bias.copy_(bias)
    return {
        "dense": dense.to(weight.dtype),
        "dense_activation": rule.dense_activation,
        "normalize_before_dense": rule.normalize_before_dense,
    }
