"""The index directory: file names, the manifest, checks on load, and the model reference.

```
INDEX_DIR/
  manifest.json     written last; its presence means the build finished
  index.faiss       faiss index over the (reduced) embeddings, row i = corpus row i
  corpus.parquet    id (uint64) and text (string) per row, in index order
  reduction.npz     optional: kind, mean (H,), matrix (H, k)
  encoder.json      optional: copy of the model's encoder.json (pooling, max_length)
  .work/            only while building: state.json and the encoded chunks (emb-000000.npy, ...)
```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.errors import InputError
from pipeline.io import sha256_file

FORMAT = "sentence-search-index"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"
CORPUS_FILE = "corpus.parquet"
REDUCTION_FILE = "reduction.npz"
ENCODER_COPY = "encoder.json"
WORK_DIR = ".work"


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def read_index_manifest(directory: str | Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(
            f"index directory {directory} does not exist; build one with `python -m pipeline index`"
        )
    path = directory / MANIFEST
    if not path.is_file():
        unfinished = (
            " (its build did not finish: re-run the same index command)"
            if (directory / WORK_DIR).is_dir()
            else ""
        )
        raise InputError(
            f"{directory} is not a search index: no {MANIFEST}{unfinished}; "
            "build one with `python -m pipeline index MODEL --input FILE --out DIR`"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not valid JSON ({exc}); rebuild the index") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError(
            f"{path} is not a {FORMAT} manifest (is {directory} a shard directory?); "
            "pass a directory written by `python -m pipeline index`"
        )
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise InputError(
            f"{path} has format version {manifest['format_version']}; this tool reads <= {FORMAT_VERSION}"
        )
    return manifest


def check_files(directory: Path, manifest: dict[str, Any], checksums: bool = True) -> None:
    """Every file the manifest lists exists with its size (and sha256 when ``checksums``)."""
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise InputError(f"{path} listed in {directory / MANIFEST} is missing; rebuild the index")
        if path.stat().st_size != entry["bytes"]:
            raise InputError(
                f"{path} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}; rebuild it"
            )
        if checksums and sha256_file(path) != entry["sha256"]:
            raise InputError(f"{path} fails its sha256 check against the manifest; rebuild the index")


# ------------------------------------------------------------------------------------------ model
def model_fingerprint(model_dir: Path | None) -> str | None:
    """sha256 of a local model's weight files (None for a Hub name): chunks from other weights are stale."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    path = Path(model_dir)
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    if not weights:
        return None
    import hashlib

    h = hashlib.sha256()
    for w in weights:
        h.update(w.name.encode())
        h.update(sha256_file(w).encode())
    return h.hexdigest()
