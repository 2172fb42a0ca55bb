"""Build everything a training run needs into one :class:`Trainer`, a package at a time.

Order matters: the process group first (Accelerate); the loss's terms parsed and the config resolved;
the encoder's tokenizer; then the data, whole, before any weights (the plan: the config held against the
world size and the data; the batches, pipeline/data/build.py; the held-out rows), so that a mistake there
fails in seconds, and only then ``config.yaml``; then the model (encoder and heads, identical on every
rank), the loss's terms with their state (queue, momentum encoder: pipeline/losses/terms.py), the
optimizer and the schedule. A resume loads the saved states into the *unwrapped* objects after the model
and optimizer are handed to Accelerate (DDP / DeepSpeed wrap them).
"""

from __future__ import annotations

import contextlib
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
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline import distributed as dist
from pipeline.config import from_dict, to_dict
from pipeline.data.build import build_stream, training_texts
from pipeline.data.holdout import HeldOut, read_holdout
from pipeline.data.stream import BatchStream
from pipeline.devices import bind_local_device, probe_cuda
from pipeline.errors import ConfigError
from pipeline.losses.legacy import split_objective
from pipeline.losses.terms import TermContext, TrainLoss
from pipeline.model import SentenceEncoder, build_char_vocab, build_scratch_backbone, make_tokenizer
from pipeline.model.compile import compile_encoder, prepare_encoder
from pipeline.model.encoder import load_tokenizer as load_model_tokenizer
from pipeline.model.heads import MLMHead, TrainModule
from pipeline.model.layers import keep_layers, reinitialise, set_dropout
from pipeline.model.vocab import SCRATCH_SMALL, eval_unk_rates, read_model_config, write_vocab
from pipeline.shards import read_shard_set
from pipeline.train.callbacks import Callbacks
from pipeline.train.checkpoint import Checkpointer, CheckpointError, check_compatible
from pipeline.train.config import Config, OptimConfig, resolve_saved_paths
from pipeline.train.metrics import MetricsLogger
from pipeline.train.plan import check_against_data
from pipeline.train.schedule import LRSchedule
from pipeline.train.signals import PreemptionHandler
from pipeline.train.speed import DeviceSetup, resolve_setup

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

    setup = resolve_setup(cfg, probe_cuda(), recorded_precision(cfg))
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


def recorded_precision(cfg: Config) -> str | None:
    """The resolved ``train.mixed_precision`` of the checkpoint this run will resume, which ``auto``
    keeps (a run moved to a CPU of another class resumes as it started); None for a fresh run."""
    if cfg.train.mixed_precision != "auto" or cfg.resume == "never":
        return None
    path = Checkpointer(cfg.run_dir).latest(verify=False) if cfg.resume == "auto" else Path(cfg.resume)
    if path is None:
        return None
    try:
        saved = Checkpointer.saved_config(path)
    except CheckpointError:  # resume() says what is wrong with it
        return None
    return (saved.get("train") or {}).get("mixed_precision")


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
    precision += f" ({setup.precision_why})"
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


