"""``python -m pipeline similarity MODEL "句子一" "句子二" [--pairs FILE]``: cosine and P(same meaning).

One line per pair on stdout, tab-separated: ``cosine``, ``p_same`` (the calibrated probability from the
model folder's ``similarity_calibration.json``, written by ``export --calibrate``; ``-`` when the model
has none), sentence 1, sentence 2. ``--pairs FILE`` reads pairs (``.tsv``/``.txt``:
``sentence1<TAB>sentence2[<TAB>label]``, or JSONL; :mod:`pipeline.data.pairs`); a bad line is one
error naming ``file:line``. When every pair of the file has a label, the Brier score and expected
calibration error on them go to stderr: the way to check whether the calibration holds on your pairs.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import option
from pipeline.errors import ConfigError, InputError

log = logging.getLogger(__name__)


@dataclass
class Config:
    model: str = option("", "MODEL: an export, model folder, checkpoint, run directory or Hub name.")
    texts: list[str] = option(factory=list, help="Two sentences to compare (positional).")
    pairs: Path | None = option(None, "File of pairs: sentence1<TAB>sentence2[<TAB>label] (.tsv) or .jsonl.")
    calibration: Path | None = option(
        None, "Calibration file (default: MODEL/similarity_calibration.json, if there is one)."
    )
    positive: float | None = option(
        None, "With labelled --pairs: label >= this means the same (empty: 1 for 0/1, 4 for 0-5 labels)."
    )
    batch_size: int = option(128, "Sentences per forward pass.")
    device: str = option("cpu", "Torch device.")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError('name the MODEL, then two sentences: similarity MODEL "句子一" "句子二"')
        if self.texts and len(self.texts) != 2:
            raise ConfigError(f"give exactly two sentences (got {len(self.texts)}), or --pairs FILE")
        if not self.texts and self.pairs is None:
            raise ConfigError('give two sentences (similarity MODEL "句子一" "句子二") or --pairs FILE')


def read_input(cfg: Config) -> tuple[list[str], list[str], np.ndarray | None]:
    """Sentences 1 and 2 and, if every pair of --pairs has one, the labels."""
    from pipeline.data.pairs import read_pairs

    first, second = ([cfg.texts[0]], [cfg.texts[1]]) if cfg.texts else ([], [])
    labels = None
    if cfg.pairs is not None:
        if not Path(cfg.pairs).is_file():
            raise InputError(f"--pairs {cfg.pairs} does not exist")
        pairs = read_pairs(cfg.pairs, require_label=False)
        if not pairs:
            raise InputError(f"--pairs {cfg.pairs} holds no pairs")
        first += [p.text_a for p in pairs]
        second += [p.text_b for p in pairs]
        if not cfg.texts and all(p.label is not None for p in pairs):
            labels = np.asarray([p.label for p in pairs], dtype=np.float64)
    return first, second, labels


def find_calibration(cfg: Config, model_dir: Path | None):
    from pipeline.evaluate.calibration import CALIBRATION_FILE, Calibration

    path = cfg.calibration or (model_dir / CALIBRATION_FILE if model_dir is not None else None)
    if cfg.calibration is not None and not Path(cfg.calibration).is_file():
        raise InputError(f"--calibration {cfg.calibration} does not exist")
    if path is None or not Path(path).is_file():
        return None
    return Calibration.load(path)


def run(cfg: Config) -> int:
    from pipeline.evaluate import calibration as cal
    from pipeline.evaluate import resolve

    first, second, labels = read_input(cfg)  # a bad file fails before the model loads
    resolved = resolve.resolve(cfg.model)
    calibration = find_calibration(cfg, resolved.model_dir)
    encoder = resolve.load_encoder(resolved, device=cfg.device)
    unique = list(dict.fromkeys(first + second))
    row = {text: i for i, text in enumerate(unique)}
    vectors = encoder.encode(unique, batch_size=cfg.batch_size)  # (U, dim), rows L2-normalised
    a = vectors[[row[t] for t in first]]
    b = vectors[[row[t] for t in second]]
    cosines = np.clip((a * b).sum(axis=1), -1.0, 1.0)
    probabilities = calibration(cosines) if calibration is not None else None
    if calibration is None:
        print(
            f"note: {resolved.name} has no similarity_calibration.json (export --calibrate writes one); "
            "p_same is '-'",
            file=sys.stderr,
        )
    out = sys.stdout
    for i, (s1, s2) in enumerate(zip(first, second)):
        p_same = "-" if probabilities is None else f"{probabilities[i]:.4f}"
        out.write(f"{cosines[i]:.4f}\t{p_same}\t{s1}\t{s2}\n")
    out.flush()
    if labels is not None and probabilities is not None:
        positive, rule = cal.positive_labels(labels, cfg.positive)
        figures = cal.summary(calibration, cosines, positive)
        print(
            f"{cfg.pairs}: {figures['pairs']} labelled pairs ({figures['positives']} with {rule}): "
            f"Brier {figures['brier']:.4f} (base rate {figures['brier_base_rate']:.4f}), "
            f"ECE {figures['ece']:.4f}",
            file=sys.stderr,
        )
    return 0
