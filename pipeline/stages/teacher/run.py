"""``python -m pipeline teacher --shards IN --out OUT --model TEACHER``: cache teacher embeddings.

Reads augmented shards and writes shards of the same names, rows and blocks with a ``teacher`` column
(``fixed_size_list<float16, D>``, L2-normalised, or with ``--dtype int8`` int8 codes and a per-row
``teacher_scale``: :mod:`pipeline.vectors`, ``shards/README.md``), optionally ``teacher_variants``
(``--variants``) and ``hard_negatives``/``hard_negative_ids`` (``--hard_negatives K``, mined over the
whole shard set: :mod:`pipeline.stages.teacher.negatives`). Work is split like ``augment``: units are shards,
local workers (``--workers``) and SLURM array tasks (``--task-index/--num-tasks``: task t takes the
shards i with ``i % num_tasks == t``), a finished shard is skipped on a rerun. A shard's embeddings are
a function of its own rows (sorted by token count within the shard, batched), so the output does not depend
on the number of workers, tasks or restarts. With hard negatives the encoded shards wait in the work
directory; whichever task finishes encoding last mines the negatives and writes the final shards,
then ``manifest.json`` (or ``--finalize-only`` does).

Refreshing the negatives during a long run: rerun this stage on the same input with ``--model`` set to
the latest checkpoint's ``model/`` folder (any checkpoint or run directory also resolves) and a new
``--out``; point ``data.shards`` and ``data.teacher`` of the next epoch's run at it (docs/teacher.md).

Given pair shards (`pipeline pairs`), the stage embeds both sides (`teacher`, `teacher_positive`) and
scores each pair against a pool of other positives (:mod:`pipeline.stages.teacher.consistency`:
`pair_rank`, `pair_cosine`, `pair_pool`), keeping those in the top `--pair-top-k` (0 keeps all).

Given a float16 teacher shard set as ``--shards`` with ``--dtype int8``, the stage converts it instead:
the same shards with int8 vectors, every other column as it was, no model loaded (:func:`convert_shard`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from pipeline.config import option
from pipeline.errors import ConfigError, InputError
from pipeline.precision import resolve_cpu_precision
from pipeline.shards import MANIFEST, holds_pairs, read_shard, write_shard
from pipeline.stages.runner import Execution, Report, ShardJob, ShardStage, ShardWork, read_input
from pipeline.stages.teacher.consistency import pair_scores
from pipeline.stages.teacher.identity import matches, model_hash, stored_dtype
from pipeline.vectors import DTYPES, block_teacher, encode_vectors, teacher_matrix, variant_columns

log = logging.getLogger(__name__)

WORK_DIR = ".teacher-work"  # completion records (and, with hard negatives, the encoded shards)
ENCODED = "encoded"  # WORK_DIR/encoded/: shards with the teacher column, before mining
# Left out of the manifest's config: ``device`` says how to run, not what to compute (so outputs compare
# equal); ``dtype`` is recorded as the manifest's ``teacher.dtype`` (so a float16 manifest is what it
# always was).
LEFT_OUT = ("device", "dtype")
Precision = Literal["fp32", "fp16", "bf16", "int8"]
TeacherPrecision = Literal["auto", "fp32", "bf16", "int8"]


@dataclass
class Config(Execution):
    shards: Path | None = option(
        None,
        "Input directory written by `augment` (or `preprocess`), or a float16 teacher output to convert.",
    )
    out: Path | None = option(None, "Output directory for the shards with teacher embeddings.")
    model: str | None = option(
        None,
        "Teacher: a model folder (models/e5-small), checkpoint, run directory or Hub id (empty when "
        "--shards is a teacher output to convert to --dtype int8).",
    )
    dtype: Literal["float16", "int8"] = option(
        "float16",
        "Stored vectors: float16 (2 bytes a value), or int8 codes with a float32 scale per row (1 byte a "
        "value + 4 a row; read back re-normalised). With teacher shards as --shards: convert them to int8.",
    )
    batch_size: int = option(128, "Sentences per forward pass (sorted by token count within a shard).")
    max_length: int | None = option(None, "Token limit per sentence (empty = the model's encoder.json).")
    device: str = option("auto", "Torch device: auto (cuda if available), cpu, cuda, cuda:1, ...")
    precision: TeacherPrecision = option(
        "auto",
        "CPU compute precision: auto (bf16 autocast on a CPU with native bf16, AMX-BF16 or AVX512-BF16; fp32 "
        "elsewhere, where bf16 is emulated and several times slower), fp32, bf16, or int8 (dynamic int8 "
        "linear layers but the feed-forward outputs: pipeline/model/int8.py). A GPU always runs fp16 "
        "weights. The manifest records what ran (teacher.compute_precision).",
    )
    variants: bool = option(False, "Also encode every cached variant (a teacher_variants column).")
    hard_negatives: int = option(
        0, "K: mine K hard negatives per sentence among the teacher's neighbours over all shards (0 = off)."
    )
    hn_depth: int = option(64, "Neighbours searched per sentence; negatives are the first K that pass.")
    hn_max_similarity: float = option(
        0.9, "Skip neighbours with teacher cosine above this (near-duplicates, likely positives)."
    )
    hn_min_similarity: float = option(-1.0, "Skip neighbours with teacher cosine below this (-1 = no floor).")
    hn_index: Literal["flat", "ivf", "hnsw"] = option(
        "flat", "faiss index over the teacher vectors: flat (exact), ivf or hnsw (large corpora)."
    )
    pair_top_k: int = option(
        0,
        "Pair shards (`pipeline pairs`): keep a pair when its partner ranks in the teacher's top k of its "
        "pool (e5/nomic keep 2); 0 keeps every pair and only stores the scores (consistency.py).",
    )
    pair_pool: int = option(
        64, "Pair shards: candidates per pool (the partner + other positives of its source in the shard)."
    )
    pairs_file: Path | None = option(
        None,
        "Instead of --shards: a labelled pair (or, with --triples, triple) file; writes --out as its first "
        "two texts' vectors for data.supervised_teacher (pipeline/data/labelled.py).",
    )
    triples: bool = option(False, "--pairs_file holds triples: the anchor and the positive are encoded.")
    max_sentences: int = option(
        0,
        "Encode only the input's first shards, in manifest order, that hold at least this many sentences "
        "(0 = every shard); the output lists those. Preprocess spreads sentences over its shards by hash, "
        "so the first shards are a uniform sample: what a run that reads fewer sentences than the corpus "
        "holds needs (launch/run_sample.sh: its 600 steps of 64).",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_sentences < 0:
            raise ConfigError("--max-sentences must be >= 0 (0 encodes every shard)")
        if self.max_sentences and self.pairs_file is not None:
            raise ConfigError("--max-sentences selects shards; --pairs_file encodes its whole file")
        if (self.shards is None) == (self.pairs_file is None) or self.out is None:
            raise ConfigError(
                "usage: python -m pipeline teacher --shards IN --out OUT --model TEACHER (or --pairs_file "
                "FILE instead of --shards)"
            )
        if self.pairs_file is not None and (self.dtype != "float16" or self.variants or self.hard_negatives):
            raise ConfigError("--pairs_file stores float16 vectors of two texts a record; drop --dtype, "
                              "--variants and --hard-negatives")  # fmt: skip
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.batch_size < 1:
            raise ConfigError("--batch-size must be >= 1")
        if self.max_length is not None and self.max_length < 4:
            raise ConfigError("--max-length must be >= 4 tokens (or empty for the model's)")
        if self.hard_negatives < 0:
            raise ConfigError("--hard-negatives must be >= 0 (0 = no mining)")
        if self.hard_negatives and self.hn_depth <= self.hard_negatives:
            raise ConfigError(
                f"--hn-depth ({self.hn_depth}) must exceed --hard-negatives ({self.hard_negatives}): the "
                "sentence itself and filtered neighbours take places; try 4x K or more"
            )
        if self.pair_top_k < 0 or self.pair_pool < 2:
            raise ConfigError(
                f"--pair-top-k must be >= 0 (0 = keep all) and --pair-pool >= 2, got {self.pair_top_k} "
                f"and {self.pair_pool}"
            )
        if self.pair_top_k >= self.pair_pool:
            raise ConfigError(
                f"--pair-top-k ({self.pair_top_k}) must be below --pair-pool ({self.pair_pool}): every "
                "pair would pass"
            )
        if not -1.0 <= self.hn_min_similarity < self.hn_max_similarity <= 1.0:
            raise ConfigError(
                "need -1 <= --hn-min-similarity < --hn-max-similarity <= 1 (cosines), got "
                f"{self.hn_min_similarity} and {self.hn_max_similarity}"
            )


# --------------------------------------------------------------------------------------------- teacher
def resolve_device(device: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def teacher_precision(device: str, setting: str) -> tuple[Precision, str]:
    """``(precision, why)``: fp16 weights on a GPU; int8 (a CPU option); on the CPU otherwise fp32, or fp32
    weights under bf16 autocast, as ``--precision`` resolves on this CPU (pipeline/precision.py: auto is
    bf16 only where the CPU has native bf16)."""
    if setting == "int8":
        if not device.startswith("cpu"):
            raise ConfigError(f"--precision int8 is a CPU option; on {device} the teacher runs fp16 weights")
        return "int8", "--precision=int8: dynamic int8 linear layers, fp32 elsewhere"
    if device.startswith("cuda"):
        return "fp16", "fp16 weights"
    return resolve_cpu_precision(setting, "--precision")


def precision_for(device: str, setting: str) -> Precision:
    """What :func:`teacher_precision` resolves ``setting`` to on ``device``."""
    return teacher_precision(device, setting)[0]


def load_teacher(cfg: Config, device: str) -> Any:
    from pipeline.evaluate.resolve import load_encoder, resolve

    encoder = load_encoder(resolve(cfg.model), device)
    if cfg.max_length is not None:
        encoder.max_length = cfg.max_length
    precision = precision_for(device, cfg.precision)
    if precision == "fp16":
        encoder.half()
    elif precision == "int8":
        from pipeline.model.int8 import quantize_int8

        _, count = quantize_int8(encoder.backbone)
        log.debug("teacher: %d linear layers in int8", count)
    return encoder


def teacher_record(cfg: Config, encoder: Any, precision: Precision) -> dict[str, Any]:
    """What the manifest says about the teacher (``data.teacher`` is checked against it)."""
    from pipeline.evaluate.resolve import resolve

    resolved = resolve(cfg.model)
    model_dir = resolved.skeleton_dir or resolved.model_dir
    digest, covers = model_hash(resolved.model_dir)
    return {
        "name": cfg.model,
        "path": str(Path(model_dir).resolve()) if model_dir else None,
        "kind": resolved.kind,
        "hash": digest,
        "hash_of": covers,
        "pooling": encoder.pooling,
        "prefix": encoder.prefix,
        "dim": encoder.dim,
        "max_length": encoder.max_length,
        "dtype": cfg.dtype,
        "compute_precision": precision,
    }


def encode_texts(
    encoder: Any, texts: list[str], batch_size: int, precision: Precision, report: Any = None
) -> np.ndarray:
    """(N, D) float32, L2-normalised, in input order: :meth:`SentenceEncoder.encode` (tokenised once,
    batches of texts sorted by token count), under bf16 autocast for ``precision`` bf16; fp16 weights
    (a GPU) and bf16 rows are renormalised in float32."""
    return encoder.encode(texts, batch_size=batch_size, bf16=precision == "bf16", report=report)


# --------------------------------------------------------------------------------------------- shards
def encode_shard(job: ShardJob, encoder: Any, cfg: Config, precision: Precision, report: Any = None) -> dict:
    """Verify one input shard, write its copy with the teacher column(s), then its completion record."""
    in_path = job.open()
    blocks = list(read_shard(in_path))  # whole shard: the length sort spans its blocks
    for block in blocks:
        if "text" not in block.column_names:
            raise InputError(f"shard {in_path} has no text column; is it a preprocess/augment shard?")
        if "teacher" in block.column_names:
            raise InputError(f"shard {in_path} already has a teacher column; encode the augment output")
    if cfg.variants and "variants" not in blocks[0].column_names:
        raise InputError(f"--variants: shard {in_path} has no variants column; run augment first")
    texts = [t for b in blocks for t in b.column("text").to_pylist()]
    started = time.perf_counter()
    vectors = encode_texts(encoder, texts, cfg.batch_size, precision, report)
    seconds = time.perf_counter() - started
    log.info("%s: %d sentences in %.1f s (%.1f sentences/s, %s)", job.name, len(texts), seconds,
             len(texts) / max(seconds, 1e-9), precision)  # fmt: skip
    counts = {"sentences": len(texts), "variants_encoded": 0}
    pairs = "positive" in blocks[0].column_names  # a pair shard: both sides, scores, the filter
    keep = np.ones(len(texts), dtype=bool)
    if pairs:
        positives = [t for b in blocks for t in b.column("positive").to_pylist()]
        positive_vectors = encode_texts(encoder, positives, cfg.batch_size, precision, report)
        sources = [t for b in blocks for t in b.column("source").to_pylist()]
        groups = np.concatenate([b.column("group").to_numpy() for b in blocks])
        scores = pair_scores(vectors, positive_vectors, sources, groups, cfg.pair_pool)
        keep = scores.keep(cfg.pair_top_k)
        counts.update(pair_counts(sources, keep))
    if cfg.variants:
        nested = [v for b in blocks for v in b.column("variants").to_pylist()]
        flat = [v for vs in nested for v in vs]
        variant_vectors = encode_texts(encoder, flat, cfg.batch_size, precision)
        offsets = np.concatenate([[0], np.cumsum([len(vs) for vs in nested])]).astype(np.int32)
        counts["variants_encoded"] = len(flat)

    def out_blocks():
        row = 0
        for block in blocks:
            lo, hi = row, row + block.num_rows
            row = hi
            if pairs:  # the filter's survivors, with their scores and the partner's vector
                mask = keep[lo:hi]
                if not mask.any():
                    continue
                block = block.filter(pa.array(mask))
                for name, values in (("rank", scores.rank), ("cosine", scores.cosine), ("pool", scores.pool)):
                    block = append(block, f"pair_{name}", pa.array(values[lo:hi][mask]))
                lo_vectors = vectors[lo:hi][mask]
                column, scale = encode_vectors(lo_vectors, cfg.dtype)
                block = append(block, "teacher", column)
                if scale is not None:
                    block = append(block, "teacher_scale", scale)
                column, scale = encode_vectors(positive_vectors[lo:hi][mask], cfg.dtype)
                block = append(block, "teacher_positive", column)
                if scale is not None:
                    block = append(block, "teacher_positive_scale", scale)
                yield block
                continue
            column, scale = encode_vectors(vectors[lo:hi], cfg.dtype)
            block = append(block, "teacher", column)
            if scale is not None:
                block = append(block, "teacher_scale", scale)
            if cfg.variants:
                o = offsets[lo : hi + 1]
                for name, column in variant_columns(variant_vectors[o[0] : o[-1]], o - o[0], cfg.dtype):
                    block = append(block, name, column)
            yield block

    entry = write_shard(job.out_dir / job.name, out_blocks(), job.shard_index)
    if pairs and "block_sources" in job.entry:  # the source of each block kept (pipeline/data/sources.py)
        starts = np.cumsum([0] + [b.num_rows for b in blocks])
        kept = [bool(keep[lo:hi].any()) for lo, hi in zip(starts[:-1], starts[1:])]
        entry["block_sources"] = [s for s, k in zip(job.entry["block_sources"], kept, strict=True) if k]
    return job.write_record(entry, counts)


def pair_counts(sources: list[str], keep: np.ndarray) -> dict[str, Any]:
    """A pair shard's record counts: pairs scored and dropped by the filter, in all and per source."""
    by_source: dict[str, list[int]] = {}
    for source, kept in zip(sources, keep.tolist(), strict=True):
        by_source.setdefault(source, [0, 0])[0 if kept else 1] += 1
    return {
        "positives_encoded": len(sources),
        "pairs_kept": int(keep.sum()),
        "pairs_dropped_consistency": int((~keep).sum()),
        "pairs_by_source": {
            s: {"kept": k, "dropped_consistency": d} for s, (k, d) in sorted(by_source.items())
        },
    }


