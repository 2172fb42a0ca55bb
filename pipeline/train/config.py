"""The training configuration: one typed dataclass per section, validated before anything runs.

Checks that need only the config live in ``__post_init__``; checks that need the world size or the
data on disk (global batch vs ranks, k vs the cached variants, the teacher, its width and the hard
negatives the shards hold, their token ids) live in :func:`pipeline.train.plan.check_against_data`,
which :func:`pipeline.train.build.build` calls with the shard set's manifest (read once) before it
builds a model, and which returns the resolved :class:`~pipeline.data.plan.DataPlan`. Every mistake
is a :class:`ConfigError` whose message says what to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pipeline.config import Legacy, option, to_dict
from pipeline.errors import ConfigError
from pipeline.losses import DEFAULT_LOSS, TERMS, Loss, build_loss
from pipeline.losses.legacy import LegacyObjective, convert_objective
from pipeline.losses.terms import HARD_NEGATIVES, MLM_LOGITS, TEACHER, as_entries

PROJECT_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)


def resolve_path(path: Path) -> Path:
    """A relative path as given if it exists from the working directory, else from the project root.

    Shipped configs name files such as ``launch/deepspeed/zero2.json`` relative to the repository,
    so they work from any working directory. The config's file fields (``data.supervised_file``,
    ``model.scratch_config``, ``train.deepspeed_config``) are resolved once, when their section is made:
    the code that opens them, and config.yaml, see the file that is read.
    """
    if path.is_absolute() or path.exists():
        return path
    alt = PROJECT_ROOT / path
    return alt if alt.exists() else path


MAX_HOLDOUT_ROWS = 2048  # data.holdout_rows: a supervised file's 2,048 records: 4,096 sentences, 8.4M pairs

# The file fields each section resolves when it is made (its __post_init__), as (section, field).
FILE_FIELDS = (
    ("data", "supervised_file"),
    ("data", "supervised_teacher"),
    ("model", "scratch_config"),
    ("train", "deepspeed_config"),
)


def resolve_saved_paths(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config (config.yaml, a checkpoint's) with its file fields resolved as loading it here
    would: a run started in the project root and resumed from elsewhere names the same files."""
    out = dict(saved)
    for section, name in FILE_FIELDS:
        value = (saved.get(section) or {}).get(name)
        if value is not None:
            out[section] = {**out[section], name: str(resolve_path(Path(value)))}
    return out


