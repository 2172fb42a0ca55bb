"""Search benchmark: approximate-index recall and speed, and what dimension reduction costs on STS.

    .venv/bin/python benchmarks/search.py                          # 200k vectors, all five STS sets
    .venv/bin/python benchmarks/search.py --n 20000 --eval-pairs 500 --fit-sentences 2000   # quick

1. ANN: recall@10 of IVF and HNSW against the exact inner-product index (IndexFlatIP), queries/s of
   each (all queries in one batch, faiss' own threads), build time. The corpus is ``--n`` unit
   vectors (``--dim``) built in one of two ways:
   * ``clusters`` (default): ``--clusters`` Gaussian centres, each vector a centre plus isotropic
     noise (``--noise`` per coordinate relative to the centre's), normalised. Queries are fresh draws
     from the same mixture, not in the index.
   * ``corpus``: the embeddings of the bundled People's Daily sentences (split on 。！？；) under the
     benchmark model, each repeated with Gaussian perturbations (``--noise``) until there are ``--n``
     vectors; queries are further perturbations. Reduced by PCA to ``--dim`` if the model is wider.
   The index code is the `index` command's (pipeline.search.backend.build_index).
2. Reduction: avg5 (mean Spearman x100 over ATEC, BQ, LCQMC, PAWSX, STS-B test; pipeline.evaluate.sts)
   with the raw embeddings, and after PCA / BERT-whitening to each of ``--reduce-dims``, fitted on
   ``--fit-sentences`` corpus sentences (never on the eval sets). The model is ``--model`` (anything
   `pipeline.evaluate.resolve` accepts) or, by default, a randomly initialised 384-d, 2-layer char-level BERT:
   untrained, its figures only show that the machinery works, not what a trained encoder loses.
"""

from __future__ import annotations

import argparse
import itertools
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.evaluate.sts import AVG_NAME, STS_SETS, embed_pair_set, load_sts_sets, spearman100
from pipeline.resources import SAMPLE_CORPUS
from pipeline.search.backend import build_index, default_nlist, set_search_params
from pipeline.search.reduction import fit_reduction


def corpus_sentences(limit: int) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    with open(SAMPLE_CORPUS, encoding="utf-8") as f:
        for line in f:
            for sentence in re.split(r"(?<=[。！？；])", line.strip()):
                sentence = sentence.strip()
                if 5 <= len(sentence) <= 120 and sentence not in seen:
                    seen.add(sentence)
                    out.append(sentence)
                    if len(out) == limit:
                        return out
    return out


def scratch_model(directory: Path, hidden: int, seed: int) -> str:
    from pipeline.model import (
        SentenceEncoder,
        build_char_vocab,
        build_scratch_backbone,
        make_tokenizer,
        write_vocab,
    )

    vocab = build_char_vocab(itertools.islice(open(SAMPLE_CORPUS, encoding="utf-8"), 20000))
    write_vocab(vocab, directory / "vocab.txt")
    heads = max(1, hidden // 64)
    config = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                  intermediate_size=4 * hidden, max_position_embeddings=128)  # fmt: skip
    backbone = build_scratch_backbone(config, len(vocab), seed)
    encoder = SentenceEncoder(
        backbone, make_tokenizer(directory / "vocab.txt"), pooling="mean", max_length=64
    )
    encoder.save_pretrained(directory)
    return str(directory)


def normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def cluster_vectors(n: int, queries: int, dim: int, clusters: int, noise: float, seed: int):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim)).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        return normalise(centres[rng.integers(clusters, size=m)] + noise * rng.normal(size=(m, dim)))

    return draw(n), draw(queries)


def perturbed_corpus(base: np.ndarray, n: int, queries: int, noise: float, seed: int):
    rng = np.random.default_rng(seed)
    scale = noise / np.sqrt(base.shape[1])  # noise is relative to the unit vector's length

    def draw(m: int) -> np.ndarray:
        return normalise(base[rng.integers(len(base), size=m)] + scale * rng.normal(size=(m, base.shape[1])))

    data = np.concatenate([base, draw(n - len(base))]) if n > len(base) else base[:n]
    return data, draw(queries)


def recall(exact: np.ndarray, approx: np.ndarray) -> float:
    k = exact.shape[1]
    return float(np.mean([len(set(e) & set(a)) / k for e, a in zip(exact, approx)]))


