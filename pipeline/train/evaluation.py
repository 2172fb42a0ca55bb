"""The run's evaluation: STS-B valid Spearman of the encoder as it is now and, with held-out training rows
(``data.holdout_rows``), its agreement with the teacher on them (pipeline/evaluate/agreement.py); the
score ``train.select_on`` names picks the best checkpoint. ``sts_b+teacher`` selects on the mean of the
two, so a step that buys STS-B valid points by leaving the teacher's geometry on the training
distribution (or the reverse) is not preferred for it alone.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline import distributed as dist
from pipeline.evaluate.agreement import teacher_agreement
from pipeline.evaluate.sts import read_pair_file, score_pairs
from pipeline.resources import EVAL_DIR
from pipeline.train.build import Trainer

log = logging.getLogger(__name__)


def evaluate(t: Trainer) -> float:
    """The ``train.select_on`` score on rank 0 (STS-B valid Spearman x100, or its mean with the teacher
    agreement), broadcast to all (collective), as ``Callbacks.on_evaluate`` leaves it."""
    score = None
    if t.accelerator.is_main_process:
        sts_valid = read_pair_file(EVAL_DIR / "STS-B.valid.tsv").first(t.cfg.train.eval_max_pairs)
        sts_b, _ = score_pairs(t.encoder.encode, sts_valid)
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
