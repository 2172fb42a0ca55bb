"""Dimension reduction fitted on the corpus and applied to both corpus and query embeddings.

Two kinds, both an affine map ``y = normalize((x - mean) @ matrix)`` with ``matrix`` of shape (H, k):

* ``pca``: the top-k principal directions (rotation only, no rescaling);
* ``whitening``: BERT-whitening (Su et al. 2021), the principal directions divided by the square root
  of their variance, from :mod:`pipeline.evaluate.whitening`.

Outputs are L2-normalised so that inner-product search stays cosine search.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from pipeline.errors import InputError
from pipeline.evaluate.whitening import fit_whitening

ReductionKind = Literal["none", "pca", "whitening"]


@dataclass
class Reduction:
    kind: str  # "pca" or "whitening"
    mean: np.ndarray  # (H,)
    matrix: np.ndarray  # (H, k)

    @property
    def in_dim(self) -> int:
        return int(self.matrix.shape[0])

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[1])

    def apply(self, x: np.ndarray) -> np.ndarray:
        y = (np.asarray(x, dtype=np.float32) - self.mean) @ self.matrix  # (N, k)
        y /= np.linalg.norm(y, axis=1, keepdims=True).clip(min=1e-12)
        return y.astype(np.float32, copy=False)

    def save(self, path: str | Path) -> None:
        with open(path, "wb") as f:  # a file object keeps np.savez from appending ".npz" to the name
            np.savez(f, kind=np.array(self.kind), mean=self.mean, matrix=self.matrix)

    @classmethod
    def load(cls, path: str | Path) -> Reduction:
        try:
            with np.load(path, allow_pickle=False) as data:
                return cls(kind=str(data["kind"]), mean=data["mean"], matrix=data["matrix"])
        except (OSError, KeyError, ValueError) as exc:
            raise InputError(f"reduction file {path} is unreadable ({exc}); rebuild the index") from None


def fit_pca(x: np.ndarray, dim: int) -> Reduction:
    """Top-``dim`` principal directions of ``x`` (N, H), from the SVD of the centred data."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"PCA needs at least 2 embeddings of shape (N, H), got {x.shape}")
    if not 0 < dim <= min(x.shape):
        raise ValueError(f"PCA dim must be in 1..{min(x.shape)}, got {dim}")
    mean = x.mean(axis=0)
    # Economy SVD of the centred data is more accurate than eigendecomposing the covariance.
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)  # vt: (min(N, H), H)
    return Reduction("pca", mean.astype(np.float32), vt[:dim].T.astype(np.float32))


def fit_reduction(kind: str, x: np.ndarray, dim: int) -> Reduction:
    if kind == "pca":
        return fit_pca(x, dim)
    if kind == "whitening":
        w = fit_whitening(x, dim)
        return Reduction("whitening", w.mean, w.matrix)
    raise ValueError(f"unknown reduction {kind!r}; choose pca or whitening")
