"""The sentence-transformers folder the export writes, and its reload check."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.errors import InputError
from pipeline.model.st_folder import dense_config, write_module_files

log = logging.getLogger(__name__)

VERIFY_SENTENCES = [
    "今天天气很好。",
    "花呗怎么还款",
    "一个男人在弹吉他，旁边有一只狗在睡觉。",
    "hello world 123",
    "好",
]


def write_sentence_transformers_folder(
    encoder: Any, out: Path, prompts: dict[str, str] | None = None
) -> None:
    """The transformer files plus the module files; ``out`` must not exist yet or be empty.

    ``prompts``: the folder's prompts (default: the encoder's prefix as ``query``); ``query`` is the
    default prompt, the one ``SentenceTransformer.encode`` applies by itself.
    """
    backbone, tokenizer = encoder.backbone, encoder.tokenizer
    num_layers = int(backbone.config.num_hidden_layers)
    config_flag = backbone.config.output_hidden_states
    tokenizer_max = tokenizer.model_max_length
    # WeightedLayerPooling reads all layers only if the saved config asks the model to return them;
    # the tokenizer's model_max_length is the truncation length sentence-transformers applies.
    backbone.config.output_hidden_states = encoder.pooling == "first_last_avg"
    tokenizer.model_max_length = encoder.max_length
    try:
        backbone.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    finally:
        backbone.config.output_hidden_states = config_flag
        tokenizer.model_max_length = tokenizer_max
    _add_identity_pooler(backbone, out)
    if prompts is None:
        prompts = {"query": encoder.prefix} if encoder.prefix else {}
    hidden, max_length = int(backbone.config.hidden_size), encoder.max_length
    default_prompt = "query" if prompts else None
    write_module_files(
        out, encoder.pooling, hidden, num_layers, max_length, prompts, default_prompt, dense_config(encoder)
    )
    if encoder.dense is not None:
        from safetensors.torch import save_file

        dense_dir = next(out.glob("*_Dense"))
        tensors = {"linear.weight": encoder.dense.weight.detach().contiguous()}
        if encoder.dense.bias is not None:
            tensors["linear.bias"] = encoder.dense.bias.detach().contiguous()
        save_file(tensors, str(dense_dir / "model.safetensors"))


def _add_identity_pooler(backbone: Any, out: Path) -> None:
    """Give a pooler-less BERT an identity pooler so that loaders do not warn about missing weights.

    Our encoder never uses BERT's pooler (it is built without one), but ``AutoModel`` and
    sentence-transformers build ``BertModel`` with a pooler and would report it as randomly
    initialised on every load. With W = I and b = 0, ``pooler_output`` is tanh of the [CLS] state:
    deterministic and documented in the model card rather than random.
    """
    import torch
    from safetensors.torch import load_file, save_file

    weights_file = out / "model.safetensors"
    if (
        getattr(backbone.config, "model_type", None) != "bert"
        or getattr(backbone, "pooler", None) is not None
    ):
        return
    if not weights_file.is_file():  # sharded weights: leave them as transformers wrote them
        log.info("weights are sharded; the exported BERT keeps no pooler (loaders will report it missing)")
        return
    tensors = load_file(str(weights_file))
    hidden = int(backbone.config.hidden_size)
    tensors["pooler.dense.weight"] = torch.eye(
        hidden, dtype=tensors["embeddings.word_embeddings.weight"].dtype
    )
    tensors["pooler.dense.bias"] = torch.zeros(hidden, dtype=tensors["pooler.dense.weight"].dtype)
    save_file(tensors, str(weights_file), metadata={"format": "pt"})


def verify_folder(encoder: Any, out: Path, atol: float = 1e-5) -> float:
    """Reload ``out`` with plain transformers, pool as the modules say, compare with ``encoder``."""
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    from pipeline.model.encoder import pool

    model = AutoModel.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    texts = [encoder.prefix + t for t in VERIFY_SENTENCES]
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
        loaded = encoder.head(pool(states, batch["attention_mask"], encoder.pooling))
    ours = encoder.encode(VERIFY_SENTENCES)
    error = float(np.abs(loaded.numpy() - ours).max())
    if error > atol:
        raise InputError(
            f"exported folder {out} does not reproduce the encoder (max |diff| {error:.2e} > {atol})"
        )
    return error


def prepare_out(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not overwrite:
        raise InputError(
            f"output folder {out} exists; pass --overwrite to replace it or choose another --out"
        )
    from pipeline.model.rules import ENCODER_FILE

    # model folders we save (training, checkpoints, models fetch) have modules.json too, and encoder.json
    earlier_export = (out / "modules.json").is_file() and not (out / ENCODER_FILE).is_file()
    if not out.is_dir() or (any(out.iterdir()) and not earlier_export):
        raise InputError(
            f"--overwrite refuses to delete {out}: it is not an earlier export (no modules.json, or a "
            f"model folder with {ENCODER_FILE})"
        )