def append(block: pa.Table, name: str, column: pa.Array) -> pa.Table:
    return block.append_column(pa.field(name, column.type, nullable=False), column)


def encode_pair_file(cfg: Config) -> int:
    """--pairs_file: the teacher's vectors of every record's first two texts (pipeline/data/labelled.py)."""
    from pipeline.data.labelled import write_pair_teacher
    from pipeline.data.pairs import read_records

    records = read_records(cfg.pairs_file, "triples" if cfg.triples else "pairs")
    device = resolve_device(cfg.device)
    encoder = load_teacher(cfg, device)
    precision = precision_for(device, cfg.precision)
    sides = [[r[i] for r in records] for i in range(2)]  # text 1 and text 2 of every record
    first, second = (encode_texts(encoder, texts, cfg.batch_size, precision) for texts in sides)
    write_pair_teacher(cfg.out, cfg.pairs_file, first, second, teacher_record(cfg, encoder, precision))
    log.info("teacher vectors of %d records of %s (%d dims) -> %s", len(records), cfg.pairs_file,
             first.shape[1], cfg.out)  # fmt: skip
    return 0


def convert_shard(job: ShardJob, cfg: Config, report: Report | None = None) -> dict:
    """One float16 teacher shard -> the same shard with int8 vectors and their scales; no model.

    The codes are those of the stored float16 values, so they may differ by one step from a direct
    ``--dtype int8`` encoding (cosine to the float16 vectors is what the tests bound). Every other
    column, the rows and the blocks stay as they were.
    """
    in_path = job.open()
    counts = {"sentences": 0, "variants_encoded": 0}

    def out_blocks():
        for block in read_shard(in_path):
            if "teacher" not in block.column_names or "teacher_scale" in block.column_names:
                raise InputError(f"shard {in_path} has no float16 teacher column to convert")
            names = block.column_names
            column, scale = encode_vectors(block_teacher(block), cfg.dtype)
            at = names.index("teacher")
            block = block.set_column(at, pa.field("teacher", column.type, nullable=False), column)
            block = block.add_column(at + 1, pa.field("teacher_scale", scale.type, nullable=False), scale)
            counts["sentences"] += block.num_rows
            if "teacher_variants" in names:
                nested = block.column("teacher_variants").combine_chunks()
                offsets = nested.offsets.to_numpy()
                flat = teacher_matrix(nested.flatten())  # (variants, D) float32
                (_, values), (name, scales) = variant_columns(flat, offsets - offsets[0], cfg.dtype)
                at = block.column_names.index("teacher_variants")
                block = block.set_column(
                    at, pa.field("teacher_variants", values.type, nullable=False), values
                )
                block = block.add_column(at + 1, pa.field(name, scales.type, nullable=False), scales)
                counts["variants_encoded"] += len(flat)
            if report is not None:
                report(block.num_rows)
            yield block

    entry = write_shard(job.out_dir / job.name, out_blocks(), job.shard_index)
    if "block_sources" in job.entry:  # pair shards: the same blocks, so the same source of each
        entry["block_sources"] = list(job.entry["block_sources"])
    return job.write_record(entry, counts)


