"""The cluster recipe's learning-rate rule, checked on CPU: distill_cluster.yaml's step at other global
batches and learning rates, each run the same number of samples, scored on STS-B valid along the way.

    .venv/bin/python benchmarks/cluster_lr.py run --data runs/sample --out runs/lr \\
        --batches 256 2048 --eval_every 25 5 --lrs 1e-3 2e-3 5e-4 --samples 51200
    .venv/bin/python benchmarks/cluster_lr.py report --out runs/lr

``--data`` holds the main job's stages of launch/run_sample.sh: ``student/`` (the 6-layer cut) and
``tokenized/`` (`pipeline tokenize` over its ``teacher/`` shards, ``--max_length 48``). Each run is
``launch/pretrain.py --config launch/configs/distill_cluster.yaml`` on the CPU (``--train.device=cpu
--train.compile=off``) under bf16 autocast, at one global batch and learning rate, with warmup 3 % of
its steps and STS-B valid every ``--eval_every`` steps; one seed each. A batch above ``--micro_batch``
(256) accumulates the gradients of micro-batches of that size (`train.grad_accum_steps`: the same update
for this per-sentence loss, in the memory a CPU has). Runs whose model exists are skipped, so the
command resumes a sweep. ``report`` prints the STS-B valid curves and the best of each
run as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from _common import PRETRAIN, ROOT, quiet_env, table

CONFIG = ROOT / "launch" / "configs" / "distill_cluster.yaml"


def run_dir(out: Path, batch: int, lr: str) -> Path:
    return out / f"b{batch}_lr{lr}"


def command(data: Path, out: Path, batch: int, lr: str, samples: int, every: int, micro: int) -> list[str]:
    steps = math.ceil(samples / batch)
    accumulate = [f"--train.grad_accum_steps={batch // micro}"] if batch > micro else []
    return [
        sys.executable, str(PRETRAIN), "--config", str(CONFIG), "--train.device=cpu", "--train.compile=off",
        "--train.mixed_precision=bf16", f"--data.shards={data / 'tokenized'}",
        f"--model.name_or_path={data / 'student'}", f"--run_dir={run_dir(out, batch, lr)}",
        f"--train.global_batch_size={batch}", "--train.epochs=1", f"--train.max_samples={samples}",
        f"--optim.warmup_steps={max(1, round(0.03 * steps))}", f"--optim.lr={lr}", "--data.num_workers=1",
        "--train.progress=false", f"--train.log_every={every}", f"--train.eval_every={every}",
        "--train.eval_every_minutes=0", "--train.final_model=last", "--checkpoint.every_steps=0",
        "--checkpoint.every_minutes=0", *accumulate,
    ]  # fmt: skip


def curve(run: Path) -> list[tuple[int, float]]:
    """(step, STS-B valid) of every evaluation of a run."""
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if run.exists() else []
    records = [json.loads(line) for line in lines]
    return [(r["step"], r["sts_b_valid_spearman"]) for r in records if r.get("event") == "eval"]


def report(out: Path) -> str:
    rows = []
    for run in sorted(out.glob("b*_lr*"), key=lambda p: (int(p.name[1:].split("_")[0]), p.name)):
        if not run.is_dir():
            continue
        batch, lr = run.name[1:].split("_lr")
        points = curve(run)
        if not points:
            continue
        best = max(points, key=lambda p: p[1])
        done = (run / "model" / "model.safetensors").exists()
        path = " / ".join(f"{s}: {v:.2f}" for s, v in points)
        rows.append([f"{int(batch):,}", lr, path, f"{best[1]:.2f} (step {best[0]})", "yes" if done else "no"])
    return table(["global batch", "lr", "STS-B valid (step: score)", "best", "finished"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["run", "report"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=ROOT / "runs" / "sample")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--lrs", nargs="+", default=["1e-3", "2e-3", "5e-4"])
    parser.add_argument(
        "--samples", type=int, default=51200, help="per run (800 x 64, the main job's when measured)"
    )
    parser.add_argument("--eval_every", type=int, nargs="+", help="steps, one per batch (default: 8 a run)")
    parser.add_argument(
        "--micro_batch", type=int, default=256,
        help="larger batches accumulate gradients over micro-batches of this size (CPU memory)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.action == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        every = args.eval_every or [max(1, math.ceil(args.samples / b) // 8) for b in args.batches]
        if len(every) != len(args.batches):
            parser.error("--eval_every takes one number per batch of --batches")
        for lr in args.lrs:
            for batch, each in zip(args.batches, every, strict=True):
                if (run_dir(args.out, batch, lr) / "model" / "model.safetensors").exists():
                    continue
                log = run_dir(args.out, batch, lr).with_suffix(".log")
                with log.open("w") as f:
                    cmd = command(args.data, args.out, batch, lr, args.samples, each, args.micro_batch)
                    code = subprocess.run(
                        cmd, env=quiet_env(2), stdout=f, stderr=subprocess.STDOUT
                    ).returncode
                print(f"batch {batch} lr {lr}: exit {code} ({log})", flush=True)
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
