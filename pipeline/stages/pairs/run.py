"""``python -m pipeline pairs RAW_FILES... --out shards/pairs``: the pairs the corpus's records give; with
``--format flag|columns``, the pairs of a user's own files (``user.py``, docs/pairs.md "Your own pairs").

preprocess's sibling (docs/pairs.md): a corpus stage (``pipeline/stages/corpus``: the same inputs,
readers, work units, phases, restart rules and SLURM arrays as preprocess) and preprocess's cleaning
and audit, but each record becomes the (anchor, positive) pairs its structure gives (``extract.py``)
instead of loose sentences. Memory per piece is one unit's buffer, one partition or one shard, flat in
the corpus size.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pipeline.config import option
from pipeline.data.eval_overlap import eval_files
from pipeline.errors import ConfigError
from pipeline.resources import EVAL_DIR
from pipeline.shards import new_manifest
from pipeline.stages.corpus import template
from pipeline.stages.corpus.template import CorpusConfig, CorpusStage, Finished, Plan
from pipeline.stages.pairs import passes
from pipeline.stages.pairs.extract import PairRules
from pipeline.stages.preprocess.text import merged_audit

log = logging.getLogger(__name__)


@dataclass
class Config(CorpusConfig):
    example = "pairs data/*.json.gz --out shards/pairs"

    inputs: list[Path] = option(
        factory=list,
        help="Input files, directories or globs (JSON lines of the five collections; .gz/.bz2/.zip).",
    )
    format: Literal["corpus", "flag", "columns"] = option(
        "corpus",
        "corpus: the raw collections' records; flag: FlagEmbedding JSON lines {query, pos, neg, prompt}; "
        "columns: sentence-transformers columns (anchor/positive[/negative...], query/answer, "
        "sentence1/sentence2[/label]) in .jsonl, .csv, .tsv or .parquet, gzip or not.",
    )
    min_label: float | None = option(
        None, "--format columns with a label (or score) column: keep the rows labelled >= this as pairs."
    )
    out: Path = option(Path("data/pairs"), "Output directory for shard-*.tar and manifest.json.")
    min_anchor_chars: int = option(2, "Drop pairs whose anchor (title, question) is shorter (characters).")
    max_anchor_chars: int = option(128, "Drop pairs whose anchor is longer.")
    min_positive_chars: int = option(5, "Drop pairs whose positive is shorter.")
    max_positive_chars: int = option(
        384, "Answers and descriptions are cut to whole leading sentences within this many characters."
    )
    lead_chars: int = option(
        256, "News leads and wiki first paragraphs: whole leading sentences within this."
    )
    min_cjk_ratio: float = option(
        0.5,
        "Drop a pair when a side has a smaller CJK share of its units (translation's English side exempt).",
    )
    easy_prefix_ratio: float = option(
        0.5, "Too easy: the shorter side is a prefix of the longer and at least this share of its length."
    )
    easy_jaccard: float = option(0.6, "Too easy: character-3-gram Jaccard of the two sides at least this.")
    plain_neighbours: bool = option(False, "Plain-text inputs give neighbouring-sentence pairs (else none).")
    exclude_eval: bool = option(
        True,
        "Drop every pair one of whose sides has its normalize_text key in a split of the five scored "
        "sets in --eval_dir (eval_overlap).",
    )
    eval_dir: Path = option(
        EVAL_DIR, "Evaluation folder --exclude_eval reads: every NAME.SPLIT.tsv of the five scored sets."
    )
    pairs_per_shard: int = option(4000, "Pairs per output shard (the last one may hold fewer).")

    def __post_init__(self) -> None:
        super().__post_init__()
        template.at_least_one(self, "pairs_per_shard", "min_anchor_chars", "min_positive_chars", "lead_chars")
        if self.exclude_eval:
            eval_files(self.eval_dir)  # a folder missing a scored set fails here, naming it
        for low, high in (
            ("min_anchor_chars", "max_anchor_chars"),
            ("min_positive_chars", "max_positive_chars"),
        ):
            if getattr(self, high) < getattr(self, low):
                raise ConfigError(f"{high} ({getattr(self, high)}) must be >= {low} ({getattr(self, low)})")
        for name in ("min_cjk_ratio", "easy_prefix_ratio", "easy_jaccard"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def side_inputs(self) -> list[Path]:
        return eval_files(self.eval_dir) if self.exclude_eval else []

    @property
    def rows_per_shard(self) -> int:
        return self.pairs_per_shard

    def rules(self) -> PairRules:
        """The per-pair limits and rules: the config's fields of the same names."""
        return PairRules(**{f.name: getattr(self, f.name) for f in fields(PairRules)})


