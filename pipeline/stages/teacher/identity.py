"""What names a teacher model folder: the hash the teacher stage records in its ``manifest.json``.

A teacher is recorded under ``"teacher"``: the name it was given (``--model``), its folder, a hash of
its weights and tokenizer (:func:`model_hash`), pooling, prefix, dimension, max_length and the stored
dtype. Reading that record back (:func:`pipeline.vectors.matches`, :func:`pipeline.vectors.stored_dtype`)
is part of the shard format, so the trainer checks ``data.teacher`` against it without importing this
stage (pipeline/data/plan.py).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from pipeline.io import sha256_file
from pipeline.vectors import matches, stored_dtype

__all__ = ["PROVENANCE", "TOKENIZER_FILES", "matches", "model_hash", "stored_dtype"]

PROVENANCE = "PROVENANCE.json"  # written by `python -m pipeline models fetch`; names its sources by sha256
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "sentencepiece.bpe.model",
    "spiece.model",
)
log = logging.getLogger(__name__)


def model_hash(model_dir: Path | None) -> tuple[str | None, str]:
    """(hash, what it covers) of a local model folder; (None, "hub") for a Hub name.

    A fetched folder's ``PROVENANCE.json`` already pins the weights and tokenizer by sha256, so its
    own sha256 stands for them (hashing 470 MB of e5-small costs seconds per rerun). Otherwise: sha256
    over each weight and tokenizer file's name and sha256, in name order.
    """
    if model_dir is None or not Path(model_dir).is_dir():
        return None, "hub"
    model_dir = Path(model_dir)
    if (model_dir / PROVENANCE).is_file():
        return sha256_file(model_dir / PROVENANCE), PROVENANCE
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    files += sorted(model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file())
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode("utf-8"))
        h.update(sha256_file(path).encode("ascii"))
    return h.hexdigest(), "weights+tokenizer files"
