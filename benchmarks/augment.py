"""Augmentation throughput and synonym-cache build time.

    .venv/bin/python benchmarks/augment.py                       # full: whole corpus, 200k words
    .venv/bin/python benchmarks/augment.py --sentences 5000 --words 20000   # a quick check

1. EDA: sentences/s of one worker with 4 variants on the bundled People's Daily corpus (input made by
   `preprocess` on the first lines of the corpus; if that stage fails, shards are built here from the
   corpus split on 。), and the wall-clock speedup of 2 worker processes (same output, checked).
2. Synonym cache for random unit vectors: faiss exact search (the `synonyms` command's code) vs a
   plain NumPy brute force (chunked matmul + argpartition), checking both find the same top-k.
   ``--numpy-queries`` times NumPy on that many queries (against all words) and extrapolates, since
   the full NumPy run at 200k words takes most of an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.io import atomic_write_json
from pipeline.resources import SAMPLE_CORPUS
from pipeline.shards import BASE_SCHEMA, new_manifest, read_manifest, sentence_id, shard_name, write_shard
from pipeline.stages.augment import run as augment
from pipeline.stages.augment import vector_synonyms as vs


# --------------------------------------------------------------------------------------------- EDA input
def corpus_head(path: Path, sentences: int) -> Path:
    """The first lines of the corpus holding about ``sentences`` sentences (counted by 。)."""
    lines, count = [], 0
    with open(SAMPLE_CORPUS, encoding="utf-8") as f:
        for line in f:
            lines.append(line)
            count += max(1, line.count("。"))
            if count >= sentences:
                break
    path.write_text("".join(lines), encoding="utf-8")
    return path


def input_with_preprocess(work: Path, sentences: int, per_shard: int) -> Path:
    from pipeline.stages.preprocess.run import Config, run

    out = work / "preprocessed"
    run(Config(inputs=[corpus_head(work / "corpus.txt", sentences)], out=out, sentences_per_shard=per_shard))
    return out


def input_by_hand(work: Path, sentences: int, per_shard: int) -> Path:
    seen: dict[str, None] = {}
    with open(SAMPLE_CORPUS, encoding="utf-8") as f:
        for line in f:
            for s in re.split(r"(?<=。)", line.strip()):
                if len(s) >= 5:
                    seen.setdefault(s)
            if len(seen) >= sentences:
                break
    texts = list(seen)[:sentences]
    out = work / "by_hand"
    out.mkdir()
    entries = []
    for k, start in enumerate(range(0, len(texts), per_shard)):
        part = texts[start : start + per_shard]
        blocks = [
            pa.table(
                {
                    "id": pa.array([sentence_id(t) for t in chunk], pa.uint64()),
                    "text": chunk,
                    "source": ["plain"] * len(chunk),
                },
                schema=BASE_SCHEMA,
            )
            for chunk in (part[b : b + 1000] for b in range(0, len(part), 1000))
        ]
        entries.append(write_shard(out / shard_name(k), blocks, k))
    atomic_write_json(out / "manifest.json", new_manifest("preprocess", {"by_hand": True}, entries))
    return out


def bench_eda(args: argparse.Namespace, work: Path) -> None:
    per_shard = max(500, args.sentences // 8)
    try:
        shards = input_with_preprocess(work, args.sentences, per_shard)
        how = "preprocess"
    except Exception as exc:  # the stage may be unfinished; the benchmark still needs input
        print(f"preprocess failed ({exc}); building shards from the corpus directly")
        shards, how = input_by_hand(work, args.sentences, per_shard), "built by hand"
    manifest = read_manifest(shards)
    total = manifest["totals"]["sentences"]
    print(f"EDA input: {total} sentences in {len(manifest['shards'])} shards ({how})")

    cfg = augment.Config(shards=shards, out=work / "steady", progress=False)
    start = time.perf_counter()
    augmenter = augment.build_augmenter(cfg)
    init = time.perf_counter() - start
    (work / "steady" / augment.WORK_DIR).mkdir(parents=True)
    start = time.perf_counter()
    for i, entry in enumerate(manifest["shards"]):
        job = augment.ShardJob(shards, entry, work / "steady", work / "steady" / augment.WORK_DIR, i)
        augment.augment_shard(job, augmenter)
    steady = time.perf_counter() - start
    print(
        f"  1 worker, {cfg.num_variants} variants: {total / steady:,.0f} sentences/s "
        f"(read + verify + segment + augment + write; worker start-up {init:.1f} s not included; "
        "target >= 5,000)"
    )

    walls = {}
    for workers in (1, 2):
        start = time.perf_counter()
        augment.run(augment.Config(shards=shards, out=work / f"w{workers}", workers=workers, progress=False))
        walls[workers] = time.perf_counter() - start
        print(
            f"  run(), {workers} worker(s): {walls[workers]:.2f} s wall, "
            f"{total / walls[workers]:,.0f} sentences/s"
        )
    same = all(
        (work / "w1" / e["name"]).read_bytes() == (work / "w2" / e["name"]).read_bytes()
        for e in manifest["shards"]
    )
    print(f"  speedup of 2 workers: {walls[1] / walls[2]:.2f}x (outputs identical: {same})")


# --------------------------------------------------------------------------------------------- cache
def numpy_topk(matrix: np.ndarray, queries: np.ndarray, top_k: int, chunk: int = 1024):
    """Exact top-k by cosine with plain NumPy: chunked matmul, argpartition, then sort the k."""
    ids = np.empty((len(queries), top_k), dtype=np.int64)
    scores = np.empty((len(queries), top_k), dtype=np.float32)
    for start in range(0, len(queries), chunk):
        rows = queries[start : start + chunk]
        sims = matrix[rows] @ matrix.T  # (chunk, N): the only large array, never (N, N)
        sims[np.arange(len(rows)), rows] = -np.inf  # not its own synonym
        part = np.argpartition(sims, -top_k, axis=1)[:, -top_k:]
        part_scores = np.take_along_axis(sims, part, 1)
        order = np.argsort(-part_scores, axis=1, kind="stable")
        ids[start : start + len(rows)] = np.take_along_axis(part, order, 1)
        scores[start : start + len(rows)] = np.take_along_axis(part_scores, order, 1)
    return ids, scores


def bench_cache(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((args.words, args.dim), dtype=np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    print(f"synonym cache: {args.words} random {args.dim}-d unit vectors, top_k={args.top_k}")
    cfg = vs.Config(
        vectors=Path("unused"), out=Path("unused.parquet"), top_k=args.top_k, threshold=-1.0, index=args.index
    )
    start = time.perf_counter()
    index, params = vs.build_index(cfg, matrix)
    faiss_ids = []
    for b in range(0, args.words, cfg.batch_size):
        e = min(b + cfg.batch_size, args.words)
        faiss_ids += vs.neighbours(index, matrix[b:e], np.arange(b, e), args.top_k, -1.0)[0]
    faiss_time = time.perf_counter() - start
    print(f"  faiss {params}: {faiss_time:.1f} s")

    queries = np.arange(args.words)
    if args.numpy_queries and args.numpy_queries < args.words:
        queries = np.sort(rng.choice(args.words, args.numpy_queries, replace=False))
    start = time.perf_counter()
    np_ids, _ = numpy_topk(matrix, queries, args.top_k)
    numpy_time = (time.perf_counter() - start) * args.words / len(queries)
    note = "" if len(queries) == args.words else f" (extrapolated from {len(queries)} queries)"
    print(f"  numpy brute force: {numpy_time:.1f} s{note}")
    same_lists = sum(list(faiss_ids[q]) == list(row) for q, row in zip(queries, np_ids))
    same_sets = np.mean([len(set(faiss_ids[q]) & set(row)) / args.top_k for q, row in zip(queries, np_ids)])
    print(f"  agreement: {same_lists}/{len(queries)} identical ranked lists, top-k overlap {same_sets:.5f}")
    print(f"  faiss speedup over numpy: {numpy_time / faiss_time:.1f}x (target >= 10x)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sentences", type=int, default=50_000, help="corpus sentences (whole corpus: ~45k)")
    parser.add_argument("--words", type=int, default=200_000, help="random words for the cache benchmark")
    parser.add_argument("--dim", type=int, default=200)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument(
        "--index", choices=["flat", "ivf", "hnsw"], default="flat", help="faiss index (ivf/hnsw: approximate)"
    )
    parser.add_argument(
        "--numpy-queries", type=int, default=0, help="time NumPy on this many queries (0: all)"
    )
    parser.add_argument("--skip-eda", action="store_true")
    parser.add_argument("--skip-cache", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_eda:
            bench_eda(args, Path(tmp))
    if not args.skip_cache:
        bench_cache(args)


if __name__ == "__main__":
    main()
