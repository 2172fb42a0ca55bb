"""Cost of luse's false-negative control per step: the loss (forward + backward) with each rule, and the
collator's text hashes per batch.

The loss is timed on random unit vectors of the encoder's width at the trainer's shapes (n views of B
sentences, a queue of Q keys, teacher vectors of width D_t), in one process, median of ``--repeats``
runs after two warm-ups; the encoder's forward and backward, which dominate a real step, are not in it.
``text_hashes`` is timed on real sentences of the bundled STS-B file, B per batch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/false_negatives.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/false_negatives.py --batch 64 --views 6 --queue 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.data.collate import text_hashes
from pipeline.losses import multi_positive, pairwise_bce
from pipeline.losses.false_negatives import Guide

STS_TRAIN = Path(__file__).resolve().parents[1] / "pipeline/resources/eval/STS-B.train.tsv"


def median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="sentences per rank (B)")
    parser.add_argument("--views", type=int, default=6, help="views per sentence (1 + k + d)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--teacher_dim", type=int, default=384)
    parser.add_argument("--queue", type=int, default=1024, help="queued keys (Q)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    b, n, q = args.batch, args.views, args.queue

    def unit(*shape: int) -> torch.Tensor:
        return F.normalize(torch.randn(*shape, generator=g), dim=-1)

    views, queue = unit(n, b, args.dim), unit(q, args.dim)
    teacher, queue_teacher = unit(b, args.teacher_dim), unit(q, args.teacher_dim)
    ids, queue_ids = torch.arange(b), torch.arange(b, b + q)  # no collisions: the masks are all False
    both = torch.stack([ids, ids + 10**6], 1), torch.stack([queue_ids, queue_ids + 10**6], 1)
    guides = {
        "off": None,
        "same_id": Guide(ids[:, None], queue_ids[:, None]),
        "same_id+same_text": Guide(*both),
        "same_id+same_text+teacher_margin": Guide(*both, teacher, queue_teacher, 0.05),
    }

    def luse(guide: Guide | None) -> None:
        x = views.clone().requires_grad_(True)
        multi_positive.compute_loss(x, 0.05, queue=queue, gather=False, guide=guide, counts={}).backward()

    def bce(guide: Guide | None) -> None:
        x = views.clone().requires_grad_(True)
        pairwise_bce.compute_loss(x, gather=False, guide=guide, counts={}).backward()

    result: dict[str, object] = {"shapes": vars(args), "torch_threads": torch.get_num_threads()}
    for name, fn in (("luse", luse), ("luse_bce", bce)):
        for rule, guide in guides.items():
            if name == "luse_bce" and guide is not None:
                guide = Guide(guide.tags, None, guide.teacher, None, guide.teacher_margin)  # no queue
            result[f"{name}/{rule}_ms"] = round(median_ms(lambda: fn(guide), args.repeats), 3)
    sentences = [line.split("\t")[0] for line in STS_TRAIN.read_text(encoding="utf-8").splitlines()[: 50 * b]]
    batches = [sentences[i : i + b] for i in range(0, len(sentences), b)]
    result["text_hashes_ms_per_batch"] = round(
        median_ms(lambda: [text_hashes(batch) for batch in batches], max(3, args.repeats // 10))
        / len(batches),
        3,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
