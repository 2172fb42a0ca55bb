"""``python -m pipeline augment --shards IN --out OUT``: cache EDA variants beside every sentence.

Reads the shards of ``preprocess`` and writes shards of the same names, rows and blocks with two more
columns, ``variants`` and ``variant_ops`` (``shards/README.md``). Units of work are shards: local
worker processes (``--workers``) and SLURM array tasks (``--task-index/--num-tasks``: task t takes the
shards i with ``i % num_tasks == t``) split them, and a finished shard is skipped on a rerun.
A shard's variants are a pure function of (seed, sentence id, config), so the output does not depend
on the number of workers or tasks, nor on restarts. ``manifest.json`` is written once every shard
exists, by whichever task finishes last (or by ``--finalize-only``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from pipeline.config import option
from pipeline.errors import ConfigError, InputError
from pipeline.io import sha256_file
from pipeline.resources import CILIN
from pipeline.shards import read_shard, write_shard
from pipeline.stages.augment.eda import OPS, Augmenter, EdaParams, parse_op
from pipeline.stages.augment.synonyms import load_cilin, load_stopwords, load_vector_cache
from pipeline.stages.runner import Execution, ShardJob, ShardStage, ShardWork, read_input

log = logging.getLogger(__name__)

STOPWORDS = Path(__file__).resolve().parent / "stopwords_zh.txt"
WORK_DIR = ".augment-work"  # per-shard completion records of an unfinished run (not part of the output)
VARIANT_FIELDS = [
    pa.field("variants", pa.list_(pa.string()), nullable=False),
    pa.field("variant_ops", pa.list_(pa.string()), nullable=False),
]


@dataclass
class Config(Execution):
    shards: Path = option(help="Input directory written by `preprocess` (manifest.json + shards).")
    out: Path = option(help="Output directory for the augmented shards and their manifest.")
    num_variants: int = option(4, "Variants per sentence (LUSE uses 4). Short sentences may get fewer.")
    alpha_sr: float = option(0.1, "Synonym replacement: share of words replaced (at least one).")
    alpha_ri: float = option(0.1, "Random insertion: synonyms inserted per word (at least one).")
    alpha_rs: float = option(0.1, "Random swap: swaps per word (at least one).")
    alpha_rd: float = option(0.1, "Random deletion: probability of deleting each word (at least one).")
    ops: list[str] = option(
        list(OPS), "Operation specs to mix: sr, ri, rs, rd, or a sequence such as 'sr+rd' applied in order."
    )
    mix: Literal["cycle", "sample"] = option(
        "cycle",
        "cycle: variant i uses the i-th spec of `ops` that applies to the sentence (4 variants = one of "
        "each op); sample: every variant draws a spec with `op_weights`.",
    )
    op_weights: list[float] = option([], "Weights of `ops` for mix=sample (empty: equal weights).")
    max_attempts: int = option(10, "Candidates tried per variant before the sentence gets fewer variants.")
    min_words: int = option(2, "Sentences with fewer jieba words are not augmented (recorded as short).")
    seed: int = option(0, "Seed; variants are a pure function of (seed, sentence id, config).")
    synonyms: Literal["cilin", "vectors"] = option(
        "cilin", "Synonym source: the Cilin dictionary or a word-vector cache built by `synonyms`."
    )
    synonyms_path: Path | None = option(
        None, "Cilin file (default: the bundled one) or the Parquet cache (required for vectors)."
    )
    stopwords: Path | None = option(None, "Stopword file, one word per line (default: the bundled list).")
    hmm: bool = option(False, "Let jieba guess unknown words with its HMM (slower, rarely matters for EDA).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_variants < 1:
            raise ConfigError("num_variants must be >= 1; set --num-variants to a positive number")
        for op in OPS:
            alpha = getattr(self, f"alpha_{op}")
            if not 0.0 < alpha <= 1.0:
                raise ConfigError(f"alpha_{op} must be in (0, 1], got {alpha}; set --alpha-{op}")
        if not self.ops:
            raise ConfigError(f"ops is empty; list at least one of {', '.join(OPS)}")
        for spec in self.ops:
            try:
                parse_op(spec)
            except ValueError as exc:
                raise ConfigError(f"ops: {exc}") from None
        if self.op_weights:
            if len(self.op_weights) != len(self.ops):
                raise ConfigError(
                    f"op_weights has {len(self.op_weights)} entries for {len(self.ops)} ops; "
                    "give one weight per op or none"
                )
            if any(w < 0 for w in self.op_weights) or sum(self.op_weights) <= 0:
                raise ConfigError("op_weights must be >= 0 with a positive sum")
            if self.mix != "sample":
                raise ConfigError("op_weights only apply to --mix sample; drop them or set --mix sample")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be >= 1")
        if self.min_words < 1:
            raise ConfigError("min_words must be >= 1")
        if self.synonyms == "vectors" and self.synonyms_path is None:
            raise ConfigError(
                "synonyms=vectors needs --synonyms-path CACHE.parquet (build it with `python -m pipeline "
                "synonyms`)"
            )

    def eda_params(self) -> EdaParams:
        return EdaParams(
            num_variants=self.num_variants,
            alpha={op: getattr(self, f"alpha_{op}") for op in OPS},
            ops=tuple(self.ops),
            weights=tuple(self.op_weights) or None,
            mix=self.mix,
            max_attempts=self.max_attempts,
            min_words=self.min_words,
            seed=self.seed,
        )

    def resolved_synonyms_path(self) -> Path:
        return self.synonyms_path if self.synonyms_path is not None else CILIN

    def resolved_stopwords(self) -> Path:
        return self.stopwords if self.stopwords is not None else STOPWORDS


# --------------------------------------------------------------------------------------------- workers
def build_augmenter(cfg: Config) -> Augmenter:
    """Load jieba, synonyms and stopwords: once per worker process (each takes ~1 s)."""
    import jieba

    jieba.setLogLevel(logging.WARNING)  # it logs the dictionary load at INFO/DEBUG on every process
    jieba.initialize()
    path = cfg.resolved_synonyms_path()
    synonyms = load_cilin(path) if cfg.synonyms == "cilin" else load_vector_cache(path)
    stopwords = load_stopwords(cfg.resolved_stopwords())
    hmm = cfg.hmm

    def segment(text: str) -> list[str]:
        return jieba.lcut(text, HMM=hmm)

    return Augmenter(cfg.eda_params(), synonyms, stopwords, segment)


@dataclass
class AugmentWork(ShardWork):
    cfg: Config

    def load(self, processes: int) -> Augmenter:
        return build_augmenter(self.cfg)

    def shard(self, job: ShardJob, augmenter: Augmenter, report: Any) -> dict[str, Any]:
        return augment_shard(job, augmenter, report)


def empty_counts() -> dict[str, Any]:
    return {
        "sentences": 0,
        "variants": 0,
        "short": 0,
        "no_variants": 0,
        "by_op": {op: 0 for op in OPS},
        "rejected": 0,
        "duplicates": 0,
    }


def add_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, dict):
            add_counts(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value


def augment_block(block: pa.Table, augmenter: Augmenter, counts: dict[str, Any]) -> pa.Table:
    all_variants, all_ops = [], []
    num_variants = augmenter.params.num_variants
    for sentence_id, text in zip(block.column("id").to_pylist(), block.column("text").to_pylist()):
        variants, ops = augmenter.augment(sentence_id, text, counts)
        all_variants.append(variants)
        all_ops.append(ops)
        counts["variants"] += len(variants)
        counts["short"] += len(variants) < num_variants
        counts["no_variants"] += not variants
        for spec in ops:
            for op in spec.split("+"):
                counts["by_op"][op] += 1
    counts["sentences"] += block.num_rows
    columns = [pa.array(all_variants, pa.list_(pa.string())), pa.array(all_ops, pa.list_(pa.string()))]
    for field, column in zip(VARIANT_FIELDS, columns):
        block = block.append_column(field, column)
    return block


def augment_shard(job: ShardJob, augmenter: Augmenter, report: Any = None) -> dict[str, Any]:
    """Verify one input shard, write its augmented copy, then its completion record; return the record."""
    in_path = job.open()
    counts = empty_counts()

    def blocks():
        for block in read_shard(in_path):
            missing = {"id", "text"} - set(block.column_names)
            if missing:
                raise InputError(
                    f"shard {in_path} has no column(s) {sorted(missing)}; is it a preprocess shard?"
                )
            if "variants" in block.column_names:
                raise InputError(
                    f"shard {in_path} already has variants; augment the preprocess output instead"
                )
            yield augment_block(block, augmenter, counts)
            if report is not None:
                report(block.num_rows)

    entry = write_shard(job.out_dir / job.name, blocks(), job.shard_index)
    return job.write_record(entry, counts)


# --------------------------------------------------------------------------------------------- driver
def _check_paths(cfg: Config) -> None:
    for path, what in (
        (cfg.resolved_synonyms_path(), "synonyms_path"),
        (cfg.resolved_stopwords(), "stopwords"),
    ):
        if not path.is_file():
            raise InputError(f"{what} {path} not found; pass an existing file")


def finish(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The manifest's shards and counts (summed over the shards)."""
    counts = empty_counts()
    for record in records:
        add_counts(counts, record["counts"])
    return [r["entry"] for r in records], {"counts": counts}


def run(cfg: Config) -> int:
    reads = "augment reads the output of `python -m pipeline preprocess`"
    in_manifest = read_input(cfg, "augment", ("preprocess",), reads)
    _check_paths(cfg)
    depends_on = {  # besides the config and the input manifest
        "synonyms_sha256": sha256_file(cfg.resolved_synonyms_path()),
        "stopwords_sha256": sha256_file(cfg.resolved_stopwords()),
    }
    stage = ShardStage("augment", cfg, in_manifest, WORK_DIR, depends_on)
    return stage.run(AugmentWork(cfg), finish)
