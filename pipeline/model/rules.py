"""A model folder's own rule: pooling, maximum length, text prefix, where the transformer lives.

Two folder layouts carry a rule (read in this order, the first one found wins):

* ``encoder.json`` (ours): ``{"pooling", "max_length", "normalize", "prefix"}``;
* a sentence-transformers folder: ``modules.json`` (Transformer -> [WeightedLayerPooling] -> Pooling ->
  [Normalize] -> [Dense] -> [Normalize]; a Dense is linear, identity or tanh activation, as the export's
  whitening writes it), the Pooling module's ``config.json`` (``pooling_mode_*`` flags or ``pooling_mode``),
  ``sentence_bert_config.json`` (``max_seq_length``) and ``config_sentence_transformers.json``
  (``prompts[default_prompt_name]`` is the prefix ``SentenceTransformer.encode`` puts before each text;
  a ``document``, ``passage`` or ``corpus`` prompt, in that order, is the document prefix that
  ``encode_document`` puts before corpus texts: e5's ``passage: ``).

A folder with neither has no rule: callers must then be told the pooling explicitly, never guess it.
Hub names are read the same way through the Hugging Face cache (offline: only what is cached).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import InputError

log = logging.getLogger(__name__)

ENCODER_FILE = "encoder.json"
ST_MODULES = "modules.json"
ST_BERT_CONFIG = "sentence_bert_config.json"
ST_CONFIG = "config_sentence_transformers.json"
SUPPORTED_MODULES = ("Transformer", "WeightedLayerPooling", "Pooling", "Normalize", "Dense")
# What may follow the Pooling module: a Dense (a linear map such as whitening) with Normalize around it
HEADS = ((), ("Normalize",), ("Dense",), ("Normalize", "Dense"), ("Dense", "Normalize"),
         ("Normalize", "Dense", "Normalize"))  # fmt: skip
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # sentence-transformers' encode_document order
DENSE_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}
POOLING_HELP = (
    "set the pooling explicitly: --model.pooling (train), --pooling (eval, index, export) or "
    "pooling= (Python), one of cls, mean, first_last_avg"
)


@dataclass(frozen=True)
class ModelRule:
    """What a folder says about turning text into one vector; None = the folder does not say."""

    pooling: str | None = None
    max_length: int | None = None
    prefix: str | None = None
    normalize: bool = True
    transformer_dir: str = (
        ""  # sub-folder of the transformer (old sentence-transformers folders: 0_Transformer)
    )
    source: str = ""  # encoder.json, sentence-transformers, or "" (no rule)
    dense_dir: str = ""  # sub-folder of a Dense module after pooling ("" = none)
    dense_activation: str = "identity"  # identity or tanh
    normalize_before_dense: bool = False  # a Normalize between Pooling and the Dense
    document_prefix: str | None = None  # the corpus-side prompt (e5: "passage: "); None = the folder has none


def _is_local(name_or_dir: str | Path) -> bool:
    return Path(name_or_dir).is_dir()


def _find(name_or_dir: str | Path, filename: str) -> Path | None:
    """``filename`` inside a local folder, or from a Hub repo through the cache; None if absent."""
    if _is_local(name_or_dir):
        path = Path(name_or_dir) / filename
        return path if path.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(str(name_or_dir), filename))
    except Exception:  # not on the Hub, offline, not a valid repo id: the folder has no such file
        return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"{path} is not readable JSON ({str(exc).splitlines()[0]}); repair or remove it"
        ) from None


def _module_kind(entry: dict[str, Any]) -> str:
    # "sentence_transformers.models.Pooling" (2.x-5.x) and
    # "sentence_transformers.sentence_transformer.modules.pooling.Pooling" (6.x) name the same class
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _st_pooling(config: dict[str, Any], where: str) -> str:
    """``cls`` or ``mean`` from a Pooling config (old ``pooling_mode_*`` flags or new ``pooling_mode``)."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        flags = {
            "pooling_mode_cls_token": "cls",
            "pooling_mode_mean_tokens": "mean",
            "pooling_mode_max_tokens": "max",
            "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens": "weightedmean",
            "pooling_mode_lasttoken": "lasttoken",
        }
        modes = [mode for key, mode in flags.items() if config.get(key)] or [
            "mean"
        ]  # as sentence-transformers
    if len(modes) != 1 or modes[0] not in ("cls", "mean"):
        raise InputError(
            f"{where}: pooling {'+'.join(modes)} is not supported (only cls or mean); "
            "convert the model or pass an explicit pooling"
        )
    return modes[0]


