"""Calibrated similarity: a monotone map from cosine to P(the two sentences mean the same).

Cosines of Chinese short texts crowd together (0.87 for unrelated questions, 0.99 for paraphrases with
one model), so a raw cosine cannot be thresholded. Isotonic regression (Zadrozny & Elkan 2002;
sklearn's ``IsotonicRegression``) fits the non-decreasing step function of cosine that minimises the
squared error to the 0/1 labels of labelled pairs; read back, it is a piecewise-linear curve through
its knots (``np.interp``, exactly what ``IsotonicRegression.predict`` computes), clipped at both ends,
so reading needs numpy only.

Stored beside an export as ``similarity_calibration.json`` (:data:`CALIBRATION_FILE`)::

    {"format": "sentence-pretrain/similarity-calibration", "version": 1,
     "method": "isotonic",
     "cosine": [...], "probability": [...],          # the knots, both non-decreasing
     "fitted_on": {"file", "pairs", "positives", "positive_rule"},
     "held_out": {"file", "pairs", "positives", "brier", "ece", "ece_bins", "brier_base_rate"},
     "thresholds": [{"probability", "cosine", "precision", "recall", "predicted_positive"}, ...],
     "transfer": "..."}

What it means: among pairs *of the task family it was fitted on* (by default Chinese STS-B, general
captions/news/forum sentences, "same meaning" = gold score >= 4 of 5) whose cosine is c, about
``P(c)`` are paraphrases. It does not transfer to another family (question matching such as LCQMC/BQ,
where "same intent" is a different notion and the base rate differs) nor to another model: fit again
on labelled pairs of that family (``export --calibration-pairs FILE``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import InputError

CALIBRATION_FILE = "similarity_calibration.json"
FORMAT = "sentence-pretrain/similarity-calibration"
THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)
TRANSFER = (
    "Where it holds: sentence pairs of the task family it was fitted on (by default general-domain "
    "Chinese sentence pairs like STS-B's captions, news and forum sentences, 'same meaning' = gold score "
    ">= 4 of 5), scored by this exact model and head. Where it does not: other task families (question or "
    "intent matching such as LCQMC, BQ, ATEC; word-order adversaries such as PAWS-X), other domains or "
    "base rates, another model, or the same model with a different whitening. There, fit it again on "
    "labelled pairs of that family (`export --calibrate --calibration-pairs FILE`)."
)


@dataclass
class Calibration:
    cosine: np.ndarray  # (K,) knots, non-decreasing
    probability: np.ndarray  # (K,) P(same meaning) at the knots, non-decreasing, in [0, 1]
    method: str = "isotonic"
    info: dict[str, Any] = field(default_factory=dict)  # fitted_on, held_out, thresholds, transfer

    def __call__(self, cosines: np.ndarray) -> np.ndarray:
        """P(same meaning) for each cosine: linear between knots, constant beyond the ends."""
        return np.interp(np.asarray(cosines, dtype=np.float64), self.cosine, self.probability)

    def cosine_at(self, probability: float) -> float | None:
        """The smallest cosine calibrated to >= ``probability`` (None: never reached)."""
        reached = np.flatnonzero(self.probability >= probability)
        if not len(reached):
            return None
        j = int(reached[0])
        if j == 0:
            return float(self.cosine[0])
        c0, c1, p0, p1 = self.cosine[j - 1], self.cosine[j], self.probability[j - 1], self.probability[j]
        return float(c0 + (probability - p0) / (p1 - p0) * (c1 - c0))  # p0 < probability <= p1

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": 1,
            "method": self.method,
            "cosine": [float(c) for c in self.cosine],
            "probability": [float(p) for p in self.probability],
            **self.info,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read and check a calibration file; anything malformed is one InputError naming the file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path} is not readable JSON ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"{path} is not a similarity calibration file (format {FORMAT!r} expected)")
        try:
            cosine = np.asarray(data["cosine"], dtype=np.float64)
            probability = np.asarray(data["probability"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: 'cosine' and 'probability' must be lists of numbers") from None
        ok = (
            cosine.ndim == 1
            and cosine.shape == probability.shape
            and len(cosine) >= 1
            and np.isfinite(cosine).all()
            and np.isfinite(probability).all()
            and (np.diff(cosine) >= 0).all()
            and (np.diff(probability) >= 0).all()
            and probability.min() >= 0
            and probability.max() <= 1
        )
        if not ok:
            raise InputError(
                f"{path}: the knots must be two equally long non-decreasing lists, probabilities in [0, 1]"
            )
        info = {
            k: v for k, v in data.items() if k not in ("format", "version", "method", "cosine", "probability")
        }
        return cls(cosine, probability, str(data.get("method", "isotonic")), info)


def fit_isotonic(cosines: np.ndarray, positive: np.ndarray) -> Calibration:
    """The non-decreasing map cosine -> P(positive) that fits ``positive`` (0/1) in least squares."""
    from sklearn.isotonic import IsotonicRegression

    cosines = np.asarray(cosines, dtype=np.float64)
    positive = np.asarray(positive, dtype=np.float64)
    if len(cosines) < 2 or len(np.unique(positive)) < 2:
        raise InputError("calibration needs labelled pairs of both kinds (same meaning and not)")
    model = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
    model.fit(cosines, positive)
    return Calibration(np.asarray(model.X_thresholds_), np.asarray(model.y_thresholds_), "isotonic")


def brier(probability: np.ndarray, positive: np.ndarray) -> float:
    """Mean squared error of the predicted probabilities against the 0/1 outcomes (lower is better)."""
    return float(np.mean((np.asarray(probability) - np.asarray(positive, dtype=np.float64)) ** 2))


def expected_calibration_error(probability: np.ndarray, positive: np.ndarray, bins: int = 10) -> float:
    """ECE: over ``bins`` equal-width probability bins, the pair-weighted mean of
    |mean predicted probability - fraction positive| (Naeini et al. 2015; Guo et al. 2017)."""
    probability = np.asarray(probability, dtype=np.float64)
    positive = np.asarray(positive, dtype=np.float64)
    which = np.minimum((probability * bins).astype(int), bins - 1)  # p = 1.0 goes in the last bin
    error = 0.0
    for b in range(bins):
        members = which == b
        if members.any():
            error += members.sum() * abs(probability[members].mean() - positive[members].mean())
    return float(error / len(probability))


def threshold_table(
    calibration: Calibration,
    cosines: np.ndarray,
    positive: np.ndarray,
    levels: tuple[float, ...] = THRESHOLDS,
) -> list[dict[str, Any]]:
    """For each probability level p: the smallest cosine calibrated to >= p, and the precision and
    recall on (``cosines``, ``positive``) of calling a pair "same meaning" when P >= p."""
    probability = calibration(cosines)
    positive = np.asarray(positive, dtype=bool)
    rows = []
    for level in levels:
        cosine = calibration.cosine_at(level)
        called = probability >= level
        hits = int((called & positive).sum())
        rows.append(
            {
                "probability": level,
                "cosine": None if cosine is None else round(cosine, 4),
                "precision": round(hits / int(called.sum()), 4) if called.any() else None,
                "recall": round(hits / int(positive.sum()), 4) if positive.any() else None,
                "predicted_positive": int(called.sum()),
            }
        )
    return rows


def positive_labels(labels: np.ndarray, threshold: float | None) -> tuple[np.ndarray, str]:
    """0/1 "same meaning" from gold labels: ``label >= threshold``; by default 0/1 labels as they are,
    and graded 0-5 labels (STS-B) positive from 4 ("mostly equivalent") up."""
    labels = np.asarray(labels, dtype=np.float64)
    if threshold is None:
        threshold = 1.0 if set(np.unique(labels)) <= {0.0, 1.0} else 4.0
    return labels >= threshold, f"label >= {threshold:g}"


def split_indices(n: int, held_out_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded (fit, held-out) split of range(n)."""
    order = np.random.default_rng(seed).permutation(n)
    cut = n - max(1, math.floor(n * held_out_fraction))
    return np.sort(order[:cut]), np.sort(order[cut:])


def summary(calibration: Calibration, cosines: np.ndarray, positive: np.ndarray, bins: int = 10) -> dict:
    """Brier score, ECE and the base-rate Brier (always predicting the positive rate) on held-out pairs."""
    probability = calibration(cosines)
    rate = float(np.mean(positive))
    return {
        "pairs": int(len(cosines)),
        "positives": int(np.sum(positive)),
        "brier": round(brier(probability, positive), 4),
        "brier_base_rate": round(brier(np.full(len(cosines), rate), positive), 4),
        "ece": round(expected_calibration_error(probability, positive, bins), 4),
        "ece_bins": bins,
    }