def build_tokenizer(cfg: Config) -> Any:
    """The scratch model's char tokenizer: built on rank 0 from training text, reused on resume."""
    folder = cfg.run_dir / TOKENIZER_DIR
    if dist.is_main_process() and not (folder / "vocab.txt").is_file():
        m, loss = cfg.model, cfg.terms()
        texts = training_texts(cfg.data, loss.data, m.vocab_max_sentences)  # never the evaluation sets
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

    A forward that records gradients computes attention with SDPA's math kernel: in bf16, torch's CPU
    flash kernel took 2.3-11x the math kernel's time for forward + backward at 16-64 tokens, and the same
    at 128 (benchmarks/cpu_attention.py; docs/BENCHMARKS.md, "The distillation step on CPU"). A forward
    without gradients (a momentum encoder's keys) keeps the flash kernel, the faster one there. With
    attention dropout torch takes the math kernel on CPU anyway; this is for dropout 0 (the main job's).
    """
    forward = module.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        attention = sdpa_kernel(SDPBackend.MATH) if torch.is_grad_enabled() else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), attention:
            out = forward(*args, **kwargs)
        return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()

    module.forward = autocast_forward


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
    world, rank, main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
    loss = cfg.terms()  # the config's loss list, parsed once
    run_config = to_dict(cfg)  # the resolved config, once: config.yaml and every checkpoint record it
    shard_set = read_shard_set(cfg.data.shards) if loss.unsupervised else None  # the manifest, once
    tokenizer, prefix = load_tokenizer(cfg)  # before the weights: the data checks need it

    # The data, whole, before any model: every check of the config against it (the plan), this rank's
    # batches (index checks, a supervised file read), the rows held out of them for the evaluation.
    plan = check_against_data(cfg, shard_set, world, tokenizer, prefix)
    started = time.perf_counter()
    stream = build_stream(
        plan, cfg.data, cfg.train, tokenizer, rank, world, prefix, setup.device, setup.workers,
        cfg.model.name_or_path,
    )  # fmt: skip
    planned = time.perf_counter() - started
    holdout = read_holdout(cfg.data, plan) if main and cfg.data.holdout_rows else None  # rank 0's
    write_run_config(cfg.run_dir, run_config)  # once the data passed its checks
    dist.barrier()

    # The model, identical on every rank, the loss's head and its terms, built once, each with its own
    # state (luse's queue and momentum encoder, kl's teacher queue) from the encoder as initialised.
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    started = time.perf_counter()
    encoder = build_encoder(cfg, tokenizer)
    log.info("model: %s built in %.1f s", cfg.model.name_or_path or "scratch", time.perf_counter() - started)
    if cfg.model.freeze_embeddings:
        encoder.backbone.get_input_embeddings().requires_grad_(False)
    prepare_encoder(encoder, cfg.train, accelerator.device)  # before the terms copy it: copies inherit it
    head = loss.build_head(encoder.dim, plan.teacher_dim or 0)  # the teacher's width from the manifest
    terms = TrainLoss(loss, TermContext(encoder, encoder.dim, plan.teacher_dim or 0, loss.needs))
    copies = terms.copies()  # encoder copies the terms run (a momentum encoder): precision below
    mlm_head = None
    if loss.needs.mlm_probability is not None:  # after the encoder: without MLM the initial weights as before
        bc = encoder.backbone.config
        mlm_head = MLMHead(encoder.dim, bc.vocab_size, getattr(bc, "layer_norm_eps", 1e-12))
    module = TrainModule(encoder, head, mlm_head).to(accelerator.device)
    terms.to(accelerator.device)
    torch.manual_seed(cfg.train.seed + 1000 * rank)  # dropout differs per rank, and reproducibly
    compile_encoder(module.encoder, cfg.train.compile)  # after the copies: a momentum encoder stays eager
    unk_rates = eval_unk_rates(encoder.tokenizer) if main else {}  # [UNK] share on the evaluation sets

    # The training state around them: precision, the log, the optimizer and its schedule.
    precision = setup.mixed_precision
    if precision == "bf16" and accelerator.device.type == "cpu":
        for m in (module, *(copy.encoder for copy in copies)):
            autocast_bf16_on_cpu(m)
    if accelerator.device.type == "cuda" and precision != "no":
        for copy in copies:  # a momentum encoder: Accelerate autocasts the online model only
            copy.autocast = torch.bfloat16 if precision == "bf16" else torch.float16
    metrics = MetricsLogger(cfg.run_dir, enabled=main)
    if main:
        log.info("[UNK] rate on the evaluation sets: %s", unk_rates)
        metrics.log({"event": "unk_rate", **unk_rates})
    total = cfg.train.total_steps(stream.batches_per_epoch)
    optimizer = build_optimizer(cfg.optim, module, setup.fused)
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
    model, optimizer = accelerator.prepare(module, optimizer)
    o = cfg.optim
    schedule = LRSchedule(optimizer, o.lr, o.warmup_steps, total, o.schedule, o.min_lr_ratio)
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
        holdout=holdout,
    )
    resume(trainer)
    return trainer
