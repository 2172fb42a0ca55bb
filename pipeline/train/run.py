"""``python -m pipeline train`` and ``launch/pretrain.py``: build, train, close (one body for both)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, NoReturn

from pipeline.train.config import Config

__all__ = ["Config", "exit_process", "run"]


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


def exit_process(code: int) -> NoReturn:
    """Leave a training process with ``code`` without tearing the interpreter down (the entry points'
    last call, after :func:`run` has returned).

    A training process still holds native threads when a run ends: gloo's workers and socket loop (the
    process group is shut down, but its C++ object outlives ``destroy_process_group``) and pyarrow's
    pool. A finished two-rank run once aborted on its way out ("terminate called without an active
    exception", status 134 instead of the run's own; the signature of a native thread pool met by the
    interpreter's teardown), which a scheduler script reads as a crash and a test as a failure. Nothing
    is lost by skipping the teardown: what a run writes is closed by then, and the exit handlers
    (logging's, the loader's, multiprocessing's) still run here, in the usual order, after the
    non-daemon threads end; the standard streams are flushed.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 -- the interpreter's own exit handlers, run as at a normal exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach the reader
            pass
    os._exit(code)
