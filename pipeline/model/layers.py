"""Surgery on a loaded backbone, in place: cutting the transformer layers of a BERT-family backbone
(``model.layers`` in training, ``python -m pipeline student --keep_layers/--layers`` offline: anything
with ``encoder.layer`` and ``config.num_hidden_layers``, i.e. BertModel, RoBERTa, XLM-R), the dropout it
trains with (``model.dropout``) and fresh weights (``model.random_init``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from pipeline.errors import ConfigError, InputError

log = logging.getLogger(__name__)


def encoder_layers(backbone: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(backbone, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(backbone.config, "num_hidden_layers"):
        raise InputError(
            f"{type(backbone).__name__} has no encoder.layer list; student surgery supports BERT-family "
            "encoders (BertModel, RobertaModel, XLMRobertaModel)"
        )
    return layers


def resolve_layers(
    num_layers: int, keep_layers: int | None = None, layers: Sequence[int] | None = None
) -> list[int]:
    """The layer indices to keep, checked against ``num_layers``; all of them when neither is given."""
    if keep_layers is not None and layers is not None:
        raise ConfigError("set either keep_layers or layers, not both")
    if keep_layers is not None:
        if not 1 <= keep_layers <= num_layers:
            raise ConfigError(
                f"keep_layers={keep_layers}: the model has {num_layers} layers; choose 1..{num_layers}"
            )
        return list(range(keep_layers))
    if layers is None:
        return list(range(num_layers))
    chosen = list(layers)
    if not chosen:
        raise ConfigError("layers is empty; list at least one layer index")
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"layers {bad} out of range: the model has {num_layers} layers (0..{num_layers - 1})"
        )
    if len(set(chosen)) != len(chosen) or chosen != sorted(chosen):
        raise ConfigError(f"layers {chosen} must be increasing and without repeats")
    return chosen


def keep_layers(backbone: nn.Module, layers: Sequence[int]) -> None:
    """Keep only ``layers`` (indices into the current stack), in place; the config says how many."""
    stack = encoder_layers(backbone)
    chosen = resolve_layers(len(stack), layers=layers)
    backbone.encoder.layer = nn.ModuleList([stack[i] for i in chosen])
    config = backbone.config
    config.num_hidden_layers = len(chosen)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in chosen]


def reinitialise(backbone: nn.Module, seed: int) -> None:
    """Fresh weights from the architecture's own initialiser (transformers' ``_init_weights``).

    transformers marks loaded tensors ``_is_hf_initialized`` and its initialisers skip those, so the
    marks are cleared first (without that, nothing changes).
    """
    for tensor in [*backbone.parameters(), *backbone.buffers()]:
        if getattr(tensor, "_is_hf_initialized", False):
            tensor._is_hf_initialized = False
    torch.manual_seed(seed)
    backbone.apply(backbone._init_weights)
    log.info("model.random_init: every weight of the model folder re-initialised (seed %d)", seed)


def set_dropout(backbone: nn.Module, p: float) -> None:
    """Train with dropout ``p`` without writing it into the model: every dropout module (hidden and
    attention; BERT's attention reads its module's ``p`` too) takes ``p``, and the config keeps the
    folder's own values, so a saved or exported model carries its original dropout to whoever fine-tunes
    it next (a distilled student trained at 0 is still fine-tuned at e5's 0.1)."""
    for module in backbone.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
