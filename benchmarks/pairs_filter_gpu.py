"""The consistency filter's cost per pair on a GPU: an e5-small-shaped encoder over real pair lengths.

The teacher stage's work per pair is two encoder passes (anchor and positive, fp16 on a GPU) and the
pool scoring (``pipeline/stages/teacher/consistency.py``). This times exactly that compute with an
encoder of multilingual-e5-small's shape (XLM-R architecture: 12 layers, 384 wide, 12 heads, 1,536
intermediate, mean pooling) and random weights — the weights do not change the cost; the vocabulary
is cut to 1,000 ids because the embedding lookup costs nothing measurable and the real 250k-row
matrix would not fit the 64 MiB the device tool carries. The token lengths are the real ones of
3,419 extracted pairs (``benchmarks/pairs_token_lengths.json``: e5's tokenizer with its prefix),
resampled to ``--pairs`` pairs; batches are sorted by length like the teacher stage's
``encode_texts``. Prints pairs per second per GPU and the projection to the full corpus.

    python3 benchmarks/pairs_filter_gpu.py --pairs 200000 --max-length 512
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

FULL_CORPUS_PAIRS = 15_000_000  # docs/pairs.md: the estimate of the five collections' pairs


def encoder(device: str):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    config = XLMRobertaConfig(
        vocab_size=1000, hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=1536, max_position_embeddings=514, attn_implementation="sdpa",
    )  # fmt: skip
    return XLMRobertaModel(config, add_pooling_layer=False).to(device).half().eval()


def encode(model, lengths: np.ndarray, batch_size: int, device: str) -> np.ndarray:
    out = torch.empty((len(lengths), 384), dtype=torch.float16, device=device)
    order = np.argsort(-lengths, kind="stable")
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = int(lengths[idx].max())
            ids = torch.randint(5, 1000, (len(idx), width), device=device)
            mask = (
                torch.arange(width, device=device)[None, :]
                < torch.as_tensor(lengths[idx], device=device)[:, None]
            )
            hidden = model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            out[torch.as_tensor(idx, device=device)] = torch.nn.functional.normalize(
                pooled.float(), dim=-1
            ).half()
    return out


def score(anchors: torch.Tensor, positives: torch.Tensor, pool: int) -> torch.Tensor:
    """Ranks within consecutive windows of ``pool`` rows (one source; no group masking: same cost)."""
    n = len(anchors) // pool * pool
    a = anchors[:n].view(-1, pool, anchors.shape[1]).float()
    p = positives[:n].view(-1, pool, positives.shape[1]).float()
    sims = a @ p.transpose(1, 2)
    own = sims.diagonal(dim1=1, dim2=2)[..., None]
    return 1 + (sims > own).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--pool", type=int, default=64)
    args = parser.parse_args()
    device = "cuda"
    real = np.array(json.loads((Path(__file__).parent / "pairs_token_lengths.json").read_text())["lengths"])
    rng = np.random.default_rng(0)
    sample = np.minimum(real[rng.integers(0, len(real), args.pairs)], args.max_length)
    model = encoder(device)
    encode(model, sample[:2048, 0], args.batch_size, device)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    started = time.perf_counter()
    a = encode(model, sample[:, 0], args.batch_size, device)
    p = encode(model, sample[:, 1], args.batch_size, device)
    ranks = score(a, p, args.pool)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    rate = args.pairs / seconds
    tokens = sample.sum(1).mean()
    print(f"{torch.cuda.get_device_name()}: {args.pairs:,} pairs ({tokens:.1f} tokens a pair, max_length "
          f"{args.max_length}, batch {args.batch_size}, fp16): both sides encoded, {ranks.numel():,} ranked "
          f"in pools of {args.pool} in {seconds:.2f} s = {rate:,.0f} pairs/s")  # fmt: skip
    hours = FULL_CORPUS_PAIRS / rate / 3600
    print(f"projection: {FULL_CORPUS_PAIRS:,} pairs / {rate:,.0f} pairs/s = {hours:.2f} GPU-hours "
          "(reading shards and writing columns not included)")  # fmt: skip


if __name__ == "__main__":
    main()
