"""The main job's distillation step on CPU, eager padded vs unpadded vs compiled, side by side.

The step of launch/configs/distill.yaml as it was measured: the 4-layer student of multilingual-e5-small
(layers 0, 4, 8, 11, the main job's student before its 6-layer cut; ``--layers`` takes others; its
word-embedding table cut to ``--vocab`` rows, the size of the student whose vocabulary ``pipeline
student`` trims to the corpus: 38M of its 45M parameters), 64 real sentences per step (the
bundled corpus, e5's "query: " prefix, max_length 48) batched as ``data.length_bucketing`` does
(sorted by length within windows of 50 batches, batches shuffled), the distill cosine loss against
fixed teacher vectors, bf16 autocast and fused AdamW. Each variant has its own copy of the student
and its own optimizer; the variants take their steps in turn (A B C ... A B C ...) over the same
batches, so a loaded machine's drift falls on all alike. Medians of per-step times after warm-up steps
(which include compiling); each variant's ratio to eager padded is the median of the per-round ratios.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/step_layouts.py --model models/e5-small --steps 15

Variants: ``padded`` (the default step: each batch padded to its longest sentence, transformers' own
mask), ``bucket8`` (``train.pad_to_multiple_of=8`` with the prepared mask), ``unpadded``
(``train.unpadded``), and with ``--compile`` also ``compiled-bucket8`` and ``compiled-unpadded``
(``train.compile=default``).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.data.collate import Batch, TokenLayout, ViewCollator
from pipeline.model import SentenceEncoder
from pipeline.model.compile import compile_counts, prepare_encoder
from pipeline.model.heads import TrainModule
from pipeline.model.layers import keep_layers
from pipeline.resources import sample_sentences

BATCH, MAX_LENGTH, WINDOW = 64, 48, 50
LAYERS = (0, 4, 8, 11)


def student_options(p: argparse.ArgumentParser) -> None:
    """The options that say which student a step benchmark builds (shared with step_bytes.py)."""
    p.add_argument("--model", required=True, help="the e5-small folder (python -m pipeline models fetch)")
    p.add_argument("--vocab", type=int, default=99_000, help="rows of the student's embedding table")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", default=",".join(map(str, LAYERS)), help="the layers the student keeps")


def student(model: str, vocab: int, used_ids: list[int], layers: list[int]) -> TrainModule:
    """The 4-layer cut of ``model`` with its embedding table cut to ``vocab`` rows: the ids the batches
    use first (renumbered 0..), then rows of other pieces up to ``vocab``."""
    encoder = SentenceEncoder.from_pretrained(model, max_length=MAX_LENGTH)
    keep_layers(encoder.backbone, layers)
    table = encoder.backbone.get_input_embeddings().weight.detach()
    taken = set(used_ids)
    others = [i for i in range(table.shape[0]) if i not in taken][: max(0, vocab - len(used_ids))]
    rows = torch.tensor(used_ids + others)
    embedding = nn.Embedding(len(rows), table.shape[1])
    embedding.weight.data.copy_(table[rows])
    encoder.backbone.set_input_embeddings(embedding)
    encoder.backbone.config.vocab_size = len(rows)
    for module in encoder.backbone.modules():  # dropout 0, as distill.yaml trains
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return TrainModule(encoder)


def batches(
    tokenizer: Any, prefix: str, steps: int, seed: int, window_batches: int = WINDOW
) -> tuple[list[dict], list[int], int]:
    """``steps`` rows dicts of 64 pre-tokenised sentences, length-bucketed in windows of
    ``window_batches`` batches (1: no bucketing); the ids they use; the pad id renumbered."""
    texts = sample_sentences(BATCH * steps, min_chars=4, max_chars=80)
    ids = tokenizer([prefix + t for t in texts], truncation=True, max_length=MAX_LENGTH)["input_ids"]
    used = sorted({i for row in ids for i in row} | {tokenizer.pad_token_id})
    renumber = {old: new for new, old in enumerate(used)}
    rows = [np.array([renumber[i] for i in row], dtype=np.int64) for row in ids]
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    window = BATCH * window_batches
    for start in range(0, len(order), window):  # data.length_bucketing: sorted within each window
        order[start : start + window] = sorted(order[start : start + window], key=lambda i: len(rows[i]))
    groups = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    rng.shuffle(groups)
    out = [{"id": g, "input_ids": [rows[i] for i in g], "variant_input_ids": [[] for _ in g]} for g in groups]
    return out, used, renumber[tokenizer.pad_token_id]


def step(module: TrainModule, optimizer: torch.optim.Optimizer, batch: Batch, teacher: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = module(**batch.inputs("cpu"))  # (64, H)
    loss = (1 - F.cosine_similarity(emb.float(), teacher, dim=-1)).mean()  # distill: {loss: cosine}
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    student_options(p)
    p.add_argument("--steps", type=int, default=15, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per variant (compiling included)")
    p.add_argument("--compile", action="store_true", help="also the compiled variants (inductor)")
    p.add_argument(
        "--window", type=int, default=WINDOW, help="length-bucketing window in batches (1 = no bucketing)"
    )
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    encoder = SentenceEncoder.from_pretrained(args.model)
    rows, used, pad_id = batches(encoder.tokenizer, encoder.prefix, args.warmup + args.steps, 0, args.window)
    base = student(args.model, args.vocab, used, [int(i) for i in args.layers.split(",")])
    layouts = {
        "padded": dict(unpadded=False, pad_to_multiple_of=0, compile="off"),
        "bucket8": dict(unpadded=False, pad_to_multiple_of=8, compile="off"),
        "unpadded": dict(unpadded=True, pad_to_multiple_of=0, compile="off"),
    }
    if args.compile:
        layouts["compiled-bucket8"] = dict(unpadded=False, pad_to_multiple_of=8, compile="default")
        layouts["compiled-unpadded"] = dict(unpadded=True, pad_to_multiple_of=0, compile="default")
    collate = ViewCollator(SimpleNamespace(pad_token_id=pad_id), MAX_LENGTH, 0, 0, pretokenized=True)
    variants = {}
    for name, fields in layouts.items():
        train = SimpleNamespace(**fields)
        module = copy.deepcopy(base)
        prepare_encoder(module.encoder, train)
        layout = TokenLayout(collate, pad_id, MAX_LENGTH, train.unpadded, train.pad_to_multiple_of)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)
        variants[name] = (module, optimizer, [layout(r) for r in rows])
    dim = base.encoder.dim  # 384: e5-small's width, the teacher's too
    teacher = F.normalize(torch.randn(BATCH, dim, generator=torch.Generator().manual_seed(0)), dim=-1)
    times: dict[str, list[float]] = {name: [] for name in variants}
    warmup_s = {name: 0.0 for name in variants}
    for i in range(args.warmup + args.steps):
        for name, (module, optimizer, laid_out) in variants.items():
            start = time.perf_counter()
            step(module, optimizer, laid_out[i], teacher)
            took = time.perf_counter() - start
            if i < args.warmup:
                warmup_s[name] += took
            else:
                times[name].append(took)
    real = sum(int(b.attention_mask.sum()) for b in variants["padded"][2])
    padded_tokens = sum(b.input_ids.numel() for b in variants["padded"][2])
    bucket_tokens = sum(b.input_ids.numel() for b in variants["bucket8"][2])
    params = sum(p.numel() for p in base.parameters())
    print(
        f"student {params / 1e6:.1f} M parameters ({args.vocab} embedding rows), batch {BATCH}, max_length "
        f"{MAX_LENGTH}, bf16 autocast, fused AdamW, {args.threads} threads; medians of {args.steps} steps "
        f"after {args.warmup} warm-up steps each, variants in turn, bucketing window {args.window} batches"
    )
    print(f"tokens per real token: padded {padded_tokens / real:.3f}, bucket8 {bucket_tokens / real:.3f}")
    figures = {}
    for name, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(times["padded"], values))
        median = statistics.median(values)
        figures[name] = {"s_per_step": median, "sentences_per_s": BATCH / median, "vs_padded": ratio,
                         "warmup_s": warmup_s[name]}  # fmt: skip
        print(
            f"  {name:18s} {median:6.3f} s/step  {BATCH / median:6.1f} sentences/s  "
            f"{ratio:5.2f}x eager padded  (warm-up {warmup_s[name]:.0f} s)"
        )
    if args.compile:
        print(f"  compiled graphs in all: {compile_counts()}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
