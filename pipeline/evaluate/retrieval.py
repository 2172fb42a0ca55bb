"""Asymmetric retrieval scoring: queries against a corpus of documents, each query with its gold document.

The corpus is every distinct document of the pair file (the corpus side as the index), so each query
competes against all the others' documents: recall@k is the share of queries whose gold document is in
the top k, nDCG@k (one relevant document: 1 / log2(1 + rank) when rank <= k) and MRR@10 reward it
being high. Queries and documents are encoded by separate functions, so a model's query and document
prompts (e5's ``query: `` / ``passage: ``) can be compared with one prompt on both sides.

Pair files: JSON lines (optionally .gz) with a query field and a document field, or a two-column TSV.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import InputError

Encoder = Callable[[Sequence[str]], np.ndarray]  # texts -> (N, dim) unit rows


@dataclass
class RetrievalSet:
    name: str
    queries: list[str]
    documents: list[str]  # distinct documents: the corpus searched
    gold: np.ndarray  # (Q,) row of each query's document in ``documents``


def make_set(name: str, pairs: Sequence[tuple[str, str]]) -> RetrievalSet:
    """Distinct documents become the corpus; duplicate (query, document) pairs are kept once."""
    documents: dict[str, int] = {}
    queries, gold, seen = [], [], set()
    for query, document in pairs:
        if (query, document) in seen or not query or not document:
            continue
        seen.add((query, document))
        queries.append(query)
        gold.append(documents.setdefault(document, len(documents)))
    if not queries:
        raise InputError(f"{name}: no (query, document) pair with both sides non-empty")
    return RetrievalSet(name, queries, list(documents), np.asarray(gold, dtype=np.int64))


def read_pairs(
    path: str | Path, query_field: str = "query", document_field: str = "desc", limit: int | None = None
) -> RetrievalSet:
    """(query, document) pairs from JSON lines (``query_field``/``document_field``; .gz allowed) or TSV."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"retrieval pair file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    pairs: list[tuple[str, str]] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if ".jsonl" in path.name or ".json" in path.name:
                try:
                    record = json.loads(line)
                    pairs.append((str(record[query_field]).strip(), str(record[document_field]).strip()))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise InputError(
                        f"{path}:{number}: not a JSON object with {query_field!r} and {document_field!r}"
                    ) from None
            else:
                columns = line.rstrip("\n").split("\t")
                if len(columns) < 2:
                    raise InputError(f"{path}:{number}: expected query<TAB>document")
                pairs.append((columns[0].strip(), columns[1].strip()))
            if limit is not None and len(pairs) >= limit:
                break
    return make_set(path.name.split(".")[0], pairs)


def ranks(
    query_vectors: np.ndarray, document_vectors: np.ndarray, gold: np.ndarray, block: int = 512
) -> np.ndarray:
    """(Q,) 1-based rank of each query's gold document by inner product (ties count against it)."""
    out = np.empty(len(gold), dtype=np.int64)
    for start in range(0, len(gold), block):
        scores = query_vectors[start : start + block] @ document_vectors.T  # (b, D)
        rows = np.arange(len(scores))
        target = scores[rows, gold[start : start + block]]  # (b,)
        out[start : start + block] = (scores >= target[:, None]).sum(axis=1)
    return out


def metrics(rank: np.ndarray, k: int = 10) -> dict[str, float]:
    """recall@k, nDCG@k and MRR@k (x100) from the gold documents' ranks."""
    hit = rank <= k
    return {
        f"recall@{k}": float(100 * hit.mean()),
        f"ndcg@{k}": float(100 * np.where(hit, 1 / np.log2(1 + rank), 0).mean()),
        f"mrr@{k}": float(100 * np.where(hit, 1 / rank, 0).mean()),
    }


def score_retrieval(
    encode_queries: Encoder, encode_documents: Encoder, data: RetrievalSet, k: int = 10
) -> dict[str, float | int]:
    """Encode both sides, rank the corpus for each query; the metrics with the set's sizes."""
    queries = np.asarray(encode_queries(data.queries), dtype=np.float32)  # (Q, dim)
    documents = np.asarray(encode_documents(data.documents), dtype=np.float32)  # (D, dim)
    if queries.shape[1] != documents.shape[1]:
        raise InputError(f"query vectors are {queries.shape[1]}-d but documents {documents.shape[1]}-d")
    return {**metrics(ranks(queries, documents, data.gold), k), "queries": len(data.queries),
            "documents": len(data.documents)}  # fmt: skip
