"""Markdown tables of an ``eval.json`` result: the terminal, eval.md, the report and the model card."""

from __future__ import annotations

from typing import Any

ROW_TITLES = {
    "model": "model",
    "model_whitened": "model + whitening",
    "tfidf": "char TF-IDF (floor)",
}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[Any]], digits: int = 2) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v, digits) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def sts_table(result: dict[str, Any]) -> str | None:
    sts = result.get("sts")
    if not sts:
        return None
    columns = list(sts.get("sets", []))
    if any("avg5" in sts.get(key, {}) for key in ROW_TITLES):
        columns.append("avg5")
    rows = [
        [ROW_TITLES[key]] + [sts[key].get(c) for c in columns]
        for key in ROW_TITLES
        if isinstance(sts.get(key), dict)
    ]
    pairs = sts.get("pairs", {})
    rows.append(["pairs"] + [pairs.get(c) for c in columns])
    return markdown_table(["Spearman x100"] + columns, rows)


def align_table(result: dict[str, Any]) -> str | None:
    align = result.get("align")
    if not align:
        return None
    rows = [[name, v.get("align"), v.get("uniform"), v.get("positives")] for name, v in align.items()]
    return markdown_table(
        ["set", "alignment (lower better)", "uniformity (lower better)", "positive pairs"], rows, 4
    )


def probe_table(result: dict[str, Any]) -> str | None:
    probe = result.get("probe")
    if not probe:
        return None
    rows = [
        [
            probe.get("data", "sentiment"),
            probe.get("accuracy"),
            probe.get("macro_f1"),
            probe.get("train"),
            probe.get("test"),
        ]
    ]
    return markdown_table(["linear probe", "accuracy", "macro F1", "train", "test"], rows)


def dims_table(result: dict[str, Any]) -> str | None:
    """One row per Matryoshka width (``eval --dims``): Spearman per set, avg5, probe accuracy and F1."""
    dims = result.get("dims")
    if not dims:
        return None
    first = next(iter(dims.values()))
    columns = list(first.get("sts", {}))
    probe = "probe" in first
    header = ["dims"] + columns + (["probe accuracy", "probe macro F1"] if probe else [])
    rows = []
    for dim, entry in dims.items():
        row = [dim] + [entry.get("sts", {}).get(c) for c in columns]
        if probe:
            row += [entry["probe"].get("accuracy"), entry["probe"].get("macro_f1")]
        rows.append(row)
    return markdown_table(header, rows)


def result_markdown(result: dict[str, Any], heading_level: int = 2) -> str:
    """All tables of a result, each under a heading."""
    hashes = "#" * heading_level
    parts = []
    for title, table in (
        ("Semantic similarity (Spearman x100 of cosine vs. label)", sts_table(result)),
        ("Alignment and uniformity (Wang & Isola 2020)", align_table(result)),
        ("Frozen-encoder linear probe (logistic regression)", probe_table(result)),
        ("Matryoshka dimensions (first k dims, re-normalised)", dims_table(result)),
    ):
        if table:
            parts.append(f"{hashes} {title}\n\n{table}\n")
    precision = (result.get("model") or {}).get("precision")
    if precision and precision != "fp32":  # a reduced-precision score says so beside its tables
        asked = (result.get("config") or {}).get("precision", precision)
        parts.append(f"Encoded under {precision} autocast on the CPU (`--precision {asked}`).\n")
    whitening = result.get("whitening")
    if whitening:
        parts.append(
            f"Whitening: fitted on {whitening.get('source')} ({whitening.get('sentences')} sentences), "
            f"dim {whitening.get('dim')}.\n"
        )
    return "\n".join(parts)
