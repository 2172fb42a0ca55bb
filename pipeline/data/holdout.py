"""Training rows held out of the stream, for the teacher-agreement score (``train.select_on``).

``data.holdout_rows: N`` takes rows of the run's own training data out of the stream before any batch is
planned, and keeps them, with their cached teacher vectors, for the evaluation
(:func:`pipeline.evaluate.agreement.teacher_agreement`):

* sentence shards with a teacher column (the teacher stage's output): the trailing whole blocks of the
  shard set, in manifest order, that hold at least N rows (:func:`split_blocks`); the stream is built from
  the blocks before them, so its epochs, batches and resume position never name a held-out row;
* a supervised file with its teacher vectors (``data.supervised_teacher``): its last N records
  (:func:`pipeline.data.labelled.memory_columns` leaves them out), both texts of each.

The score reads the first N held-out sentences of the shards (all 2N texts of a supervised file's N
records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class HeldOut:
    """Held-out sentences and their teacher's vectors, row for row."""

    texts: list[str]
    teacher: np.ndarray  # (N, D_t) float32 unit vectors
    where: str  # what they are, for the log: "the last 1 blocks (1,000 rows) of DIR"


def split_blocks(blocks: list[Any], rows: int, where: Any) -> tuple[list[Any], list[Any]]:
    """(the blocks the stream reads, the trailing whole blocks holding at least ``rows`` rows); a shard set
    too small to keep a training block is a ConfigError naming ``data.holdout_rows`` and ``where``."""
    if rows <= 0:
        return blocks, []
    held, count = 0, 0
    while count < rows and held < len(blocks) - 1:
        held += 1
        count += blocks[-held].rows
    if count < rows:
        total = sum(b.rows for b in blocks)
        raise ConfigError(
            f"data.holdout_rows={rows} but {where} holds {total} rows in {len(blocks)} blocks and one block "
            f"at least must stay for training; set data.holdout_rows to at most {total - blocks[0].rows}"
        )
    return blocks[:-held], blocks[-held:]


def shard_holdout(source: Any, rows: int, where: Any) -> HeldOut:
    """The first ``rows`` rows of a :class:`~pipeline.data.stream.ShardSource` over the held-out blocks
    (columns ``text`` and ``teacher``)."""
    runs, left = [], rows
    for i, block in enumerate(source.blocks):
        take = min(left, block.rows)
        runs.append((i, np.arange(take)))
        left -= take
        if not left:
            break
    columns = source.rows(runs)
    teacher = np.asarray(columns["teacher"], dtype=np.float32)  # (rows, D_t)
    n = len(source.blocks)
    return HeldOut(list(columns["text"]), teacher, f"the first {rows} rows of the last {n} blocks of {where}")


def refuse_holdout(d: Any, teacher: bool, pairs: bool) -> None:
    """``data.holdout_rows`` needs batches with the teacher's vectors, from sentence shards or a pair file."""
    if d.holdout_rows and (not teacher or pairs):
        raise ConfigError(
            "data.holdout_rows holds rows out for the teacher-agreement score: it needs batches with teacher "
            "vectors (teacher-stage data.shards with data.teacher set, or data.supervised_teacher) and is "
            "not supported on pair shards; set data.holdout_rows to 0"
        )


def memory_holdout(
    records: list[tuple], first: np.ndarray, second: np.ndarray, rows: int, where: Any
) -> HeldOut:
    """Both texts of the last ``rows`` records of a supervised file, with their teacher vectors
    (``first``/``second``: (records, D_t), text 1's and text 2's)."""
    last = records[-rows:]
    texts = [r[0] for r in last] + [r[1] for r in last]
    teacher = np.concatenate([first[-rows:], second[-rows:]]).astype(np.float32)  # (2 rows, D_t)
    return HeldOut(texts, teacher, f"both texts of the last {rows} records of {where}")


def read_holdout(d: Any, plan: Any) -> HeldOut:
    """The held-out rows of a run (``data.holdout_rows``), as :func:`split_blocks` or the supervised file's
    reader left them out of its stream; ``plan`` its :class:`~pipeline.data.plan.DataPlan`."""
    from pipeline.data.pairs import read_records
    from pipeline.data.stream import ShardSource, index_shards

    if plan.shard_set is None:
        records = read_records(d.supervised_file, plan.source)
        first, second = plan.pair_teacher.vectors()
        return memory_holdout(records, first, second, d.holdout_rows, d.supervised_file)
    where = plan.shard_set.directory
    _, held = split_blocks(index_shards(plan.shard_set, verify=False), d.holdout_rows, where)
    return shard_holdout(ShardSource(held, ["text", "teacher"]), d.holdout_rows, where)