@dataclass
class DataConfig:
    shards: Path | None = option(
        None, "Directory of augmented shards (with manifest.json); the unsupervised objectives read it."
    )
    num_variants: int = option(
        4, "k: cached EDA variants used per sentence as positives (at most what the augment stage cached)."
    )
    num_dropout_views: int = option(1, "d: extra dropout re-encodings of the original used as positives.")
    max_length: int = option(64, "Maximum tokens per sentence (longer ones are truncated).")
    num_workers: int | Literal["auto"] = option(
        2,
        "DataLoader worker processes per rank (0 = tokenise in the main process). auto: on CUDA "
        "min(8, CPUs per rank - 1), at least 1 (docs/training.md, GPU-speed settings); on CPU 2.",
    )
    prefetch_factor: int = option(4, "Batches each loader worker prepares ahead.")
    supervised_file: Path | None = option(
        None,
        "TSV/JSONL pair or triple file for sup_simcse, cosent and sbert, never a split of the scored sets "
        "(`python -m pipeline decontaminate` filters one: docs/objectives.md, 'Labelled pairs').",
    )
    supervised_teacher: Path | None = option(
        None,
        "The teacher's vectors of data.supervised_file's first two texts (`python -m pipeline teacher "
        "--pairs_file FILE --out DIR --model TEACHER`); set: batches carry them and a distill (or kl) term "
        "may train beside the supervised term (docs/objectives.md, 'Labels beside distillation').",
    )
    verify_shards: bool = option(
        True,
        "Check each shard's size and block index (sha256) at start, and each block's CRC-32 when it is "
        "first read: a damaged shard is refused with its file named, without reading every shard at start.",
    )
    length_bucketing: bool = option(
        True,
        "Sort each window of data.bucket_window global batches by sentence length and permute those "
        "batches, so a batch pads little; resume stays exact (docs/DESIGN.md, 'Training data order'). "
        "False: batches in plain seeded random order.",
    )
    bucket_window: int = option(50, "Global batches per length-bucketing window (more = less padding).")
    teacher: str | None = option(
        None,
        "Teacher the shards were encoded with by `python -m pipeline teacher` (its --model name, folder "
        "name or hash); set: batches carry batch['teacher'] (B, D) and the shards' manifest must match.",
    )
    num_hard_negatives: int = option(
        0, "m: mined hard negatives per sentence appended after the views (at most what the shards cache)."
    )
    teacher_dim: int = option(
        0,
        "Optional check: the width of the shards' teacher embeddings, which the trainer reads from their "
        "manifest (0 = no check). Set and different from the manifest's: a ConfigError. When the teacher's "
        "width differs from the student's, the distill term (and luse's teacher_positive) learn a "
        "projection of the student to it.",
    )
    # Pair shards (`pipeline pairs`, docs/pairs.md "Training on pairs"; pipeline/data/sources.py)
    one_source_per_batch: bool = option(
        False,
        "Pair shards: every global batch holds pairs of one source, drawn with probability proportional "
        "to size^source_alpha (false: every batch holds every source in proportion).",
    )
    source_alpha: float = option(0.5, "alpha of one_source_per_batch (1: by size; 0: sources uniformly).")
    holdout_rows: int = option(
        0,
        "Rows of the training data kept out of every batch for the teacher-agreement score: the trailing "
        "whole blocks of teacher shards holding at least this many rows, or a supervised file's last records "
        "(with data.supervised_teacher); 0 = none (pipeline/data/holdout.py, docs/training.md).",
    )
    pair_max_rank: int = option(
        0,
        "Pair shards: only pairs the teacher's consistency filter ranked within k (checks that the teacher "
        "stage ran with --pair-top-k between 1 and k, which drops the rest); 0 = no check.",
    )

    def __post_init__(self) -> None:
        if self.supervised_file is not None:
            self.supervised_file = resolve_path(self.supervised_file)
        if self.supervised_teacher is not None:
            self.supervised_teacher = resolve_path(self.supervised_teacher)
        if self.source_alpha < 0 or self.pair_max_rank < 0:
            raise ConfigError("data.source_alpha and data.pair_max_rank must be >= 0")
        if not 0 <= self.holdout_rows <= MAX_HOLDOUT_ROWS:
            raise ConfigError(
                f"data.holdout_rows must be in [0, {MAX_HOLDOUT_ROWS}], got {self.holdout_rows}: the teacher "
                "agreement compares every pair of the held-out sentences (N^2 cosines at each evaluation)"
            )
        if self.num_variants < 0:
            raise ConfigError("data.num_variants must be >= 0; set --data.num_variants to 0 or more")
        if self.num_dropout_views < 0:
            raise ConfigError(
                "data.num_dropout_views must be >= 0; set --data.num_dropout_views to 0 or more"
            )
        if self.max_length < 4:
            raise ConfigError("data.max_length must be >= 4 tokens; raise --data.max_length")
        if self.num_workers != "auto" and self.num_workers < 0:
            raise ConfigError("data.num_workers must be >= 0; set --data.num_workers=0 to load in-process")
        if self.prefetch_factor < 1:
            raise ConfigError("data.prefetch_factor must be >= 1")
        if self.bucket_window < 1:
            raise ConfigError("data.bucket_window must be >= 1 global batches; raise --data.bucket_window")
        if self.num_hard_negatives < 0:
            raise ConfigError("data.num_hard_negatives must be >= 0 (0 = none)")
        if self.teacher_dim < 0:
            raise ConfigError("data.teacher_dim must be >= 0 (0 = the manifest's width, unchecked)")


