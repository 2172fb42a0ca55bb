"""Semantic textual similarity: Spearman x100 between cosine similarity and the gold label.

The five bundled sets (ATEC, BQ, LCQMC, PAWSX: 0/1 labels; STS-B: 0-5 scores) are the Chinese STS
suite that text2vec and LUSE report; ``avg5`` is their unweighted mean. Anything that maps sentences
to vectors (a :class:`SentenceEncoder`, the TF-IDF baseline) is scored by the same :func:`score_pairs`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import sparse
from scipy.stats import spearmanr

from pipeline.errors import InputError
from pipeline.resources import EVAL_DIR

log = logging.getLogger(__name__)

# name -> bundled file; the order is the column order of every table.
STS_SETS: dict[str, str] = {
    "ATEC": "ATEC.test.tsv",
    "BQ": "BQ.dev.tsv",
    "LCQMC": "LCQMC.dev.tsv",
    "PAWSX": "PAWSX.dev.tsv",
    "STS-B": "STS-B.test.tsv",
}
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

    def subsample(self, max_pairs: int | None, seed: int) -> PairSet:
        """A seeded random subset of ``max_pairs`` pairs (kept in file order); all if None or enough."""
        if max_pairs is None or len(self) <= max_pairs:
            return self
        keep = np.sort(np.random.default_rng(seed).choice(len(self), size=max_pairs, replace=False))
        return PairSet(
            self.name,
            [self.sentence1[i] for i in keep],
            [self.sentence2[i] for i in keep],
            self.labels[keep],
        )


def _jsonl_pair(line: str, where: str) -> tuple[str, str, float]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg}); expected one pair object per line") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object with sentence1, sentence2, label")
    keys = (("sentence1", "text1", "text_a"), ("sentence2", "text2", "text_b"), ("label", "score"))
    values = []
    for names in keys:
        found = next((row[k] for k in names if k in row), None)
        if found is None:
            raise InputError(f"{where}: missing field {names[0]!r} (or {', '.join(names[1:])})")
        values.append(found)
    return str(values[0]), str(values[1]), _label(values[2], where)


def _label(value: Any, where: str) -> float:
    try:
        label = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{where}: label {value!r} is not a number") from None
    if not np.isfinite(label):
        raise InputError(f"{where}: label {value!r} is not finite")
    return label


def read_pair_file(path: str | Path, name: str | None = None) -> PairSet:
    """Read ``sentence1<TAB>sentence2<TAB>label`` (.tsv/.txt, no header) or JSONL (``.jsonl``/``.json``).

    JSONL objects take ``sentence1``/``sentence2``/``label`` (or ``text1``/``text2``/``score``). Blank
    lines are skipped; any other malformed line is an error naming the file and line, never dropped.
    A local reader: pipeline/data/pairs.py had not landed when this was written.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"pair file {path} does not exist")
    is_json = path.suffix.lower() in (".jsonl", ".json")
    s1, s2, labels = [], [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"pair file {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        if is_json:
            a, b, label = _jsonl_pair(line, where)
        else:
            parts = line.rstrip("\r\n").split("\t")
            if len(parts) != 3:
                raise InputError(
                    f"{where}: expected 3 tab-separated fields (sentence1, sentence2, label), "
                    f"got {len(parts)}"
                )
            a, b, label = parts[0], parts[1], _label(parts[2], where)
        s1.append(a)
        s2.append(b)
        labels.append(label)
    if not labels:
        raise InputError(f"pair file {path} holds no pairs")
    if len(set(labels)) < 2:
        raise InputError(f"pair file {path}: every label is {labels[0]}; Spearman needs at least two values")
    return PairSet(name or path.stem, s1, s2, np.asarray(labels, dtype=np.float64))


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