# --------------------------------------------------------------------------------------------- work
@dataclass
class EncodeWork(ShardWork):
    """Encode shards with the teacher (``loaded``: the model, loaded once per process)."""

    cfg: Config
    device: str  # resolved: cpu, cuda or cuda:N
    progress_per_sentence: int = 1  # 2 for pair shards: both sides are encoded

    def load(self, processes: int) -> Any:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // processes))  # the workers share the CPUs
        # this process may use (its affinity: what SLURM's --cpus-per-task grants, not the node's cores)
        device = self.device
        if device == "cuda" and torch.cuda.device_count() > 1:  # one GPU per worker, round robin
            device = f"cuda:{(mp.current_process()._identity[0] - 1) % torch.cuda.device_count()}"
        return load_teacher(self.cfg, device)

    def shard(self, job: ShardJob, encoder: Any, report: Report) -> dict[str, Any]:
        return encode_shard(job, encoder, self.cfg, precision_for(self.device, self.cfg.precision), report)


@dataclass
class ConvertWork(ShardWork):
    """Convert float16 teacher shards to int8: no model."""

    cfg: Config

    def shard(self, job: ShardJob, loaded: None, report: Report) -> dict[str, Any]:
        return convert_shard(job, self.cfg, report)


# --------------------------------------------------------------------------------------------- driver
def layout(cfg: Config) -> tuple[Path, Path]:
    """(where encoded shards go, where their records go): OUT itself, or the work dir before mining."""
    work = cfg.out / WORK_DIR
    return (work / ENCODED, work / ENCODED) if cfg.hard_negatives else (cfg.out, work)


