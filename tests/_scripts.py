"""Load a script of benchmarks/ as a module, for tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, name, module)  # dataclasses look their module up by name
        mp.syspath_prepend(str(BENCHMARKS))  # as `python benchmarks/X.py` has it: `from _common import ...`
        spec.loader.exec_module(module)
        yield module
