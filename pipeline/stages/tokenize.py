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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import option
from pipeline.data.token_ids import (
    TEXT_COLUMNS,
    TOKEN_ID_COLUMNS,
    canonical_tokenizer,
    id_dtype,
    tokenizer_hash,
)
from pipeline.errors import ConfigError, InputError
from pipeline.shards import holds_pairs, read_shard, write_shard
from pipeline.stages.runner import Execution, Report, ShardJob, ShardStage, ShardWork, read_input

log = logging.getLogger(__name__)

WORK_DIR = ".tokenize-work"  # completion records of finished shards
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
@dataclass
class TokenizeWork(ShardWork):
    tokenizer_json: str  # canonical_tokenizer(...).to_str(): a worker rebuilds the tokenizer from it
    prefix: str
    max_length: int
    dtype: str  # of the ids: uint16 or uint32

    def load(self, processes: int) -> IdEncoder:
        return IdEncoder(self.tokenizer_json, self.prefix, self.max_length, pa.type_for_alias(self.dtype))

    def shard(self, job: ShardJob, encoder: IdEncoder, report: Report) -> dict[str, Any]:
        return tokenize_shard(job, encoder, report)


def tokenize_shard(job: ShardJob, encoder: IdEncoder, report: Report) -> dict[str, Any]:
    """Verify one input shard, write its copy with the id columns, then its completion record."""
    in_path = job.open()
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

    entry = write_shard(job.out_dir / job.name, out_blocks(), job.shard_index)
    log.info("%s: %d texts in %.1f s", job.name, counts["texts_tokenized"],
             time.perf_counter() - started)  # fmt: skip
    return job.write_record(entry, counts)


# --------------------------------------------------------------------------------------------- driver
def run(cfg: Config) -> int:
    reads = "tokenize reads the output of `augment`, `teacher` or `preprocess`"
    in_manifest = read_input(cfg, "tokenize", ("preprocess", "augment", "teacher"), reads)
    if holds_pairs(in_manifest):  # it would store ids of the anchors alone
        raise InputError(
            f"{cfg.shards} holds pair shards (`pipeline pairs`); tokenize stores the ids of sentence shards "
            "only: train on the pair shards as they are (their texts are tokenised in the loader)"
        )
    tokenizer, prefix = load_tokenizer(cfg)
    record = tokenizer_record(cfg, tokenizer, prefix)
    stage = ShardStage("tokenize", cfg, in_manifest, WORK_DIR, {"tokenizer": record},
                       differs="config, input or tokenizer")  # fmt: skip

    def finish(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The counts, what the input was, and the input's records the trainer checks (CARRIED)."""
        counts = {key: sum(r["counts"][key] for r in records) for key in records[0]["counts"]}
        carried = {key: in_manifest[key] for key in CARRIED if key in in_manifest}
        return [r["entry"] for r in records], {
            "counts": counts,
            "input_stage": in_manifest.get("stage"),
            "input_config": in_manifest.get("config", {}),
            **carried,
        }

    work = TokenizeWork(canonical_tokenizer(tokenizer).to_str(), prefix, cfg.max_length, record["dtype"])
    return stage.run(work, finish)
