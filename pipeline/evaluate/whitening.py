"""BERT-whitening (Su et al. 2021, "Whitening Sentence Representations for Better Semantics and Faster
Retrieval"): map embeddings to zero mean and identity covariance, optionally keeping the first
``dim`` principal directions, which also reduces the dimension.

``x_white = (x - mu) @ W`` with ``W = U[:, :k] / sqrt(S[:k])`` from the SVD of the covariance, where k
is ``dim`` or fewer: directions whose eigenvalue is below ``EIGENVALUE_FLOOR`` times the largest are
dropped.

Why the floor: full-rank whitening divides by the square root of the smallest eigenvalue, and a
near-null direction carries no signal, only rounding noise, which whitening scales up to a whole
unit-variance component (a randomly initialised BERT's LayerNorm makes every hidden state sum to 0, an
exact null direction; a few hundred sentences for a few hundred dimensions make more). Dropping the
directions below the floor bounds the largest singular value of W by ``1 / sqrt(floor * S[0])``: an
input perturbation d moves ``(x - mu) W`` by at most ``|d| / sqrt(floor * S[0])``, and after the final
normalisation by at most ``2 |d| sigma_max(W) / |(x - mu) W|`` (tests/test_export_whitening.py uses this
bound as its tolerance). With 1e-5 no kept direction is amplified more than 316 times the first one.
Shared by evaluation (whitened Spearman) and search (dimension reduction stored with an index).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

EIGENVALUE_FLOOR = 1e-5  # relative to the largest eigenvalue: W's condition number <= 1e-5 ** -0.5 = 316


@dataclass
class Whitening:
    mean: np.ndarray  # (H,)
    matrix: np.ndarray  # (H, dim)
    dropped: int = 0  # of the requested directions, those below the eigenvalue floor (0 after load)
    floor: float = 0.0  # the absolute eigenvalue floor used (EIGENVALUE_FLOOR * largest eigenvalue)

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[1])

    def apply(self, x: np.ndarray, normalize: bool = True) -> np.ndarray:
        y = (x - self.mean) @ self.matrix  # (N, dim)
        if normalize:
            y /= np.linalg.norm(y, axis=1, keepdims=True).clip(min=1e-12)
        return y.astype(np.float32)

    def save(self, path: str | Path) -> None:
        np.savez(path, mean=self.mean, matrix=self.matrix)

    @classmethod
    def load(cls, path: str | Path) -> Whitening:
        with np.load(path, allow_pickle=False) as data:
            return cls(mean=data["mean"], matrix=data["matrix"])


def fit_whitening(
    x: np.ndarray, dim: int | None = None, eps: float = 1e-8, eigenvalue_floor: float = EIGENVALUE_FLOOR
) -> Whitening:
    """Fit on embeddings ``x`` (N, H); ``dim`` keeps the top principal directions (None: all).

    Directions with an eigenvalue below ``eigenvalue_floor`` times the largest are dropped (see the
    module docstring), so the result may have fewer than ``dim`` columns; ``eps`` is the absolute floor
    for embeddings without variance.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"whitening needs at least 2 embeddings of shape (N, H), got {x.shape}")
    dim = x.shape[1] if dim is None else dim
    if not 0 < dim <= x.shape[1]:
        raise ValueError(f"whitening dim must be in 1..{x.shape[1]}, got {dim}")
    mean = x.mean(axis=0)
    cov = np.cov((x - mean).T)  # (H, H)
    u, s, _ = np.linalg.svd(cov)
    floor = max(eigenvalue_floor * float(s[0]), eps)
    kept = max(int((s[:dim] >= floor).sum()), 1)
    matrix = u[:, :kept] / np.sqrt(np.maximum(s[:kept], floor))
    return Whitening(mean=mean.astype(np.float32), matrix=matrix.astype(np.float32),
                     dropped=dim - kept, floor=floor)  # fmt: skip


def as_linear(whitening: Whitening):
    """The whitening as an ``nn.Linear`` (a sentence-transformers Dense): ``x W - mu W`` = ``(x - mu) W``.

    The layer's weight is ``W.T`` (dim, H), as torch stores (out, in), and its bias ``-mu W`` (dim,).
    """
    import torch
    from torch import nn

    matrix = torch.from_numpy(np.asarray(whitening.matrix, dtype=np.float64))  # (H, dim)
    mean = torch.from_numpy(np.asarray(whitening.mean, dtype=np.float64))  # (H,)
    layer = nn.Linear(matrix.shape[0], matrix.shape[1])
    with torch.no_grad():
        layer.weight.copy_(matrix.T)
        layer.bias.copy_(-(mean @ matrix))
    return layer
