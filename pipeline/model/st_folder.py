"""The sentence-transformers module files of one of our encoders' rules (pooling, prefix, Dense head).

Written beside the transformer by every folder we save (:meth:`SentenceEncoder.save_pretrained`, the
export, ``models fetch``), so that ``SentenceTransformer(folder)`` computes our vectors;
:mod:`pipeline.model.rules` reads them back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["dense_config", "module_list", "write_module_files"]


def module_list(
    pooling: str, dim: int, num_layers: int, dense: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """modules.json entries and the config of each module folder for our pooling rule.

    ``dense`` (a Dense module's config) goes between two Normalize modules, as :func:`dense_config`.
    """
    modules: list[dict[str, Any]] = []
    configs: dict[str, dict[str, Any]] = {}

    def add(kind: str, folder: bool = True) -> str:
        """Append module ``kind`` (sentence_transformers.models.<kind>); return its folder, N_<kind>."""
        path = f"{len(modules)}_{kind}" if folder else ""
        modules.append(
            {"idx": len(modules), "name": str(len(modules)), "path": path,
             "type": f"sentence_transformers.models.{kind}"}
        )  # fmt: skip
        return path

    add("Transformer", folder=False)
    if pooling == "first_last_avg":
        configs[add("WeightedLayerPooling")] = {
            "word_embedding_dimension": dim,
            "layer_start": 1,
            "num_hidden_layers": num_layers,
        }
    configs[add("Pooling")] = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling in ("mean", "first_last_avg"),
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    if dense is not None:
        if dense.pop("normalize_before", True):
            configs[add("Normalize")] = {}
        configs[add("Dense")] = dense
    configs[add("Normalize")] = {}
    return modules, configs


def dense_config(encoder: Any) -> dict[str, Any] | None:
    """The sentence-transformers Dense config (its 6.x field names) of ``encoder.dense``, or None."""
    if encoder.dense is None:
        return None
    activation = {"identity": "torch.nn.modules.linear.Identity", "tanh": "torch.nn.modules.activation.Tanh"}
    return {
        "in_features": int(encoder.dense.in_features),
        "out_features": int(encoder.dense.out_features),
        "bias": encoder.dense.bias is not None,
        "activation_function": activation[encoder.dense_activation],
        "normalize_before": encoder.normalize_before_dense,  # popped by module_list, not written
    }


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_module_files(
    out: Path,
    pooling: str,
    dim: int,
    num_layers: int,
    max_length: int,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    dense: dict[str, Any] | None = None,
    model_args: dict[str, Any] | None = None,
) -> None:
    """The sentence-transformers files around the transformer in ``out`` (also used by ``models fetch``).

    ``prompts[default_prompt_name]`` is the prefix: SentenceTransformer.encode(texts) then puts it before
    every text and pools over it (include_prompt), exactly as SentenceEncoder.tokenize does.
    """
    import torch
    from safetensors.torch import save_file

    import pipeline

    modules, configs = module_list(pooling, dim, num_layers, dict(dense) if dense else None)
    _write_json(out / "modules.json", modules)
    for folder, config in configs.items():
        _write_json(out / folder / "config.json", config)
    if pooling == "first_last_avg":
        weights = torch.zeros(num_layers)  # one weight per layer 1..L: keep the first and the last
        weights[0] = weights[-1] = 1.0
        save_file({"layer_weights": weights}, str(out / "1_WeightedLayerPooling" / "model.safetensors"))
    settings: dict[str, Any] = {"max_seq_length": max_length, "do_lower_case": False}
    if model_args:  # passed to the transformer's from_pretrained (the key every 2.x-6.x release reads)
        settings["model_args"] = dict(model_args)
    _write_json(out / "sentence_bert_config.json", settings)
    _write_json(
        out / "config_sentence_transformers.json",
        {
            "__version__": {"sentence_pretrain": pipeline.__version__, "pytorch": torch.__version__},
            "prompts": dict(prompts or {}),
            "default_prompt_name": default_prompt_name,
            "similarity_fn_name": "cosine",
        },
    )
