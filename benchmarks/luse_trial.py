"""The LUSE trial's tables: zero-shot and fine-tuned scores of several pretraining arms, 3 seeds each.

    .venv/bin/python benchmarks/luse_trial.py RUNS [--reference cut] [--pairs distill_luse:distill]
        [--plot RUNS/luse_trial.png]

``RUNS`` holds one directory per (arm, seed), ``ARM-sSEED`` (what benchmarks/luse_trial.sh writes): its
``zs/eval.json`` (`eval --suite [sts]`, the five sets) and ``ft/finetune.json`` (`finetune --seeds
SEED`: one fine-tuning seed per pretraining seed, so the spread covers both). Every figure is a test
score at the lr chosen on dev (the finetune command's rule); mean ± sample std over the arm's seeds. The
selection table averages the dev scores only: a recipe is chosen on it, never on the test columns.

The verdict compares an arm with its init (``--reference``; ``--pairs A:B`` adds more comparisons: the
CLS-pooled arms against the init read with CLS pooling, LUSE against SimCSE, distillation + LUSE against
distillation alone)
task by task: **better** when the difference of the
means exceeds the larger of the two standard deviations, **worse** when it is below minus that, level
otherwise (the issue's "beyond one standard deviation").
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
from _common import mean_std as fmt
from _common import stats, table

from pipeline.evaluate.sts import AVG_NAME
from pipeline.evaluate.sts import STS_SETS as SCORED_SETS

STS_SETS = [*SCORED_SETS, AVG_NAME]  # the columns: each scored set, then their mean
REGIMES = {"train": "TrainBERT", "freeze": "FreezeBERT"}


def load(runs: Path) -> dict[str, dict[str, dict]]:
    """arm -> {"zs": {set: [scores]}, "ft": {(task, regime): [scores]}, "seeds": [...], "tasks": {...}}."""
    arms: dict[str, dict] = {}
    for run in sorted(runs.iterdir()):
        match = re.fullmatch(r"(.+)-s(\d+)", run.name)
        if not match or not run.is_dir():
            continue
        arm = arms.setdefault(match[1], {"zs": {}, "ft": {}, "dev": {}, "seeds": [], "tasks": {}})
        if (
            run / "identical.txt"
        ).is_file():  # luse_trial.sh found its weights bit-identical to another arm's
            print((run / "identical.txt").read_text(encoding="utf-8").strip())
            continue
        zs_file, ft_file = run / "zs" / "eval.json", run / "ft" / "finetune.json"
        if not (zs_file.is_file() and ft_file.is_file()):
            continue  # a run still going (or stopped): left out, and the seed count says so
        arm["seeds"].append(int(match[2]))
        for name, score in json.loads(zs_file.read_text(encoding="utf-8"))["sts"]["model"].items():
            arm["zs"].setdefault(name, []).append(score)
        dev: dict[str, list[float]] = {}
        for task, entry in json.loads(ft_file.read_text(encoding="utf-8"))["tasks"].items():
            arm["tasks"][task] = entry["metric"]
            for regime, row in entry["regimes"].items():
                arm["ft"].setdefault((task, regime), []).extend(row["test"])
                dev.setdefault(regime, []).extend(row["dev"])
        for regime, scores in dev.items():  # this seed's mean over tasks
            arm["dev"].setdefault(regime, []).append(float(np.mean(scores)))
    return {name: arm for name, arm in arms.items() if arm["seeds"]}


def verdict(arm: list[float] | None, ref: list[float] | None) -> tuple[str, float] | None:
    a, r = stats(arm), stats(ref)
    if a is None or r is None:
        return None
    diff, bar = a[0] - r[0], max(a[1], r[1])
    return ("better" if diff > bar else "worse" if diff < -bar else "level"), diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--reference", default="cut", help="the init every arm is compared with")
    parser.add_argument(
        "--pairs",
        nargs="*",
        default=[
            "luse:cut_cls",
            "luse_bce:cut_cls",
            "luse_gist:cut_cls",
            "simcse:cut_cls",
            "luse:simcse",
            "luse_bce:simcse",
            "distill_luse:distill",
        ],
        help="more ARM:REFERENCE (default: the comparisons of the module docstring)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the differences as a PNG here")
    args = parser.parse_args()
    arms = load(args.runs)
    if args.reference not in arms:
        parser.error(f"{args.runs}: no finished run of the reference arm {args.reference!r}")
    tasks = arms[args.reference]["tasks"]

    print("### Zero-shot: Spearman x100 of cosine, five sets (eval --suite [sts] --max_pairs 2000)\n")
    rows = [
        [name, str(len(a["seeds"])), *(fmt(a["zs"].get(s)) for s in STS_SETS)] for name, a in arms.items()
    ]
    print(table(["arm", "seeds", *STS_SETS], rows))
    for regime, title in REGIMES.items():
        print(f"\n### {title}: test score x100 after fine-tuning (lr chosen on dev)\n")
        header = ["arm", "seeds", *(f"{t} ({m})" for t, m in tasks.items())]
        rows = [
            [name, str(len(a["seeds"])), *(fmt(a["ft"].get((t, regime))) for t in tasks)]
            for name, a in arms.items()
        ]
        print(table(header, rows))

    print("\n### Selection: dev score x100, mean over tasks, mean ± std over seeds (the recipe choice)\n")
    rows = [[name, *(fmt(a["dev"].get(r)) for r in REGIMES)] for name, a in arms.items()]
    print(table(["arm", *(f"{t} dev" for t in REGIMES.values())], rows))

    comparisons = [(name, args.reference) for name in arms if name != args.reference]
    comparisons += [tuple(p.split(":", 1)) for p in args.pairs if all(x in arms for x in p.split(":", 1))]
    print("\n### Verdict: arm against its init, per task (better/worse: beyond the larger std)\n")
    rows, diffs = [], {}
    for arm, ref in comparisons:
        for regime, title in REGIMES.items():
            cells, counts = [], {"better": 0, "level": 0, "worse": 0}
            for task in tasks:
                found = verdict(arms[arm]["ft"].get((task, regime)), arms[ref]["ft"].get((task, regime)))
                if found is None:
                    cells.append("–")
                    continue
                word, diff = found
                counts[word] += 1
                diffs[(arm, ref, regime, task)] = diff
                cells.append(f"{diff:+.2f} {word}")
            tally = f"{counts['better']} / {counts['level']} / {counts['worse']}"
            rows.append([f"{arm} vs {ref}", title, *cells, tally])
    print(table(["comparison", "regime", *tasks, "better / level / worse"], rows))
    if args.plot:
        plot(diffs, comparisons, list(tasks), args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def plot(diffs: dict, comparisons: list, tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True)
    width = 0.84 / max(1, len(comparisons))
    for ax, (regime, title) in zip(axes, REGIMES.items(), strict=True):
        for k, (arm, ref) in enumerate(comparisons):
            x = np.arange(len(tasks)) + (k - (len(comparisons) - 1) / 2) * width
            values = [diffs.get((arm, ref, regime, t), np.nan) for t in tasks]
            ax.bar(x, values, width, color=colours[k % len(colours)], label=f"{arm} − {ref}")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(tasks)))
        ax.set_xticklabels(tasks, fontsize=8)
        ax.set_title(f"{title}: test score difference, mean of seeds", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("points x100 (arm − reference)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
