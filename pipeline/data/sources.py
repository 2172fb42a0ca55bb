"""Pair shards as training data (docs/pairs.md, "Training on pairs").

:func:`pair_batches` decides, from the loss and the shard set's manifest, whether a run's batches are
pairs (anchor, positive): with the ``pairs`` term, or with no main term (distillation alone) over pair
shards, which then distils both sides.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import ConfigError
from pipeline.shards import ShardSet


def is_pair_set(shard_set: ShardSet) -> bool:
    """Written by ``pipeline pairs``, or by a stage over its output (teacher: ``input_stage``)."""
    return shard_set.stage == "pairs" or shard_set.manifest.get("input_stage") == "pairs"


def pair_batches(loss: Any, shard_set: ShardSet | None) -> bool:
    """Whether the run's batches are pairs; a ConfigError when the loss and the shards do not fit."""
    if shard_set is None:
        return False
    pairs = is_pair_set(shard_set)
    if loss.data == "pair_shards" and not pairs:
        raise ConfigError(
            f"loss term {loss.main.name} reads pair shards, but {shard_set.directory} holds sentences "
            f"(stage {shard_set.stage}); point data.shards to the output of `pipeline pairs` (or of "
            "`pipeline teacher` over it)"
        )
    if pairs and loss.main is not None and loss.data != "pair_shards":
        raise ConfigError(
            f"{shard_set.directory} holds pairs (`pipeline pairs`); loss term {loss.main.name} reads "
            "sentence shards: use the pairs term, or distill/kl alone (docs/pairs.md, 'Training on pairs')"
        )
    return pairs
