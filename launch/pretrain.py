"""Thin entry: ``accelerate launch launch/pretrain.py --config launch/configs/X.yaml [--a.b=v]``.

Parse the config, build, train, close. Everything else lives in ``pipeline.train``.
"""

from __future__ import annotations

import sys

from pipeline.cli import build_config, setup_logging
from pipeline.errors import PipelineError
from pipeline.train.build import build
from pipeline.train.config import Config
from pipeline.train.loop import train


def main(argv: list[str]) -> int:
    setup_logging()
    try:
        cfg = build_config(Config, argv)
        trainer = build(cfg)
    except PipelineError as exc:  # a user mistake: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        return train(trainer)
    finally:
        trainer.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