@dataclass
class ModelConfig:
    name_or_path: str | None = option(
        None,
        "A transformers encoder by Hub name or local folder (e.g. hfl/rbt3); empty = build from scratch.",
    )
    scratch_config: Path | None = option(
        None,
        "BertConfig fields (JSON) for a from-scratch model; empty = the package's small BERT "
        "(pipeline/model/scratch_small.json: 4 layers, 128 hidden).",
    )
    vocab_min_count: int = option(
        2, "Scratch model: keep characters seen at least this often in training text."
    )
    vocab_max_size: int = option(8000, "Scratch model: vocabulary size cap (special + ASCII + characters).")
    vocab_max_sentences: int = option(
        200_000, "Scratch model: count characters over at most this many training sentences."
    )
    pooling: Literal["cls", "mean", "first_last_avg"] | None = option(
        None,
        "How token states become one vector; empty = the model folder's rule (encoder.json or its "
        "sentence-transformers files). Required for a scratch model or a folder without a rule.",
    )
    prefix: str | None = option(
        None,
        "Text put before every sentence (e5: 'query: '); empty = the model folder's rule "
        "(encoder.json prefix or the sentence-transformers default prompt), none for a scratch model.",
    )
    dropout: float | None = option(
        None,
        "Hidden and attention dropout while training; empty keeps the model's own (dropout makes the views "
        "differ). Saved models keep the folder's own value in config.json.",
    )
    freeze_embeddings: bool = option(
        False,
        "Keep the word embeddings fixed: no gradient, no AdamW state (e5-small: 96 M of its 118 M "
        "parameters are the 250k-piece embedding matrix).",
    )
    random_init: bool = option(
        False,
        "Re-initialise every weight of the model folder (seeded by train.seed), keeping its architecture, "
        "tokenizer, pooling and prefix: the from-scratch baseline of a student cut.",
    )
    layers: list[int] | None = option(
        None,
        "Keep only these transformer layers of the model (e.g. [0, 4, 8, 11]); empty keeps all. "
        "`python -m pipeline student` does the same offline and can also trim the vocabulary.",
    )

    def __post_init__(self) -> None:
        if self.scratch_config is not None:
            self.scratch_config = resolve_path(self.scratch_config)
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.layers is not None and (not self.layers or sorted(set(self.layers)) != self.layers):
            raise ConfigError(f"model.layers must be increasing indices without repeats, got {self.layers}")
        if self.random_init and not self.name_or_path:
            raise ConfigError("model.random_init re-initialises a model folder; set model.name_or_path")
        if self.vocab_max_size < 100:
            raise ConfigError("model.vocab_max_size must be >= 100")
        if not self.name_or_path and self.pooling is None:
            raise ConfigError(
                "model.pooling: a from-scratch model has no folder to take a pooling rule from; "
                "set --model.pooling to cls, mean or first_last_avg"
            )


