"""The export a user deploys: retrieval prompts, ONNX / int8 fidelity, quality and CPU speed.

    # recall@10 of query -> document with e5's document prompt vs today's query prefix on both sides
    python benchmarks/export_deploy.py retrieval --model models/e5-small \
        --pairs /work/shared/data/pairs/baidu_hot_query_desc.jsonl.gz --fields query,desc --n 2000

    # an export with --onnx --onnx-int8: cosine to PyTorch on 1,000 sentences, avg5 fp32 vs int8,
    # sentences/s for PyTorch fp32 / bf16 and ONNX fp32 / int8 at batch 1 and 64 (interleaved rounds)
    python benchmarks/export_deploy.py onnx --folder runs/g34/export --max-pairs 2000

Prints one JSON object per measurement. The machine's load is not controlled here: say in the
write-up whether it was shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def retrieval(args: argparse.Namespace) -> None:
    from pipeline.evaluate.retrieval import make_set, read_pairs, score_retrieval
    from pipeline.model import SentenceEncoder
    from pipeline.model.rules import read_rule

    encoder = SentenceEncoder.from_pretrained(args.model)
    if args.max_length:
        encoder.max_length = args.max_length
    query_field, document_field = args.fields.split(",")
    data = read_pairs(args.pairs, query_field, document_field)
    keep = np.sort(np.random.default_rng(args.seed).choice(len(data.queries), args.n, replace=False))
    data = make_set(data.name, [(data.queries[i], data.documents[data.gold[i]]) for i in keep])
    query_prefix, document_prefix = encoder.prefix, read_rule(args.model).document_prefix
    cache: dict[str, np.ndarray] = {}

    def encode_with(prefix: str):
        def encode(texts):
            key = f"{prefix}|{len(texts)}|{texts[0]}"
            if key not in cache:
                own, encoder.prefix = encoder.prefix, prefix
                try:
                    cache[key] = encoder.encode(list(texts), batch_size=64)
                finally:
                    encoder.prefix = own
            return cache[key]

        return encode

    for name, doc_prefix in (
        ("query prefix on both sides (before)", query_prefix),
        ("document prompt for documents (now)", document_prefix),
    ):
        start = time.perf_counter()
        scores = score_retrieval(encode_with(query_prefix), encode_with(doc_prefix), data)
        print(
            json.dumps(
                {
                    "set": data.name,
                    "model": args.model,
                    "arm": name,
                    "query_prefix": query_prefix,
                    "document_prefix": doc_prefix,
                    "max_length": encoder.max_length,
                    **scores,
                    "seconds": round(time.perf_counter() - start, 1),
                },
                ensure_ascii=False,
            ),
            flush=True,
        )


def onnx(args: argparse.Namespace) -> None:
    import torch

    from pipeline.evaluate.run import corpus_sentences
    from pipeline.evaluate.sts import STS_SETS, embed_pair_set, load_sts_sets, spearman100
    from pipeline.export.onnx_encode import INT8_FILE, ONNX_FILE, OnnxEncoder
    from pipeline.model import SentenceEncoder

    torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    pt = SentenceEncoder.from_pretrained(folder)
    fp32 = OnnxEncoder(folder, ONNX_FILE, threads=args.threads)
    int8 = OnnxEncoder(folder, INT8_FILE, threads=args.threads)
    sentences = corpus_sentences(args.sentences, args.seed + 7)
    reference = pt.encode(sentences, batch_size=64) if "cosine" in args.parts else None
    for name, enc in (("onnx fp32", fp32), ("onnx int8", int8)) if reference is not None else ():
        cos = (enc.encode(sentences, batch_size=64) * reference).sum(axis=1)
        print(
            json.dumps(
                {
                    "what": "cosine to PyTorch fp32",
                    "model": name,
                    "sentences": len(sentences),
                    "min": float(cos.min()),
                    "mean": float(cos.mean()),
                }
            ),
            flush=True,
        )

    if "speed" in args.parts:
        speed(args, pt, fp32, int8)
    if "sts" in args.parts:
        sets = load_sts_sets(list(STS_SETS))
        if args.max_pairs:
            sets = [s.subsample(args.max_pairs, args.seed) if hasattr(s, "subsample") else s for s in sets]
        for name, embed in (
            ("onnx fp32", lambda t: fp32.encode(list(t), batch_size=64)),
            ("onnx int8", lambda t: int8.encode(list(t), batch_size=64)),
        ):
            scores = {s.name: spearman100(embed_pair_set(embed, s).cosines(), s.labels) for s in sets}
            scores["avg5"] = float(np.mean(list(scores.values())))
            print(
                json.dumps(
                    {
                        "what": "STS Spearman x100",
                        "model": name,
                        "pairs": {s.name: len(s) for s in sets},
                        **scores,
                    }
                ),
                flush=True,
            )


def speed(args: argparse.Namespace, pt, fp32, int8) -> None:
    import torch

    from pipeline.evaluate.run import corpus_sentences

    texts = corpus_sentences(args.speed_sentences, args.seed + 11)

    def pt_run(batch: int, bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            pt.encode(texts, batch_size=batch)

    arms = {
        "pytorch fp32": lambda b: pt_run(b, False),
        "pytorch bf16": lambda b: pt_run(b, True),
        "onnx fp32": lambda b: fp32.encode(texts, batch_size=b),
        "onnx int8": lambda b: int8.encode(texts, batch_size=b),
    }
    for batch in (1, 64):
        times: dict[str, list[float]] = {k: [] for k in arms}
        for name, fn in arms.items():  # warm-up
            fn(batch)
        for _ in range(args.rounds):  # interleaved: each round runs every arm once, in turn
            for name, fn in arms.items():
                start = time.perf_counter()
                fn(batch)
                times[name].append(time.perf_counter() - start)
        for name, values in times.items():
            rates = [len(texts) / v for v in values]
            print(
                json.dumps(
                    {
                        "what": "sentences/s",
                        "model": name,
                        "batch": batch,
                        "threads": args.threads,
                        "sentences": len(texts),
                        "rounds": args.rounds,
                        "median": float(np.median(rates)),
                        "min": float(min(rates)),
                        "max": float(max(rates)),
                    }
                ),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("retrieval")
    r.add_argument("--model", required=True)
    r.add_argument("--pairs", required=True)
    r.add_argument("--fields", default="query,desc")
    r.add_argument("--n", type=int, default=2000)
    r.add_argument("--max-length", type=int, default=0)
    r.add_argument("--seed", type=int, default=0)
    o = sub.add_parser("onnx")
    o.add_argument("--folder", required=True)
    o.add_argument("--sentences", type=int, default=1000)
    o.add_argument("--max-pairs", type=int, default=0)
    o.add_argument("--speed-sentences", type=int, default=256)
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--threads", type=int, default=2)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--parts", default="cosine,speed,sts", help="which measurements, in this order")
    args = parser.parse_args()
    {"retrieval": retrieval, "onnx": onnx}[args.command](args)


if __name__ == "__main__":
    main()
