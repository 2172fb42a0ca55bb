"""Thin entry: ``accelerate launch launch/pretrain.py --config launch/configs/X.yaml [--a.b=v]``.

Parse the config, build, train, close. Everything else lives in ``pipeline.train``.
"""

from __future__ import annotations

import sys
from typing import Any

from pipeline.cli import build_config, exit_process, setup_logging
from pipeline.config import help_lines
from pipeline.errors import PipelineError, write_error_line
from pipeline.train.config import Config
from pipeline.train.run import run


def main(argv: list[str], on_batch: Any = None) -> int:
    """``on_batch``: a function ``on_batch(trainer, batch)``, or pipeline.train.callbacks.Callbacks."""
    if "-h" in argv or "--help" in argv:
        print("usage: accelerate launch launch/pretrain.py --config CONFIG.yaml [--key=value ...]\n")
        print("options (the same as `python -m pipeline train`):")
        print("\n".join(help_lines(Config)))
        return 0
    setup_logging()
    try:
        return run(build_config(Config, argv), on_batch)
    except PipelineError as exc:  # a user mistake: one line, no traceback
        write_error_line(exc)  # one whole line per rank
        return exc.exit_code


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))  # not sys.exit: see exit_process
