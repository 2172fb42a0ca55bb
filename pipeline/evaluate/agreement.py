"""Teacher agreement: how closely the student orders held-out training sentences as the teacher does.

The Spearman correlation x100 between the student's and the teacher's cosines over every pair of the N
held-out sentences (N (N - 1) / 2 pairs, the teacher's from its cached vectors). It reads only
similarities, so it needs no projection when the widths differ, and it is on STS-B's scale: 100 when the
student orders every pair as the teacher does. When the widths are equal the mean cosine of each
sentence's student and teacher vectors is given too (``teacher_cosine``). The trainer scores it beside
STS-B valid at each evaluation (pipeline/train/evaluation.py, ``data.holdout_rows``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.data.holdout import HeldOut
from pipeline.evaluate.sts import spearman100


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
