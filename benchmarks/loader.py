"""Pre-tokenized shards (``python -m pipeline tokenize``): loader rate, shard size, padding.

Prints, for shards written by the tokenize stage:

* shard bytes over the UTF-8 bytes of their texts (text, variants, hard negatives), with and
  without the id columns (``--text_shards``: the stage's input);
* the training loader's samples/s in one worker (in-process, as ``train_throughput.py``), each sample
  1 + ``--variants`` texts, length-bucketed: tokenising the texts on the fly vs padding the stored
  ids; the two paths alternate ``--repeats`` times and the median is printed;
* padded/real tokens of one view per sample at the shards' max_length, bucketed by the character
  proxy (the order of ``--text_shards``) and by the exact token counts (the order of the ids).

    python -m pipeline tokenize --shards /tmp/tk/aug --out /tmp/tk/tok48 --model models/e5-small \
        --max_length 48
    .venv/bin/python benchmarks/loader.py --shards /tmp/tk/tok48 --text_shards /tmp/tk/aug \
        --model models/e5-small
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from pipeline.data.collate import ViewCollator
from pipeline.data.stream import BatchStream, BlockRef, ShardSource, index_shards
from pipeline.data.token_ids import TEXT_COLUMNS, shards_have_ids
from pipeline.shards import read_manifest, read_shard


def text_bytes(directory: Path) -> int:
    """UTF-8 bytes of every text the shards hold: text, variants, hard negatives."""
    total = 0
    for entry in read_manifest(directory)["shards"]:
        for block in read_shard(directory / entry["name"]):
            for name in TEXT_COLUMNS:
                if name in block.column_names:
                    column = block.column(name)
                    while hasattr(column.type, "value_type"):  # list<string> -> string
                        column = pc.list_flatten(column)
                    total += int(pc.sum(pc.binary_length(column)).as_py() or 0)
    return total


def loader_rate(
    blocks: list[BlockRef], collate: ViewCollator, batch: int, window: int, samples: int
) -> float:
    """Samples/s of one loader worker (in-process) over ``samples`` samples after a warm-up batch."""
    stream = BatchStream(ShardSource(blocks, collate.columns), collate, batch, 0, 1, 0, 0, 1, window)
    batches = stream.epoch_batches()
    next(batches)  # first block decode (and the tokenizer's warm-up)
    start, n = time.perf_counter(), 0
    for b in batches:
        n += b.ids.shape[0]
        if n >= samples:
            break
    return n / (time.perf_counter() - start)


class TokenCounts:
    """A collator reduced to (real tokens, padded tokens) of its batch."""

    def __init__(self, collate: ViewCollator):
        self.collate, self.columns = collate, collate.columns

    def __call__(self, rows: dict[str, list[Any]]) -> dict[str, int]:
        mask = self.collate(rows).attention_mask  # (n * B, L)
        return {"real": int(mask.sum()), "padded": mask.numel()}


def padded_over_real(blocks: list[BlockRef], collate: ViewCollator, batch: int, window: int) -> float:
    counts = TokenCounts(collate)
    stream = BatchStream(ShardSource(blocks, counts.columns), counts, batch, 0, 1, 0, 0, 1, window)
    real = padded = 0
    for b in stream.epoch_batches():
        real, padded = real + b["real"], padded + b["padded"]
    return padded / real


def main() -> None:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=Path, required=True, help="output of `pipeline tokenize`")
    p.add_argument("--text_shards", type=Path, default=None, help="its input (augment output)")
    p.add_argument("--model", type=Path, required=True, help="the model folder the ids were made with")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--variants", type=int, default=4, help="texts per sample: 1 + this")
    p.add_argument("--window", type=int, default=50, help="bucket window in global batches (0 = off)")
    p.add_argument("--samples", type=int, default=20000, help="samples per loader measurement")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    record = read_manifest(args.shards)["tokenizer"]
    prefix, max_length = record["prefix"], record["max_length"]
    assert shards_have_ids(args.shards, tokenizer, prefix, max_length)
    print(f"{args.shards}: tokenizer {record['name']} ({record['dtype']}, vocab {record['vocab_size']}), "
          f"prefix {prefix!r}, max_length {max_length}, batch {args.batch}")  # fmt: skip

    texts = text_bytes(args.shards)
    ids_bytes = read_manifest(args.shards)["totals"]["bytes"]
    line = f"shard bytes / UTF-8 text bytes: with ids {ids_bytes:,} / {texts:,} = {ids_bytes / texts:.3f}"
    if args.text_shards is not None:
        plain = read_manifest(args.text_shards)["totals"]["bytes"]
        line += f"; without ids {plain:,} / {texts:,} = {plain / texts:.3f}; ids add {ids_bytes / plain:.2f}x"
    print(line)

    blocks = index_shards(args.shards)  # token-count lengths
    common = (tokenizer, max_length, args.variants, 0, prefix)
    collators = {
        "tokenise on the fly": ViewCollator(*common),
        "pad stored ids": ViewCollator(*common, pretokenized=True),
    }
    rates: dict[str, list[float]] = {name: [] for name in collators}
    for _ in range(args.repeats):
        for name, collate in collators.items():
            rates[name].append(loader_rate(blocks, collate, args.batch, args.window, args.samples))
    for name, values in rates.items():
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"loader, one worker, 1 + {args.variants} texts per sample, window {args.window}, {name}: "
              f"{statistics.median(values):,.0f} samples/s (runs {runs})")  # fmt: skip

    one_view = ViewCollator(tokenizer, max_length, 0, 0, prefix, pretokenized=True)
    orders = {"token counts (ids)": blocks}
    if args.text_shards is not None:
        by_chars = index_shards(args.text_shards)
        # the same rows in the same blocks; only the bucketing lengths differ (characters)
        orders["character proxy"] = [
            BlockRef(b.path, b.offset, b.size, b.rows, c.lengths)
            for b, c in zip(blocks, by_chars, strict=True)
        ]
    for name, order in orders.items():
        ratio = padded_over_real(order, one_view, args.batch, args.window)
        print(f"padded/real tokens, one view, {max_length} tokens, G = {args.batch}, window {args.window}, "
              f"bucketed by {name}: {ratio:.3f}")  # fmt: skip
    print(f"no bucketing: {padded_over_real(blocks, one_view, args.batch, 0):.3f}")


if __name__ == "__main__":
    main()
