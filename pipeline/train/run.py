"""``python -m pipeline train`` and ``launch/pretrain.py``: build, train, close (one body for both)."""

from __future__ import annotations

from typing import Any

from pipeline.train.config import Config

__all__ = ["Config", "run"]


def run(cfg: Config, callbacks: Any = None) -> int:
    """Train ``cfg``; returns the exit code (0, or EXIT_CODE_PREEMPTED after a preemption checkpoint).

    A collective that times out or loses its peer (another rank hung, stopped, died or was cut off)
    does not return: this rank prints one ``collective timeout:`` line and exits at once with
    EXIT_CODE_COLLECTIVE_TIMEOUT (pipeline/train/hangs.py).

    ``callbacks``: :class:`~pipeline.train.callbacks.Callbacks`, or a function ``on_batch(trainer, batch)``
    that sees each batch before its step (tests record the sample ids with it).
    """
    from pipeline import distributed as dist
    from pipeline.train.build import build
    from pipeline.train.hangs import exit_now, failure_line
    from pipeline.train.loop import train

    trainer = None
    try:
        trainer = build(cfg)
        return train(trainer, callbacks)
    except RuntimeError as exc:
        if trainer is None:
            where = "at start-up"
        elif trainer.state.step < trainer.total_steps:
            where = f"at step {trainer.state.step + 1}"
        else:
            where = "after the last step"
        line = failure_line(exc, where, cfg.train.collective_timeout)
        if line is None:
            raise
        exit_now(line, [trainer.metrics.close] if trainer is not None else [])
        raise  # not reached: exit_now leaves the process
    finally:
        if trainer is not None:
            trainer.close()
        else:
            dist.shutdown()
