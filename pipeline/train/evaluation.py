"""The run's evaluation: STS-B valid Spearman of the encoder as it is now and, with held-out training rows
(``data.holdout_rows``), its agreement with the teacher on them; the score ``train.select_on`` names picks
the best checkpoint.

Teacher agreement: the Spearman correlation x100 between the student's and the teacher's cosines over every
pair of the N held-out sentences (N (N - 1) / 2 pairs, the teacher's from its cached vectors). It reads
only similarities, so it needs no projection when the widths differ, and it is on STS-B's scale: 100 when
the student orders every pair as the teacher does. ``sts_b+teacher`` selects on the mean of the two, so a
step that buys STS-B valid points by leaving the teacher's geometry on the training distribution (or the
reverse) is not preferred for it alone. When the widths are equal the mean cosine of each sentence's
student and teacher vectors is logged too (``teacher_cosine``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from pipeline import distributed as dist
from pipeline.data.holdout import HeldOut
from pipeline.evaluate.sts import score_pairs, spearman100
from pipeline.train.build import Trainer

log = logging.getLogger(__name__)


def teacher_agreement(encode: Any, held: HeldOut) -> dict[str, float]:
    """``teacher_agreement_spearman`` of the held-out rows (see above) and, at equal widths,
    ``teacher_cosine``; ``encode`` maps N texts to (N, H) unit rows."""
    student = np.asarray(encode(held.texts), dtype=np.float32)  # (N, H)
    teacher = held.teacher  # (N, D_t)
    upper = np.triu_indices(len(held.texts), k=1)  # every pair once, no self-pairs
    cosines = (student @ student.T)[upper], (teacher @ teacher.T)[upper]  # (N (N - 1) / 2,) each
    out = {"teacher_agreement_spearman": spearman100(*cosines)}
    if student.shape[1] == teacher.shape[1]:
        out["teacher_cosine"] = float(np.mean(np.sum(student * teacher, axis=1)))
    return out


def evaluate(t: Trainer) -> float:
    """The ``train.select_on`` score on rank 0 (STS-B valid Spearman x100, or its mean with the teacher
    agreement), broadcast to all (collective), as ``Callbacks.on_evaluate`` leaves it."""
    score = None
    if t.accelerator.is_main_process:
        sts_b, _ = score_pairs(t.encoder.encode, t.sts_valid)
        record: dict[str, Any] = {"event": "eval", "step": t.state.step, "sts_b_valid_spearman": sts_b}
        score = sts_b
        if t.holdout is not None:
            record.update(teacher_agreement(t.encoder.encode, t.holdout))
            if t.cfg.train.select_on == "sts_b+teacher":
                score = (sts_b + record["teacher_agreement_spearman"]) / 2
                record["selection_score"] = score
        t.metrics.log(record, t.state.step)
        logged = ("event", "step", "sts_b_valid_spearman")
        extra = "".join(f", {k} {v:.2f}" for k, v in record.items() if k not in logged)
        log.info("step %d: STS-B valid Spearman %.2f%s", t.state.step, sts_b, extra)
    return float(t.callbacks.on_evaluate(t, float(dist.broadcast_object(score))))
