"""``python -m pipeline tokenize --shards IN --out OUT --model MODEL``: store the token ids in the shards.

Writes shards of the same names, rows and blocks as IN with ``input_ids`` (the ids of prefix + text,
with the special tokens, truncated to ``--max_length``), ``variant_input_ids`` (one id list per cached
variant) and, when IN has mined negatives, ``hard_negative_input_ids``; list<uint16> when the vocabulary
fits 16 bits, else list<uint32> (``shards/README.md``). The tokenizer and the prefix are the model
folder's, as ``SentenceEncoder`` loads them; the manifest's ``tokenizer`` record holds their hash
(:func:`pipeline.data.token_ids.tokenizer_hash`), which the trainer checks before it pads the ids.

Work is split like the teacher stage: units are shards, local workers (``--workers``) and SLURM array
tasks (``--task-index/--num-tasks``: task t takes the shards i with ``i % num_tasks == t``); a finished
shard is skipped on a rerun, and whichever task finishes last writes ``manifest.json``. A shard's ids
depend on its rows only, so the output does not depend on workers, tasks or restarts.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import option, to_dict
from pipeline.data.token_ids import (
    TEXT_COLUMNS,
    TOKEN_ID_COLUMNS,
    canonical_tokenizer,
    id_dtype,
    tokenizer_hash,
)
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json, sha256_file
from pipeline.shards import (
    MANIFEST,
    new_manifest,
    read_manifest,
    read_shard,
    verify_shard,
    write_manifest,
    write_shard,
)
from pipeline.stages.runner import (
    EXECUTION_FIELDS,
    Execution,
    already_done,
    claim_out_dir,
    finished_records,
    own_shards,
    process_shards,
    read_record,
    record_path,
    remove_stale_temps,
    shard_index,
)

log = logging.getLogger(__name__)

WORK_DIR = ".tokenize-work"  # completion records of finished shards
# How to run, not what to compute: left out of the manifest so outputs compare equal.
CARRIED = ("teacher", "hard_negatives")  # input manifest records the trainer checks; kept as they are


@dataclass
class Config(Execution):
    shards: Path | None = option(None, "Input directory written by `augment`, `teacher` or `preprocess`.")
    out: Path | None = option(None, "Output directory for the shards with token ids.")
    model: str | None = option(None, "Model folder (models/e5-small) whose tokenizer and prefix to use.")
    max_length: int = option(64, "Token limit per text, specials included; must equal data.max_length.")
    prefix: str | None = option(None, "Text prefix (empty = the model folder's rule, as model.prefix).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shards is None or self.out is None or not self.model:
            raise ConfigError("usage: python -m pipeline tokenize --shards IN --out OUT --model MODEL_DIR")
        if self.max_length < 4:
            raise ConfigError("--max-length must be >= 4 tokens (data.max_length of the training run)")


# --------------------------------------------------------------------------------------------- tokenizer
def load_tokenizer(cfg: Config) -> tuple[Any, str]:
    """The model folder's tokenizer and prefix, exactly as the trainer's SentenceEncoder has them."""
    from transformers import AutoTokenizer

    from pipeline.model.rules import read_rule

    folder = Path(cfg.model)
    if not folder.is_dir():
        raise InputError(f"--model {cfg.model}: not a model folder; give one like models/e5-small")
    rule = read_rule(folder)
    source = folder / rule.transformer_dir if rule.transformer_dir else folder
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise InputError(f"--model {cfg.model}: cannot load its tokenizer ({exc})".splitlines()[0]) from None
    prefix = (rule.prefix or "") if cfg.prefix is None else cfg.prefix
    return tokenizer, prefix


def tokenizer_record(cfg: Config, tokenizer: Any, prefix: str) -> dict[str, Any]:
    """What the manifest says about the ids (the trainer compares ``hash`` with its own)."""
    vocab_size = len(tokenizer)
    return {
        "name": cfg.model,
        "path": str(Path(cfg.model).resolve()),
        "hash": tokenizer_hash(tokenizer, prefix, cfg.max_length),
        "hash_of": "tokenizer rules (JSON, no truncation/padding) + pad id + prefix + max_length",
        "prefix": prefix,
        "max_length": cfg.max_length,
        "pad_token_id": tokenizer.pad_token_id,
        "vocab_size": vocab_size,
        "dtype": str(id_dtype(vocab_size)),
    }


class IdEncoder:
    """Texts -> list<uint16|uint32> of ids of prefix + text, specials included, truncated; no padding."""

    def __init__(self, tokenizer_json: str, prefix: str, max_length: int, dtype: pa.DataType):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_str(tokenizer_json)
        self.backend.enable_truncation(max_length=max_length)
        self.prefix, self.max_length, self.dtype = prefix, max_length, dtype

    def __call__(self, texts: list[str]) -> tuple[pa.ListArray, int]:
        """The id lists, and how many texts were truncated."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encodings = encode([self.prefix + t for t in texts])
        truncated = sum(1 for e in encodings if e.overflowing)
        rows = [e.ids for e in encodings]
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = np.fromiter(itertools.chain.from_iterable(rows), dtype=self.dtype.to_pandas_dtype(),
                             count=int(offsets[-1]))  # fmt: skip
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, self.dtype)), truncated

    def nested(self, column: pa.ChunkedArray) -> tuple[pa.ListArray, int]:
        """list<string> -> list<list<ids>>: every entry of every row, the row structure kept."""
        array = column.combine_chunks()
        inner, truncated = self(array.flatten().to_pylist())
        offsets = array.offsets.to_numpy() - array.offsets.to_numpy()[0]
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), inner), truncated