def encodes_pairs(in_manifest: dict[str, Any]) -> bool:
    """Whether this run encodes pairs: its input holds pairs (:func:`pipeline.shards.holds_pairs`) and is
    not a teacher output, which a conversion copies as it was."""
    return in_manifest.get("stage") != "teacher" and holds_pairs(in_manifest)


def finish(cfg: Config, in_manifest: dict[str, Any], records: list[dict[str, Any]]) -> tuple[list, dict]:
    """The counts and what the input was; with ``--hard-negatives``, mines them over the encoded shards
    and writes the final shards (the manifest's entries are then theirs)."""
    counts: dict[str, Any] = {"sentences": 0, "variants_encoded": 0}
    if encodes_pairs(in_manifest):
        counts.update(positives_encoded=0, pairs_kept=0, pairs_dropped_consistency=0, pairs_by_source={})
    for r in records:
        for key in counts:
            if key == "pairs_by_source":
                for source, c in r["counts"][key].items():
                    total = counts[key].setdefault(source, {"kept": 0, "dropped_consistency": 0})
                    for name, n in c.items():
                        total[name] += n
            else:
                counts[key] += r["counts"][key]
    extra: dict[str, Any] = {"counts": counts, "input_config": in_manifest.get("config", {})}
    if encodes_pairs(in_manifest):
        extra["input_stage"] = "pairs"
        extra["pair_filter"] = {"k": cfg.pair_top_k, "pool": cfg.pair_pool, "rule": "teacher/consistency.py"}
    entries = [r["entry"] for r in records]
    if in_manifest.get("stage") == "teacher":  # a conversion: the input's negatives, as they were
        extra["input_stage"] = "teacher"
        if holds_pairs(in_manifest):  # still pair shards: training must read them so
            extra["input_stage"] = "pairs"
            extra["pair_filter"] = in_manifest.get("pair_filter")
        if "hard_negatives" in in_manifest:
            extra["hard_negatives"] = in_manifest["hard_negatives"]
            counts["hard_negatives"] = in_manifest["counts"]["hard_negatives"]
    elif cfg.hard_negatives:
        from pipeline.stages.teacher.negatives import MineParams, mine_shards

        params = MineParams(
            cfg.hard_negatives, cfg.hn_depth, cfg.hn_max_similarity, cfg.hn_min_similarity, cfg.hn_index
        )
        shard_dir, _ = layout(cfg)
        entries, mined = mine_shards(
            shard_dir, entries, cfg.out, cfg.out / WORK_DIR, params, cfg.progress, cfg.device
        )
        counts["hard_negatives"] = mined
        extra["hard_negatives"] = params.record()
    return entries, extra


