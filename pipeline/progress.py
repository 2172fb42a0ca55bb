"""Progress of long work: a bar on a terminal, a plain line every so often in a log file.

tqdm redraws its bar in place with carriage returns. That is right on a terminal and wrong in a SLURM
log or a ``tee``'d file, where the redraws pile up on one line that nobody can read (and that grows by
a hundred bytes a second). :func:`bar` returns a tqdm either way: on a terminal it is tqdm as usual; when
stderr is not a terminal it prints one ordinary line (``teacher: 41%|... | 2.1M/5.1M [03:12<04:39,
10.9k sent/s]``) at most every ``PIPELINE_PROGRESS_SECONDS`` seconds (default 30) and a last one when
the work ends. Every long command takes ``--progress``; ``false`` switches both off.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["LOG_INTERVAL_SECONDS", "bar"]

LOG_INTERVAL_SECONDS = 30.0


class _Lines:
    """A file for tqdm that turns each in-place redraw into one line of its own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "").strip()
        if text and text != self.last:  # close() redraws the final state once more
            self.stream.write(text + "\n")
            self.last = text

    def flush(self) -> None:
        self.stream.flush()


def _interval() -> float:
    value = os.environ.get("PIPELINE_PROGRESS_SECONDS", "")
    try:
        return float(value) if value else LOG_INTERVAL_SECONDS
    except ValueError:
        return LOG_INTERVAL_SECONDS


def bar(*, desc: str, total: float | None = None, disable: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm progress bar for ``desc``; plain periodic lines when stderr is not a terminal."""
    stream = kwargs.pop("file", None) or sys.stderr
    if disable or stream.isatty():
        return tqdm(total=total, desc=desc, disable=disable, file=stream, **kwargs)
    interval = _interval()
    kwargs.pop("dynamic_ncols", None)
    kwargs.update(mininterval=interval, maxinterval=max(interval, 10.0), miniters=1, ncols=100)
    return tqdm(total=total, desc=desc, file=_Lines(stream), **kwargs)
