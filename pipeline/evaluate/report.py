"""``python -m pipeline report RUN_DIR``: plots and a Markdown page for a training run.

Writes ``RUN_DIR/report/`` (or ``--out``): ``training.png`` and ``eval_curves.png`` from
``metrics.jsonl``, ``similarity.png`` (cosine per gold label for the run's latest or best
checkpoint) and ``report.md`` embedding them, with the evaluation tables if an ``eval.json`` exists
and the run's resolved config.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.config import option
from pipeline.errors import ConfigError, InputError
from pipeline.evaluate.run import check_precision, resolve_encode_precision
from pipeline.evaluate.sts import STS_SETS
from pipeline.precision import CpuPrecision

log = logging.getLogger(__name__)


@dataclass
class Config:
    run_dir: Path | None = option(
        None, "RUN_DIR: the training run's directory (metrics.jsonl, checkpoints/)."
    )
    out: Path | None = option(None, "Output directory (default: RUN_DIR/report).")
    select: Literal["latest", "best"] = option(
        "latest", "Checkpoint whose similarity distribution is plotted."
    )
    similarity: bool = option(True, "Encode pairs with the checkpoint and plot cosine per gold label.")
    sets: list[str] = option(list(STS_SETS), "Pair sets for the similarity plot.")
    max_pairs: int = option(2000, "Pairs per set for the similarity plot (seeded subsample).")
    seed: int = option(0, "Seed of the pair subsample.")
    batch_size: int = option(64, "Sentences per encoding batch.")
    device: str = option("cpu", "torch device to encode on.")
    precision: CpuPrecision = option(
        "auto",
        "CPU compute precision of the similarity plot's encoding, as eval's: auto (bf16 autocast on a CPU "
        "with native bf16, fp32 elsewhere), fp32 or bf16.",
    )
    progress: bool = option(True, "Show progress bars while encoding.")

    def __post_init__(self) -> None:
        if self.run_dir is None:
            raise ConfigError("name the RUN_DIR to report on")
        unknown = [s for s in self.sets if s not in STS_SETS]
        if unknown:
            raise ConfigError(f"--sets: unknown {unknown}; choose from {', '.join(STS_SETS)}")
        if self.max_pairs < 10:
            raise ConfigError("--max-pairs must be >= 10")
        check_precision(self.precision, self.device)


def similarity_by_set(
    resolved: Any, cfg: Config, evaluation: tuple[Path, dict[str, Any]] | None
) -> dict[str, tuple[Any, Any]]:
    """Cosine and gold label of each set's pairs (a seeded subsample of ``--max-pairs``): the per-pair
    cosines ``eval`` saved for the same weights in the same precision when there are some (no encoding),
    else the checkpoint's encoder on the pairs."""
    from pipeline.evaluate import resolve
    from pipeline.evaluate.sts import embed_pair_set, load_sts_sets

    precision, why = resolve_encode_precision(cfg.precision, cfg.device)
    sets = load_sts_sets(cfg.sets)
    saved = saved_cosines(evaluation, resolve.weights_digest(resolved), precision, sets)
    if saved is not None:
        log.info("similarity plot: the cosines %s holds for these weights (%s); nothing to encode",
                 evaluation[0].parent / saved.pop("_file"), precision)  # fmt: skip
        found = {}
        for pairs in sets:
            rows = pairs.subsample_rows(cfg.max_pairs, cfg.seed)
            found[pairs.name] = (saved[pairs.name][rows], pairs.labels[rows])
        return found
    log.info("similarity plot: encoding in %s (%s)", precision, why)
    encoder = resolve.load_encoder(resolved, cfg.device)
    found = {}
    for pairs in sets:
        pairs = pairs.subsample(cfg.max_pairs, cfg.seed)
        embedded = embed_pair_set(
            lambda t, n=pairs.name: encoder.encode(
                t, cfg.batch_size, cfg.progress, desc=n, bf16=precision == "bf16"
            ),
            pairs,
        )
        found[pairs.name] = (embedded.cosines(), pairs.labels)
    return found