def first_shards(in_manifest: dict[str, Any], wanted: int, where: Path) -> dict[str, Any]:
    """``in_manifest`` with its shard list cut to the first shards that hold ``wanted`` sentences (all of
    them when they hold fewer, said in the log); a conversion is refused: it keeps every shard."""
    if in_manifest.get("stage") == "teacher":
        raise ConfigError(
            f"--max-sentences: {where} is a teacher output, which a conversion keeps whole; "
            "drop --max-sentences, or give the augment output"
        )
    entries, held = [], 0
    for entry in in_manifest["shards"]:
        if held >= wanted:
            break
        entries.append(entry)
        held += entry["sentences"]
    total = sum(e["sentences"] for e in in_manifest["shards"])
    if held < wanted:
        log.info("teacher: --max-sentences %d: %s holds %d sentences; encoding all of them", wanted, where,
                 total)  # fmt: skip
    else:
        log.info("teacher: --max-sentences %d: the first %d of %d shards, %d of %d sentences", wanted,
                 len(entries), len(in_manifest["shards"]), held, total)  # fmt: skip
    return {**in_manifest, "shards": entries}


def conversion_record(cfg: Config, in_manifest: dict[str, Any]) -> dict[str, Any]:
    """The input teacher set's record with the new dtype; refuses what a conversion cannot do."""
    teacher = in_manifest.get("teacher") or {}
    where = cfg.shards / MANIFEST
    have = stored_dtype(teacher, cfg.shards)
    if have != "float16" or cfg.dtype != "int8":
        raise ConfigError(
            f"{where} holds {have} teacher vectors; a teacher set as --shards converts float16 to "
            f"--dtype int8 only (to encode in {cfg.dtype}, give the augment output as --shards)"
        )
    if cfg.variants or cfg.hard_negatives:
        raise ConfigError(
            f"--variants/--hard-negatives: converting {cfg.shards} keeps its columns as they are; "
            "to add them, run the stage on the augment output"
        )
    if cfg.model and not matches(teacher, cfg.model):
        raise ConfigError(
            f"--model {cfg.model} is not the teacher of {where} ({teacher.get('name')}); omit --model"
        )
    return {**teacher, "dtype": cfg.dtype}