def timed_search(index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    _, rows = index.search(queries, k)
    return rows, len(queries) / (time.perf_counter() - start)


def ann_benchmark(data: np.ndarray, queries: np.ndarray, args: argparse.Namespace) -> None:
    n, dim = data.shape
    print(f"\n== ANN: {n} vectors x {dim} dims, {len(queries)} queries, recall@{args.k} vs exact ==")
    print(f"{'index':<34} {'build s':>8} {'queries/s':>10} {'recall@' + str(args.k):>10}")
    start = time.perf_counter()
    flat, _ = build_index("flat", dim, {}, None, [data], use_gpu=False)
    build = time.perf_counter() - start
    exact, qps = timed_search(flat, queries, args.k)
    print(f"{'flat (exact)':<34} {build:8.1f} {qps:10.0f} {1.0:10.3f}")

    nlist = args.nlist or default_nlist(n)
    train = data[np.random.default_rng(0).choice(n, size=min(n, args.train_size), replace=False)]
    start = time.perf_counter()
    ivf, _ = build_index("ivf", dim, {"nlist": nlist, "nprobe": 1}, train, [data], use_gpu=False)
    build = time.perf_counter() - start
    for nprobe in args.nprobe:
        set_search_params(ivf, nprobe=nprobe)
        rows, qps = timed_search(ivf, queries, args.k)
        print(
            f"{f'ivf nlist={nlist} nprobe={nprobe}':<34} {build:8.1f} {qps:10.0f} {recall(exact, rows):10.3f}"
        )

    params = {"hnsw_m": args.hnsw_m, "ef_construction": args.ef_construction, "ef_search": 16}
    start = time.perf_counter()
    hnsw, _ = build_index("hnsw", dim, params, None, [data], use_gpu=False)
    build = time.perf_counter() - start
    for ef in args.ef_search:
        set_search_params(hnsw, ef_search=ef)
        rows, qps = timed_search(hnsw, queries, args.k)
        label = f"hnsw M={args.hnsw_m} efC={args.ef_construction} efS={ef}"
        print(f"{label:<34} {build:8.1f} {qps:10.0f} {recall(exact, rows):10.3f}")


def reduction_benchmark(encoder: Any, fit: np.ndarray, args: argparse.Namespace) -> None:
    sets = [s.subsample(args.eval_pairs, seed=0) for s in load_sts_sets()]
    print(f"\n== Reduction: avg5 (Spearman x100), {encoder.dim}-d model, fitted on {len(fit)} sentences ==")
    embedded = []
    for pairs in sets:
        embedded.append(embed_pair_set(lambda t: encoder.encode(t, batch_size=args.batch_size), pairs))
    print(f"{'embedding':<18}" + "".join(f"{n:>8}" for n in STS_SETS) + f"{AVG_NAME:>8}")
    variants: list[tuple[str, Any]] = [(f"raw {encoder.dim}-d", None)]
    for kind in ("pca", "whitening"):
        for dim in args.reduce_dims:
            if dim <= min(encoder.dim, len(fit)):
                variants.append((f"{kind} {dim}", fit_reduction(kind, fit, dim).apply))
    for label, transform in variants:
        scores = [spearman100(e.cosines(transform), p.labels) for e, p in zip(embedded, sets)]
        print(f"{label:<18}" + "".join(f"{s:8.2f}" for s in scores) + f"{np.mean(scores):8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=200_000, help="vectors in the ANN corpus")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--source", choices=["clusters", "corpus"], default="clusters")
    parser.add_argument("--dim", type=int, default=256, help="ANN vector dimension")
    parser.add_argument("--clusters", type=int, default=2000)
    parser.add_argument("--noise", type=float, default=2.0)
    parser.add_argument("--base-sentences", type=int, default=50_000, help="corpus source: sentences encoded")
    parser.add_argument("--nlist", type=int, default=0, help="0: about 4*sqrt(n)")
    parser.add_argument("--train-size", type=int, default=100_000)
    parser.add_argument("--nprobe", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--hnsw-m", type=int, default=32)
    parser.add_argument("--ef-construction", type=int, default=80)
    parser.add_argument("--ef-search", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--model", default=None, help="default: an untrained 384-d scratch BERT")
    parser.add_argument("--hidden", type=int, default=384, help="scratch model width")
    parser.add_argument("--fit-sentences", type=int, default=10_000)
    parser.add_argument("--eval-pairs", type=int, default=2000, help="pairs per STS set (seeded subsample)")
    parser.add_argument("--reduce-dims", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--skip-ann", action="store_true")
    parser.add_argument("--skip-reduction", action="store_true")
    args = parser.parse_args()

    need_model = not args.skip_reduction or args.source == "corpus"
    encoder = None
    with tempfile.TemporaryDirectory() as tmp:
        if need_model:
            from pipeline.evaluate.resolve import load_encoder, resolve

            model = args.model or scratch_model(Path(tmp), args.hidden, seed=0)
            encoder = load_encoder(resolve(model), "cpu")
            print(f"model: {args.model or f'untrained scratch BERT, hidden {args.hidden}, 2 layers'}")
        sentences = corpus_sentences(
            max(args.fit_sentences, args.base_sentences if args.source == "corpus" else 0)
        )
        if not args.skip_ann:
            if args.source == "clusters":
                data, queries = cluster_vectors(
                    args.n, args.queries, args.dim, args.clusters, args.noise, seed=0
                )
                print(f"ANN data: {args.clusters} Gaussian clusters, noise {args.noise}, normalised")
            else:
                start = time.perf_counter()
                base = encoder.encode(
                    sentences[: args.base_sentences], batch_size=args.batch_size, progress=True
                )
                print(f"encoded {len(base)} corpus sentences in {time.perf_counter() - start:.0f}s")
                if args.dim < base.shape[1]:
                    base = fit_reduction("pca", base, args.dim).apply(base)
                data, queries = perturbed_corpus(base, args.n, args.queries, args.noise, seed=0)
                print(f"ANN data: {len(base)} sentence embeddings + perturbed copies (noise {args.noise})")
            ann_benchmark(data, queries, args)
        if not args.skip_reduction:
            fit = encoder.encode(sentences[: args.fit_sentences], batch_size=args.batch_size, progress=True)
            reduction_benchmark(encoder, fit, args)


if __name__ == "__main__":
    main()