def run(cfg: Config) -> int:
    if cfg.format != "corpus":  # a user's own pair files
        from pipeline.stages.pairs import user

        return user.run(cfg)
    if cfg.min_label is not None:
        raise ConfigError("--min_label reads a label column of --format columns; the corpus has none")
    return template.run(cfg, STAGE)


def _params(cfg: Config, num_partitions: int) -> passes.PairParams:
    return passes.PairParams(
        rules=cfg.rules(),
        max_record_bytes=cfg.max_record_bytes,
        num_partitions=num_partitions,
        seed=cfg.seed,
        strict=cfg.strict,
        neardup=cfg.neardup,
        eval_dir=str(cfg.eval_dir) if cfg.exclude_eval else None,
    )


def _finalize(cfg: Config, plan: Plan, done: Finished, elapsed: float) -> None:
    counts = summed_counts(done.units, done.parts, done.shards, done.near_duplicate)
    entries = [{k: v for k, v in m.items() if k not in ("by_source", "by_kind")} for m in done.shards]
    audit = merged_audit(done.units, done.parts)
    manifest = new_manifest("pairs", template.output_config(cfg), entries, counts=counts, audit=audit)
    template.write_and_clean(cfg, manifest)
    dropped = ", ".join(f"{k} {v:,}" for k, v in counts["dropped"].items() if v) or "none"
    if counts["kept"] == 0:
        log.warning("no pair was kept: check the inputs' formats and the limits against the dropped counts")
    log.info(
        "pairs done: kept %s of %s pairs from %s records; dropped: %s; %d shards; %.1fs -> %s",
        f"{counts['kept']:,}",
        f"{counts['pairs_extracted']:,}",
        f"{counts['records']:,}",
        dropped,
        len(entries),
        elapsed,
        cfg.out,
    )


STAGE = CorpusStage("pairs", unit="pair", passes=passes, split_params=_params, finalize=_finalize)


def summed_counts(
    units: list[dict[str, Any]],
    parts: list[dict[str, Any]],
    shards: list[dict[str, Any]],
    near_duplicate: int,
) -> dict[str, Any]:
    """The manifest's counts (shards/README.md): totals, dropped by reason, and the same per source."""
    by_source: dict[str, Counter] = {}
    for unit in units:
        by_source.setdefault(unit["source"], Counter()).update(unit["counts"])
    for part in parts:
        for source, n in part["duplicate_by_source"].items():
            by_source.setdefault(source, Counter())["duplicate"] += n
    kept: Counter = Counter()
    kinds: Counter = Counter()
    for shard in shards:
        kept.update(shard["by_source"])
        kinds.update(shard["by_kind"])
    reasons = (*passes.RECORD_REASONS, *passes.PAIR_REASONS)
    per_source = {}
    total: Counter = Counter()
    for source, c in sorted(by_source.items()):
        c["near_duplicate"] = c["kept_pass1"] - c["duplicate"] - kept[source]
        c["kept"] = kept[source]
        total.update(c)
        per_source[source] = {
            "records": c["records"],
            "pairs_extracted": c["pairs_extracted"],
            "kept": c["kept"],
            "dropped": {r: c[r] for r in reasons if c[r]},
        }
    assert total["near_duplicate"] == near_duplicate, (total["near_duplicate"], near_duplicate)
    return {
        "records": total["records"],
        "records_with_pairs": total["records_with_pairs"],
        "pairs_extracted": total["pairs_extracted"],
        "kept": sum(kept.values()),
        "dropped": {r: total[r] for r in reasons},
        "by_source": per_source,
        "kept_by_kind": dict(sorted(kinds.items())),
    }