def run(cfg: Config) -> int:
    if cfg.pairs_file is not None:
        return encode_pair_file(cfg)
    reads = (
        "the teacher stage reads the output of `augment` (or `preprocess`, or `pairs`), or converts a "
        "`teacher` output to --dtype int8"
    )
    in_manifest = read_input(cfg, "teacher", ("augment", "preprocess", "pairs", "teacher"), reads)
    stage = in_manifest["stage"]
    pairs = encodes_pairs(in_manifest)
    if pairs and (cfg.variants or cfg.hard_negatives):
        raise ConfigError(
            f"--variants/--hard-negatives: {cfg.shards} holds pairs (stage pairs); their negatives are the "
            "other pairs of a batch, so leave both off"
        )
    if stage != "teacher" and not cfg.model:
        raise ConfigError("usage: python -m pipeline teacher --shards IN --out OUT --model TEACHER")
    if cfg.max_sentences:
        in_manifest = first_shards(in_manifest, cfg.max_sentences, cfg.shards)
    device = resolve_device(cfg.device)
    if stage == "teacher":  # a conversion
        work: ShardWork = ConvertWork(cfg)
        record = conversion_record(cfg, in_manifest)
    else:
        work = EncodeWork(cfg, device, progress_per_sentence=2 if pairs else 1)
        work.loaded = load_teacher(cfg, device)  # for the record; the shards use it if they run here
        precision, why = teacher_precision(device, cfg.precision)
        log.info("teacher: computing in %s on %s (%s)", precision, device, why)
        record = teacher_record(cfg, work.loaded, precision)
    shard_dir, record_dir = layout(cfg)
    shards = ShardStage("teacher", cfg, in_manifest, WORK_DIR, {"teacher": record}, LEFT_OUT,
                        "config, input or teacher", shard_dir, record_dir)  # fmt: skip
    return shards.run(work, lambda records: finish(cfg, in_manifest, records))
