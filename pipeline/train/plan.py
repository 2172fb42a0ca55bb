"""The training config held against the data and the world size, once, before any model is built.

:func:`check_against_data` checks what needs the world size and the loss (the global batch against the
ranks and micro-batches; the negative queue against a micro-batch,
:meth:`pipeline.losses.terms.Loss.check_batch`), then hands the columns the loss's terms ask for to the
data plan (:func:`pipeline.data.plan.plan_batches`), which holds them against the shard set's manifest and
returns the :class:`~pipeline.data.plan.DataPlan`.
Checks that need only the config stay in ``Config.__post_init__``; every mistake here is one
:class:`ConfigError` line naming the field, the data and what to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.data.plan import DataPlan, plan_batches
from pipeline.errors import ConfigError
from pipeline.shards import ShardSet

if TYPE_CHECKING:
    from pipeline.train.config import Config

__all__ = ["DataPlan", "check_against_data"]


def check_against_data(
    cfg: Config, shard_set: ShardSet | None, world_size: int, tokenizer: Any = None, prefix: str = ""
) -> DataPlan:
    """Every check that needs the world size or the data, before any model is built; the resolved plan.

    ``tokenizer`` and ``prefix`` are the encoder's (:func:`pipeline.train.build.load_tokenizer`): shards
    that hold token ids are used only when their tokenizer hash equals theirs. They may be left out for
    shards without ids.
    """
    loss, d = cfg.terms(), cfg.data
    per_rank, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    if per_rank % (world_size * accum):
        raise ConfigError(
            f"train.global_batch_size ({per_rank}) must be divisible by world size x grad_accum_steps "
            f"({world_size} x {accum} = {world_size * accum}); pick a multiple of {world_size * accum}"
        )
    loss.check_batch(per_rank // accum)  # a negative queue against the keys of a micro-batch (all ranks)
    columns = loss.columns(d.num_variants, d.num_dropout_views)  # what the terms ask every batch to carry
    return plan_batches(loss, columns, d, shard_set, tokenizer, prefix)
