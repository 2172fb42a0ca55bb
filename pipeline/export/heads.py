"""What the export fits on top of the encoder: BERT-whitening (a Dense module) and the calibration file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.errors import InputError

log = logging.getLogger(__name__)


def add_whitening(encoder: Any, cfg: Any) -> dict[str, Any]:
    """Fit BERT-whitening on a seeded sample of bundled corpus sentences; set it as ``encoder.dense``.

    Fitted on the encoder's normalised output, as ``eval --whitening`` does, so the exported head is
    Normalize -> Dense -> Normalize. Never fitted on evaluation sentences: the scored sets stay unseen.
    """
    import numpy as np

    from pipeline.evaluate.run import corpus_sentences
    from pipeline.evaluate.whitening import EIGENVALUE_FLOOR, as_linear, fit_whitening

    if encoder.dense is not None:
        raise InputError("the model already ends in a Dense module; export --whitening needs one without")
    sentences = corpus_sentences(cfg.whitening_sentences, cfg.seed)
    vectors = encoder.encode(sentences, progress=True, desc="whitening")  # (N, H)
    dim = None if cfg.whitening_dim is None else min(cfg.whitening_dim, vectors.shape[1])
    if len(vectors) < vectors.shape[1]:
        log.warning("whitening fitted on %d sentences for %d dimensions: the covariance is rank-deficient",
                    len(vectors), vectors.shape[1])  # fmt: skip
    whitening = fit_whitening(vectors, dim)
    singular = np.linalg.svd(whitening.matrix.astype(np.float64), compute_uv=False)
    encoder.dense = as_linear(whitening).to(next(encoder.parameters()).dtype)
    encoder.dense_activation, encoder.normalize_before_dense = "identity", True
    return {"source": "bundled People's Daily corpus (1998-01)", "sentences": len(sentences),
            "dim": encoder.dim, "input_dim": int(vectors.shape[1]), "seed": cfg.seed,
            "eigenvalue_floor": EIGENVALUE_FLOOR, "dropped": whitening.dropped,
            "max_gain": float(singular.max() / singular.min())}  # fmt: skip


def add_calibration(encoder: Any, cfg: Any) -> Any:
    """Fit cosine -> P(same meaning) (isotonic) on labelled pairs; Brier/ECE/thresholds on held-out pairs.

    The scored evaluation sets are refused as fitting data: a calibration fitted on them would make
    the evaluation and the thresholds in the card optimistic.
    """
    import numpy as np

    from pipeline.evaluate import calibration as cal
    from pipeline.evaluate.sts import EVAL_DIR, STS_SETS, embed_pair_set, read_pair_file

    default = cfg.calibration_pairs is None
    fit_path = EVAL_DIR / "STS-B.train.tsv" if default else Path(cfg.calibration_pairs)
    scored = {(EVAL_DIR / name).resolve() for name in STS_SETS.values()}
    for path in (fit_path, cfg.calibration_holdout):
        if path is not None and Path(path).resolve() in scored:
            raise InputError(f"{path} is a scored evaluation set; calibrate on training pairs instead")
    if not fit_path.is_file():
        raise InputError(f"--calibration-pairs {fit_path} does not exist")

    def cosines(pairs: Any) -> np.ndarray:
        embed = lambda texts: encoder.encode(texts, progress=True, desc="calibration")  # noqa: E731
        return embed_pair_set(embed, pairs).cosines()

    pairs = read_pair_file(fit_path)
    scores = cosines(pairs)
    positive, rule = cal.positive_labels(pairs.labels, cfg.calibration_positive)
    holdout_path = cfg.calibration_holdout or (EVAL_DIR / "STS-B.valid.tsv" if default else None)
    if holdout_path is None:
        fit, held = cal.split_indices(len(pairs), 0.2, cfg.seed)
        held_scores, held_positive = scores[held], positive[held]
        held_name = f"{fit_path.name}: a seeded 20% ({len(held)} pairs, seed {cfg.seed}) left out of the fit"
        scores, positive = scores[fit], positive[fit]
    else:
        held_pairs = read_pair_file(holdout_path)
        held_scores = cosines(held_pairs)
        held_positive, _ = cal.positive_labels(held_pairs.labels, cfg.calibration_positive)
        held_name = Path(holdout_path).name
    calibration = cal.fit_isotonic(scores, positive)
    calibration.info = {
        "what": "P(the two sentences mean the same | cosine of their embeddings under this model)",
        "fitted_on": {
            "file": fit_path.name,
            "pairs": int(len(scores)),
            "positives": int(positive.sum()),
            "positive_rule": rule,
        },  # fmt: skip
        "held_out": {"file": held_name, **cal.summary(calibration, held_scores, held_positive)},
        "thresholds": cal.threshold_table(calibration, held_scores, held_positive),
        "transfer": cal.TRANSFER,
    }
    return calibration
