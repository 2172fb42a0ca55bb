"""What pretrain.sbatch needs to know of a training command line, read from the config it resolves to.

    python launch/slurm/run_info.py [DRIVER_ARG ...] --config X.yaml [--key=value ...]

prints ``run_dir=ABSOLUTE_PATH`` and ``cpu=0|1`` (1 when the config asks for CPU training:
``train.cpu: true`` or ``train.device: cpu``). Leading arguments that do not start with ``-`` (those of
a custom PRETRAIN driver, which passes the rest on) are skipped. When the arguments do not resolve to
a config it prints one line on stderr and exits 2; the sbatch then goes on without this knowledge.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    skipped = 0
    while argv and not argv[0].startswith("-"):
        argv, skipped = argv[1:], skipped + 1
    if skipped and not argv:  # a driver with only its own arguments: nothing says where the run is
        print("run_info: no training options after the driver's arguments (set RUN_DIR)", file=sys.stderr)
        return 2
    try:
        from pipeline.cli import build_config
        from pipeline.train.config import Config

        cfg = build_config(Config, argv)
    except Exception as exc:  # noqa: BLE001 - any failure: say it in one line, the caller carries on
        print(f"run_info: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    cpu = bool(getattr(cfg.train, "cpu", False)) or getattr(cfg.train, "device", "auto") == "cpu"
    print(f"run_dir={os.path.abspath(cfg.run_dir)}")
    print(f"cpu={int(cpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