@dataclass
class OptimConfig:
    lr: float = option(5e-5, "Peak learning rate after warmup.")
    weight_decay: float = option(0.01, "AdamW weight decay (not applied to biases and LayerNorm weights).")
    betas: list[float] = option([0.9, 0.999], "AdamW betas.")
    eps: float = option(1e-8, "AdamW epsilon.")
    warmup_steps: int = option(100, "Linear warmup from 0 to lr over this many optimizer steps.")
    schedule: Literal["linear", "cosine", "constant"] = option(
        "linear", "Decay after warmup, to min_lr_ratio."
    )
    min_lr_ratio: float = option(0.0, "Final learning rate as a fraction of lr.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0 = no clipping).")
    fused: bool | Literal["auto"] = option(
        False,
        "Fused AdamW kernel (torch >= 2.4, CPU and GPU): one kernel for all tensors instead of a loop; it "
        "also lets the non-finite guard skip a step on the GPU without a host sync. auto: fused on CUDA, "
        "not on CPU (resolved at start; config.yaml records the result).",
    )

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError("optim.lr must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps, grad_clip and weight_decay must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("optim.min_lr_ratio must be in [0, 1]")


@dataclass
class CheckpointConfig:
    every_steps: int = option(1000, "Save a checkpoint every this many optimizer steps (0 = off).")
    every_minutes: float = option(
        30.0, "Also save when this many minutes passed since the last save (0 = off)."
    )
    keep_last: int = option(
        2,
        "Keep the newest this many checkpoints (the best is kept too). Disk: (keep_last + 2) x one "
        "checkpoint at the peak of a save (the new one, the kept ones, the best); one checkpoint is 12-16 "
        "bytes per parameter (weights, AdamW's two moments, the momentum encoder).",
    )

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.every_minutes < 0 or self.keep_last < 1:
            raise ConfigError("checkpoint.every_steps/every_minutes must be >= 0 and keep_last >= 1")


@dataclass
class GuardConfig:
    max_nonfinite_steps: int = option(
        5,
        "Skip a step whose loss or gradient norm is NaN/inf (bf16, fp32; fp16's GradScaler skips by itself); "
        "stop after this many consecutive skips (exit code 70). 0 = no check (saves one host sync per step).",
    )
    spike_factor: float = option(
        0.0, "Roll back on a loss spike: loss > this x the running median (0 = off; e.g. 3)."
    )
    spike_steps: int = option(3, "... for this many consecutive steps.")
    spike_history: int = option(50, "Steps in the running median (the spike check starts once it is full).")
    spike_skip_batches: int = option(
        20, "After a rollback, skip the batches up to the spike and this many more (global batches)."
    )

    def __post_init__(self) -> None:
        if self.max_nonfinite_steps < 0 or self.spike_factor < 0 or self.spike_skip_batches < 0:
            raise ConfigError("guard.max_nonfinite_steps, spike_factor and spike_skip_batches must be >= 0")
        if self.spike_factor and self.spike_factor <= 1:
            raise ConfigError("guard.spike_factor must be > 1 (or 0 = off)")
        if self.spike_steps < 1 or self.spike_history < 1:
            raise ConfigError("guard.spike_steps and guard.spike_history must be >= 1")


@dataclass
class TrainConfig:
    global_batch_size: int = option(
        64, "Sentences per optimizer step over all ranks (each yields n views in the contrastive objectives)."
    )
    grad_accum_steps: int = option(
        1, "Micro-batches per optimizer step. Saves memory but does NOT enlarge the negative set."
    )
    max_steps: int = option(
        0, "Stop after this many optimizer steps (0 = train.max_samples, or else train.epochs, decides)."
    )
    max_samples: int = option(
        0,
        "Stop once this many samples (sentences, or pairs of a supervised file) have been trained on: "
        "ceil(max_samples / global_batch_size) steps, whatever the corpus size (0 = train.epochs "
        "decides). A length that holds when the global batch changes; not with train.max_steps.",
    )
    epochs: int = option(1, "Passes over the data when max_steps and max_samples are 0.")
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] = option(
        "no",
        "Autocast precision (fp16 uses a grad scaler). auto: bf16 on a CUDA GPU that supports it and on a "
        "CPU with native bf16 (AMX-BF16, AVX512-BF16), else no (fp32); resolved at start, config.yaml "
        "records the result, and a resumed run keeps it. bf16 on a CPU without native bf16 runs several "
        "times slower than fp32 (a warning says so).",
    )
    tf32: bool = option(
        True,
        "CUDA only: let float32 matmuls and convolutions use TF32 tensor cores (Ampere and later; "
        "torch.set_float32_matmul_precision('high')): faster fp32 work outside autocast, ~1e-3 relative "
        "rounding. No effect on CPU.",
    )
    gradcache_chunk_size: int = option(
        0, "GradCache: encode the batch in chunks of this many sequences (0 = one forward for the batch)."
    )
    seed: int = option(42, "Seed of the model init, the data order and the dropout streams.")
    device: Literal["auto", "cuda", "cpu"] = option(
        "auto",
        "Where to train: cuda (fail in seconds, saying why, when torch sees no GPU), cpu, or auto: the "
        "GPUs if torch sees any; none while the job was given GPUs (SLURM_*GPUS*, CUDA_VISIBLE_DEVICES) "
        "fails like cuda; none and none given trains on CPU and says so in the start-up line.",
    )
    cpu: bool = option(False, "Deprecated: the same as train.device=cpu.")
    collective_timeout: float = option(
        600.0,
        "Seconds a collective (gloo, NCCL, DeepSpeed) may wait for the other ranks; after that every "
        "waiting rank exits with status 76 and one line naming the collective and the silent ranks. "
        "Must exceed the longest time one rank works alone (rank 0's evaluation, a checkpoint write).",
    )
    deepspeed_config: Path | None = option(
        None, "DeepSpeed JSON (launch/deepspeed/zero2.json) to train with ZeRO."
    )
    log_every: int = option(10, "Log loss, lr, throughput and batch statistics every this many steps.")
    progress: bool = option(
        True, "Show a progress bar of the steps (rank 0): a bar on a terminal, a line every 30 s in a log."
    )
    eval_every: int = option(500, "Evaluate on STS-B valid every this many steps (0 = only at the end).")
    eval_every_minutes: float = option(
        0.0,
        "Also evaluate when this many minutes passed since the last evaluation (0 = off); the clock is "
        "read at log steps (rank 0's, broadcast), so an evaluation may come up to log_every - 1 steps late.",
    )
    eval_max_pairs: int = option(0, "Evaluate on the first this many STS-B valid pairs (0 = all).")
    select_on: Literal["sts_b", "sts_b+teacher"] = option(
        "sts_b",
        "The score that picks the best checkpoint: STS-B valid Spearman, or the mean of it and the teacher "
        "agreement (Spearman x100 of the student's and the teacher's pairwise cosines over the rows "
        "data.holdout_rows keeps out of training), both logged at every evaluation (docs/training.md).",
    )
    final_model: Literal["last", "best"] = option(
        "last",
        "Weights written to RUN_DIR/model at the end: the last step's, or the checkpoint with the best "
        "train.select_on score (model selection on the dev set, as SimCSE's reference trainer does).",
    )
    debug_dump: bool = option(False, "Write RUN_DIR/debug/rank{r}.json (checksums of parameters and queue).")
    unpadded: bool = option(
        False,
        "BERT encoders: batches of flat tokens without padding (cu_seqlens, max_seqlen, position ids), the "
        "encoder run on the real tokens only (varlen flash attention on a GPU in fp16/bf16, a padded SDPA "
        "reference elsewhere); the same weights. Not with the mlm term, a momentum encoder or GradCache "
        '(docs/training.md, "Unpadded, static and compiled steps").',
    )
    pad_to_multiple_of: int = option(
        0,
        "Pad each batch's width up to a multiple of this many tokens (at most data.max_length), so a run "
        "sees a handful of shapes instead of one per longest sentence (0 = pad to the longest).",
    )
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = option(
        "off",
        "torch.compile the encoder with this mode (off = eager). Recompiles are bounded "
        "(torch._dynamo recompile_limit) and each one is logged with its reason.",
    )
    deterministic: bool = option(
        False,
        "Deterministic GPU kernels (deterministic algorithms, cuBLAS workspace, cuDNN without autotuning, "
        "SDPA math attention): the same weights on every rerun and resume on GPUs, at a speed cost. "
        "CPU runs are exact either way (docs/fault_tolerance.md).",
    )

    def __post_init__(self) -> None:
        if self.deepspeed_config is not None:
            self.deepspeed_config = resolve_path(self.deepspeed_config)
        if self.global_batch_size < 2:
            raise ConfigError("train.global_batch_size must be >= 2 (in-batch negatives need two sentences)")
        if self.grad_accum_steps < 1:
            raise ConfigError("train.grad_accum_steps must be >= 1")
        if self.global_batch_size % self.grad_accum_steps:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"train.grad_accum_steps ({self.grad_accum_steps})"
            )
        if self.max_steps < 0 or self.max_samples < 0 or self.epochs < 1:
            raise ConfigError("train.max_steps and train.max_samples must be >= 0 and train.epochs >= 1")
        if self.max_steps and self.max_samples:
            raise ConfigError(
                f"train.max_steps ({self.max_steps}) and train.max_samples ({self.max_samples}) both set "
                "the run's length; set the other to 0"
            )
        if self.cpu:  # the deprecated flag, read as device=cpu
            if self.device == "cuda":
                raise ConfigError("train.cpu=true contradicts train.device=cuda; drop train.cpu (deprecated)")
            self.device = "cpu"
        if self.collective_timeout <= 0:
            raise ConfigError("train.collective_timeout must be > 0 seconds (e.g. 600)")
        if self.gradcache_chunk_size < 0 or self.log_every < 1 or self.eval_every < 0:
            raise ConfigError("train.gradcache_chunk_size/eval_every must be >= 0 and log_every >= 1")
        if self.eval_every_minutes < 0:
            minutes = self.eval_every_minutes
            raise ConfigError(f"train.eval_every_minutes must be >= 0 (0 = off), not {minutes}")
        if self.pad_to_multiple_of < 0:
            raise ConfigError("train.pad_to_multiple_of must be >= 0 (0 = pad to each batch's longest)")
        if self.unpadded and self.pad_to_multiple_of:
            raise ConfigError("train.unpadded has no padding to round; set train.pad_to_multiple_of to 0")
        if self.unpadded and self.gradcache_chunk_size:
            raise ConfigError("train.unpadded is not supported with train.gradcache_chunk_size; unset one")

    def total_steps(self, batches_per_epoch: int) -> int:
        """The run's length in optimizer steps: max_steps, else max_samples in global batches (the last
        one counted whole), else ``epochs`` passes of ``batches_per_epoch``."""
        if self.max_steps:
            return self.max_steps
        if self.max_samples:
            return -(-self.max_samples // self.global_batch_size)
        return self.epochs * batches_per_epoch


def term_fields(term: Any) -> str:
    """``{field: default, ...}`` of a term's config, for --help."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in to_dict(term.config_class()).items()) + "}"


LOSS_HELP = (
    "The loss: a list of weighted terms, each `{TERM: {fields}, weight: W}` (docs/objectives.md), e.g. "
    "[{distill: {loss: cosine}, weight: 1.0}]. Terms: "
    + "; ".join(f"{name} {term_fields(t)}: {t.summary()}" for name, t in TERMS.items())
    + "."
)


def read_objective(data: dict[str, Any], section: LegacyObjective) -> dict[str, Any]:
    """A config mapping with its deprecated ``objective:`` section (a file's, a saved config's,
    ``--objective.*`` overrides) read into ``loss`` and ``data.teacher_dim``
    (:func:`pipeline.losses.legacy.convert_objective`, the one reader of that section)."""
    given, loss = section.given(), data.get("loss", list(DEFAULT_LOSS))
    if not given or not isinstance(loss, list):  # nothing set, or a `loss` its own check refuses
        return data
    loss, teacher_dim = convert_objective(loss, given, TERMS)
    if teacher_dim is None:
        return {**data, "loss": loss}
    return {**data, "loss": loss, "data": {**(data.get("data") or {}), "teacher_dim": teacher_dim}}


@dataclass
class Config:
    data: DataConfig = option(factory=DataConfig, help="Training data and views.")
    model: ModelConfig = option(factory=ModelConfig, help="The encoder.")
    loss: list[dict[str, Any]] = option(DEFAULT_LOSS, LOSS_HELP)
    optim: OptimConfig = option(factory=OptimConfig, help="Optimizer and learning-rate schedule.")
    train: TrainConfig = option(factory=TrainConfig, help="Batching, precision, steps, logging.")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, help="Periodic checkpoints.")
    guard: GuardConfig = option(factory=GuardConfig, help="Non-finite steps and loss spikes.")
    run_dir: Path = option(
        Path("runs/default"), "Output directory: config, logs, metrics, checkpoints, model."
    )
    resume: str = option("auto", "auto (newest valid checkpoint in run_dir, else fresh), never, or a path.")
    # the deprecated `objective:` section: read into `loss` when the config is made, never a field
    LEGACY: ClassVar[dict[str, Legacy]] = {"objective": Legacy(LegacyObjective, read_objective)}

    def __post_init__(self) -> None:
        loss = build_loss(self.loss)  # checks every term's fields: the one parse of the list
        self.loss = as_entries(loss.terms)  # every field resolved: config.yaml records the recipe
        self._parsed = (self.loss, loss)  # not a field: terms() hands it out (the plan, build, the loop)
        d, t = self.data, self.train
        if loss.unsupervised and d.shards is None:
            raise ConfigError("loss: its terms read shards: set --data.shards to an augmented shard dir")
        if not loss.unsupervised and d.supervised_file is None:
            raise ConfigError(
                f"loss term {loss.main.name} needs --data.supervised_file (a TSV/JSONL pair/triple file)"
            )
        one_view = (  # a term that also reads pair shards (luse): the plan checks it against the data
            loss.main is not None and loss.main.uses_variants and d.num_variants + d.num_dropout_views < 1
        ) and not loss.main.trains_on_pairs
        if one_view and not loss.needs.teacher_positive:
            raise ConfigError(
                f"{loss.main.name} needs at least one positive: set data.num_variants or num_dropout_views "
                ">= 1 (or luse.teacher_positive; for distillation alone the loss is one distill term)"
            )
        if not loss.unsupervised and (d.num_hard_negatives or loss.reads(MLM_LOGITS)):
            raise ConfigError(
                f"loss term {loss.main.name} reads a pair file; data.num_hard_negatives and the mlm term "
                "read the shards: unset them, or use luse or simcse"
            )
        teacher_read = loss.reads(TEACHER) or d.teacher is not None
        if not loss.unsupervised and teacher_read and d.supervised_teacher is None:
            raise ConfigError(
                f"loss term {loss.main.name} reads a pair file without teacher vectors; data.teacher and "
                "the distill and kl terms need them: set data.supervised_teacher to the file's (`python -m "
                "pipeline teacher --pairs_file FILE --out DIR --model TEACHER`), unset them, or use luse or "
                "simcse"
            )
        if d.supervised_teacher is not None and (loss.unsupervised or not loss.reads(TEACHER)):
            raise ConfigError(
                "data.supervised_teacher holds the teacher vectors of data.supervised_file for a distill or "
                "kl term beside a supervised term (cosent, sbert, sup_simcse); add both terms or unset it"
            )
        if d.num_hard_negatives and not loss.reads(HARD_NEGATIVES):
            raise ConfigError(
                "no loss term takes hard negatives (luse and pairs do); set data.num_hard_negatives to 0"
            )
        if loss.reads(MLM_LOGITS) and t.gradcache_chunk_size:
            raise ConfigError(
                "the mlm loss term is not supported with train.gradcache_chunk_size; remove one of them"
            )
        if t.unpadded and (loss.reads(MLM_LOGITS) or loss.needs.momentum):
            raise ConfigError(
                "train.unpadded is not supported with the mlm term or a momentum encoder (both read padded "
                "rows); set --train.unpadded=false"
            )
        if t.select_on == "sts_b+teacher" and not d.holdout_rows:
            raise ConfigError(
                "train.select_on=sts_b+teacher scores the teacher agreement on held-out training rows; set "
                "data.holdout_rows (e.g. 1000) or select on sts_b"
            )
        if t.gradcache_chunk_size and t.grad_accum_steps > 1:
            raise ConfigError("use either train.gradcache_chunk_size or train.grad_accum_steps > 1, not both")
        if t.gradcache_chunk_size and t.deepspeed_config:
            raise ConfigError(
                "train.gradcache_chunk_size is not supported with DeepSpeed; use DDP or set it to 0"
            )

    def terms(self) -> Loss:
        """The loss's weighted terms: parsed once when the config is made (again only if ``loss`` is
        replaced afterwards). A :class:`Loss` holds nothing that changes, so every reader shares it."""
        entries, loss = self.__dict__.get("_parsed", (None, None))
        if entries is not self.loss:
            loss = build_loss(self.loss)
            self._parsed = (self.loss, loss)
        return loss

    def __getstate__(self) -> dict[str, Any]:
        """The fields alone (a parsed loss holds functions; it is parsed again on first use)."""
        return {k: v for k, v in self.__dict__.items() if k != "_parsed"}

    def num_views(self) -> int:
        """Views per sentence n: luse 1 + k + d, simcse 2, the supervised ones their texts, else 1."""
        return self.terms().num_views(self.data.num_variants, self.data.num_dropout_views)