def saved_cosines(
    evaluation: tuple[Path, dict[str, Any]] | None, digest: str | None, precision: str, sets: list[Any]
) -> dict[str, Any] | None:
    """The per-pair cosines of an eval.json (eval's cosines.npz) when they were computed with these
    weights (sha256), in this precision, on every pair of each of ``sets``; None otherwise."""
    import numpy as np

    record = (evaluation[1].get("cosines") if evaluation else None) or {}
    path = evaluation[0].parent / str(record.get("file", "")) if evaluation else None
    if (
        digest is None
        or record.get("weights_sha256") != digest
        or record.get("precision") != precision
        or record.get("max_pairs") is not None
        or path is None
        or not path.is_file()
    ):
        return None
    with np.load(path) as data:
        found = {s.name: data[s.name] for s in sets if s.name in data.files and len(data[s.name]) == len(s)}
    if len(found) != len(sets):
        return None
    return {**found, "_file": record["file"]}


def find_eval(run_dir: Path, checkpoint_dir: Path | None) -> tuple[Path, dict[str, Any]] | None:
    candidates = [run_dir / "eval" / "eval.json", run_dir / "eval.json"]
    if checkpoint_dir is not None:
        candidates = [checkpoint_dir / "eval" / "eval.json", checkpoint_dir / "eval.json"] + candidates
    for path in candidates:
        if path.is_file():
            try:
                return path, json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                log.warning("ignoring %s: not valid JSON (%s)", path, exc.msg)
    return None


def run(cfg: Config) -> int:
    from pipeline.evaluate import plots, resolve
    from pipeline.evaluate.tables import result_markdown

    run_dir = Path(cfg.run_dir)
    if not run_dir.is_dir():
        raise InputError(f"run directory {run_dir} does not exist")
    out = cfg.out or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"# Run report: `{run_dir}`\n"]
    images: list[tuple[str, Path]] = []

    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        records, bad = plots.read_metrics(metrics)
        train, evals = plots.metric_series(records)
        note = f" ({bad} malformed line(s) skipped)" if bad else ""
        sections.append(f"`metrics.jsonl`: {len(records)} records{note}.\n")
        for title, png in (
            ("Training curves", plots.plot_training(train, out / "training.png")),
            ("Evaluation during training", plots.plot_eval(evals, out / "eval_curves.png")),
        ):
            if png is not None:
                images.append((title, png))
    else:
        sections.append(f"No `metrics.jsonl` in {run_dir}: no training curves.\n")

    checkpoint_dir = None
    if cfg.similarity:
        try:
            resolved = resolve.resolve(run_dir, cfg.select)
        except InputError as exc:
            sections.append(f"No similarity plot: {exc}\n")
        else:
            checkpoint_dir = resolved.checkpoint_dir
            title = f"cosine similarity per gold label: {Path(resolved.name).parent.name or resolved.name}"
            cosines = similarity_by_set(resolved, cfg, find_eval(run_dir, checkpoint_dir))
            png = plots.plot_similarity(cosines, out / "similarity.png", title)
            if png is not None:
                images.append(("Cosine similarity per gold label", png))
    for title, png in images:
        sections.append(f"## {title}\n\n![{title}]({png.name})\n")

    found = find_eval(run_dir, checkpoint_dir)
    if found:
        path, result = found
        sections.append(f"## Evaluation (`{path}`)\n\n{result_markdown(result, heading_level=3)}")
    else:
        sections.append("## Evaluation\n\nNo eval.json yet: run `python -m pipeline eval RUN_DIR`.\n")
    config = run_dir / "config.yaml"
    if config.is_file():
        sections.append(f"## Config\n\n```yaml\n{config.read_text(encoding='utf-8').rstrip()}\n```\n")
    (out / "report.md").write_text("\n".join(sections), encoding="utf-8")
    print(f"wrote {out / 'report.md'} with {len(images)} plot(s)")
    return 0
