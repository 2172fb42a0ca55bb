"""Auxiliary MLM ablation (issue 9): avg5 and the sentiment linear probe for several MLM weights lambda.

For every (lambda, seed) it pretrains from scratch with ``launch/configs/default.yaml`` (LUSE, the
small scratch BERT) on the given augmented shards with identical steps and batch, then scores the
final ``model/`` with ``python -m pipeline eval --suite=[sts, probe]``; it prints one row per run and
a table of mean +- std over seeds. Runs that already have ``eval/eval.json`` are reused, so an
interrupted grid continues where it stopped.

    python benchmarks/mlm_ablation.py --shards runs/sample/augmented --out runs/mlm_ablation \\
        --weights 0 0.1 0.3 --seeds 1 2 3 --steps 100 --batch 32 --max-length 32 --max-pairs 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STS_SETS = ("ATEC", "BQ", "LCQMC", "PAWSX", "STS-B")


def train_and_eval(args: argparse.Namespace, weight: float, seed: int) -> dict[str, float]:
    run_dir = args.out / f"mlm{weight:g}_seed{seed}"
    result = run_dir / "eval" / "eval.json"
    if not result.is_file():
        start = time.time()
        train = [
            sys.executable,
            str(ROOT / "launch" / "pretrain.py"),
            "--config",
            str(ROOT / "launch" / "configs" / "default.yaml"),
            f"--data.shards={args.shards}",
            f"--run_dir={run_dir}",
            "--resume=never",
            f"--train.seed={seed}",
            f"--objective.mlm_weight={weight}",
            f"--train.max_steps={args.steps}",
            f"--train.global_batch_size={args.batch}",
            f"--objective.queue_size={args.queue}",
            f"--data.max_length={args.max_length}",
            f"--optim.warmup_steps={max(1, args.steps // 10)}",
            "--train.eval_every=0",
            "--train.eval_max_pairs=200",
            "--checkpoint.every_steps=0",
            "--checkpoint.every_minutes=0",
        ]
        subprocess.run(train, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        trained = time.time()
        evaluate = [
            sys.executable,
            "-m",
            "pipeline",
            "eval",
            str(run_dir / "model"),
            "--suite=[sts, probe]",
            "--progress=false",
            f"--out={run_dir / 'eval'}",
        ]
        if args.max_pairs:
            evaluate.append(f"--max_pairs={args.max_pairs}")
        subprocess.run(evaluate, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        took = f"train {trained - start:.0f} s, eval {time.time() - trained:.0f} s"
        print(f"  lambda={weight:g} seed={seed}: {took}", flush=True)
    data = json.loads(result.read_text(encoding="utf-8"))
    sts = data["sts"]["model"]
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in last if "loss" in r][-1]
    std_probe = standardized_probe(run_dir, args.max_pairs or None)
    return {
        "avg5": statistics.mean(sts[s] for s in STS_SETS),
        "probe_std_acc": std_probe["accuracy"],
        "probe_std_f1": std_probe["macro_f1"],
        **{s: sts[s] for s in STS_SETS},
        "probe_acc": data["probe"]["accuracy"],
        "probe_f1": data["probe"]["macro_f1"],
        "contrastive": last.get("contrastive_loss", last["loss"]),
        "mlm": last.get("mlm_loss", float("nan")),
    }


def standardized_probe(run_dir: Path, max_examples: int | None) -> dict[str, float]:
    """The sentiment probe on standardised embeddings (cached in RUN/probe_std.json).

    ``pipeline eval``'s probe fits C=1 logistic regression on the raw L2-normalised vectors; on a
    briefly trained encoder the coordinates are tiny and it returns the majority class. Scaling each
    coordinate to unit variance (fitted on the probe's sentences, labels unused) makes the same
    linear probe informative; the split, subsample and classifier are those of pipeline.evaluate.
    """
    cache = run_dir / "probe_std.json"
    if cache.is_file():
        return json.loads(cache.read_text(encoding="utf-8"))
    import numpy as np

    from pipeline.evaluate.probe import linear_probe, read_labelled_tsv
    from pipeline.model import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(run_dir / "model")

    def embed(texts: list[str]) -> np.ndarray:
        x = encoder.encode(texts, batch_size=64)  # (N, H)
        return (x - x.mean(0)) / (x.std(0) + 1e-8)

    result = linear_probe(embed, read_labelled_tsv(), max_examples=max_examples)
    cache.write_text(json.dumps(result), encoding="utf-8")
    return result


def mean_std(values: list[float]) -> str:
    if any(v != v for v in values):  # NaN: the MLM loss of a lambda = 0 run
        return "–"
    if len(values) < 2:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=Path, default=Path("runs/sample/augmented"), help="augmented shards")
    p.add_argument("--out", type=Path, default=Path("runs/mlm_ablation"), help="one run dir per cell")
    p.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.1, 0.3], help="MLM weights lambda")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="train.seed of each repeat")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (equal for all)")
    p.add_argument("--batch", type=int, default=32, help="train.global_batch_size")
    p.add_argument("--queue", type=int, default=128, help="objective.queue_size (a multiple of --batch)")
    p.add_argument("--max-length", type=int, default=32, help="data.max_length")
    p.add_argument("--max-pairs", type=int, default=2000, help="eval subsample per set and probe (0 = all)")
    args = p.parse_args()
    args.shards, args.out = args.shards.resolve(), args.out.resolve()

    results: dict[float, list[dict[str, float]]] = {}
    for seed in args.seeds:  # seed-major: a partial grid already compares every lambda
        for weight in args.weights:
            results.setdefault(weight, []).append(train_and_eval(args, weight, seed))
            r = results[weight][-1]
            print(
                f"lambda={weight:g} seed={seed}: avg5 {r['avg5']:.2f} probe acc {r['probe_acc']:.2f} "
                f"F1 {r['probe_f1']:.2f} std-probe acc {r['probe_std_acc']:.2f} "
                f"final contrastive {r['contrastive']:.3f} mlm {r['mlm']:.3f}",
                flush=True,
            )
    cols = ["avg5", *STS_SETS, "probe_acc", "probe_f1", "probe_std_acc", "probe_std_f1", "mlm"]
    print(f"\n{args.steps} steps x {args.batch} sentences, max_length {args.max_length}, seeds {args.seeds}")
    print("| lambda | " + " | ".join(cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    for weight, rows in results.items():
        print(f"| {weight:g} | " + " | ".join(mean_std([r[c] for r in rows]) for c in cols) + " |")


if __name__ == "__main__":
    main()
