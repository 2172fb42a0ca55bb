"""Training throughput per GPU of the main job's student and the 12-layer e5-small, with MFU.

    .venv/bin/python benchmarks/gpu_throughput.py                                  # on a GPU: the table
    .venv/bin/python benchmarks/gpu_throughput.py --tiny --steps 3                 # CPU smoke test

For each model (``student``: e5-small cut to layers 0, 4, 8, 11 with its vocabulary trimmed, 4 layers;
``e5-small``: all 12 layers, the 250,037-piece vocabulary) and each sequence length (64, 128 tokens):
a distillation step as the main job trains it (one view per sentence, the cosine distill loss against a
fixed teacher vector, AdamW fused, bf16 autocast on a GPU, fp32 on CPU) on random token ids of full
length (no padding: the upper bound a length-bucketed batch approaches). Reported per GPU:

- ``sequences_per_s`` and ``tokens_per_s`` (median of the timed steps, CUDA-synchronised);
- ``mfu``: model FLOPs / s divided by the device's peak. Model FLOPs per token = 6 x N + 12 x L x H x T
  (N: parameters outside the embeddings, which are a lookup; L layers, H width, T tokens per sequence:
  the attention scores and their weighted sum; forward + backward = 3 x forward, the PaLM appendix B
  count). Peak: ``--peak-tflops`` (default: H100 SXM 989 dense bf16, A100 312, H200 989; CPU: none);
- ``peak_memory_gb``: ``torch.cuda.max_memory_allocated`` (CPU: the process's peak RSS);
- ``loader_headroom``: sentences/s one loader worker tokenises (the bundled sample, 1 view, this
  model's length; a character WordPiece tokenizer stands in for e5's SentencePiece, which is not
  bundled) x ``--workers`` / sequences/s of the step: above 1, the loader keeps up.

Weights are random with the architectures' shapes (no download): throughput does not depend on values.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

E5_SMALL = {  # intfloat/multilingual-e5-small's config.json
    "hidden_size": 384,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 250_037,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}
# The main job's student: layers [0, 4, 8, 11]; its trimmed vocabulary (the corpus's pieces) has about
# 99k pieces (45 M parameters in all, docs/BENCHMARKS.md): the exact count changes the embedding, not
# the FLOPs that MFU counts.
STUDENT = {**E5_SMALL, "num_hidden_layers": 4, "vocab_size": 99_000}
TINY = {**E5_SMALL, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 1000}  # fmt: skip
PEAKS_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def model_flops_per_token(config: dict, model: torch.nn.Module, seq_len: int) -> float:
    """6 N + 12 L H T: training FLOPs per token (N: parameters outside the embeddings)."""
    embedding = sum(p.numel() for n, p in model.named_parameters() if "embeddings" in n)
    n = sum(p.numel() for p in model.parameters()) - embedding
    return 6 * n + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq_len


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAKS_TFLOPS.items() if key in name), None)


def loader_rate(seq_len: int, sentences: int = 2000) -> float:
    """Sentences/s one loader worker (in-process) tokenises and pads to ``seq_len``."""
    import tempfile

    from pipeline.data.collate import ViewCollator
    from pipeline.model import build_char_vocab, make_tokenizer
    from pipeline.model.vocab import write_vocab
    from pipeline.resources import sample_sentences

    texts = sample_sentences(sentences)
    with tempfile.TemporaryDirectory() as tmp:
        write_vocab(build_char_vocab(texts), Path(tmp) / "vocab.txt")
        tokenizer = make_tokenizer(Path(tmp) / "vocab.txt")
    collate = ViewCollator(tokenizer, seq_len, num_variants=0, num_dropout_views=0)
    rows = {"id": list(range(len(texts))), "text": texts, "variants": [[] for _ in texts]}
    rows = {k: v for k, v in rows.items() if k in collate.columns}
    collate({k: v[:64] for k, v in rows.items()})  # warm-up
    started = time.perf_counter()
    for start in range(0, len(texts), 64):
        collate({k: v[start : start + 64] for k, v in rows.items()})
    return len(texts) / (time.perf_counter() - started)


def bench(name: str, config: dict, seq_len: int, args: argparse.Namespace, device: torch.device) -> dict:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(**config), add_pooling_layer=False).to(device)
    model.train()
    fused = device.type == "cuda" or args.tiny
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    batch = args.batch
    ids = torch.randint(5, config["vocab_size"], (batch, seq_len), device=device)
    mask = torch.ones_like(ids)
    teacher = F.normalize(torch.randn(batch, config["hidden_size"], device=device), dim=-1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        with autocast:
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
            pooled = states.float().mean(dim=1)  # mean pooling, no padding here
        loss = (1 - F.cosine_similarity(pooled, teacher, dim=-1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    seqs = batch / seconds
    flops = model_flops_per_token(config, model, seq_len) * seq_len * seqs
    peak = peak_flops(device, args.peak_tflops)
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated(device) / 1e9
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
    loader = loader_rate(seq_len)
    return {
        "model": name,
        "seq_len": seq_len,
        "batch": batch,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": "bf16" if device.type == "cuda" else "fp32",
        "step_s": round(seconds, 4),
        "sequences_per_s": round(seqs, 1),
        "tokens_per_s": round(seqs * seq_len),
        "model_tflops_per_s": round(flops / 1e12, 2),
        "mfu": round(flops / peak, 3) if peak else None,
        "peak_flops_used": peak,
        "peak_memory_gb": round(memory, 2),
        "loader_sentences_per_s_per_worker": round(loader),
        "loader_headroom": round(loader * args.workers / seqs, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["student", "e5-small"], choices=["student", "e5-small"]
    )
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--batch", type=int, default=256, help="sequences per step per GPU")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=8, help="loader workers per rank for the headroom")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 32-wide model, batch 8: a smoke test")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--deterministic", action="store_true", help="train.deterministic's switches (its cost on a GPU)"
    )
    args = parser.parse_args()
    if args.deterministic:
        from pipeline.train.determinism import enable_determinism

        enable_determinism(True)  # before CUDA starts, as build() does
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.batch = min(args.batch, 8)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # train.tf32
    configs = {"student": STUDENT, "e5-small": E5_SMALL}
    rows = []
    for name in args.models:
        for seq_len in args.lengths:
            row = bench(name, TINY if args.tiny else configs[name], seq_len, args, device)
            row["deterministic"] = args.deterministic
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