# --------------------------------------------------------------------------------------------- shards
@dataclass(frozen=True)
class ShardJob:
    in_dir: Path
    entry: dict[str, Any]  # the input manifest's entry for this shard
    out_dir: Path
    record_dir: Path
    shard_index: int


def tokenize_shard(job: ShardJob, encoder: IdEncoder, report: Callable[[int], Any]) -> dict[str, Any]:
    """Verify one input shard, write its copy with the id columns, then its completion record."""
    in_path = verify_shard(job.in_dir, job.entry)
    remove_stale_temps(job.out_dir, job.entry["name"])
    counts = {"sentences": 0, "texts_tokenized": 0, "truncated": 0, "tokens": 0}
    started = time.perf_counter()

    def out_blocks():
        for block in read_shard(in_path):
            if "text" not in block.column_names:
                raise InputError(f"shard {in_path} has no text column; is it a preprocess/augment shard?")
            if "input_ids" in block.column_names:
                raise InputError(f"shard {in_path} already has token ids; tokenize its input instead")
            counts["sentences"] += block.num_rows
            for text_name, ids_name in zip(TEXT_COLUMNS, TOKEN_ID_COLUMNS):
                if text_name not in block.column_names:
                    continue
                column = block.column(text_name)
                if text_name == "text":
                    ids, truncated = encoder(column.to_pylist())
                else:
                    ids, truncated = encoder.nested(column)
                counts["truncated"] += truncated
                flat = ids.flatten() if text_name == "text" else ids.flatten().flatten()
                counts["tokens"] += len(flat)
                counts["texts_tokenized"] += len(ids) if text_name == "text" else len(ids.flatten())
                block = block.append_column(pa.field(ids_name, ids.type, nullable=False), ids)
            report(block.num_rows)
            yield block

    entry = write_shard(job.out_dir / job.entry["name"], out_blocks(), job.shard_index)
    log.info("%s: %d texts in %.1f s", job.entry["name"], counts["texts_tokenized"],
             time.perf_counter() - started)  # fmt: skip
    record = {"entry": entry, "counts": counts}
    atomic_write_json(record_path(job.record_dir, job.entry["name"]), record)  # after the shard: it is done
    return record


_worker: dict[str, Any] = {}


def _init_worker(args: tuple[str, str, int, str], progress: Any) -> None:  # + the progress queue
    tokenizer_json, prefix, max_length, dtype = args
    _worker["encoder"] = IdEncoder(tokenizer_json, prefix, max_length, pa.type_for_alias(dtype))
    _worker["progress"] = progress


