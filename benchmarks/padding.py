"""Padded/real token ratio of training batches, with and without length bucketing (data.length_bucketing).

Runs one epoch of the real BatchStream over augmented shards and tokenises every rank slice with the
trainer's collator (each slice pads its (1 + k + d) * B rows to its longest row); the ratio is
padded tokens (rows x L) over real tokens (attention mask ones), summed over the epoch. 1.00 = no
padding. Counts, not times, so the machine's load does not matter.

    bash launch/run_sample.sh   # or: pipeline preprocess + augment --num_variants 4 (runs/sample/augmented)
    .venv/bin/python benchmarks/padding.py --shards runs/sample/augmented --model models/e5-small
    .venv/bin/python benchmarks/padding.py --shards ... --model ... --views 1 --max_length 48 --world 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pipeline.data.collate import ViewCollator
from pipeline.data.stream import BatchStream, ShardSource, index_shards
from pipeline.shards import read_shard_set


class TokenCounts:
    """The trainer's collator, reduced to (real tokens, padded tokens) of the slice."""

    def __init__(self, collate: ViewCollator):
        self.collate = collate
        self.columns = collate.columns

    def __call__(self, rows: dict[str, list[Any]]) -> dict[str, int]:
        mask = self.collate(rows).attention_mask  # (n * B, L)
        return {"real": int(mask.sum()), "padded": mask.numel()}


def epoch_ratio(blocks, collate: TokenCounts, batch: int, world: int, window: int) -> tuple[float, int]:
    real = padded = steps = 0
    for rank in range(world):
        stream = BatchStream(
            ShardSource(blocks, collate.columns), collate, batch, rank, world, 0, 0, 1, window
        )
        for b in stream.epoch_batches():
            real, padded, steps = real + b["real"], padded + b["padded"], steps + (rank == 0)
    return padded / real, steps


def main() -> None:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=Path, required=True, help="augmented shards (runs/sample/augmented)")
    p.add_argument("--model", type=Path, required=True, help="model folder whose tokenizer pads the batches")
    p.add_argument("--batch", type=int, default=64, help="global batch (default config: 64)")
    p.add_argument("--world", type=int, default=1, help="ranks: each pads its own slice")
    p.add_argument("--max_length", type=int, default=32, help="default config: 32")
    p.add_argument("--views", type=int, default=None, help="k variants (default: 4, the default config)")
    p.add_argument("--dropout_views", type=int, default=1)
    p.add_argument("--windows", default="10,50", help="bucket windows to measure (global batches)")
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    spec = args.model / "encoder.json"
    prefix = json.loads(spec.read_text()).get("prefix", "") if spec.exists() else ""
    k = args.views if args.views is not None else min(4, read_shard_set(args.shards).num_variants or 0)
    blocks = index_shards(args.shards)
    collate = TokenCounts(ViewCollator(tokenizer, args.max_length, k, args.dropout_views, prefix))
    print(
        f"{sum(b.rows for b in blocks)} sentences in {args.shards}, "
        f"tokenizer {args.model} (prefix {prefix!r}), "
        f"global batch {args.batch} over {args.world} rank(s), max_length {args.max_length}, "
        f"views 1 + {k} variants + {args.dropout_views} dropout"
    )
    for window in [0, *(int(w) for w in args.windows.split(","))]:
        start = time.perf_counter()
        ratio, steps = epoch_ratio(blocks, collate, args.batch, args.world, window)
        label = f"bucketed, window {window} batches" if window else "random batches (no bucketing)"
        took = time.perf_counter() - start
        print(f"  {label:34s} padded/real tokens {ratio:.3f}  ({steps} steps, {took:.0f} s)")


if __name__ == "__main__":
    main()
