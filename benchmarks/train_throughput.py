"""Training throughput on this machine: our trainer step vs the sentence-transformers trainer.

Both train the same small from-scratch BERT (one local folder), at the same sequence length and the
same number of encoded sequences per step: our trainer with the LUSE objective at n = 2 views
(original + one cached variant, no queue) and s-t's ``SentenceTransformerTrainer`` with
``MultipleNegativesRankingLoss`` on (anchor, positive) pairs. Also: our loader's samples/s in one
worker with 1 + 4 texts per sample (tokenised, padded, the worker's whole job).

    .venv/bin/python benchmarks/train_throughput.py                       # defaults below
    .venv/bin/python benchmarks/train_throughput.py --batch 64 --steps 20 --hidden 256 --layers 4

Figures are wall-clock and noisy on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.config import load_config
from pipeline.data.stream import BatchStream, ShardSource, ViewCollator, index_shards
from pipeline.io import atomic_write_json
from pipeline.model import SentenceEncoder, build_char_vocab, build_scratch_backbone, make_tokenizer
from pipeline.model.vocab import write_vocab
from pipeline.resources import sample_sentences
from pipeline.shards import new_manifest, sentence_id, shard_name, write_shard
from pipeline.train.config import Config

SCHEMA = pa.schema(
    [
        ("id", pa.uint64()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("variants", pa.list_(pa.string())),
        ("variant_ops", pa.list_(pa.string())),
    ]
)


def write_sample_shards(directory: Path, texts: list[str], k: int, rows_per_block: int = 1000) -> None:
    """Shards with k character-deletion variants per sentence (a stand-in for EDA, same shape)."""
    rng = random.Random(0)
    directory.mkdir(parents=True, exist_ok=True)
    blocks = []
    for start in range(0, len(texts), rows_per_block):
        rows = texts[start : start + rows_per_block]
        variants = []
        for t in rows:
            vs = []
            for _ in range(k):
                i = rng.randrange(len(t))
                vs.append(t[:i] + t[i + 1 :])
            variants.append(vs)
        blocks.append(
            pa.table(
                {
                    "id": [sentence_id(t) for t in rows],
                    "text": rows,
                    "source": ["plain"] * len(rows),
                    "variants": variants,
                    "variant_ops": [["rd"] * k for _ in rows],
                },
                schema=SCHEMA,
            )
        )
    entry = write_shard(directory / shard_name(0), blocks, 0)
    atomic_write_json(directory / "manifest.json", new_manifest("augment", {"num_variants": k}, [entry]))


def build_model_folder(folder: Path, texts: list[str], args: argparse.Namespace) -> None:
    write_vocab(build_char_vocab(texts), folder.parent / "vocab.txt")
    tokenizer = make_tokenizer(folder.parent / "vocab.txt")
    cfg = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": max(1, args.hidden // 64),
        "intermediate_size": 4 * args.hidden,
        "max_position_embeddings": 512,
    }
    SentenceEncoder(
        build_scratch_backbone(cfg, len(tokenizer), 0), tokenizer, "cls", args.max_length
    ).save_pretrained(folder)


def bench_loader(shards: Path, tokenizer, args: argparse.Namespace) -> float:
    """Samples/s of one loader worker (in-process) producing 1 + 4 tokenised texts per sample."""
    collate = ViewCollator(tokenizer, args.max_length, num_variants=4, num_dropout_views=0)
    stream = BatchStream(ShardSource(index_shards(shards), collate.columns), collate, args.batch, 0, 1, 0, 0)
    batches = stream.epoch_batches()
    next(batches)  # first block decode and tokenizer warm-up
    t0, n = time.perf_counter(), 0
    for batch in batches:
        n += batch["ids"].shape[0]
    return n / (time.perf_counter() - t0)


def bench_ours(shards: Path, model_dir: Path, run_dir: Path, args: argparse.Namespace) -> float:
    from pipeline.train.build import build
    from pipeline.train.loop import train_step

    over = {
        "data.shards": str(shards),
        "data.num_variants": 1,
        "data.num_dropout_views": 0,
        "data.max_length": args.max_length,
        "data.num_workers": args.num_workers,
        "model.name_or_path": str(model_dir),
        "objective.queue_size": 0,
        "train.global_batch_size": args.batch,
        "train.max_steps": args.steps + args.warmup,
        "train.cpu": True,
        "run_dir": str(run_dir),
        "train.eval_max_pairs": 16,
        "optim.warmup_steps": 0,
        "checkpoint.every_steps": 0,
        "checkpoint.every_minutes": 0.0,
    }
    trainer = build(load_config(Config, None, over))
    trainer.checkpointer = None
    batches = iter(trainer.stream)
    trainer.model.train()
    for _ in range(args.warmup):
        train_step(trainer, next(batches))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = train_step(trainer, next(batches))
    out["loss"].item()  # the one host sync
    elapsed = time.perf_counter() - t0
    trainer.close()
    return args.batch * args.steps / elapsed


def bench_sentence_transformers(
    model_dir: Path, texts: list[str], out_dir: Path, args: argparse.Namespace
) -> float:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
    from sentence_transformers.training_args import SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.max_seq_length = args.max_length
    rng = random.Random(1)
    pairs = []
    for t in texts[: args.batch * (args.steps + args.warmup + 1)]:
        i = rng.randrange(len(t))
        pairs.append({"anchor": t, "positive": t[:i] + t[i + 1 :]})
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    targs = SentenceTransformerTrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps + args.warmup,
        learning_rate=5e-5,
        warmup_steps=0,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=targs,
        train_dataset=Dataset.from_list(pairs),
        loss=losses.MultipleNegativesRankingLoss(model),
        callbacks=[Clock()],
    )
    trainer.train()
    # steps after warm-up: time between the end of warm-up step and the end of the last step
    return args.batch * args.steps / (stamps[-1] - stamps[args.warmup - 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="sentences per step (each encoded twice)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=1, help="our loader workers during training")
    p.add_argument("--loader-sentences", type=int, default=20000, help="sentences for the loader benchmark")
    p.add_argument("--skip", choices=["ours", "st", "loader"], action="append", default=[])
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, float] = {"threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        needed = max(args.loader_sentences, args.batch * (args.steps + args.warmup + 2))
        texts = sample_sentences(needed, 8, 60)
        write_sample_shards(tmp / "shards4", texts, k=4)
        build_model_folder(tmp / "model", texts, args)
        tokenizer = make_tokenizer(tmp / "vocab.txt")
        if "loader" not in args.skip:
            results["loader_samples_per_s_per_worker"] = bench_loader(tmp / "shards4", tokenizer, args)
        if "ours" not in args.skip:
            results["ours_sentences_per_s"] = bench_ours(tmp / "shards4", tmp / "model", tmp / "run", args)
            results["ours_sequences_per_s"] = 2 * results["ours_sentences_per_s"]
        if "st" not in args.skip:
            results["st_sentences_per_s"] = bench_sentence_transformers(
                tmp / "model", texts, tmp / "st", args
            )
            results["st_sequences_per_s"] = 2 * results["st_sentences_per_s"]
        if "ours_sentences_per_s" in results and "st_sentences_per_s" in results:
            results["ratio_ours_over_st"] = results["ours_sentences_per_s"] / results["st_sentences_per_s"]
    print(json.dumps({"args": vars(args), **{k: round(v, 2) for k, v in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