def _first_last_weights(folder: Path, config: dict[str, Any], where: str) -> None:
    """Accept a WeightedLayerPooling only if it is first_last_avg: layers 1..L weighted (1, 0, ..., 0, 1)."""
    weights_file = folder / "model.safetensors"
    if weights_file.is_file():
        from safetensors.torch import load_file

        weights = load_file(str(weights_file)).get("layer_weights")
    elif (folder / "pytorch_model.bin").is_file():
        import torch

        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True).get(
            "layer_weights"
        )
    else:
        weights = None
    ok = (
        weights is not None
        and config.get("layer_start") == 1
        and len(weights) >= 2
        and float(weights[0]) == float(weights[-1]) != 0
        and not any(float(w) for w in weights[1:-1])
    )
    if not ok:
        raise InputError(
            f"{where}: only a WeightedLayerPooling that averages the first and last layer (layer_start 1, "
            "weights 1, 0, ..., 0, 1) is supported; convert the model"
        )


def _sentence_transformers_rule(name_or_dir: str | Path, modules_file: Path) -> ModelRule:
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not modules:
        raise InputError(f"{modules_file} is not a list of modules; is this a sentence-transformers folder?")
    kinds = [_module_kind(m) for m in modules]
    unsupported = [k for k in kinds if k not in SUPPORTED_MODULES]
    if unsupported:
        raise InputError(
            f"{modules_file}: module {unsupported[0]} is not supported (only "
            f"{', '.join(SUPPORTED_MODULES)}); our encoder cannot reproduce it: convert the model"
        )
    if kinds[0] != "Transformer" or "Pooling" not in kinds:
        raise InputError(f"{modules_file}: expected Transformer first and a Pooling module; found {kinds}")
    body, head = tuple(kinds[: kinds.index("Pooling")]), tuple(kinds[kinds.index("Pooling") + 1 :])
    if body not in (("Transformer",), ("Transformer", "WeightedLayerPooling")) or head not in HEADS:
        raise InputError(
            f"{modules_file}: only Transformer -> [WeightedLayerPooling] -> Pooling, then [Normalize] -> "
            f"[Dense] -> [Normalize] after Pooling is supported, found {' -> '.join(kinds)}; our encoder "
            "cannot reproduce it: convert the model"
        )
    by_kind = {k: m for k, m in zip(kinds, modules)}
    base = modules_file.parent

    def module_config(kind: str) -> tuple[Path, dict[str, Any]]:
        sub = str(by_kind[kind].get("path", ""))
        path = _find(name_or_dir, f"{sub}/config.json" if sub else "config.json")
        if path is None:
            raise InputError(f"{base / sub}: the {kind} module has no config.json; the folder is incomplete")
        return path.parent, _read_json(path)

    folder, pooling_config = module_config("Pooling")
    pooling = _st_pooling(pooling_config, str(folder / "config.json"))
    if "WeightedLayerPooling" in by_kind:
        layer_folder, layer_config = module_config("WeightedLayerPooling")
        _first_last_weights(layer_folder, layer_config, str(layer_folder))
        if pooling != "mean":
            raise InputError(f"{folder}: WeightedLayerPooling followed by {pooling} pooling is not supported")
        pooling = "first_last_avg"

    transformer_dir = str(by_kind["Transformer"].get("path", ""))
    bert_config = _find(
        name_or_dir, f"{transformer_dir}/{ST_BERT_CONFIG}" if transformer_dir else ST_BERT_CONFIG
    )
    max_length = None
    if bert_config is not None:
        settings = _read_json(bert_config)
        max_length = settings.get("max_seq_length")
        if settings.get("do_lower_case"):
            raise InputError(
                f"{bert_config}: do_lower_case is not supported; lowercase in the tokenizer instead"
            )

    prefix = ""
    st_config = _find(name_or_dir, ST_CONFIG)
    if st_config is not None:
        settings = _read_json(st_config)
        name, prompts = settings.get("default_prompt_name"), settings.get("prompts") or {}
        if name is not None:
            if name not in prompts:
                raise InputError(
                    f"{st_config}: default_prompt_name {name!r} is not one of the prompts {list(prompts)}"
                )
            prefix = str(prompts[name] or "")
    document_prefix = _document_prompt(name_or_dir)
    if prefix and pooling_config.get("include_prompt") is False:
        raise InputError(
            f"{folder}: include_prompt=false (prompt tokens left out of pooling) is not supported"
        )
    dense_dir, activation = "", "identity"
    if "Dense" in by_kind:
        dense_folder, dense_config = module_config("Dense")
        dense_dir, activation = (
            str(by_kind["Dense"].get("path", "")),
            _dense_activation(dense_config, dense_folder),
        )
    normalize = head[-1:] == ("Normalize",)
    if not normalize:
        log.info(
            "%s has no final Normalize module; our encoder L2-normalises anyway (cosines are unchanged)", base
        )
    return ModelRule(
        pooling, max_length, prefix, normalize, transformer_dir, "sentence-transformers",
        dense_dir, activation, head[:2] == ("Normalize", "Dense"), document_prefix,
    )  # fmt: skip


