"""The bytes outside the encoder on CPU: the embedding table's share of the optimizer
step, and the MLM head at every position against the head on the selected positions only.

The main job's step as ``benchmarks/step_layouts.py`` builds it (by default the 4-layer student of
multilingual-e5-small with its embedding table cut to ``--vocab`` rows: 38M of its 45M parameters; 64
real sentences of the bundled corpus per step, max_length 48, length-bucketed; the distill cosine loss
against fixed teacher vectors; bf16 autocast; fused AdamW; dropout 0), in four variants, each with its
own copy of the student and optimizer, taking their steps in turn over the same batches:

- ``trainable``: the main job's step, every parameter trained;
- ``frozen``: ``model.freeze_embeddings`` (the word-embedding table gets no gradient and no AdamW state);
- ``mlm-full``: the same step plus the mlm term (weight 0.1, 15 % of the tokens selected, BERT's head tied
  to the embeddings) with the head at every position, (B, L, V) logits, as before;
- ``mlm-masked``: the same with the head on the selected positions only, (M, V) (``mlm_positions``).

Medians of per-step times after warm-up steps, and of the backward and the optimizer step alone (the
table's gradient is made in the backward); each variant's ratio to its reference is the median of the
per-round ratios. ``[MASK]`` is stood in for by an id the batches use (the ids are renumbered to the rows
kept): the timing does not depend on which id it is.

Then, ``--updates`` times each in turn: the fused AdamW step alone (gradients held fixed) over every
parameter against every parameter but the embedding table (what freezing it leaves); and the momentum
update of a copy of the student under the guard's device verdict (``MomentumEncoder.update(online, m,
apply)``), in place, against the out-of-place form it replaced (kept below as
:func:`old_momentum_update`).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/step_bytes.py --model models/e5-small
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from step_layouts import BATCH, MAX_LENGTH, batches, student, student_options

from pipeline.data.collate import Batch, TokenLayout, ViewCollator
from pipeline.data.masking import batch_generator, mask_tokens
from pipeline.losses.mlm import compute_loss
from pipeline.losses.queue import MomentumEncoder
from pipeline.model import SentenceEncoder
from pipeline.model.heads import MLMHead, TrainModule

MLM_WEIGHT = 0.1


def step(module: TrainModule, optimizer: torch.optim.Optimizer, batch: Batch, teacher: torch.Tensor,
         mlm: str | None) -> tuple[float, float]:  # fmt: skip
    """One step; returns the seconds of its backward and of its optimizer step."""
    inputs = batch.inputs("cpu")
    if mlm == "full":
        inputs.pop("mlm_positions")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if mlm is None:
            emb = module(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])  # (64, H)
        else:
            emb, logits = module(**inputs, mlm_input_ids=batch.mlm_input_ids)  # (64, H), (B, L | M, V)
    loss = (1 - F.cosine_similarity(emb.float(), teacher, dim=-1)).mean()  # distill: {loss: cosine}
    if mlm is not None:
        loss = loss + MLM_WEIGHT * compute_loss(logits, batch.mlm_labels)
    start = time.perf_counter()
    loss.backward()
    backward = time.perf_counter() - start
    start = time.perf_counter()
    optimizer.step()
    took = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    return backward, took


def old_momentum_update(copy: torch.nn.Module, online: torch.nn.Module, momentum: float,
                        apply: torch.Tensor) -> None:  # fmt: skip
    """The update under a device verdict as first written: an out-of-place lerp, kept with torch.where."""
    with torch.no_grad():
        targets = list(copy.parameters())
        new = torch._foreach_lerp(targets, [q.detach() for q in online.parameters()], 1.0 - momentum)
        for target, value in zip(targets, new):
            target.copy_(torch.where(apply, value, target))
        for ours, theirs in zip(copy.buffers(), online.buffers()):
            ours.copy_(theirs)


def momentum_times(online: torch.nn.Module, updates: int) -> dict[str, float]:
    """Median seconds of one momentum update of a copy of ``online``, in place vs the old form."""
    new, old = MomentumEncoder(online), MomentumEncoder(online)
    apply = torch.tensor(True)
    times: dict[str, list[float]] = {"in place": [], "out of place": []}
    for _ in range(updates):
        start = time.perf_counter()
        new.update(online, 0.995, apply)
        times["in place"].append(time.perf_counter() - start)
        start = time.perf_counter()
        old_momentum_update(old.encoder, online, 0.995, apply)
        times["out of place"].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def optimizer_times(module: torch.nn.Module, updates: int) -> dict[str, float]:
    """Median seconds of one fused AdamW step over all of ``module``'s parameters vs all but its word
    embeddings, gradients held fixed (random), the two in turn."""
    module = copy.deepcopy(module)
    table = module.encoder.backbone.get_input_embeddings().weight
    for q in module.parameters():
        q.grad = torch.randn_like(q) * 1e-3
    optimizers = {
        "all": torch.optim.AdamW(list(module.parameters()), lr=1e-5, fused=True),
        "frozen table": torch.optim.AdamW(
            [q for q in module.parameters() if q is not table], lr=1e-5, fused=True
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in optimizers}
    for _ in range(updates):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def masked(batch: Batch, index: int, special: list[int], mask_id: int, vocab: int) -> Batch:
    """The batch with BERT masks of its sentences (mlm_input_ids, mlm_labels), as MLMCollator draws them."""
    generator = batch_generator(0, [index])
    batch.mlm_input_ids, batch.mlm_labels = mask_tokens(
        batch.input_ids, batch.attention_mask, special, mask_id, vocab, generator
    )
    return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    student_options(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--updates", type=int, default=20, help="optimizer steps, momentum updates per form")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    encoder = SentenceEncoder.from_pretrained(args.model)  # loaded once: its tokenizer and prefix
    tokenizer = encoder.tokenizer
    rows, used, pad_id = batches(tokenizer, encoder.prefix, args.warmup + args.steps, 0)
    base = student(args.model, args.vocab, used, [int(i) for i in args.layers.split(",")])
    renumber = {old: new for new, old in enumerate(used)}
    special = sorted(renumber[i] for i in tokenizer.all_special_ids if i in renumber)
    mask_id = next(i for i in range(len(used)) if i not in special)  # a stand-in for [MASK]
    vocab = base.encoder.backbone.config.vocab_size
    collate = ViewCollator(SimpleNamespace(pad_token_id=pad_id), MAX_LENGTH, 0, 0, pretokenized=True)
    layout = TokenLayout(collate, pad_id, MAX_LENGTH, False, 0)
    laid_out = [masked(layout(r), i, special, mask_id, vocab) for i, r in enumerate(rows)]
    dim = base.encoder.dim
    variants = {}
    for name in ("trainable", "frozen", "mlm-full", "mlm-masked"):
        module = copy.deepcopy(base)
        if name == "frozen":  # what build.py does for model.freeze_embeddings
            module.encoder.backbone.get_input_embeddings().requires_grad_(False)
        if name.startswith("mlm"):
            torch.manual_seed(0)
            module.mlm_head = MLMHead(dim, vocab)
        params = [q for q in module.parameters() if q.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
        variants[name] = (module, optimizer, name[4:] if name.startswith("mlm") else None)
    teacher = F.normalize(torch.randn(BATCH, dim, generator=torch.Generator().manual_seed(0)), dim=-1)
    times: dict[str, list[float]] = {name: [] for name in variants}
    optim: dict[str, list[float]] = {name: [] for name in variants}
    backward: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.steps):
        for name, (module, optimizer, mlm) in variants.items():
            start = time.perf_counter()
            back, opt = step(module, optimizer, laid_out[i], teacher, mlm)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
                optim[name].append(opt)
                backward[name].append(back)
    params = sum(q.numel() for q in base.parameters())
    table = base.encoder.backbone.get_input_embeddings().weight.numel()
    selected = sum(int((b.mlm_labels != -100).sum()) for b in laid_out)
    positions = sum(b.mlm_labels.numel() for b in laid_out)
    print(
        f"student {params / 1e6:.1f} M parameters, of them the embedding table {table / 1e6:.1f} M "
        f"({args.vocab} rows); batch {BATCH}, max_length {MAX_LENGTH}, bf16 autocast, fused AdamW, "
        f"{args.threads} threads; medians of {args.steps} steps after {args.warmup} warm-up steps, variants "
        f"in turn; MLM: {selected} of {positions} positions selected ({100 * selected / positions:.1f} %)"
    )
    reference = {"trainable": "trainable", "frozen": "trainable", "mlm-full": "mlm-full",
                 "mlm-masked": "mlm-full"}  # fmt: skip
    for name, values in times.items():
        ref = reference[name]
        ratio = statistics.median(a / b for a, b in zip(times[ref], values))
        print(
            f"  {name:11s} {statistics.median(values):6.3f} s/step  backward "
            f"{statistics.median(backward[name]):6.3f} s  optimizer {statistics.median(optim[name]):6.3f} s  "
            f"{ratio:5.2f}x {ref}"
        )

    stepped = optimizer_times(base, args.updates)
    print(
        f"fused AdamW step alone, medians of {args.updates}: all parameters {stepped['all']:.3f} s, "
        f"all but the embedding table {stepped['frozen table']:.3f} s"
    )
    moved = momentum_times(base.encoder, args.updates)
    print(
        f"momentum update of the student ({params / 1e6:.1f} M parameters), verdict on the device, medians "
        f"of {args.updates}: in place {moved['in place']:.3f} s, out of place {moved['out of place']:.3f} s"
    )


if __name__ == "__main__":
    main()
