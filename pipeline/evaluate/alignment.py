"""Alignment and uniformity of L2-normalised embeddings (Wang & Isola 2020, "Understanding Contrastive
Representation Learning through Alignment and Uniformity on the Hypersphere").

``align = E ||f(x) - f(y)||^2`` over positive pairs: lower means paraphrases land closer.
``uniform = log E exp(-2 ||f(x) - f(y)||^2)`` over random pairs of sentences: lower (more negative)
means the embeddings spread over the sphere; a collapsed encoder scores near 0.
"""

from __future__ import annotations

import numpy as np


def alignment(x: np.ndarray, y: np.ndarray, alpha: float = 2.0) -> float:
    """Mean ||x_i - y_i||^alpha over rows; x and y are (N, H) unit vectors of positive pairs."""
    if len(x) == 0:
        raise ValueError("alignment needs at least one positive pair")
    return float((np.linalg.norm(x - y, axis=1) ** alpha).mean())


def uniformity(x: np.ndarray, num_pairs: int = 100_000, t: float = 2.0, seed: int = 0) -> float:
    """log E exp(-t ||x_i - x_j||^2) over ``num_pairs`` random pairs i != j of rows of ``x`` (N, H).

    Sampling pairs instead of all N^2 keeps the cost linear; 1e5 pairs pins the value to about 1e-3.
    """
    n = len(x)
    if n < 2:
        raise ValueError("uniformity needs at least two embeddings")
    rng = np.random.default_rng(seed)
    i = rng.integers(0, n, size=num_pairs)
    j = (i + rng.integers(1, n, size=num_pairs)) % n  # j != i, uniform over the other rows
    sq_dist = ((x[i].astype(np.float64) - x[j]) ** 2).sum(axis=1)  # (num_pairs,)
    # log-mean-exp, shifted by the maximum so tiny values do not underflow
    z = -t * sq_dist
    top = z.max()
    return float(top + np.log(np.exp(z - top).mean()))
