"""Hard-negative mining at the corpus's size: a small measurement, and the projection to N x D it implies.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/mining_projection.py --n 200000 --queries 2000

Measures, on this machine, the exact search of ``--queries`` queries against ``--n`` random unit vectors
(faiss IndexFlatIP, and pipeline.search.backend.ChunkedExactSearch on the CPU; on a GPU too when torch
sees one) and prints what the all-pairs search of the full corpus (every sentence a query, as the
teacher stage mines) costs: the measured part scaled by (N / n) x (N / queries), and the GPU part from
the GPU's peak rate (a PROJECTION unless measured on that GPU). The memory lines are arithmetic.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from _common import timed

from pipeline.search.backend import ChunkedExactSearch, faiss_module

H100_FP16_DENSE = 989e12  # FLOP/s, NVIDIA H100 SXM5 datasheet (dense, no sparsity)
H100_HBM = 3.35e12  # bytes/s
PCIE5_X16 = 50e9  # bytes/s, a realistic host-to-device rate (64 GB/s nominal)


def unit_rows(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="corpus rows measured")
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=64, help="neighbours per query (the teacher's --hn-depth)")
    parser.add_argument("--target", type=float, default=110e6, help="corpus size projected to")
    args = parser.parse_args()

    corpus, queries = unit_rows(args.n, args.dim, 0), unit_rows(args.queries, args.dim, 1)
    index = faiss_module().IndexFlatIP(args.dim)
    index.add(corpus)
    faiss_s = timed(lambda: index.search(queries, args.k))
    chunked = ChunkedExactSearch(corpus, "cpu", corpus_chunk=1 << 16, query_block=1 << 10)
    chunked_s = timed(lambda: chunked.search(queries, args.k))
    pairs = args.n * args.queries
    n, d = args.target, args.dim
    all_pairs = n * n
    out = {
        "measured": {
            "n": args.n,
            "queries": args.queries,
            "dim": d,
            "k": args.k,
            "faiss_flat_cpu_s": round(faiss_s, 3),
            "chunked_cpu_s": round(chunked_s, 3),
            "faiss_flat_cpu_pairs_per_s": round(pairs / faiss_s),
            "chunked_cpu_pairs_per_s": round(pairs / chunked_s),
        },
        "projection_at_target": {
            "N": n,
            "corpus_float32_GB": round(n * d * 4 / 1e9, 1),
            "corpus_float16_GB": round(n * d * 2 / 1e9, 1),
            "faiss_flat_cpu_hours_this_machine": round(all_pairs / (pairs / faiss_s) / 3600),
            "gpu_flops_all_pairs": f"{2 * all_pairs * d:.2e}",
            "h100_hours_at_peak_fp16": round(2 * all_pairs * d / H100_FP16_DENSE / 3600, 2),
            "h100_hours_at_50pct": round(2 * all_pairs * d / (0.5 * H100_FP16_DENSE) / 3600, 2),
            "h100_hours_score_traffic": round(all_pairs * 2 * 2 / H100_HBM / 3600, 2),
        },
    }
    try:
        import torch

        if torch.cuda.is_available():
            gpu = ChunkedExactSearch(corpus, "cuda", resident_bytes=1 << 34)
            gpu.search(queries[:64], args.k)  # warm-up
            torch.cuda.synchronize()
            gpu_s = timed(lambda: gpu.search(queries, args.k))
            out["measured"]["chunked_gpu_s"] = round(gpu_s, 4)
            out["measured"]["chunked_gpu_pairs_per_s"] = round(pairs / gpu_s)
            out["measured"]["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
