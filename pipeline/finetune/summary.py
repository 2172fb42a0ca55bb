"""From recorded cells to the run's table (markdown + JSON) and plot.

Per (task, regime, seed), the lr of the grid with the best dev score is chosen (ties: the first lr of
the grid) and that cell's test score is the seed's result; mean and sample standard deviation (ddof 1;
0 for one seed) over seeds are reported. Test scores never influence the choice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.finetune.cells import cells_of, task_digest
from pipeline.finetune.tasks import SPLITS, Task


def summarise(cfg: Any, tasks: list[Task], records: dict[Any, dict[str, Any]], out: Path) -> dict[str, Any]:
    from pipeline.finetune.train import primary_metric

    summary: dict[str, Any] = {}
    for task in tasks:
        metric = primary_metric(task)
        entry: dict[str, Any] = {
            "kind": task.kind,
            "metric": metric,
            "source": task.source,
            "sizes": {s: len(task.splits[s]) for s in SPLITS},
            "classes": task.classes,
            "regimes": {},
        }
        cache_stem = out / "cache" / f"{task.name}-{task_digest(task)}"
        if task.kind == "similarity" and cache_stem.with_suffix(".npy").is_file():
            entry["zero_shot"] = zero_shot(task, np.load(cache_stem.with_suffix(".npy")))
        for regime in cfg.regimes:
            per_seed: dict[int, list[dict[str, Any]]] = {}
            for cell in cells_of(cfg, task.name, regime):
                if cell in records:
                    per_seed.setdefault(cell.seed, []).append(records[cell])
            chosen = [max(cells, key=lambda r: r["dev"][metric]) for cells in per_seed.values()]
            if not chosen:
                continue
            row: dict[str, Any] = {
                "seeds": [r["seed"] for r in chosen],
                "lrs": [r["lr"] for r in chosen],
                "dev": [r["dev"][metric] for r in chosen],
                "test": [r["test"][metric] for r in chosen],
                "seconds": round(sum(r["seconds"] for cells in per_seed.values() for r in cells), 1),
                "cpu_seconds": round(sum(r.get("cpu_seconds", 0.0) for c in per_seed.values() for r in c), 1),
            }
            row |= _mean_std(row["test"])
            if task.kind == "classification":
                row["macro_f1"] = _mean_std([r["test"]["macro_f1"] for r in chosen])
            cache = cache_stem.with_suffix(".json")
            if regime == "freeze" and cache.is_file():
                timing = json.loads(cache.read_text(encoding="utf-8"))
                row["encode_seconds"] = timing["seconds"]
                row["encode_cpu_seconds"] = timing.get("cpu_seconds", 0.0)
            entry["regimes"][regime] = row
        summary[task.name] = entry
    return summary


def zero_shot(task: Task, features: np.ndarray) -> dict[str, float]:
    """Spearman x100 of the untouched encoder's cosine on dev and test, from FreezeBERT's cache: the
    reference both regimes should beat (fine-tuning that does not has hurt the encoder)."""
    from pipeline.evaluate.sts import pair_cosine, spearman100

    row = {t: i for i, t in enumerate(task.unique_texts())}
    scores = {}
    for name in ("dev", "test"):
        split = task.splits[name]
        a = features[[row[t] for t in split.texts_a]]
        b = features[[row[t] for t in split.texts_b]]
        scores[name] = spearman100(pair_cosine(a, b), split.labels)
    return scores


def _mean_std(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0}


def _cell(row: dict[str, Any] | None, key: str | None = None) -> str:
    if not row:
        return "–"
    stats = row[key] if key else row
    return f"{stats['mean']:.2f} ± {stats['std']:.2f} ({len(row['seeds'])})"


def markdown(result: dict[str, Any]) -> str:
    regimes = result["config"]["regimes"]
    titles = {"train": "TrainBERT", "freeze": "FreezeBERT"}
    header = [
        "task",
        "metric x100",
        *[titles[r] for r in regimes],
        "zero-shot cosine",
        "train/dev/test",
        "lr chosen (per seed)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for name, entry in result["tasks"].items():
        rows = [(entry["metric"], None)]
        if entry["kind"] == "classification":
            rows.append(("macro_f1", "macro_f1"))
        for metric, key in rows:
            cells = [_cell(entry["regimes"].get(r), key) for r in regimes]
            sizes = "/".join(str(entry["sizes"][s]) for s in SPLITS)
            lrs = "; ".join(
                f"{titles[r]} " + ",".join(f"{lr:g}" for lr in entry["regimes"][r]["lrs"])
                for r in regimes
                if r in entry["regimes"]
            )
            zero = entry.get("zero_shot", {}).get("test")
            zero_text = "–" if zero is None else f"{zero:.2f}"
            lines.append("| " + " | ".join([name, metric, *cells, zero_text, sizes, lrs]) + " |")
    cfg = result["config"]
    notes = (
        "Test score at the lr chosen on dev, mean ± std over seeds (n). Budgets: "
        f"TrainBERT {cfg['train_epochs']} epochs, lr grid {cfg['train_lrs']}, "
        f"head lr {cfg['head_lr']:g}; FreezeBERT {cfg['freeze_epochs']} epochs, "
        f"lr grid {cfg['freeze_lrs']}; batch {cfg['batch_size']}, max length {cfg['max_length']}, "
        f"similarity loss {cfg['sim_head']}, at most {cfg['max_train']} training examples per task."
    )
    notes += (
        " Zero-shot cosine: the untouched encoder's Spearman on the same test split (similarity tasks "
        "with FreezeBERT's cache)."
    )
    return "\n".join(lines) + "\n\n" + notes + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = result["config"]["regimes"]
    names = list(result["tasks"])
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(names)), 3.6))
    width = 0.8 / len(regimes)
    for k, regime in enumerate(regimes):
        rows = [result["tasks"][n]["regimes"].get(regime) for n in names]
        x = np.arange(len(names)) + (k - (len(regimes) - 1) / 2) * width
        means = [r["mean"] if r else np.nan for r in rows]
        stds = [r["std"] if r else 0.0 for r in rows]
        label = {"train": "TrainBERT", "freeze": "FreezeBERT"}[regime]
        ax.bar(x, means, width, yerr=stds, capsize=3, label=label)
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels([f"{n}\n({result['tasks'][n]['metric']})" for n in names], fontsize=8)
    ax.set_ylabel("test score x100 (lr chosen on dev)")
    ax.set_title(f"Fine-tuning: {Path(str(result['model']['model_dir'])).name}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # path may be a temporary name without .png
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path) -> str:
    from pipeline.io import atomic_write, atomic_write_bytes, atomic_write_json

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "finetune.json", result)
    table = markdown(result)
    text = f"# Fine-tuning evaluation of `{result['model']['spec']}`\n\n{table}"
    atomic_write_bytes(out / "finetune.md", text.encode("utf-8"))
    atomic_write(out / "finetune.png", lambda tmp: plot(result, tmp))
    return table
