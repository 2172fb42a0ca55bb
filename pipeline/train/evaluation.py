"""The run's evaluation: STS-B valid Spearman of the encoder as it is now."""

from __future__ import annotations

import logging

from pipeline import distributed as dist
from pipeline.evaluate.sts import score_pairs
from pipeline.train.build import Trainer

log = logging.getLogger(__name__)


def evaluate(t: Trainer) -> float:
    """STS-B valid Spearman x100 on rank 0, broadcast to all (collective), as ``Callbacks.on_evaluate``
    leaves it."""
    score = None
    if t.accelerator.is_main_process:
        score, _ = score_pairs(t.encoder.encode, t.sts_valid)
        t.metrics.log({"event": "eval", "step": t.state.step, "sts_b_valid_spearman": score}, t.state.step)
        log.info("step %d: STS-B valid Spearman %.2f", t.state.step, score)
    return float(t.callbacks.on_evaluate(t, float(dist.broadcast_object(score))))
