"""Samples/s of one loader worker's whole job on pre-tokenized shards, for the code of a checkout.

The training stream as a worker runs it (bucketed BatchStream, block reads, the teacher column, ids
padded), in this process, after a first batch; ``--root`` imports the pipeline from another checkout,
so two versions of the loader can be timed in turn on the same shards (an A/B: alternate the two
commands and compare medians).

    python -m pipeline tokenize --shards runs/sample/teacher --out runs/tok48 --model runs/sample/student \
        --max_length 48
    for r in 1 2 3 4 5; do for root in ../base .; do
      OMP_NUM_THREADS=1 .venv/bin/python benchmarks/loader_worker.py --root $root --shards runs/tok48 \
          --model runs/sample/student --variants 0 --batch 512 --samples 60000
    done; done
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = Path(__file__).resolve().parents[1]
    p.add_argument("--root", type=Path, default=here, help="the checkout to import the pipeline from")
    p.add_argument("--shards", type=Path, required=True, help="tokenize output, teacher column")
    p.add_argument("--model", type=Path, required=True, help="the model folder the ids were made with")
    p.add_argument("--variants", type=int, default=0, help="texts per sample: 1 + this")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--window", type=int, default=50, help="bucket window in global batches")
    p.add_argument("--samples", type=int, default=60000)
    args = p.parse_args()
    sys.path.insert(0, str(args.root.resolve()))
    from transformers import AutoTokenizer

    from pipeline.data.collate import ViewCollator
    from pipeline.data.stream import BatchStream, ShardSource, index_shards
    from pipeline.shards import read_manifest

    record = read_manifest(args.shards)["tokenizer"]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = ViewCollator(
        tokenizer, record["max_length"], args.variants, 0, record["prefix"], teacher=True, pretokenized=True
    )
    source = ShardSource(index_shards(args.shards), collate.columns)
    batches = BatchStream(source, collate, args.batch, 0, 1, 0, 0, 1, args.window).epoch_batches()
    next(batches)
    n, start = 0, time.perf_counter()
    for batch in batches:
        n += batch.ids.shape[0]
        if n >= args.samples:
            break
    rate = n / (time.perf_counter() - start)
    print(f"{args.root}: {rate:,.0f} samples/s, 1 + {args.variants} texts, batch {args.batch}")


if __name__ == "__main__":
    main()
