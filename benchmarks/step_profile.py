"""Where the time of one training step goes, on a real model: sections of the trainer's step, timed.

Builds the real trainer (``pipeline.train.build``) on a model folder and augmented shards, then times
``loop.train_step`` whole and, on the same batches, its sections: loading the batch (tokenising in
the main process), forward, loss, backward, clipping, the optimizer, the queue keys (a momentum
encoder forward and the enqueue) and the momentum update. Also a bare forward+backward of the same
batch (the model and a sum of the embeddings: no loss, no optimizer), the floor a step can reach.
Medians over ``--steps`` after ``--warmup`` steps.

    .venv/bin/python benchmarks/step_profile.py --model models/e5-small --shards runs/sample/augmented
    benchmarks/step_profile.py ... --set model.freeze_embeddings=true train.mixed_precision=bf16

Wall-clock on whatever else the machine runs: compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.cli import build_config
from pipeline.data.collate import Batch
from pipeline.train import engines, loop
from pipeline.train.build import Trainer, build
from pipeline.train.config import Config

REPO = Path(__file__).resolve().parents[1]


def timed_step(t: Trainer, batch: Batch, times: dict[str, list[float]]) -> None:
    """``loop.train_step`` for one micro-batch, no GradCache, no MLM, with a clock between sections."""
    acc, cfg = t.accelerator, t.cfg
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        times[name].append(now - clock[0])
        clock[0] = now

    t.schedule.apply(t.state.step)
    inputs, batch = batch.inputs(acc.device), batch.sentences_to(acc.device)  # as Engine.run does
    with acc.accumulate(t.model):
        encoded = engines.forward(t, inputs, batch)  # bf16: autocasts itself (build.autocast_bf16_on_cpu)
        lap("forward")
        part = engines.term_loss(t, encoded, batch)
        rows = encoded[0] if isinstance(encoded, tuple) else encoded
        lap("loss")
        acc.backward(part.total)
        lap("backward")
        if cfg.optim.grad_clip:
            acc.clip_grad_norm_(t.model.parameters(), cfg.optim.grad_clip)
        lap("clip")
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        lap("optimizer")
    t.loss.after_micro_batch(rows, inputs, batch)  # the terms' queues
    lap("queue keys")
    t.loss.after_step(t.module.encoder)  # the momentum encoder
    lap("momentum update")
    t.state.step += 1


def bare_forward_backward(t: Trainer, batch: Batch) -> float:
    start = time.perf_counter()
    rows = t.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    rows.sum().backward()
    t.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder (e.g. models/e5-small)")
    p.add_argument("--shards", type=Path, required=True, help="augmented shards")
    p.add_argument("--batch", type=int, default=32, help="sentences per step (x n views = sequences)")
    p.add_argument("--max_length", type=int, default=48)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--set", nargs="*", default=[], help="extra config overrides, e.g. train.mixed_precision=bf16"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run_dir = Path(tempfile.mkdtemp(prefix="step_profile-"))
    argv = [
        "--config",
        str(REPO / "launch/configs/luse_scratch.yaml"),
        f"--model.name_or_path={args.model}",
        f"--data.shards={args.shards}",
        f"--data.max_length={args.max_length}",
        "--data.num_variants=2",
        "--data.num_dropout_views=1",
        "--data.num_workers=0",
        "--data.verify_shards=false",
        "--data.length_bucketing=true",
        f"--train.global_batch_size={args.batch}",
        "--train.max_steps=1000",
        "--train.cpu=true",
        "--train.eval_every=0",
        "--train.final_model=last",
        "--checkpoint.every_steps=0",
        "--checkpoint.every_minutes=0",
        f"--run_dir={run_dir}",
        *(f"--{s}" for s in args.set),
    ]
    cfg = build_config(Config, argv)
    t = build(cfg)
    t.model.train()
    batches = iter(t.stream)
    times: dict[str, list[float]] = defaultdict(list)
    whole, bare, seqs, tokens = [], [], 0, 0
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        batch = next(batches)
        load = time.perf_counter() - start
        seqs, tokens = batch.input_ids.shape[0], batch.input_ids.numel()
        start = time.perf_counter()
        loop.train_step(t, batch)
        step_time = time.perf_counter() - start
        sections: dict[str, list[float]] = defaultdict(list)
        timed_step(t, batch, sections)
        bare_time = bare_forward_backward(t, batch)
        if i >= args.warmup:
            times["load batch (main process)"].append(load)
            for k, v in sections.items():
                times[k].extend(v)
            whole.append(step_time)
            bare.append(bare_time)
    params = sum(p.numel() for p in t.module.parameters())
    trained = sum(p.numel() for p in t.module.parameters() if p.requires_grad)
    print(
        f"{args.model}: {params / 1e6:.1f} M parameters ({trained / 1e6:.1f} M trained), "
        f"{seqs} sequences x {tokens // seqs} tokens (last batch), {args.threads} threads, "
        f"overrides {args.set or 'none'}; medians of {args.steps} steps"
    )
    print(f"  {'train_step (whole)':28s} {statistics.median(whole):7.3f} s")
    print(f"  {'bare forward+backward':28s} {statistics.median(bare):7.3f} s")
    total = sum(statistics.median(v) for k, v in times.items() if not k.startswith("load"))
    for name, values in times.items():
        m = statistics.median(values)
        share = f"{100 * m / total:5.1f} % of the timed step" if not name.startswith("load") else ""
        print(f"  {name:28s} {m:7.3f} s  {share}")
    print(f"  step / bare forward+backward: {statistics.median(whole) / statistics.median(bare):.2f}x")
    t.close()


if __name__ == "__main__":
    main()
