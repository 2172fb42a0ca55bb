"""Build everything a training run needs, in small ``build_*`` steps, into one :class:`Trainer`.

Order matters: the process group first (Accelerate), then config checks that need the world size and
the data, then tokenizer and model (identical on every rank), optimizer, queue and momentum encoder,
the data stream; then a resume loads the saved states into the *unwrapped* objects; only then are
model and optimizer handed to Accelerate (DDP / DeepSpeed wrap them).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from pipeline import distributed as dist
from pipeline.config import from_dict, to_dict
from pipeline.data.collate import MLMCollator, PairCollator, PairShardCollator, ViewCollator, token_layout
from pipeline.data.holdout import HeldOut, read_holdout, split_blocks
from pipeline.data.labelled import memory_columns
from pipeline.data.pairs import read_records
from pipeline.data.sources import pair_order
from pipeline.data.stream import BatchStream, MemorySource, ShardSource, index_shards
from pipeline.data.token_ids import tokenising_on_gpu
from pipeline.devices import bind_local_device, probe_cuda
from pipeline.errors import ConfigError, InputError, PipelineError
from pipeline.evaluate.sts import PairSet, read_pair_file
from pipeline.losses.legacy import split_objective
from pipeline.losses.terms import TermContext, TrainLoss
from pipeline.model import SentenceEncoder, build_char_vocab, build_scratch_backbone, make_tokenizer
from pipeline.model.compile import prepare_encoder
from pipeline.model.encoder import load_tokenizer as load_model_tokenizer
from pipeline.model.heads import MLMHead, TrainModule
from pipeline.model.layers import keep_layers, reinitialise, set_dropout
from pipeline.model.vocab import SCRATCH_SMALL, read_model_config, unk_rate, write_vocab
from pipeline.resources import EVAL_DIR
from pipeline.shards import ShardSet, read_shard, read_shard_set, shard_paths
from pipeline.train.callbacks import Callbacks
from pipeline.train.checkpoint import Checkpointer, check_compatible
from pipeline.train.config import Config, OptimConfig, resolve_saved_paths
from pipeline.train.metrics import MetricsLogger
from pipeline.train.plan import DataPlan, check_against_data
from pipeline.train.schedule import LRSchedule
from pipeline.train.signals import PreemptionHandler
from pipeline.train.speed import DeviceSetup, loader_workers, resolve_setup

log = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"


@dataclass
class TrainState:
    """Counters that must survive a restart (the data position lives in the stream's cursor)."""

    step: int = 0
    samples_seen: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    # the non-finite guard and the spike detector (pipeline/train/guard.py), kept in every checkpoint
    nonfinite_skipped: int = 0  # steps skipped in all
    nonfinite_streak: int = 0  # steps skipped in a row
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # one record per spike rollback
    spike: dict[str, Any] | None = None  # the spike detector's state (guard.spike_factor)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a checkpoint written before a field existed keeps that field's default
        self.__dict__.update(state)


@dataclass(kw_only=True)
class Trainer:
    """Every piece of a run, built once by :func:`build` (keyword arguments only)."""

    cfg: Config
    run_config: dict[str, Any]  # cfg resolved, as config.yaml and every checkpoint record it
    accelerator: Any
    module: TrainModule  # unwrapped
    model: nn.Module  # what Accelerate returned (DDP / DeepSpeed engine / the module itself)
    optimizer: Any
    schedule: LRSchedule
    stream: BatchStream
    loss: TrainLoss  # the weighted terms of cfg.loss, built once; each holds its own state (a queue)
    state: TrainState
    metrics: MetricsLogger
    total_steps: int
    checkpointer: Checkpointer | None = None
    preemption: PreemptionHandler | None = None
    sts_valid: PairSet | None = None  # rank 0 only: the STS-B valid pairs scored by evaluate()
    holdout: HeldOut | None = None  # rank 0 only: data.holdout_rows's rows, for the teacher agreement
    callbacks: Callbacks = field(default_factory=Callbacks)  # hooks into the run (train() sets them)
    engine: Any = None  # the step's engine (pipeline/train/engines.py), chosen once by train()
    guard: Any = None  # the guard's part in each step (engines.GuardPolicy), decided once by train()

    @property
    def encoder(self) -> SentenceEncoder:
        return self.module.encoder

    def states(self) -> dict[str, Any]:
        """Everything identical on all ranks that a restart needs, for the checkpointer."""
        out: dict[str, Any] = {"train_state": self.state, "data": self.stream, "schedule": self.schedule}
        if not self.cfg.train.deepspeed_config:  # else the engine saves it (ZeRO-partitioned)
            out["optimizer"] = self.optimizer
        if self.accelerator.scaler is not None:
            out["grad_scaler"] = self.accelerator.scaler
        if self.module.head is not None:
            out["head"] = self.module.head
        if self.module.mlm_head is not None:
            out["mlm_head"] = self.module.mlm_head
        out.update(self.loss.states())  # the terms' own (luse: queue, momentum_encoder; kl: teacher_queue)
        return out

    def rank_states(self) -> dict[str, Any]:
        """Per-rank states: the RNG streams (dropout masks differ per rank).

        Under DeepSpeed the ZeRO-partitioned optimizer is saved by the engine's own checkpoint (the
        checkpointer's ``engine``), not here.
        """
        from pipeline.train.rng import RNGState

        return {"rng": RNGState()}

    def close(self) -> None:
        self.metrics.close()
        if self.preemption is not None:
            self.preemption.uninstall()
        dist.shutdown()  # else gloo aborts at exit (status 134) and hides the run's exit code


# ------------------------------------------------------------------------------------------ pieces
def build_accelerator(cfg: Config) -> tuple[Any, DeviceSetup]:
    """The process group and the device, checked first: a run that asked for GPUs and has none fails
    here, in seconds, before anything is built (pipeline/devices.py says why and what to do). Returns
    the accelerator and the :class:`~pipeline.train.speed.DeviceSetup` it was made with."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    from pipeline.train.hangs import init_process_group

    setup = resolve_setup(cfg, probe_cuda())
    no_gpu = setup.device == "cpu"
    if not no_gpu:
        torch.cuda.set_device(bind_local_device())  # one GPU per task: cuda:0 whatever the LOCAL_RANK
    # Accelerate drops DeepSpeed when told to use the CPU, so under DeepSpeed a GPU-less run keeps
    # cpu=False and gets the gloo backend explicitly (else Accelerate reports one process).
    cpu = no_gpu and setup.deepspeed is None
    if setup.deepspeed is not None and os.environ.pop("ACCELERATE_USE_CPU", None):
        log.info("DeepSpeed: ignoring ACCELERATE_USE_CPU (DeepSpeed runs on CPU over gloo by itself)")
    backend = "gloo" if no_gpu else "nccl"
    # Our own process group, with train.collective_timeout; Accelerate and DeepSpeed use it as it is.
    timeout_s = cfg.train.collective_timeout
    init_process_group(backend, timeout_s)
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if no_gpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]
    elif not no_gpu:
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="nccl", timeout=timeout)]
    if setup.deepspeed is not None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=setup.deepspeed)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=setup.mixed_precision,
        gradient_accumulation_steps=cfg.train.grad_accum_steps,
        **kwargs,
    )
    if accelerator.is_main_process:
        log.info("%s", device_line(accelerator, setup, timeout_s))
    return accelerator, setup


def device_line(accelerator: Any, setup: DeviceSetup, timeout_s: float) -> str:
    """The run's one start-up line: device, backend, world and nodes, precision, torch and driver."""
    probe, ds = setup.probe, setup.deepspeed
    world = accelerator.num_processes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    nodes = -(-world // local) if local else int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1)
    backend = torch.distributed.get_backend() if dist.is_dist() else "none (one process)"
    d = accelerator.device
    if d.type == "cuda":
        d = torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)
        name = probe.device_names[d.index] if len(probe.device_names) > d.index else "GPU"
        bf16 = "yes" if probe.bf16 else "no"
        tf32 = "on" if torch.backends.cuda.matmul.allow_tf32 else "off"
        where = f"device {d} ({name}, bf16 {bf16}, TF32 matmul {tf32})"
    else:
        where = f"device {d} ({setup.why})"
    precision = setup.mixed_precision if setup.mixed_precision != "no" else "fp32"
    if ds is not None:
        enabled = [k for k in ("bf16", "fp16") if isinstance(ds.get(k), dict) and ds[k].get("enabled")]
        half = enabled[0] if enabled else None
        stage = (ds.get("zero_optimization") or {}).get("stage", 0)
        precision += f", DeepSpeed ZeRO-{stage} {half or 'fp32'}"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    driver = (
        f"driver {probe.driver_version or '?'} (CUDA {probe.driver_cuda or '?'})"
        if probe.driver_version or probe.driver_cuda
        else "no NVIDIA driver"
    )
    return (
        f"start: {where}, backend {backend}, {world} process{'es' if world > 1 else ''} on {nodes} "
        f"node{'s' if nodes > 1 else ''}, precision {precision}, torch {torch.__version__} ({build}), "
        f"{driver}, collective timeout {timeout_s:g} s"
    )


def training_texts(cfg: Config, limit: int) -> list[str]:
    """Sentences of the training data (never the evaluation sets), for the character vocabulary."""
    loss = cfg.terms()
    if not loss.unsupervised:  # a supervised file: its texts, not its labels
        records = read_records(cfg.data.supervised_file, loss.data)
        return [t for r in records for t in r[:-1] if isinstance(t, str)][:limit]
    texts: list[str] = []
    for path in shard_paths(cfg.data.shards):
        for table in read_shard(path):
            texts.extend(table.column("text").to_pylist())
            if len(texts) >= limit:
                return texts[:limit]
    return texts


def build_tokenizer(cfg: Config) -> Any:
    """The scratch model's char tokenizer: built on rank 0 from training text, reused on resume."""
    folder = cfg.run_dir / TOKENIZER_DIR
    if dist.is_main_process() and not (folder / "vocab.txt").is_file():
        m = cfg.model
        texts = training_texts(cfg, m.vocab_max_sentences)
        vocab = build_char_vocab(texts, m.vocab_min_count, m.vocab_max_size)
        folder.mkdir(parents=True, exist_ok=True)
        write_vocab(vocab, folder / "vocab.txt")
        make_tokenizer(folder / "vocab.txt").save_pretrained(folder)
        log.info("built a %d-token character vocabulary from the training data in %s", len(vocab), folder)
    dist.barrier()
    return make_tokenizer(folder / "vocab.txt")


def load_tokenizer(cfg: Config) -> tuple[Any, str]:
    """(tokenizer, text prefix) of the encoder :func:`build_encoder` builds, before its weights: the data
    checks (:func:`pipeline.train.plan.check_against_data`) and the batches need them."""
    m = cfg.model
    if m.name_or_path:
        return load_model_tokenizer(m.name_or_path, m.prefix)
    return build_tokenizer(cfg), m.prefix or ""


def build_encoder(cfg: Config, tokenizer: Any = None) -> SentenceEncoder:
    """The encoder of ``model``; ``tokenizer``: its own, when :func:`load_tokenizer` loaded it already."""
    m = cfg.model
    tokenizer = load_tokenizer(cfg)[0] if tokenizer is None else tokenizer
    if m.name_or_path:
        encoder = SentenceEncoder.from_pretrained(
            m.name_or_path, pooling=m.pooling, max_length=cfg.data.max_length, prefix=m.prefix,
            tokenizer=tokenizer,
        )  # fmt: skip
        if m.layers is not None:  # the layers kept first: their dropout set, their weights re-drawn
            keep_layers(encoder.backbone, m.layers)
        if m.dropout is not None:
            set_dropout(encoder.backbone, m.dropout)
        if m.random_init:
            reinitialise(encoder.backbone, cfg.train.seed)
        return encoder
    path = m.scratch_config if m.scratch_config is not None else SCRATCH_SMALL
    if not path.is_file():
        raise ConfigError(f"model.scratch_config: {path} does not exist; point it to a BertConfig JSON")
    dropout = (
        {}
        if m.dropout is None
        else {"hidden_dropout_prob": m.dropout, "attention_probs_dropout_prob": m.dropout}
    )
    backbone = build_scratch_backbone({**read_model_config(path), **dropout}, len(tokenizer), cfg.train.seed)
    return SentenceEncoder(
        backbone, tokenizer, pooling=m.pooling, max_length=cfg.data.max_length, prefix=m.prefix or ""
    )


def report_unk_rate(encoder: SentenceEncoder, metrics: MetricsLogger, lines: int = 500) -> dict[str, float]:
    """[UNK] share of tokens (:func:`pipeline.model.unk_rate`) on each evaluation set (first ``lines``
    pairs), logged and recorded."""
    rates = {}
    for path in sorted(EVAL_DIR.glob("*.tsv")):
        texts = []
        for line in path.read_text(encoding="utf-8").splitlines()[:lines]:
            texts.extend(f for f in line.split("\t") if f and not f.lstrip("-").isdigit())
        rates[path.stem] = round(unk_rate(encoder.tokenizer, texts), 5)
    log.info("[UNK] rate on the evaluation sets: %s", rates)
    metrics.log({"event": "unk_rate", **rates})
    return rates


def build_optimizer(o: OptimConfig, module: nn.Module, fused: bool) -> torch.optim.Optimizer:
    """AdamW; biases and LayerNorm weights get no weight decay (they are not scale-like). ``fused``:
    ``optim.fused`` resolved for the device (:class:`~pipeline.train.speed.DeviceSetup`)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kernel = True if fused else None  # None: torch's own choice (a per-tensor loop on CPU)
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=kernel)


def autocast_bf16_on_cpu(module: nn.Module) -> None:
    """Run ``module``'s forward under CPU bf16 autocast, outputs back in fp32.

    Accelerate (1.15) with mixed_precision=bf16 on CPU neither wraps the prepared forward nor autocasts
    in ``accelerator.autocast()``: the run stayed fp32. On GPU Accelerate does this itself.
    """
    forward = module.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(*args, **kwargs)
        return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()

    module.forward = autocast_forward


def shard_blocks(shards: ShardSet, verify: bool, rank: int) -> list[Any]:
    """Every rank reads the small block indexes itself; rank 0 alone checks their sha256s and broadcasts
    only whether they passed (a message or None), never the index (it grows with the data)."""
    error: str | None = None
    try:
        blocks = index_shards(shards, verify=verify and rank == 0, check_blocks=verify)
    except PipelineError as exc:
        blocks, error = [], f"{type(exc).__name__}\0{exc}"
    error = dist.broadcast_object(error)
    if error is not None:
        kind, message = error.split("\0", 1)
        raise (InputError if kind == "InputError" else ConfigError)(message)
    return blocks


def build_stream(
    cfg: Config,
    plan: DataPlan | ShardSet | None,
    tokenizer: Any,
    rank: int,
    world: int,
    prefix: str = "",
    device: str = "cpu",
) -> BatchStream:
    """This rank's batches, as ``plan`` (:func:`pipeline.train.plan.check_against_data`) resolved them;
    a shard set (None: the supervised file) is resolved here first. ``prefix`` is the encoder's text
    prefix, put before every text once. On ``device`` cuda the batches are pinned and
    ``data.num_workers: auto`` takes the CPUs per rank (pipeline/train/speed.py)."""
    d, t = cfg.data, cfg.train
    workers = loader_workers(d.num_workers, device)
    if not isinstance(plan, DataPlan):
        plan = check_against_data(cfg, plan, world, tokenizer, prefix)
    model = cfg.model.name_or_path
    tokenising_on_gpu(device, plan.shard_set, plan.token_ids, plan.pairs, d.max_length, model)  # one line
    order: dict[str, Any] = {}  # pair shards: their batch order by source (pipeline/data/sources.py)
    if plan.pairs:  # pair shards: anchors then positives (docs/pairs.md)
        blocks = shard_blocks(plan.shard_set, d.verify_shards, rank)
        # with teacher_positive: distill reads both
        collate = PairShardCollator(
            tokenizer, d.max_length, prefix, plan.teacher, plan.text_hashes, plan.num_dropout_views
        )  # luse on pairs: d dropout re-encodings of the anchors
        source: Any = ShardSource(blocks, collate.columns)
        order = pair_order(d, plan.shard_set, blocks)
    elif plan.shard_set is not None:
        blocks = shard_blocks(plan.shard_set, d.verify_shards, rank)
        blocks, _ = split_blocks(blocks, d.holdout_rows, d.shards)  # data.holdout_rows: never in a batch
        collate = ViewCollator(
            tokenizer, d.max_length, plan.num_variants, plan.num_dropout_views, prefix, plan.teacher,
            plan.num_hard_negatives, plan.token_ids, plan.text_hashes,
        )  # fmt: skip
        source = ShardSource(blocks, collate.columns)
        if plan.mlm_probability is not None:  # masks drawn in the loader workers, from the data cursor
            collate = MLMCollator(collate, tokenizer, t.seed, plan.mlm_probability)
    else:  # a supervised file (and its teacher vectors: pipeline/data/labelled.py)
        labels = plan.label_dtype is not None
        columns = memory_columns(d.supervised_file, plan.source, plan.num_texts, labels, plan.pair_teacher,
                                 d.holdout_rows)  # fmt: skip
        text_columns = [f"text{i}" for i in range(plan.num_texts)]
        collate = PairCollator(tokenizer, d.max_length, text_columns, plan.label_dtype, prefix, plan.teacher)
        source = MemorySource(columns, text_columns)
    collate = token_layout(collate, tokenizer.pad_token_id, d.max_length, t)  # unpadded / bucketed widths
    window = d.bucket_window if d.length_bucketing else 0
    return BatchStream(
        source, collate, t.global_batch_size, rank, world, t.seed, workers, d.prefetch_factor, window,
        pin_memory=device == "cuda", **order,
    )  # fmt: skip


def build_checkpointer(cfg: Config, model: nn.Module) -> Checkpointer:
    """The seam to checkpointing (pipeline/train/checkpoint.py); ``model`` is what ``prepare`` returned."""
    engine = model if cfg.train.deepspeed_config else None  # ZeRO state: the engine's own checkpoint
    return Checkpointer(cfg.run_dir, keep_last=cfg.checkpoint.keep_last, engine=engine)


def read_saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config as this version resolves it: an ``objective:`` section of an earlier
    version is read into ``loss`` as loading that config would (:mod:`pipeline.losses.legacy`), and
    one of nulls dropped, so such a run resumes; its file fields resolved from here, as the current
    config's are (:func:`pipeline.train.config.resolve_saved_paths`)."""
    rest, legacy = split_objective(saved)
    return to_dict(from_dict(Config, saved)) if legacy else resolve_saved_paths(rest)


def resume(trainer: Trainer) -> None:
    """Load the newest valid checkpoint (``resume: auto``) or a given one, after ``prepare``.

    After ``prepare`` because a DeepSpeed engine loads its own (ZeRO-partitioned) state; under DDP the
    wrapped and unwrapped module share their parameters, so loading into the unwrapped one suffices.
    """
    wanted = trainer.cfg.resume
    if trainer.checkpointer is None or wanted == "never":
        return
    path = trainer.checkpointer.latest() if wanted == "auto" else Path(wanted)
    if path is None:
        return
    check_compatible(read_saved_config(trainer.checkpointer.saved_config(path)), trainer.run_config)
    trainer.checkpointer.load(path, trainer.encoder, trainer.states(), trainer.rank_states())
    log.info(
        "resumed from %s at step %d (%d samples seen)", path, trainer.state.step, trainer.state.samples_seen
    )


def write_run_config(run_dir: Path, run_config: dict[str, Any]) -> None:
    """RUN_DIR/config.yaml: the resolved config (rank 0)."""
    if dist.is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(run_config, sort_keys=False, allow_unicode=True)
        (run_dir / "config.yaml").write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------------------------ build
def build(cfg: Config) -> Trainer:
    """Every piece of a run, checked and (if there is a checkpoint) resumed, ready for :func:`train`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # loader workers tokenise; no nested pools
    from pipeline.train.determinism import enable_determinism  # before CUDA is initialised

    enable_determinism(cfg.train.deterministic)
    accelerator, setup = build_accelerator(cfg)
    # config.yaml, the checkpoints and the loop see the resolved precision and fused AdamW
    cfg.train.mixed_precision, cfg.optim.fused = setup.mixed_precision, setup.fused
    run_config = to_dict(cfg)  # the resolved config, once: config.yaml and every checkpoint record it
    world, rank = accelerator.num_processes, accelerator.process_index
    loss = cfg.terms()
    shard_set = read_shard_set(cfg.data.shards) if loss.unsupervised else None  # the manifest, once
    tokenizer, prefix = load_tokenizer(cfg)  # before the weights: the data checks need it
    plan = check_against_data(cfg, shard_set, world, tokenizer, prefix)  # every check of the data
    write_run_config(cfg.run_dir, run_config)
    dist.barrier()
    started = time.perf_counter()  # the batches (index checks, a supervised file read) before any model
    stream = build_stream(cfg, plan, tokenizer, rank, world, prefix, accelerator.device.type)
    planned = time.perf_counter() - started

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    started = time.perf_counter()
    encoder = build_encoder(cfg, tokenizer)
    log.info("model: %s built in %.1f s", cfg.model.name_or_path or "scratch", time.perf_counter() - started)
    if cfg.model.freeze_embeddings:
        encoder.backbone.get_input_embeddings().requires_grad_(False)
    head = loss.build_head(encoder.dim, plan.teacher_dim or 0)  # the teacher's width from the manifest
    mlm_head = None
    if loss.needs.mlm_probability is not None:  # after the encoder: without MLM the initial weights as before
        bc = encoder.backbone.config
        mlm_head = MLMHead(encoder.dim, bc.vocab_size, getattr(bc, "layer_norm_eps", 1e-12))
    module = TrainModule(encoder, head, mlm_head).to(accelerator.device)
    torch.manual_seed(cfg.train.seed + 1000 * rank)  # dropout differs per rank, and reproducibly
    metrics = MetricsLogger(cfg.run_dir, enabled=accelerator.is_main_process)
    if accelerator.is_main_process:
        report_unk_rate(encoder, metrics)
    total = cfg.train.max_steps or cfg.train.epochs * stream.batches_per_epoch
    optimizer = build_optimizer(cfg.optim, module, setup.fused)
    # The loss, built once: each term with its own state (luse's queue and momentum encoder, kl's teacher
    # queue), from the encoder as initialised and the teacher's width in the manifest.
    terms = TrainLoss(loss, TermContext(encoder, encoder.dim, plan.teacher_dim or 0, loss.needs))
    terms.to(accelerator.device)
    precision = setup.mixed_precision
    if precision == "bf16" and accelerator.device.type == "cpu":
        for m in (module, *(copy.encoder for copy in terms.copies())):
            autocast_bf16_on_cpu(m)
    if accelerator.device.type == "cuda" and precision != "no":
        for copy in terms.copies():  # a momentum encoder: Accelerate autocasts the online model only
            copy.autocast = torch.bfloat16 if precision == "bf16" else torch.float16
    log.info(
        "data: %d samples in %d blocks, %d global batches of %d per epoch, %d dropped per epoch; %d steps "
        "in all (planned in %.2f s)",
        stream.num_items,
        len(stream.block_rows),
        stream.batches_per_epoch,
        cfg.train.global_batch_size,
        stream.dropped_per_epoch,
        total,
        planned,
    )
    prepare_encoder(module.encoder, cfg.train)  # train.unpadded/pad_to_multiple_of/compile
    model, optimizer = accelerator.prepare(module, optimizer)
    o = cfg.optim
    schedule = LRSchedule(optimizer, o.lr, o.warmup_steps, total, o.schedule, o.min_lr_ratio)
    sts_valid = None
    if accelerator.is_main_process:
        sts_valid = read_pair_file(EVAL_DIR / "STS-B.valid.tsv").first(cfg.train.eval_max_pairs)
    holdout = read_holdout(cfg.data, plan) if accelerator.is_main_process and cfg.data.holdout_rows else None
    trainer = Trainer(
        cfg=cfg,
        run_config=run_config,
        accelerator=accelerator,
        module=module,
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        stream=stream,
        loss=terms,
        state=TrainState(),
        metrics=metrics,
        total_steps=total,
        checkpointer=build_checkpointer(cfg, model),
        preemption=PreemptionHandler().install(),
        sts_valid=sts_valid,
        holdout=holdout,
    )
    resume(trainer)
    return trainer
