"""Near-duplicate removal: precision, recall and cost on a constructed set with known near duplicates.

    python benchmarks/neardup.py                       # 20,000 base sentences, 2,000 with variants
    python benchmarks/neardup.py --grid                # several (shingle, bands, rows) settings
    python benchmarks/neardup.py --datasketch          # the same with datasketch's MinHash + MinHashLSH

The base sentences are the unique cleaned sentences (10-120 characters) of the bundled People's Daily
sample. For a seeded tenth of them, one to three variants are made with the edits reposts and
templates show: a character or two replaced, deleted or inserted, a number changed, a source tag or
lead-in added, punctuation changed. A base and its variants form a cluster; removal is right when it
leaves exactly one sentence of each cluster.

  precision = drops inside clusters (at most size-1 per cluster) / all drops
  recall    = drops inside clusters (at most size-1 per cluster) / sum over clusters of (size-1)

Drops outside the constructed clusters are printed with the true character-shingle Jaccard of the
pair, so one can see whether they are real near duplicates in the sample itself or mistakes.
Cost: seconds per sentence for signatures + band hashes, and for the grouping rule, one process.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from pipeline.resources import SAMPLE_CORPUS
from pipeline.stages.corpus.neardup import NearDupParams, band_hashes, near_duplicates, signatures
from pipeline.stages.preprocess.passes import text_ids
from pipeline.stages.preprocess.text import clean_paragraphs, split_sentences

LEAD_INS = ["据悉，", "记者获悉，", "【转载】", "原标题：", "新华社消息，"]
TAGS = ["（图）", "（来源：新华网）", "（完）", "。转自人民网", "（记者 王伟）"]


def base_sentences(limit: int) -> list[str]:
    paragraphs = clean_paragraphs(SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines())
    seen, out = set(), []
    for paragraph in paragraphs:
        for s in split_sentences(paragraph):
            if 10 <= len(s) <= 120 and s not in seen:
                seen.add(s)
                out.append(s)
    return out[:limit]


def variant(s: str, rng: random.Random, alphabet: str) -> str:
    kind = rng.choice(["replace", "delete", "insert", "number", "lead", "tag", "punct", "two"])
    chars = list(s)
    if kind in ("replace", "two"):
        for _ in range(1 if kind == "replace" else 2):
            chars[rng.randrange(len(chars))] = rng.choice(alphabet)
    elif kind == "delete":
        del chars[rng.randrange(len(chars))]
    elif kind == "insert":
        chars.insert(rng.randrange(len(chars)), rng.choice(alphabet))
    elif kind == "number":
        digits = [i for i, c in enumerate(chars) if c.isdigit()]
        if digits:
            chars[rng.choice(digits)] = str(rng.randrange(10))
        else:
            chars.insert(rng.randrange(len(chars)), str(rng.randrange(10)))
    elif kind == "lead":
        chars = list(rng.choice(LEAD_INS)) + chars
    elif kind == "tag":
        chars = chars + list(rng.choice(TAGS))
    else:
        commas = [i for i, c in enumerate(chars) if c == "，"]
        if commas:
            chars[rng.choice(commas)] = "、"
        else:
            chars = chars[:-1] if chars[-1] in "。！？" else chars + ["。"]
    return "".join(chars)


def constructed_set(n_base: int, share: float, seed: int) -> tuple[list[str], list[int]]:
    """Texts and their cluster ids (a base and its variants share one; unrelated bases their own)."""
    rng = random.Random(seed)
    bases = base_sentences(n_base)
    alphabet = "".join(sorted({c for s in bases for c in s if "\u4e00" <= c <= "\u9fff"}))
    texts, clusters = list(bases), list(range(len(bases)))
    seen = set(bases)
    for i in rng.sample(range(len(bases)), int(share * len(bases))):
        for _ in range(rng.randint(1, 3)):
            v = variant(bases[i], rng, alphabet)
            if v not in seen:  # exact duplicates are exact dedup's job
                seen.add(v)
                texts.append(v)
                clusters.append(i)
    return texts, clusters


def jaccard(a: str, b: str, k: int) -> float:
    sa = {a[i : i + k] for i in range(max(len(a) - k + 1, 1))}
    sb = {b[i : i + k] for i in range(max(len(b) - k + 1, 1))}
    return len(sa & sb) / len(sa | sb)


def score(dropped: set[int], clusters: list[int]) -> tuple[float, float, int, int]:
    size = np.bincount(clusters)
    removable = int((size - 1).clip(min=0).sum())
    dropped_per_cluster = np.bincount([clusters[i] for i in dropped], minlength=len(size))
    correct = int(np.minimum(dropped_per_cluster, (size - 1).clip(min=0)).sum())
    precision = correct / len(dropped) if dropped else 1.0
    return precision, correct / removable, len(dropped), removable


def run_ours(texts: list[str], clusters: list[int], params: NearDupParams, show: int) -> None:
    keys = text_ids(texts)  # any fixed 64-bit key per text works for the rule
    started = time.perf_counter()
    hashes = band_hashes(signatures(texts, params), params)
    signed = time.perf_counter()
    drop_keys, kept_keys = near_duplicates(hashes.ravel(), np.repeat(keys, params.bands))
    grouped = time.perf_counter()
    index = {int(k): i for i, k in enumerate(keys.tolist())}
    dropped = {index[int(k)] for k in drop_keys.tolist()}
    precision, recall, drops, removable = score(dropped, clusters)
    n = len(texts)
    print(
        f"shingle={params.shingle} bands={params.bands} rows={params.rows} "
        f"(threshold ~{params.threshold:.2f}): precision {precision:.3f} recall {recall:.3f} "
        f"({drops} dropped, {removable} removable); "
        f"{(signed - started) / n * 1e6:.1f} us/sentence signatures, "
        f"{(grouped - signed) / n * 1e6:.1f} us/sentence grouping"
    )
    wrong = [
        (index[int(d)], index[int(k)])
        for d, k in zip(drop_keys.tolist(), kept_keys.tolist(), strict=True)
        if clusters[index[int(d)]] != clusters[index[int(k)]]
    ]
    for d, k in wrong[:show]:
        print(
            f"   outside a cluster (J={jaccard(texts[d], texts[k], params.shingle):.2f}): "
            f"{texts[d]} | {texts[k]}"
        )


def run_datasketch(texts: list[str], clusters: list[int], threshold: float, num_perm: int, k: int) -> None:
    from datasketch import MinHash, MinHashLSH

    started = time.perf_counter()
    hashes = []
    for t in texts:
        m = MinHash(num_perm=num_perm, seed=1)
        m.update_batch([t[i : i + k].encode("utf-8") for i in range(max(len(t) - k + 1, 1))])
        hashes.append(m)
    signed = time.perf_counter()
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    dropped = set()
    for i, m in enumerate(hashes):  # keep the first of each candidate group, as a streaming index would
        if lsh.query(m):
            dropped.add(i)
        else:
            lsh.insert(str(i), m)
    grouped = time.perf_counter()
    precision, recall, drops, removable = score(dropped, clusters)
    n = len(texts)
    print(
        f"datasketch MinHash({num_perm}) + MinHashLSH(threshold={threshold}) shingle={k}: precision "
        f"{precision:.3f} recall {recall:.3f} ({drops} dropped, {removable} removable); "
        f"{(signed - started) / n * 1e6:.1f} us/sentence signatures, {(grouped - signed) / n * 1e6:.1f} "
        "us/sentence LSH (in memory, not partitioned)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=int, default=20000, help="base sentences")
    parser.add_argument("--share", type=float, default=0.1, help="share of bases that get variants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid", action="store_true", help="several settings")
    parser.add_argument("--datasketch", action="store_true", help="also datasketch (pip install datasketch)")
    parser.add_argument("--show", type=int, default=5, help="drops outside clusters to print")
    args = parser.parse_args()
    texts, clusters = constructed_set(args.base, args.share, args.seed)
    print(
        f"{len(texts):,} sentences, {len(set(clusters)):,} clusters, "
        f"{len(texts) - len(set(clusters)):,} variants"
    )
    settings = [NearDupParams()]
    if args.grid:
        settings = [
            NearDupParams(shingle, bands, rows)
            for shingle in (2, 3)
            for bands, rows in ((8, 4), (10, 6), (16, 4), (20, 5), (9, 8))
        ]
    for params in settings:
        run_ours(texts, clusters, params, args.show)
    if args.datasketch:
        for threshold in (0.5, 0.7):
            run_datasketch(texts, clusters, threshold, 128, 3)


if __name__ == "__main__":
    main()
