"""Restartable encoding: the corpus is cut into fixed chunks, each saved atomically as a .npy file.

A rerun after a crash loads the chunks already on disk and encodes only the missing ones. Chunks
are reused only if ``state.json`` matches this build exactly (same texts, model weights, pooling,
length and chunk size); otherwise the work directory is stale and is cleared.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.io import atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)

STATE = "state.json"


class ChunkStore:
    def __init__(self, work_dir: Path, num_rows: int, chunk_size: int, state: dict[str, Any]):
        self.work_dir = work_dir
        self.num_rows = num_rows
        self.chunk_size = chunk_size
        self.num_chunks = -(-num_rows // chunk_size)
        self._open(state)

    def _open(self, state: dict[str, Any]) -> None:
        state_path = self.work_dir / STATE
        if state_path.is_file():
            try:
                old = json.loads(state_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                old = None
            if old != state:
                log.warning("%s holds chunks of a different build; starting over", self.work_dir)
                shutil.rmtree(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.work_dir.glob(".*.tmp-*"):  # half-written files of a killed run
            tmp.unlink()
        if not state_path.is_file():
            atomic_write_json(state_path, state)

    def path(self, i: int) -> Path:
        return self.work_dir / f"emb-{i:06d}.npy"

    def bounds(self, i: int) -> tuple[int, int]:
        return i * self.chunk_size, min((i + 1) * self.chunk_size, self.num_rows)

    def done(self, i: int) -> bool:
        return self.path(i).is_file()

    def missing(self) -> list[int]:
        return [i for i in range(self.num_chunks) if not self.done(i)]

    def write(self, i: int, embeddings: np.ndarray) -> None:
        start, end = self.bounds(i)
        assert embeddings.shape[0] == end - start, (embeddings.shape, start, end)
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(embeddings, dtype=np.float32))
        atomic_write_bytes(self.path(i), buffer.getvalue())

    def read(self, i: int) -> np.ndarray:
        return np.load(self.path(i), allow_pickle=False)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.num_chunks):
            yield self.read(i)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (sorted) of the whole matrix, reading one chunk at a time."""
        parts = []
        for i in range(self.num_chunks):
            start, end = self.bounds(i)
            sel = rows[(rows >= start) & (rows < end)]
            if len(sel):
                parts.append(self.read(i)[sel - start])
        return np.concatenate(parts)

    def remove(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)