def _document_prompt(name_or_dir: str | Path, query_prefix: str | None = None) -> str | None:
    """The folder's corpus-side prompt from ``config_sentence_transformers.json``, or None.

    With ``query_prefix`` (encoder.json's prefix), only if the file's query prompt is that prefix: a
    sentence-transformers file left over from another rule does not lend its document prompt.
    """
    st_config = _find(name_or_dir, ST_CONFIG)
    if st_config is None:
        return None
    prompts = _read_json(st_config).get("prompts") or {}
    if query_prefix is not None and prompts.get("query", query_prefix) != query_prefix:
        return None
    return next((str(prompts[name]) for name in DOCUMENT_PROMPTS if name in prompts), None)


def _dense_activation(config: dict[str, Any], folder: Path) -> str:
    """``identity`` or ``tanh`` from a Dense config; anything we cannot reproduce is an InputError."""
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")  # the Dense default
    problem = None
    if name not in DENSE_ACTIVATIONS:
        problem = f"activation {name}"
    elif config.get("use_residual"):
        problem = "use_residual"
    elif {config.get("module_input_name"), config.get("module_output_name")} - {None, "sentence_embedding"}:
        problem = "a module_input_name/module_output_name other than sentence_embedding"
    if problem:
        raise InputError(
            f"{folder}: Dense with {problem} is not supported (only a linear map with identity or tanh "
            "activation); convert the model"
        )
    return DENSE_ACTIVATIONS[name]


def read_dense_weights(name_or_dir: str | Path, rule: ModelRule) -> tuple[Any, Any]:
    """The (out, in) weight and (out,) bias (or None) of the rule's Dense module, as torch tensors."""
    path = _find(name_or_dir, f"{rule.dense_dir}/model.safetensors")
    if path is not None:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        path = _find(name_or_dir, f"{rule.dense_dir}/pytorch_model.bin")
        if path is None:
            raise InputError(f"{name_or_dir}/{rule.dense_dir}: the Dense module has no weights file")
        import torch

        tensors = torch.load(path, map_location="cpu", weights_only=True)
    if "linear.weight" not in tensors:
        raise InputError(f"{path}: no linear.weight in the Dense module's weights")
    return tensors["linear.weight"], tensors.get("linear.bias")


def read_rule(name_or_dir: str | Path) -> ModelRule:
    """The folder's (or Hub repo's) rule; ``ModelRule()`` with ``source == ""`` when it has none."""
    encoder_file = _find(name_or_dir, ENCODER_FILE)
    if encoder_file is not None:
        meta = _read_json(encoder_file)
        if not isinstance(meta, dict):
            raise InputError(f"{encoder_file} must be a JSON object with pooling, max_length, prefix")
        return ModelRule(
            meta.get("pooling"),
            meta.get("max_length"),
            meta.get("prefix", ""),
            bool(meta.get("normalize", True)),
            source=ENCODER_FILE,
            document_prefix=_document_prompt(name_or_dir, meta.get("prefix", "")),
        )
    modules_file = _find(name_or_dir, ST_MODULES)
    if modules_file is not None:
        return _sentence_transformers_rule(name_or_dir, modules_file)
    return ModelRule()


def is_sentence_transformers_folder(path: Path) -> bool:
    return (path / ST_MODULES).is_file()
