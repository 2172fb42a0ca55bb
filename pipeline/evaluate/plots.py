"""PNG plots for a run: training curves and evaluation curves from ``metrics.jsonl``, and the
distribution of cosine similarity per gold label (the "collapse" picture: an untrained BERT puts
nearly every pair between 0.6 and 1.0 whatever the label; a useful encoder separates the labels).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

X_KEYS = ("step", "samples_seen")  # axes, not series


def _matplotlib() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Records of a metrics.jsonl; malformed lines are skipped, counted and reported once."""
    records, bad, first_bad = [], 0, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                bad += 1
                first_bad = first_bad or lineno
                continue
            records.append(record)
    if bad:
        log.warning("%s: skipped %d malformed line(s) (first at line %d)", path, bad, first_bad)
    return records, bad


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, Mapping):
        for key, sub in value.items():
            _flatten(f"{prefix}/{key}" if prefix else str(key), sub, out)
    elif _is_number(value):
        out[prefix] = float(value)


def metric_series(
    records: list[dict[str, Any]],
) -> tuple[dict[str, tuple[list, list]], dict[str, tuple[list, list]]]:
    """(training series, evaluation series): name -> (steps, values). Every numeric field is a series;
    the ``eval`` mapping of a record, and the fields of an ``"event": "eval"`` record, give the evaluation
    series. Other events (e.g. the start-up ``unk_rate`` report) are not curves and are left out.
    Records without a step use their index."""
    train: dict[str, tuple[list, list]] = {}
    evals: dict[str, tuple[list, list]] = {}
    for index, record in enumerate(records):
        event = record.get("event")
        if event is not None and event != "eval":
            continue
        step = record.get("step")
        x = step if _is_number(step) else index
        values: dict[str, float] = {}
        for key, value in record.items():
            if key in X_KEYS or key in ("eval", "event"):
                continue
            _flatten(key, value, values)
        target = evals if event == "eval" else train
        for name, value in values.items():
            target.setdefault(name, ([], []))
            target[name][0].append(x)
            target[name][1].append(value)
        scores: dict[str, float] = {}
        _flatten("", record.get("eval"), scores)
        for name, value in scores.items():
            evals.setdefault(name, ([], []))
            evals[name][0].append(x)
            evals[name][1].append(value)
    return train, evals


def _order(names: list[str]) -> list[str]:
    first = [n for n in ("loss", "lr") if n in names]
    return first + sorted(n for n in names if n not in first)


def _save_grid(plt: Any, fig: Any, axes: Any, used: int, title: str, path: Path) -> Path:
    """Hide the grid's unused axes, title the figure, write it to ``path`` and close it."""
    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # leave room for the title above the first row
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training(series: dict[str, tuple[list, list]], path: Path, title: str = "training") -> Path | None:
    """One panel per training series (loss and lr first); None when there is nothing to plot."""
    if not series:
        return None
    plt = _matplotlib()
    names = _order(list(series))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        steps, values = series[name]
        ax.plot(steps, values, lw=1.2, color="tab:blue")
        if len(values) >= 20 and name == "loss":  # a moving average shows the trend through the noise
            window = max(5, len(values) // 20)
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1 :], smooth, lw=2, color="tab:orange", label=f"mean of {window}")
            ax.legend(fontsize=8)
        if name == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _save_grid(plt, fig, axes, len(names), title, path)


def plot_eval(
    series: dict[str, tuple[list, list]], path: Path, title: str = "evaluation during training"
) -> Path | None:
    if not series:
        return None
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in sorted(series):
        steps, values = series[name]
        ax.plot(steps, values, marker="o", ms=4, lw=1.5, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def label_groups(labels: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(label text, mask) per gold label; more than 10 distinct values are rounded to integers."""
    values = np.asarray(labels, dtype=float)
    if len(np.unique(values)) > 10:
        values = np.round(values)
    groups = []
    for value in np.unique(values):
        text = str(int(value)) if float(value).is_integer() else f"{value:g}"
        groups.append((text, values == value))
    return groups


def plot_similarity(
    cosines: Mapping[str, tuple[np.ndarray, np.ndarray]],
    path: Path,
    title: str = "cosine similarity per gold label",
) -> Path | None:
    """One panel per pair set: a violin of the pairs' cosine similarity for each gold label."""
    if not cosines:
        return None
    plt = _matplotlib()
    names = list(cosines)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        sims, labels = cosines[name]
        groups = [(text, sims[mask]) for text, mask in label_groups(labels) if mask.sum() >= 2]
        if not groups:
            ax.set_visible(False)
            continue
        parts = ax.violinplot([g for _, g in groups], showmedians=True, widths=0.8)
        for body in parts["bodies"]:
            body.set_alpha(0.55)
        medians = [float(np.median(g)) for _, g in groups]
        ax.set_xticks(
            range(1, len(groups) + 1),
            [f"{text}\n{m:.2f}" for (text, _), m in zip(groups, medians)],
            fontsize=8,
        )
        ax.set_xlabel("gold label (median cosine)", fontsize=9)
        ax.set_ylabel("cosine")
        ax.set_ylim(min(-0.05, float(sims.min()) - 0.05), 1.02)
        ax.set_title(f"{name} (n={len(sims)})")
        ax.grid(alpha=0.3, axis="y")
    return _save_grid(plt, fig, axes, len(names), title, path)
