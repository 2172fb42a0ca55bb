"""What names a teacher, and the trainer's check that the shards were encoded with the one it expects.

A teacher is recorded in the teacher stage's ``manifest.json`` under ``"teacher"``: the name it was
given (``--model``), its folder, a hash of its weights and tokenizer, pooling, prefix, dimension,
max_length and the stored dtype (``float16`` or ``int8``; a dtype this version does not know is refused).
``data.teacher`` in a training config names it back: the recorded
name, the folder's name or path, or the hash (a prefix of 8 or more hex digits).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, InputError
from pipeline.io import sha256_file
from pipeline.losses.terms import TEACHER
from pipeline.shards import ShardSet, read_shard_set
from pipeline.vectors import DTYPES

PROVENANCE = "PROVENANCE.json"  # written by `python -m pipeline models fetch`; names its sources by sha256
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "sentencepiece.bpe.model",
    "spiece.model",
)
MIN_HASH_PREFIX = 8
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


def matches(teacher: dict[str, Any], wanted: str) -> bool:
    """Does ``wanted`` (data.teacher) name the recorded ``teacher``?"""
    wanted = wanted.strip().rstrip("/")
    recorded = [str(teacher.get("name") or "").rstrip("/"), str(teacher.get("path") or "")]
    names = {n for n in recorded if n} | {Path(n).name for n in recorded if n}
    if wanted in names or (Path(wanted).exists() and str(Path(wanted).resolve()) in names):
        return True
    digest = teacher.get("hash") or ""
    return len(wanted) >= MIN_HASH_PREFIX and bool(digest) and digest.startswith(wanted.lower())


def stored_dtype(teacher: dict[str, Any], shards: Path) -> str:
    """The recorded ``teacher.dtype`` (``float16`` when absent: sets written before int8 existed)."""
    dtype = str(teacher.get("dtype") or "float16")
    if dtype not in DTYPES:
        raise InputError(
            f"{Path(shards) / 'manifest.json'}: teacher vectors stored as {dtype!r}, which this version "
            f"cannot read ({' or '.join(DTYPES)}); use the version that wrote them or re-encode with "
            "`python -m pipeline teacher`"
        )
    return dtype


def describe(teacher: dict[str, Any]) -> str:
    return f"{teacher.get('name')} (hash {str(teacher.get('hash'))[:12]}, dim {teacher.get('dim')})"


def check_shards(
    shards: str | Path | ShardSet, wanted: str | None, num_hard_negatives: int = 0
) -> dict[str, Any] | None:
    """The shard set's recorded teacher, checked against ``data.teacher`` and ``data.num_hard_negatives``.

    Returns None when the shards hold no teacher and none is asked for. Every mismatch is one
    ConfigError naming both sides and the command that fixes it.
    """
    info = read_shard_set(shards)
    teacher, shards = info.teacher, info.directory
    rerun = f"python -m pipeline teacher --shards AUGMENTED --out NEW_DIR --model {wanted or 'TEACHER'}"
    if teacher is None:
        if wanted is not None or num_hard_negatives:
            what = "teacher embeddings" if wanted is not None else "hard negatives"
            raise ConfigError(
                f"data.shards {shards} has no {what} (stage {info.stage!r}); "
                f"encode them with `{rerun}` and train on NEW_DIR"
            )
        return None
    stored_dtype(teacher, shards)
    if wanted is not None and not matches(teacher, wanted):
        raise ConfigError(
            f"data.teacher={wanted!r} but {shards} was encoded with {describe(teacher)}; set "
            f"--data.teacher to that name or hash, or re-encode with `{rerun}`"
        )
    cached = info.hard_negatives
    if num_hard_negatives > cached:
        raise ConfigError(
            f"data.num_hard_negatives={num_hard_negatives} but {shards} caches {cached} per sentence; "
            f"lower it or rerun the teacher stage with --hard_negatives {num_hard_negatives}"
        )
    return teacher


def batches_carry_teacher(cfg: Any, shard_set: ShardSet | None = None) -> bool:
    """Whether the training batches carry ``batch["teacher"]``; checks the shards against ``cfg.data``.

    Yes when ``data.teacher`` is set (the shards' teacher must match it), or when a loss term reads
    teacher vectors and the shards hold some (logged).
    """
    d = cfg.data
    recorded = check_shards(shard_set or d.shards, d.teacher, d.num_hard_negatives)
    width = d.teacher_dim
    if recorded is not None and width and width != recorded.get("dim"):
        raise ConfigError(
            f"data.teacher_dim={width} but the teacher in {d.shards} has {recorded.get('dim')} "
            f"dimensions; set --data.teacher_dim {recorded.get('dim')} (or 0 if the student's width)"
        )
    if d.teacher is not None:
        return True
    if cfg.terms().reads(TEACHER):
        if recorded is not None:
            log.info("using the shards' teacher %s; set data.teacher to pin it", describe(recorded))
            return True
        log.warning(
            "a loss term reads teacher embeddings but %s has none and data.teacher is unset: batches "
            "carry no batch['teacher']; encode the shards with `python -m pipeline teacher`",
            d.shards,
        )
    return False
