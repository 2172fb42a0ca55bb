"""Semantic textual similarity: Spearman x100 between cosine similarity and the gold label.

The five bundled sets (ATEC, BQ, LCQMC, PAWSX: 0/1 labels; STS-B: 0-5 scores) are the Chinese STS
suite that text2vec and LUSE report; ``avg5`` is their unweighted mean. Anything that maps sentences
to vectors (a :class:`SentenceEncoder`, the TF-IDF baseline) is scored by the same :func:`score_pairs`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import sparse
from scipy.stats import spearmanr

from pipeline.data.pairs import read_pairs
from pipeline.errors import InputError
from pipeline.resources import EVAL_DIR, STS_SETS

log = logging.getLogger(__name__)

AVG_NAME = "avg5"

# An embedder maps N sentences to N row vectors, dense (N, H) or scipy-sparse; rows need not be unit length.
Embedder = Callable[[Sequence[str]], Any]


@dataclass
class PairSet:
    name: str
    sentence1: list[str]
    sentence2: list[str]
    labels: np.ndarray  # (N,) float

    def __len__(self) -> int:
        return len(self.labels)

    def sentences(self) -> list[str]:
        """Unique sentences of both columns, first-seen order (what needs encoding)."""
        return list(dict.fromkeys(self.sentence1 + self.sentence2))

    def positive_mask(self) -> np.ndarray:
        """Pairs that count as paraphrases: label 1 on 0/1 sets, score >= 4 on a 0-5 scale."""
        binary = set(np.unique(self.labels).tolist()) <= {0.0, 1.0}
        return self.labels >= (1.0 if binary else 4.0)

    def first(self, max_pairs: int) -> PairSet:
        """The first ``max_pairs`` pairs in file order; all if 0 or enough."""
        if not max_pairs or len(self) <= max_pairs:
            return self
        n = max_pairs
        return PairSet(self.name, self.sentence1[:n], self.sentence2[:n], self.labels[:n])

    def subsample_rows(self, max_pairs: int | None, seed: int) -> np.ndarray:
        """The rows :meth:`subsample` keeps, in file order."""
        if max_pairs is None or len(self) <= max_pairs:
            return np.arange(len(self))
        return np.sort(np.random.default_rng(seed).choice(len(self), size=max_pairs, replace=False))

    def subsample(self, max_pairs: int | None, seed: int) -> PairSet:
        """A seeded random subset of ``max_pairs`` pairs (kept in file order); all if None or enough."""
        if max_pairs is None or len(self) <= max_pairs:
            return self
        keep = self.subsample_rows(max_pairs, seed)
        return PairSet(
            self.name,
            [self.sentence1[i] for i in keep],
            [self.sentence2[i] for i in keep],
            self.labels[keep],
        )


def read_pair_file(path: str | Path, name: str | None = None) -> PairSet:
    """A scored pair file (format and errors: :func:`pipeline.data.pairs.read_pairs`) as a PairSet.

    Spearman needs at least two distinct labels: a file with one label value is an error.
    """
    pairs = read_pairs(path)
    labels = np.asarray([p.label for p in pairs], dtype=np.float64)
    if len(np.unique(labels)) < 2:
        raise InputError(f"pair file {path}: every label is {labels[0]}; Spearman needs at least two values")
    return PairSet(name or Path(path).stem, [p.text_a for p in pairs], [p.text_b for p in pairs], labels)


def load_sts_sets(names: Sequence[str] | None = None, eval_dir: Path = EVAL_DIR) -> list[PairSet]:
    names = list(STS_SETS) if names is None else list(names)
    unknown = [n for n in names if n not in STS_SETS]
    if unknown:
        raise InputError(f"unknown STS set(s) {unknown}; choose from {list(STS_SETS)}")
    return [read_pair_file(eval_dir / STS_SETS[n], n) for n in names]


def row_normalize(x: Any) -> Any:
    """L2-normalise rows of a dense array or a scipy sparse matrix (zero rows stay zero)."""
    if sparse.issparse(x):
        norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1))).ravel()
        return sparse.diags(1.0 / np.clip(norms, 1e-12, None)) @ x
    x = np.asarray(x, dtype=np.float64)
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)


def pair_cosine(a: Any, b: Any) -> np.ndarray:
    """Row-wise cosine similarity of two equally long batches of vectors, dense or sparse."""
    a, b = row_normalize(a), row_normalize(b)
    if sparse.issparse(a):
        return np.asarray(a.multiply(b).sum(axis=1)).ravel()
    return (a * b).sum(axis=1)


def spearman100(scores: np.ndarray, labels: np.ndarray) -> float:
    """Spearman rank correlation x100; 0.0 when the scores are constant (correlation undefined)."""
    if np.ptp(scores) == 0:
        return 0.0
    return float(spearmanr(scores, labels).statistic * 100.0)


@dataclass
class EmbeddedPairs:
    vectors: Any  # (U, H) one row per unique sentence, dense or sparse
    index1: np.ndarray  # (N,) row of each pair's first sentence
    index2: np.ndarray  # (N,) row of each pair's second sentence

    def cosines(self, transform: Callable[[Any], Any] | None = None) -> np.ndarray:
        vectors = self.vectors if transform is None else transform(self.vectors)
        return pair_cosine(vectors[self.index1], vectors[self.index2])


def embed_pair_set(embed: Embedder, pairs: PairSet) -> EmbeddedPairs:
    """Embed each unique sentence of ``pairs`` once."""
    unique = pairs.sentences()
    row = {s: i for i, s in enumerate(unique)}
    return EmbeddedPairs(
        embed(unique),
        np.asarray([row[s] for s in pairs.sentence1]),
        np.asarray([row[s] for s in pairs.sentence2]),
    )


def score_pairs(embed: Embedder, pairs: PairSet) -> tuple[float, np.ndarray]:
    """Spearman x100 of ``pairs`` under ``embed`` and the per-pair cosines."""
    cosines = embed_pair_set(embed, pairs).cosines()
    return spearman100(cosines, pairs.labels), cosines
