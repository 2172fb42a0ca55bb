"""What the benchmark scripts share: markdown tables, mean ± std, number formats, timing, run commands.

A script of benchmarks/ imports this as ``from _common import ...`` (run as ``python benchmarks/X.py``,
its folder is first on ``sys.path``; tests load scripts the same way, tests/_scripts.py). It knows no
pipeline internals: a benchmark drives the pipeline through its commands and configs.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = ROOT / "launch" / "pretrain.py"


# ------------------------------------------------------------------------------------------ numbers
def finite(values: Iterable[float] | None) -> list[float]:
    """The values that are numbers (a NaN marks a cell a run did not produce)."""
    return [float(v) for v in values or () if not math.isnan(float(v))]


def stats(values: Iterable[float] | None) -> tuple[float, float] | None:
    """``(mean, sample standard deviation)`` of the finite values (std 0 for one), None for none."""
    found = finite(values)
    if not found:
        return None
    return statistics.mean(found), statistics.stdev(found) if len(found) > 1 else 0.0


def mean_std(values: Iterable[float] | None, digits: int = 2, count: bool = False) -> str:
    """``"m ± s"`` (sample std) of the finite values, ``"m"`` for one value, ``"–"`` for none;
    ``count``: `` (n)`` after it."""
    found = finite(values)
    if not found:
        return "–"
    m, s = stats(found) or (0.0, 0.0)
    text = f"{m:.{digits}f}" if len(found) == 1 else f"{m:.{digits}f} ± {s:.{digits}f}"
    return f"{text} ({len(found)})" if count else text


def fmt(x: float) -> str:
    """A number for a table: an integer with thousands separators, else 4 significant digits."""
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:.4g}"


# ------------------------------------------------------------------------------------------- tables
def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table (cells as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


# ------------------------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn()``."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ------------------------------------------------------------------------------------------ runs
def quiet_env(threads: int = 1) -> dict[str, str]:
    """The environment of a child run: ``threads`` BLAS threads unless OMP_NUM_THREADS is set (two
    runs side by side on 2 cores beat one run with 2 threads), no tokenizer threads."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_logged(*cmd: str, log: Path | None = None) -> None:
    """Run ``cmd`` from the repository root, echoed first; its output to ``log`` when given. Fails loudly."""
    print("+", " ".join(cmd), flush=True)
    if log is None:
        subprocess.run(cmd, check=True, cwd=ROOT)
        return
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def hash_share(key: str) -> float:
    """``key``'s place in [0, 1) by an 8-byte BLAKE2b digest: a held-out split that no order changes."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def pretrain_command(config: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``python launch/pretrain.py --config CONFIG --run_dir RUN_DIR --resume=never OVERRIDES...``."""
    return [sys.executable, str(PRETRAIN), "--config", str(config), f"--run_dir={run_dir}", "--resume=never",
            *overrides]  # fmt: skip


def loss_override(*terms: dict[str, Any]) -> str:
    """``--loss=[...]``: a run's loss terms on the command line, in the config's own YAML form."""
    text = yaml.safe_dump(list(terms), default_flow_style=True, width=10**6, sort_keys=False)
    return "--loss=" + text.strip()


def config_loss(config: Path) -> list[dict[str, Any]]:
    """The ``loss`` list of a YAML training config."""
    return yaml.safe_load(config.read_text(encoding="utf-8")).get("loss") or []


def luse_fields(loss: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    """The fields of the luse term of a ``loss`` list ({} without one)."""
    return next((dict(e["luse"] or {}) for e in loss or () if "luse" in e), {})


def overridden_loss(overrides: Iterable[str]) -> list[dict[str, Any]] | None:
    """The ``loss`` that command-line overrides set (the last ``--loss=`` wins, as in the loader)."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("--loss=")]
    return yaml.safe_load(given[-1]) if given else None
