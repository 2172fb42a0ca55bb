"""Tiny augmented shards and configs for the training, stream and launch tests (built, never downloaded)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa

from pipeline.resources import sample_sentences
from pipeline.shards import new_manifest, sentence_id, shard_name, write_manifest, write_shard

SCHEMA = pa.schema(
    [
        pa.field("id", pa.uint64(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("variants", pa.list_(pa.string()), nullable=False),
        pa.field("variant_ops", pa.list_(pa.string()), nullable=False),
    ]
)


def _variants(text: str, k: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(k):
        chars = list(text)
        i = rng.randrange(len(chars))
        del chars[i]  # a deletion: enough to make a distinct, similar variant
        v = "".join(chars)
        if v and v != text:
            out.append(v)
    return out


def make_shards(
    directory: Path, block_sizes: list[list[int]], num_variants: int = 4, seed: int = 0
) -> list[int]:
    """Shards with ``block_sizes[shard][block]`` rows each; returns every id in write order.

    Every 7th sentence gets fewer variants than ``num_variants`` (like a short sentence in augment).
    """
    directory.mkdir(parents=True, exist_ok=True)
    total = sum(sum(s) for s in block_sizes)
    texts = sample_sentences(total)
    rng = random.Random(seed)
    ids, entries, pos = [], [], 0
    for s, sizes in enumerate(block_sizes):
        blocks = []
        for size in sizes:
            rows = texts[pos : pos + size]
            pos += size
            variants = [_variants(t, num_variants - (i % 7 == 0), rng) for i, t in enumerate(rows)]
            table = pa.table(
                {
                    "id": [sentence_id(t) for t in rows],
                    "text": rows,
                    "source": ["plain"] * len(rows),
                    "variants": variants,
                    "variant_ops": [["rd"] * len(v) for v in variants],
                },
                schema=SCHEMA,
            )
            ids.extend(sentence_id(t) for t in rows)
            blocks.append(table)
        entries.append(write_shard(directory / shard_name(s), blocks, s))
    write_manifest(directory, new_manifest("augment", {"num_variants": num_variants}, entries, counts={}))
    return ids


DEBUG_CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "debug.yaml"


def debug_luse(**fields) -> list[dict]:
    """debug.yaml's ``loss`` (one luse term) with ``fields`` of the luse term changed, e.g.
    ``{"loss": debug_luse(momentum=0.9)}``."""
    import yaml

    (term,) = yaml.safe_load(DEBUG_CONFIG.read_text(encoding="utf-8"))["loss"]
    return [{"luse": {**term["luse"], **fields}}]


def debug_config(tmp_path: Path, shards: Path, **overrides):
    """launch/configs/debug.yaml on ``shards`` with its run directory in ``tmp_path``, then ``overrides``."""
    from pipeline.config import load_config
    from pipeline.train.config import Config

    base = {"data.shards": str(shards), "run_dir": str(tmp_path / "run")}
    return load_config(Config, DEBUG_CONFIG, {**base, **overrides})


def run_and_dump(cfg) -> dict:
    """Train ``cfg`` in this process (fresh Accelerate state) and return rank 0's debug dump."""
    import json

    from accelerate.state import AcceleratorState

    from pipeline.train.run import run

    AcceleratorState._reset_state(True)
    assert run(cfg) == 0
    return json.loads((cfg.run_dir / "debug" / "rank0.json").read_text())


def full_and_resumed(tmp_path: Path, make_cfg, stop: int, total: int) -> tuple[dict, dict]:
    """Debug dumps of ``total`` steps uninterrupted (run dir ``full``) and of a run stopped after ``stop``
    steps and resumed to ``total`` (``split``); ``make_cfg(run_dir, max_steps)`` gives each run's config."""
    full = run_and_dump(make_cfg(tmp_path / "full", total))
    run_and_dump(make_cfg(tmp_path / "split", stop))
    return full, run_and_dump(make_cfg(tmp_path / "split", total))


def with_teacher(shards: Path, out: Path, dim: int, seed: int = 0) -> Path:
    """A copy of ``shards`` as the teacher stage would write it, with random unit ``teacher`` vectors of
    width ``dim`` (float16) and a manifest that records a teacher of that width (no model involved)."""
    import numpy as np

    from pipeline.shards import read_manifest, read_shard
    from pipeline.vectors import vector_column

    out.mkdir(parents=True, exist_ok=True)
    manifest, rng = read_manifest(shards), np.random.default_rng(seed)
    entries = []
    for s, entry in enumerate(manifest["shards"]):
        blocks = []
        for table in read_shard(shards / entry["name"]):
            vectors = rng.standard_normal((table.num_rows, dim))
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            blocks.append(table.append_column("teacher", vector_column(vectors.astype(np.float16))))
        entries.append(write_shard(out / shard_name(s), blocks, s))
    teacher = {"name": "random-teacher", "hash": "0" * 64, "dim": dim, "dtype": "float16"}
    config = manifest["config"]
    write_manifest(out, new_manifest("teacher", {}, entries, counts={}, input_config=config, teacher=teacher))
    return out


def batch_stream(cfg, shard_set, tokenizer, rank: int = 0, world: int = 1, prefix: str = ""):
    """The trainer's batches for ``cfg`` on ``shard_set`` (None: the supervised file), as ``build`` makes
    them: the data plan (the config held against the data), then the stream built from it."""
    from pipeline.data.build import build_stream
    from pipeline.train.plan import check_against_data
    from pipeline.train.speed import loader_workers

    plan = check_against_data(cfg, shard_set, world, tokenizer, prefix)
    workers = loader_workers(cfg.data.num_workers, "cpu")
    return build_stream(plan, cfg.data, cfg.train, tokenizer, rank, world, prefix, workers=workers)
