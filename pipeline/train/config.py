"""The training configuration: one typed dataclass per section, validated before anything runs.

Checks that need only the config live in ``__post_init__``; checks that need the world size or the
data on disk (global batch vs ranks, k vs the cached variants, missing shards) live in
:func:`check_against_environment`, which :func:`pipeline.train.build.build` calls before it builds a
model. Every mistake is a :class:`ConfigError` whose message says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.losses import OBJECTIVES, get_objective
from pipeline.losses.distill import DISTILL_LOSSES

PROJECT_ROOT = Path(__file__).resolve().parents[2]
UNSUPERVISED = tuple(name for name, o in OBJECTIVES.items() if o.unsupervised)  # read the shards


def resolve_path(path: Path) -> Path:
    """A relative path as given if it exists from the working directory, else from the project root.

    Shipped configs name files such as ``launch/configs/model_small.json`` relative to the repository,
    so they work from any working directory.
    """
    if path.is_absolute() or path.exists():
        return path
    alt = PROJECT_ROOT / path
    return alt if alt.exists() else path


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
    num_workers: int = option(2, "DataLoader worker processes per rank (0 = tokenise in the main process).")
    prefetch_factor: int = option(4, "Batches each loader worker prepares ahead.")
    supervised_file: Path | None = option(
        None, "TSV/JSONL pair or triple file for sup_simcse, cosent and sbert (e.g. STS-B.train.tsv)."
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

    def __post_init__(self) -> None:
        if self.num_variants < 0:
            raise ConfigError("data.num_variants must be >= 0; set --data.num_variants to 0 or more")
        if self.num_dropout_views < 0:
            raise ConfigError(
                "data.num_dropout_views must be >= 0; set --data.num_dropout_views to 0 or more"
            )
        if self.max_length < 4:
            raise ConfigError("data.max_length must be >= 4 tokens; raise --data.max_length")
        if self.num_workers < 0:
            raise ConfigError("data.num_workers must be >= 0; set --data.num_workers=0 to load in-process")
        if self.prefetch_factor < 1:
            raise ConfigError("data.prefetch_factor must be >= 1")
        if self.bucket_window < 1:
            raise ConfigError("data.bucket_window must be >= 1 global batches; raise --data.bucket_window")
        if self.num_hard_negatives < 0:
            raise ConfigError("data.num_hard_negatives must be >= 0 (0 = none)")


@dataclass
class ModelConfig:
    name_or_path: str | None = option(
        None,
        "A transformers encoder by Hub name or local folder (e.g. hfl/rbt3); empty = build from scratch.",
    )
    scratch_config: Path = option(
        Path("launch/configs/model_small.json"), "BertConfig fields (JSON) for a from-scratch model."
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
        None, "Hidden and attention dropout; empty keeps the model's own (dropout makes the views differ)."
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
class ObjectiveConfig:
    name: str = option("luse", "; ".join(f"{name}: {o.summary}" for name, o in OBJECTIVES.items()) + ".")
    temperature: float = option(
        0.05, "Softmax temperature tau of the contrastive objectives: logits = cos / tau."
    )
    queue_size: int = option(
        0, "LUSE: negatives kept from earlier steps (0 = no queue); a multiple of the batch."
    )
    momentum: float = option(
        0.0, "LUSE: EMA momentum of the key encoder (e.g. 0.999); 0 = keys are the detached online view 0."
    )
    cosent_scale: float = option(20.0, "CoSENT: lambda, the scale of cosine differences.")
    num_labels: int = option(3, "sbert: number of classes in the labelled pair file.")
    mlm_weight: float = option(
        0.0,
        "luse/simcse: lambda of the auxiliary masked-token loss on the originals "
        "(loss = contrastive + lambda * mlm; 0 = off).",
    )
    mlm_probability: float = option(
        0.15, "Share of a sentence's tokens selected for the MLM loss (BERT: 0.15; split 80/10/10)."
    )
    contrastive_weight: float = option(
        1.0, "Weight of the objective's own (contrastive) loss; 0 with a distill weight = distillation alone."
    )
    distill_weight: float = option(
        0.0, "luse/simcse: weight of embedding distillation to the batch's teacher embeddings (0 = off)."
    )
    distill_loss: str = option("cosine", "Embedding distillation: cosine (1 - cos) or mse (of unit vectors).")
    teacher_dim: int = option(
        0, "Width of the teacher embeddings; 0 = the student's. If it differs, a learned projection is built."
    )
    kl_weight: float = option(
        0.0, "luse/simcse: weight of KL(teacher || student) over in-batch (+ queue) similarities (0 = off)."
    )
    kl_teacher_temperature: float = option(0.05, "KL term: temperature of the teacher's softmax.")
    kl_student_temperature: float = option(0.05, "KL term: temperature of the student's softmax.")
    teacher_positive: bool = option(
        False, "luse: the teacher embedding of each sentence is one more positive (and a candidate)."
    )

    def __post_init__(self) -> None:
        objective = get_objective(self.name)
        weights = (self.contrastive_weight, self.distill_weight, self.kl_weight)
        if min(weights) < 0 or not any(weights):
            raise ConfigError(
                "objective.contrastive_weight/distill_weight/kl_weight must be >= 0 and one of them > 0"
            )
        if self.distill_loss not in DISTILL_LOSSES:
            raise ConfigError(f"objective.distill_loss must be one of {', '.join(DISTILL_LOSSES)}")
        if self.teacher_dim < 0 or self.kl_teacher_temperature <= 0 or self.kl_student_temperature <= 0:
            raise ConfigError("objective.teacher_dim must be >= 0 and the kl temperatures > 0 (try 0.05)")
        distills = self.distill_weight > 0 or self.kl_weight > 0 or self.teacher_positive
        if distills and not objective.unsupervised:
            raise ConfigError(
                f"objective {self.name}: distillation reads teacher embeddings from the shards; "
                "use luse or simcse, or set distill_weight/kl_weight to 0 and teacher_positive to false"
            )
        if self.teacher_positive and not (objective.uses_teacher_positive and self.contrastive_weight):
            raise ConfigError("objective.teacher_positive needs objective luse with contrastive_weight > 0")
        if self.mlm_weight < 0:
            raise ConfigError("objective.mlm_weight must be >= 0 (0 turns the MLM loss off; try 0.1)")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ConfigError("objective.mlm_probability must be in (0, 1) (BERT uses 0.15)")
        if self.temperature <= 0:
            raise ConfigError("objective.temperature must be > 0 (try 0.05)")
        if self.queue_size < 0:
            raise ConfigError("objective.queue_size must be >= 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("objective.momentum must be in [0, 1) (0 = no momentum encoder)")
        if not objective.uses_queue and (self.queue_size or self.momentum):
            raise ConfigError(
                f"objective.queue_size/momentum apply only to luse, not {self.name}; set them to 0"
            )
        if self.num_labels < 2:
            raise ConfigError("objective.num_labels must be >= 2")


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
    fused: bool = option(
        False, "Fused AdamW kernel (torch >= 2.4, CPU and GPU): one kernel for all tensors instead of a loop."
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
    max_steps: int = option(0, "Stop after this many optimizer steps (0 = run `epochs` epochs).")
    epochs: int = option(1, "Passes over the data when max_steps is 0.")
    mixed_precision: Literal["no", "fp16", "bf16"] = option(
        "no", "Autocast precision (fp16 uses a grad scaler)."
    )
    gradcache_chunk_size: int = option(
        0, "GradCache: encode the batch in chunks of this many sequences (0 = one forward for the batch)."
    )
    seed: int = option(42, "Seed of the model init, the data order and the dropout streams.")
    cpu: bool = option(False, "Force CPU even when a GPU is present (CI, tests).")
    deepspeed_config: Path | None = option(
        None, "DeepSpeed JSON (launch/deepspeed/zero2.json) to train with ZeRO."
    )
    log_every: int = option(10, "Log loss, lr, throughput and batch statistics every this many steps.")
    eval_every: int = option(500, "Evaluate on STS-B valid every this many steps (0 = only at the end).")
    eval_max_pairs: int = option(0, "Evaluate on the first this many STS-B valid pairs (0 = all).")
    final_model: Literal["last", "best"] = option(
        "last",
        "Weights written to RUN_DIR/model at the end: the last step's, or the checkpoint with the best "
        "STS-B valid score (model selection on the dev set, as SimCSE's reference trainer does).",
    )
    debug_dump: bool = option(False, "Write RUN_DIR/debug/rank{r}.json (checksums of parameters and queue).")

    def __post_init__(self) -> None:
        if self.global_batch_size < 2:
            raise ConfigError("train.global_batch_size must be >= 2 (in-batch negatives need two sentences)")
        if self.grad_accum_steps < 1:
            raise ConfigError("train.grad_accum_steps must be >= 1")
        if self.global_batch_size % self.grad_accum_steps:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"train.grad_accum_steps ({self.grad_accum_steps})"
            )
        if self.max_steps < 0 or self.epochs < 1:
            raise ConfigError("train.max_steps must be >= 0 and train.epochs >= 1")
        if self.gradcache_chunk_size < 0 or self.log_every < 1 or self.eval_every < 0:
            raise ConfigError("train.gradcache_chunk_size/eval_every must be >= 0 and log_every >= 1")


@dataclass
class Config:
    data: DataConfig = option(factory=DataConfig, help="Training data and views.")
    model: ModelConfig = option(factory=ModelConfig, help="The encoder.")
    objective: ObjectiveConfig = option(factory=ObjectiveConfig, help="The loss.")
    optim: OptimConfig = option(factory=OptimConfig, help="Optimizer and learning-rate schedule.")
    train: TrainConfig = option(factory=TrainConfig, help="Batching, precision, steps, logging.")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, help="Periodic checkpoints.")
    guard: GuardConfig = option(factory=GuardConfig, help="Non-finite steps and loss spikes.")
    run_dir: Path = option(
        Path("runs/default"), "Output directory: config, logs, metrics, checkpoints, model."
    )
    resume: str = option("auto", "auto (newest valid checkpoint in run_dir, else fresh), never, or a path.")

    def __post_init__(self) -> None:
        name = self.objective.name
        if name in UNSUPERVISED and self.data.shards is None:
            raise ConfigError(f"objective {name} reads shards: set --data.shards to an augmented shard dir")
        if name not in UNSUPERVISED and self.data.supervised_file is None:
            raise ConfigError(f"objective {name} needs --data.supervised_file (a TSV/JSONL pair/triple file)")
        o = self.objective
        positives = self.data.num_variants + self.data.num_dropout_views
        one_view = get_objective(name).uses_variants and positives < 1
        if one_view and o.contrastive_weight and not o.teacher_positive:
            raise ConfigError(
                "luse needs at least one positive: set data.num_variants or num_dropout_views >= 1 "
                "(or objective.contrastive_weight 0 for distillation alone, or objective.teacher_positive)"
            )
        if (self.data.teacher is not None or self.data.num_hard_negatives) and name not in UNSUPERVISED:
            raise ConfigError(
                f"data.teacher/num_hard_negatives come from the shards; objective {name} reads a pair file: "
                "unset them or train luse/simcse"
            )
        if self.data.num_hard_negatives and not get_objective(name).uses_hard_negatives:
            raise ConfigError(f"objective {name} takes no hard negatives; set data.num_hard_negatives to 0")
        if self.objective.mlm_weight and name not in UNSUPERVISED:
            raise ConfigError(
                f"objective.mlm_weight applies to luse and simcse only, not {name}; set it to 0"
            )
        if self.objective.mlm_weight and self.train.gradcache_chunk_size:
            raise ConfigError(
                "objective.mlm_weight is not supported with train.gradcache_chunk_size; set one of them to 0"
            )
        if self.train.gradcache_chunk_size and self.train.grad_accum_steps > 1:
            raise ConfigError("use either train.gradcache_chunk_size or train.grad_accum_steps > 1, not both")

    def num_views(self) -> int:
        """Views per sentence n: LUSE 1 + k + d, SimCSE 2, the supervised ones their columns."""
        d = self.data
        return get_objective(self.objective.name).num_views(d.num_variants, d.num_dropout_views)


def needs_teacher(cfg: Config) -> bool:
    """Does the objective read ``batch["teacher"]``? (Extend here when a new term reads it.)"""
    o = cfg.objective
    return o.distill_weight > 0 or o.kl_weight > 0 or o.teacher_positive


def check_against_environment(cfg: Config, world_size: int, cached_variants: int | None) -> None:
    """Checks that need the world size and the data's manifest; raise before any model is built."""
    from pipeline.train.queue import validate_queue_size

    per_rank, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    if per_rank % (world_size * accum):
        raise ConfigError(
            f"train.global_batch_size ({per_rank}) must be divisible by world size x grad_accum_steps "
            f"({world_size} x {accum} = {world_size * accum}); pick a multiple of {world_size * accum}"
        )
    if cfg.objective.queue_size:
        validate_queue_size(cfg.objective.queue_size, per_rank // accum)
    if (
        get_objective(cfg.objective.name).uses_variants
        and cached_variants is not None
        and cfg.data.num_variants > cached_variants
    ):
        raise ConfigError(
            f"data.num_variants={cfg.data.num_variants} but the shards in {cfg.data.shards} cache "
            f"{cached_variants} variants per sentence; set --data.num_variants <= {cached_variants} "
            "or re-run augment with more variants"
        )
