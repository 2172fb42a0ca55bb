"""What the fine-tuning evaluation costs: one model, every task, both regimes, one seed.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/finetune_cost.py --model MODEL --out /tmp/ftcost [ARGS...]

Runs ``python -m pipeline finetune MODEL --seeds 0 --out OUT ARGS...`` in this process (the command's
defaults unless ARGS change them), then prints, per task and regime, the training-and-scoring time of
its cells (all lrs of the grid) and, for FreezeBERT, the one-off encoding of the task's texts, with the
wall time of the whole run and the load average before and after (the target is <= 15 minutes on the
2-core box; other people's jobs share it, so say what the load was when quoting a figure).
``OUT`` must be new or empty: a rerun into it would skip the recorded cells and time nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.cli import main  # noqa: E402


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args, rest = parser.parse_known_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty: its recorded cells would be skipped, not timed")
    load_before = os.getloadavg()
    start = time.perf_counter()
    command = ["finetune", args.model, "--seeds", "0", "--out", str(args.out), "--progress", "false"]
    code = main([*command, *rest])
    wall = time.perf_counter() - start
    load_after = os.getloadavg()
    if code:
        return code
    result = json.loads((args.out / "finetune.json").read_text(encoding="utf-8"))
    print("\n| task | regime | encode once (s) | cells (s) | total (s) | total CPU (s) | lrs | score |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    totals = {"train": 0.0, "freeze": 0.0}
    cpu_totals = {"train": 0.0, "freeze": 0.0}
    for name, entry in result["tasks"].items():
        for regime, row in entry["regimes"].items():
            encode = row.get("encode_seconds", 0.0)
            total = encode + row["seconds"]
            cpu = row.get("encode_cpu_seconds", 0.0) + row["cpu_seconds"]
            totals[regime] += total
            cpu_totals[regime] += cpu
            lrs = len(result["config"]["train_lrs" if regime == "train" else "freeze_lrs"])
            score = f"{entry['metric']} {row['mean']:.2f}"
            cells = f"{encode:.1f} | {row['seconds']:.1f} | {total:.1f} | {cpu:.1f}"
            print(f"| {name} | {regime} | {cells} | {lrs} | {score} |")
    print(
        f"\nTrainBERT {totals['train'] / 60:.1f} min, FreezeBERT {totals['freeze'] / 60:.1f} min "
        f"(CPU time, all threads: {cpu_totals['train'] / 60:.1f} and {cpu_totals['freeze'] / 60:.1f} min); "
        f"wall {wall / 60:.1f} min for the whole run (model loading and tables included); "
        f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (1 min), "
        f"{load_after[2]:.1f} (15 min); OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run())