def _run_in_worker(job: ShardJob) -> dict[str, Any]:
    return tokenize_shard(job, _worker["encoder"], _worker["progress"].put)


# --------------------------------------------------------------------------------------------- driver
def run_fingerprint(cfg: Config, in_manifest_sha: str, tokenizer: dict[str, Any]) -> dict[str, Any]:
    """What the output depends on: config, input manifest, the tokenizer record (with its hash)."""
    config = {k: v for k, v in to_dict(cfg).items() if k not in EXECUTION_FIELDS}
    return {"config": config, "input_manifest_sha256": in_manifest_sha, "tokenizer": tokenizer}


def finalize(cfg: Config, in_manifest: dict[str, Any], fingerprint: dict[str, Any]) -> bool:
    """Write manifest.json once every shard is done; return whether it did."""
    names = [e["name"] for e in in_manifest["shards"]]
    records = finished_records(cfg.out, cfg.out / WORK_DIR, cfg.out, names, cfg.finalize_only, "tokenize")
    if records is None:
        return (cfg.out / MANIFEST).is_file()
    counts = {key: sum(r["counts"][key] for r in records) for key in records[0]["counts"]}
    manifest = new_manifest(
        "tokenize",
        fingerprint["config"],
        [r["entry"] for r in records],
        counts=counts,
        input_manifest_sha256=fingerprint["input_manifest_sha256"],
        input_stage=in_manifest.get("stage"),
        input_config=in_manifest.get("config", {}),
        tokenizer=fingerprint["tokenizer"],
        **{key: in_manifest[key] for key in CARRIED if key in in_manifest},
    )
    write_manifest(cfg.out, manifest)
    shutil.rmtree(cfg.out / WORK_DIR, ignore_errors=True)  # the manifest now records everything in it
    log.info("wrote %s: %d texts, %d tokens", cfg.out / MANIFEST, counts["texts_tokenized"], counts["tokens"])
    return True


def run(cfg: Config) -> int:
    in_manifest = read_manifest(cfg.shards)
    if in_manifest.get("stage") not in ("preprocess", "augment", "teacher"):
        raise InputError(
            f"{cfg.shards / MANIFEST} was written by stage {in_manifest.get('stage')!r}; tokenize reads "
            "the output of `augment`, `teacher` or `preprocess`"
        )
    if cfg.out.resolve() == cfg.shards.resolve():
        raise ConfigError("out must differ from shards: the tokenize stage never writes over its input")
    tokenizer, prefix = load_tokenizer(cfg)
    record = tokenizer_record(cfg, tokenizer, prefix)
    fingerprint = run_fingerprint(cfg, sha256_file(cfg.shards / MANIFEST), record)
    if already_done(cfg.out, fingerprint, "config, input or tokenizer"):
        return 0
    claim_out_dir(cfg.out, WORK_DIR, fingerprint, "tokenize", "config, input or tokenizer")
    record_dir, entries = cfg.out / WORK_DIR, in_manifest["shards"]
    if not cfg.finalize_only:
        mine = own_shards(entries, cfg.task_index, cfg.num_tasks)
        jobs = [
            ShardJob(cfg.shards, entries[i], cfg.out, record_dir, shard_index(entries[i]["name"], i))
            for i in mine
            if read_record(record_dir, cfg.out, entries[i]["name"]) is None
        ]
        log.info("task %d/%d: %d shard(s), %d to do", cfg.task_index, cfg.num_tasks, len(mine), len(jobs))
        init = (canonical_tokenizer(tokenizer).to_str(), prefix, cfg.max_length, record["dtype"])

        def run_here(jobs: list[ShardJob], report: Callable[[int], Any]) -> None:
            args = (init[0], init[1], init[2], pa.type_for_alias(init[3]))
            encoder = IdEncoder(*args)
            for job in jobs:
                tokenize_shard(job, encoder, report)

        total = sum(job.entry["sentences"] for job in jobs)
        process_shards(
            jobs,
            cfg.workers,
            total,
            "tokenize",
            cfg.progress,
            run_here,
            _init_worker,
            (init,),
            _run_in_worker,
        )
    finalize(cfg, in_manifest, fingerprint)
    return 0
