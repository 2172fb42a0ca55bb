"""A labelled pair file beside its teacher's vectors: what lets a supervised term train with distillation.

``python -m pipeline teacher --pairs_file FILE --out DIR --model TEACHER`` encodes the first two texts of
every record of ``FILE`` (a pair's two sides; a triple's anchor and positive) with the teacher and writes
``DIR`` (:func:`write_pair_teacher`):

* ``teacher.parquet``: one row per record, in the file's order: ``teacher`` (text 1) and
  ``teacher_positive`` (text 2), each ``fixed_size_list<float16, D>`` of L2-normalised vectors, as the
  pair shards' columns of the same names (shards/README.md);
* ``manifest.json``: ``format`` (:data:`FORMAT`), ``rows``, ``pairs_file`` and its ``pairs_sha256`` (a
  changed file is refused, not silently misaligned), and the ``teacher`` record the shard manifests carry
  (name, hash, dim, pooling, prefix, ...; :func:`pipeline.vectors.matches` reads it for ``data.teacher``).

A run names it in ``data.supervised_teacher``; :func:`pipeline.data.plan.check_pair_teacher` holds it
against the config and :func:`memory_batches` puts the vectors in every batch beside the texts and
labels (``Batch.teacher``, ``Batch.teacher_positive``: the distill term pulls both sides of each pair
towards their own teacher vectors, as on pair shards). docs/objectives.md, "Labels beside distillation".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.pairs import read_records
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json, atomic_write_parquet, read_json, sha256_file
from pipeline.vectors import encode_vectors, teacher_matrix

FORMAT = "pair-file-teacher"
TEACHER_FILE = "teacher.parquet"
MANIFEST = "manifest.json"
COLUMNS = ("teacher", "teacher_positive")  # the vectors of text 1 and text 2 of each record


def encode_command(pairs_file: Path | str) -> str:
    return f"python -m pipeline teacher --pairs_file {pairs_file} --out DIR --model TEACHER"


@dataclass(frozen=True)
class PairTeacher:
    """A pair file's teacher vectors as the manifest describes them (read, checked; vectors not loaded)."""

    directory: Path
    rows: int
    teacher: dict[str, Any]  # the teacher record (name, hash, dim, ...)

    @property
    def dim(self) -> int:
        return int(self.teacher["dim"])

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, D) float32 of text 1 and of text 2, in the file's order."""
        table = pq.read_table(self.directory / TEACHER_FILE, columns=list(COLUMNS))
        first, second = (teacher_matrix(table.column(name)) for name in COLUMNS)
        if len(first) != self.rows:
            raise InputError(
                f"{self.directory / TEACHER_FILE}: {len(first)} rows but its manifest says {self.rows}; "
                "encode the file again"
            )
        return first, second


def write_pair_teacher(
    directory: Path, pairs_file: Path, first: np.ndarray, second: np.ndarray, teacher: dict[str, Any]
) -> None:
    """The vectors of text 1 and text 2 of every record ((N, D) each, L2-normalised) and the manifest."""
    if first.shape != second.shape or first.ndim != 2:
        raise ValueError(f"two (N, D) arrays expected, got {first.shape} and {second.shape}")
    directory.mkdir(parents=True, exist_ok=True)
    columns = {name: encode_vectors(v, "float16")[0] for name, v in zip(COLUMNS, (first, second))}
    atomic_write_parquet(directory / TEACHER_FILE, pa.table(columns))
    manifest = {
        "format": FORMAT,
        "format_version": 1,
        "rows": len(first),
        "pairs_file": str(pairs_file),
        "pairs_sha256": sha256_file(pairs_file),
        "teacher": {**teacher, "dim": int(first.shape[1]), "dtype": "float16"},
    }
    atomic_write_json(directory / MANIFEST, manifest)  # last: a directory with a manifest is complete


def read_pair_teacher(directory: Path, pairs_file: Path) -> PairTeacher:
    """The manifest of ``directory``, checked against ``pairs_file``: a ConfigError naming what to rerun."""
    rerun = encode_command(pairs_file)
    path = directory / MANIFEST
    if not path.is_file():
        raise ConfigError(f"data.supervised_teacher: {path} does not exist; write it with `{rerun}`")
    manifest = read_json(path, "pair-file teacher manifest", f"encode the file again with `{rerun}`")
    if manifest.get("format") != FORMAT:
        raise ConfigError(
            f"data.supervised_teacher: {path} is not a pair file's teacher vectors (format "
            f"{manifest.get('format')!r}); teacher shards go in data.shards, these come from `{rerun}`"
        )
    if manifest.get("pairs_sha256") != sha256_file(pairs_file):
        raise ConfigError(
            f"data.supervised_teacher: {directory} holds the vectors of another file than "
            f"data.supervised_file {pairs_file} (it encoded {manifest.get('pairs_file')}, whose sha256 "
            f"differs); encode it with `{rerun}`"
        )
    return PairTeacher(directory, int(manifest["rows"]), manifest["teacher"])


def memory_columns(
    pairs_file: Path, source: str, num_texts: int, labels: bool, teacher: PairTeacher | None, holdout: int = 0
) -> dict[str, Any]:
    """The in-memory columns of a supervised file: ``text0..``, ``index``, ``label`` (when the term reads
    labels) and, with its teacher vectors, ``teacher`` and ``teacher_positive`` ((N, D) float32 arrays).
    The last ``holdout`` records (``data.holdout_rows``, pipeline/data/holdout.py) are left out."""
    records = read_records(pairs_file, source)
    if holdout >= len(records):
        raise ConfigError(
            f"data.holdout_rows={holdout} but {pairs_file} holds {len(records)} records; hold fewer out"
        )
    kept = len(records) - holdout
    columns: dict[str, Any] = {f"text{i}": [r[i] for r in records[:kept]] for i in range(num_texts)}
    columns["index"] = list(range(kept))
    if labels:
        columns["label"] = [r[-1] for r in records[:kept]]
    if teacher is not None:
        if teacher.rows != len(records):  # the sha256 matched, so only a reader change could do this
            raise InputError(
                f"{teacher.directory} holds {teacher.rows} rows but {pairs_file} reads as {len(records)} "
                f"records; encode it again with `{encode_command(pairs_file)}`"
            )
        first, second = teacher.vectors()
        columns["teacher"], columns["teacher_positive"] = first[:kept], second[:kept]
    return columns
