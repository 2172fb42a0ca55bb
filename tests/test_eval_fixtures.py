"""A tiny from-scratch encoder and a fake run directory, shared by the eval, report and export tests.

Imported by test_eval*.py, test_report*.py and test_export*.py; holds no tests itself.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pipeline.model import (
    SentenceEncoder,
    build_char_vocab,
    build_scratch_backbone,
    make_tokenizer,
    write_vocab,
)
from pipeline.resources import SAMPLE_CORPUS

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


def build_tiny_encoder(directory: Path, pooling: str = "cls", seed: int = 0, max_length: int = 48) -> Path:
    """Write a tiny random BERT encoder folder (char vocabulary from 300 corpus lines) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(SAMPLE_CORPUS, encoding="utf-8") as f:
        lines = list(itertools.islice(f, 300))
    vocab = build_char_vocab(lines)
    vocab_path = directory.parent / f"{directory.name}.vocab.txt"
    write_vocab(vocab, vocab_path)
    backbone = build_scratch_backbone(TINY, len(vocab), seed)
    SentenceEncoder(backbone, make_tokenizer(vocab_path), pooling, max_length).save_pretrained(directory)
    return directory


def build_fake_run(run_dir: Path, model_dir: Path, steps: tuple[int, ...] = (10, 20)) -> Path:
    """A run directory laid out as docs/DESIGN.md "Checkpoints" says, with copies of one model."""
    import shutil

    checkpoints = run_dir / "checkpoints"
    config = (
        "data:\n  shards: data/augmented\n  num_variants: 4\n  num_dropout_views: 1\n"
        "loss:\n  - luse: {temperature: 0.05, queue_size: 4096, momentum: 0.999}\n"
        "train:\n  max_steps: 20\n  global_batch_size: 64\n"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config, encoding="utf-8")
    for step in steps:
        ckpt = checkpoints / f"step-{step:08d}"
        shutil.copytree(model_dir, ckpt / "model")
        (ckpt / "config.yaml").write_text(config, encoding="utf-8")
        meta = {"step": step, "samples_seen": step * 64, "world_size": 1}
        (ckpt / "checkpoint.json").write_text(json.dumps(meta), encoding="utf-8")
    (checkpoints / "latest").write_text(f"step-{steps[-1]:08d}\n", encoding="utf-8")
    (checkpoints / "best").write_text(f"step-{steps[0]:08d}\n", encoding="utf-8")
    lines = [
        json.dumps({"step": s, "samples_seen": s * 64, "loss": 5.0 / s, "lr": 1e-4 * min(1, s / 5)})
        for s in range(1, 21)
    ]
    lines.insert(3, "{not json")
    lines += [json.dumps({"step": s, "eval": {"stsb_valid": 10.0 + s}}) for s in (10, 20)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("tiny") / "model", "cls")


@pytest.fixture(scope="session")
def tiny_mean_model(tmp_path_factory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("tiny_mean") / "model", "mean", seed=1)
