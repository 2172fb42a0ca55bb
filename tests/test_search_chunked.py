"""The chunked exact search (pipeline/search/backend.py) equals faiss' flat index with device memory bounded
by its chunk sizes, and hard-negative mining gives the same negatives through it (run on CPU here; on a
GPU the same code runs in float16: tests/test_gpu.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.search.backend import ChunkedExactSearch, faiss_module, search_device


def unit_rows(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def faiss_flat(vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    index = faiss_module().IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index.search(queries, k)


@pytest.mark.parametrize(
    ("chunk", "block", "resident"), [(7, 5, 0), (50, 64, 0), (16, 3, 10_000), (1000, 1000, 0)]
)
def test_equals_faiss_flat_in_any_chunking(chunk, block, resident):
    corpus, queries = unit_rows(203, 24, 0), unit_rows(37, 24, 1)
    search = ChunkedExactSearch(corpus, "cpu", corpus_chunk=chunk, query_block=block, resident_bytes=resident)
    scores, rows = search.search(queries, 20)
    ref_scores, ref_rows = faiss_flat(corpus, queries, 20)
    np.testing.assert_array_equal(rows, ref_rows)  # random unit vectors: no ties
    np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=1e-5)
    assert search.peak_scores <= block * chunk  # the score matrix never exceeds one block x one chunk


def test_resident_chunks_are_copied_once_and_the_rest_per_query_block():
    corpus = unit_rows(100, 8, 2)
    search = ChunkedExactSearch(corpus, "cpu", corpus_chunk=10, query_block=4, resident_bytes=3 * 10 * 8 * 4)
    search.search(unit_rows(12, 8, 3), 5)  # 3 query blocks x 10 chunks, 3 of them resident
    assert len(search.resident) == 3 and search.chunks_copied == 10  # each chunk once per call
    search.search(unit_rows(12, 8, 4), 5)
    assert search.chunks_copied == 10 + 7  # the resident ones stay


def test_fewer_rows_than_k_pad_like_faiss():
    corpus, queries = unit_rows(4, 6, 4), unit_rows(2, 6, 5)
    scores, rows = ChunkedExactSearch(corpus, "cpu", corpus_chunk=3).search(queries, 6)
    ref_scores, ref_rows = faiss_flat(corpus, queries, 6)
    np.testing.assert_array_equal(rows, ref_rows)
    assert (rows[:, 4:] == -1).all()


def test_mining_through_the_chunked_search_gives_faiss_negatives():
    from pipeline.normalize import normalize_text
    from pipeline.stages.teacher.negatives import MineParams, Pool, build_search_index, mine_rows

    n = 150
    texts = [f"句子{i}" for i in range(n)]
    pool = Pool(
        ids=np.arange(n, dtype=np.uint64),
        texts=texts,
        keys=[normalize_text(t) for t in texts],
        variant_keys=[frozenset()] * n,
        vectors=unit_rows(n, 16, 6),
        starts=[0],
    )
    params = MineParams(k=3, depth=12, max_similarity=0.6, min_similarity=-0.5)
    flat = build_search_index(pool.vectors, params, "cpu")  # faiss, as before
    chunked = ChunkedExactSearch(pool.vectors, "cpu", corpus_chunk=40, query_block=32)
    a, b = Counter(), Counter()
    assert mine_rows(flat, pool, 0, n, params, a) == mine_rows(chunked, pool, 0, n, params, b)
    assert a == b and a["negatives"] > 0


def test_search_device_opt_out_and_missing_gpu(monkeypatch):
    import torch

    assert search_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert search_device("auto") == "cpu"
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        search_device("cuda")
