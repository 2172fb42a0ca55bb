"""Side by side: the recorded cells of several ``finetune --out`` directories, as one markdown table.

    .venv/bin/python benchmarks/finetune_compare.py NAME=DIR NAME=DIR [--train-lrs 3e-5,1e-4]
        [--freeze-lrs 1e-4,3e-4,1e-3]

Reads ``DIR/cells/TASK/REGIME-seedS-lrLR.json`` (what is recorded so far: a run still going or
stopped early is fine) and applies the command's rule: per (task, regime, seed), the lr of the grid
with the best dev score (a seed is used only when every lr of its grid is recorded), its test score;
mean ± std (ddof 1) over those seeds. The zero-shot cosine of similarity tasks comes from FreezeBERT's
cache. Both directories must hold the same setting (``finetune_config.json``) but the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from _common import mean_std, table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.finetune.cells import task_digest  # noqa: E402
from pipeline.finetune.run import Config, load_tasks  # noqa: E402
from pipeline.finetune.summary import zero_shot  # noqa: E402

METRIC = {"classification": "accuracy", "similarity": "spearman"}


def collect(directory: Path, grids: dict[str, list[float]]) -> dict[tuple[str, str], list[float]]:
    results: dict[tuple[str, str], list[float]] = {}
    for task_dir in sorted((directory / "cells").iterdir()):
        for regime, lrs in grids.items():
            seeds = {}
            for path in task_dir.glob(f"{regime}-seed*-lr*.json"):
                record = json.loads(path.read_text(encoding="utf-8"))
                seeds.setdefault(record["seed"], {})[record["lr"]] = record
            for _seed, by_lr in sorted(seeds.items()):
                if not all(lr in by_lr for lr in lrs):
                    continue
                metric = "accuracy" if "accuracy" in next(iter(by_lr.values()))["dev"] else "spearman"
                best = max((by_lr[lr] for lr in lrs), key=lambda r: r["dev"][metric])
                results.setdefault((task_dir.name, regime), []).append(best["test"][metric])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=DIR")
    parser.add_argument("--train-lrs", default="3e-5,1e-4")
    parser.add_argument("--freeze-lrs", default="1e-4,3e-4,1e-3")
    args = parser.parse_args()
    grids = {
        "train": [float(v) for v in args.train_lrs.split(",")],
        "freeze": [float(v) for v in args.freeze_lrs.split(",")],
    }
    runs = [(name, Path(d)) for name, _, d in (r.partition("=") for r in args.runs)]
    setting = json.loads((runs[0][1] / "finetune_config.json").read_text(encoding="utf-8"))
    cfg = Config(
        model=setting["model"],
        out=runs[0][1],
        **{k: setting[k] for k in ("max_train", "max_dev", "max_test", "split_seed")},
    )
    tasks = {t.name: t for t in load_tasks(cfg)}
    found = {name: collect(d, grids) for name, d in runs}
    header = ["task", "metric"]
    for name, _ in runs:
        header += [f"{name} zero-shot", f"{name} TrainBERT", f"{name} FreezeBERT"]
    rows = []
    for task_name, task in tasks.items():
        row = [task_name, METRIC[task.kind]]
        for name, directory in runs:
            cache = directory / "cache" / f"{task_name}-{task_digest(task)}.npy"
            zero = (
                f"{zero_shot(task, np.load(cache))['test']:.2f}"
                if task.kind == "similarity" and cache.is_file()
                else "–"
            )
            row += [
                zero,
                mean_std(found[name].get((task_name, "train")), count=True),
                mean_std(found[name].get((task_name, "freeze")), count=True),
            ]
        rows.append(row)
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
