"""Cutting the transformer layers of a BERT-family backbone, in place (``model.layers`` in training,
``python -m pipeline student --keep_layers/--layers`` offline): anything with ``encoder.layer`` and
``config.num_hidden_layers`` (BertModel, RoBERTa, XLM-R)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipeline.errors import ConfigError, InputError


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
