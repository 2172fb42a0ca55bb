"""``python -m pipeline preprocess``: raw corpus files -> deduplicated, globally shuffled shards.

A corpus stage (``pipeline/stages/corpus``: the phases, resume and SLURM arrays are the template's;
docs/preprocess.md): each record's text fields are cleaned and split into sentences (``passes.py``,
``text.py``), and the sentences deduplicated, shuffled and cut into shards.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import option
from pipeline.data.eval_overlap import eval_files
from pipeline.errors import ConfigError
from pipeline.resources import EVAL_DIR, SAMPLE_CORPUS
from pipeline.shards import new_manifest
from pipeline.stages.corpus import template
from pipeline.stages.corpus.passes import (
    RECORD_REASONS,
    SAMPLES_PER_RULE,
    bucket_paths,
    dedup_paths,
    partition_of,
    read_json,
    read_partition,
    shuffle_keys,
)
from pipeline.stages.corpus.readers import COLLECTIONS
from pipeline.stages.corpus.template import CorpusConfig, CorpusStage, Finished, Plan
from pipeline.stages.preprocess import passes
from pipeline.stages.preprocess.text import merged_audit

log = logging.getLogger(__name__)


@dataclass
class TextFields:
    """Which fields of each nlp_chinese_corpus collection become text (each field split on its own)."""

    wiki_zh: list[str] = option(["text"], "wiki_zh fields ({id,url,title,text}); text starts with the title")
    news2016zh: list[str] = option(
        ["title", "content"], "news2016zh fields ({news_id,keywords,desc,title,...})"
    )
    baike2018qa: list[str] = option(["title", "desc", "answer"], "baike2018qa fields ({qid,category,...})")
    webtext2019zh: list[str] = option(["title", "desc", "content"], "webtext2019zh fields ({qid,title,...})")
    translation2019zh: list[str] = option(["chinese"], "translation2019zh fields ({english,chinese})")

    def __post_init__(self) -> None:
        for name in COLLECTIONS:
            if not getattr(self, name):
                raise ConfigError(f"text_fields.{name} is empty: list at least one field, e.g. [text]")


@dataclass
class Config(CorpusConfig):
    example = "preprocess data/*.json.gz"

    inputs: list[Path] = option(
        factory=lambda: [SAMPLE_CORPUS],
        help="Input files, directories or globs (plain text or JSON lines; .gz/.bz2/.zip read as is).",
    )
    out: Path = option(Path("data/preprocessed"), "Output directory for shard-*.tar and manifest.json.")
    text_fields: TextFields = option(factory=TextFields, help="Fields that become text, per collection.")
    min_chars: int = option(5, "Drop sentences shorter than this many characters.")
    max_chars: int = option(256, "Drop sentences longer than this many characters.")
    min_cjk_ratio: float = option(
        0.5,
        "Drop sentences in which CJK ideographs make a smaller share of the units (0-1); a unit is an "
        "ideograph, a Latin word, a number or another script's letter (punctuation counts for nothing).",
    )
    truncated_fields: list[str] = option(
        ["webtext2019zh.content"],
        "collection.field values cut at a fixed length: their unterminated last sentence is dropped "
        "(truncated); [] keeps every tail.",
    )
    exclude_eval: bool = option(
        True,
        "Drop every sentence whose normalize_text key occurs in a split of the five scored sets in "
        "--eval_dir (eval_overlap): the distillation set stays zero-shot for evaluation.",
    )
    eval_dir: Path = option(
        EVAL_DIR, "Evaluation folder --exclude_eval reads: every NAME.SPLIT.tsv of the five scored sets."
    )
    sentences_per_shard: int = option(4000, "Sentences per output shard (the last one may hold fewer).")

    def __post_init__(self) -> None:
        super().__post_init__()
        template.at_least_one(self, "sentences_per_shard", "min_chars")
        if self.exclude_eval:
            eval_files(self.eval_dir)  # a folder missing a scored set fails here, naming it
        if self.max_chars < self.min_chars:
            raise ConfigError(f"max_chars ({self.max_chars}) must be >= min_chars ({self.min_chars})")
        if not 0.0 <= self.min_cjk_ratio <= 1.0:
            raise ConfigError(f"min_cjk_ratio must be in [0, 1], got {self.min_cjk_ratio}")
        for name in self.truncated_fields:
            collection, _, field = name.partition(".")
            if collection not in COLLECTIONS or not field:
                raise ConfigError(
                    f"truncated_fields: {name!r} is not collection.field with a collection of "
                    f"{', '.join(COLLECTIONS)} (e.g. webtext2019zh.content)"
                )

    def side_inputs(self) -> list[Path]:
        return eval_files(self.eval_dir) if self.exclude_eval else []

    @property
    def rows_per_shard(self) -> int:
        return self.sentences_per_shard


def run(cfg: Config) -> int:
    return template.run(cfg, STAGE)


def _filters(cfg: Config, num_partitions: int) -> passes.Filters:
    return passes.Filters(
        fields=asdict(cfg.text_fields),
        min_chars=cfg.min_chars,
        max_chars=cfg.max_chars,
        min_cjk_ratio=cfg.min_cjk_ratio,
        max_record_bytes=cfg.max_record_bytes,
        num_partitions=num_partitions,
        seed=cfg.seed,
        strict=cfg.strict,
        to_simplified=cfg.to_simplified,
        truncated_fields=tuple(cfg.truncated_fields),
        neardup=cfg.neardup,
        eval_dir=str(cfg.eval_dir) if cfg.exclude_eval else None,
    )


def _finalize(cfg: Config, plan: Plan, done: Finished, elapsed: float) -> None:
    counts = summed_counts([u["counts"] for u in done.units], done.parts, done.near_duplicate)
    audit = merged_audit(done.units, done.parts)
    if done.drops is not None:
        audit["samples"]["near_duplicate"] = _near_dup_examples(cfg, plan)
    config = template.output_config(cfg)
    manifest = new_manifest("preprocess", config, done.shards, counts=counts, audit=audit)
    template.write_and_clean(cfg, manifest)
    dropped = ", ".join(f"{k} {v:,}" for k, v in counts["dropped"].items() if v) or "none"
    if counts["kept"] == 0:
        log.warning(
            "no sentence was kept: check --input_format/--text_fields and the filters (min_chars, "
            "max_chars, min_cjk_ratio) against the dropped counts below"
        )
    log.info(
        "preprocess done: kept %s of %s sentences from %s records; dropped: %s; %d shards, %.1f MB; "
        "%.1fs -> %s",
        f"{counts['kept']:,}",
        f"{counts['sentences_split']:,}",
        f"{counts['records']:,}",
        dropped,
        len(done.shards),
        manifest["totals"]["bytes"] / 1e6,
        elapsed,
        cfg.out,
    )
    rules = ", ".join(f"{k} {v:,}" for k, v in audit["rules"].items() if v) or "none"
    log.info("cleaning rules applied (fields changed): %s; examples in manifest.json audit.samples", rules)


STAGE = CorpusStage("preprocess", unit="sent", passes=passes, split_params=_filters, finalize=_finalize)


def _near_dup_examples(cfg: Config, plan: Plan) -> list[dict[str, str]]:
    """The first few near duplicates with the sentence each duplicates (buckets in order)."""
    pairs: list[tuple[int, int]] = []
    for q in range(plan.num_partitions):
        meta = read_json(bucket_paths(cfg.work, q)[1])
        pairs += [(d, m) for d, m in meta["examples"]][: SAMPLES_PER_RULE - len(pairs)]
        if len(pairs) >= SAMPLES_PER_RULE:
            break
    texts: dict[int, str] = {}
    for key in sorted({k for pair in pairs for k in pair}):
        part = int(partition_of(np.array([key], np.uint64), plan.num_partitions)[0])
        table = read_partition(str(dedup_paths(cfg.work, part)[0]), None, cfg.seed)
        keys = shuffle_keys(table["id"].to_numpy(), cfg.seed)
        texts[key] = table["text"][int(np.flatnonzero(keys == np.uint64(key))[0])].as_py()
    return [{"dropped": texts[d], "duplicates": texts[m]} for d, m in pairs]


def summed_counts(
    unit_counts: list[dict[str, int]], parts: list[dict[str, Any]], near_duplicate: int = 0
) -> dict[str, Any]:
    """Manifest counts: records, sentences_split, kept, dropped by reason (see shards/README.md)."""
    total: Counter = Counter()
    for counts in unit_counts:
        total.update(counts)
    rows_in = sum(p["rows_in"] for p in parts)
    kept = sum(p["unique"] for p in parts)
    total["duplicate"] = rows_in - kept
    total["near_duplicate"] = near_duplicate
    kept -= near_duplicate
    dropped = {r: total[r] for r in (*RECORD_REASONS, *passes.SENTENCE_REASONS)}
    return {
        "records": total["records"],
        "records_with_text": total["records_with_text"],
        "control_chars": total["control_chars"],
        "sentences_split": total["sentences_split"],
        "kept": kept,
        "dropped": dropped,
    }
