"""Speed settings resolved at start from the device: precision, TF32, fused AdamW, DeepSpeed, loader
workers, pinned memory.

:func:`resolve_setup` resolves them once, with the device, into one :class:`DeviceSetup` that
``build`` hands on (the accelerator, the optimizer, the batches, the start-up line). Each applies only
where it helps: ``mixed_precision: auto`` is bf16 on a CUDA GPU that has it and on a CPU with native
bf16 (AMX-BF16, AVX512-BF16; pipeline/precision.py), fp32 elsewhere, and a resumed run keeps the
precision it started with; TF32 is a CUDA switch; ``optim.fused: auto`` is fused on CUDA only;
``data.num_workers: auto`` takes the CPUs per rank on CUDA and today's 2 on CPU; batches are pinned
only for a CUDA device. On CPU the C allocator keeps freed memory for reuse (:func:`keep_freed_memory`).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.devices import CudaProbe, resolve_device
from pipeline.errors import ConfigError
from pipeline.precision import resolve_cpu_precision

if TYPE_CHECKING:
    from pipeline.train.config import Config

log = logging.getLogger(__name__)

CPU_WORKERS = 2  # data.num_workers: auto on CPU, the field's default before auto existed
MAX_WORKERS = 8  # beyond this a rank's tokenising outruns any step here (docs/BENCHMARKS.md, loader)


@dataclass(frozen=True)
class DeviceSetup:
    """Where this rank trains and the speed settings resolved for it, once (:func:`resolve_setup`)."""

    device: str  # "cuda" or "cpu"
    why: str  # why that device (pipeline/devices.py), for the start-up line
    probe: CudaProbe  # what the process saw of the GPUs
    mixed_precision: str  # train.mixed_precision as Accelerate takes it: "no", "fp16" or "bf16"
    precision_why: str  # why that precision, for the start-up line
    fused: bool  # optim.fused, auto resolved
    deepspeed: dict[str, Any] | None = None  # train.deepspeed_config as the engine takes it
    workers: int = CPU_WORKERS  # data.num_workers, auto resolved (:func:`loader_workers`)


def resolve_setup(cfg: Config, probe: CudaProbe, recorded_precision: str | None = None) -> DeviceSetup:
    """The device for ``train.device`` (or a DeviceError that says why there is none) and what follows
    from it; TF32 is switched here, before anything runs on the device. ``recorded_precision``: the
    resolved precision of the checkpoint this run resumes, which ``auto`` keeps."""
    device, why = resolve_device(cfg.train.device, probe)
    apply_tf32(cfg.train.tf32, device)
    keep_freed_memory(device)
    precision, precision_why = resolve_precision(cfg.train.mixed_precision, device, recorded_precision)
    return DeviceSetup(
        device=device,
        why=why,
        probe=probe,
        mixed_precision=precision,
        precision_why=precision_why,
        fused=cfg.optim.fused is True or (cfg.optim.fused == "auto" and device == "cuda"),
        deepspeed=deepspeed_settings(cfg) if cfg.train.deepspeed_config else None,
        workers=loader_workers(cfg.data.num_workers, device),  # auto: the CPUs per rank on CUDA
    )


def deepspeed_settings(cfg: Config) -> dict[str, Any]:
    """``train.deepspeed_config`` with the run's batch sizes, accumulation and clipping filled in."""
    path = cfg.train.deepspeed_config
    if not path.is_file():
        raise ConfigError(f"train.deepspeed_config: {path} does not exist (see launch/deepspeed/)")
    ds = json.loads(path.read_text(encoding="utf-8"))
    t = cfg.train
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ds["gradient_accumulation_steps"] = t.grad_accum_steps
    ds["gradient_clipping"] = cfg.optim.grad_clip
    ds["train_micro_batch_size_per_gpu"] = t.global_batch_size // world // t.grad_accum_steps
    ds["train_batch_size"] = t.global_batch_size
    if isinstance(ds.get("bf16"), dict) and cfg.guard.max_nonfinite_steps:
        # The engine skips a bf16 step with non-finite gradients; the guard reads its verdict.
        ds["bf16"].setdefault("check_grad_overflow", True)
    return ds


def resolve_precision(setting: str, device: str, recorded: str | None = None) -> tuple[str, str]:
    """``(precision, why)``: ``train.mixed_precision`` as Accelerate takes it ("no", "fp16", "bf16").

    ``auto`` is bf16 on a CUDA GPU that supports it, and on a CPU with native bf16
    (:func:`pipeline.precision.resolve_cpu_precision`); fp32 ("no") elsewhere. A resumed run
    (``recorded``: the precision its checkpoint's config.yaml holds) keeps what it started with, so that
    a run moved to another CPU class resumes exactly. An explicit bf16 on a CPU without native bf16 runs
    after one warning; other values are kept.
    """
    what = "train.mixed_precision"
    if setting == "auto" and recorded in ("no", "bf16", "fp16"):
        return recorded, f"{what}=auto: {recorded}, as the checkpoint this run resumes"
    if device == "cuda":
        if setting != "auto":
            return setting, f"{what}={setting}"
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{what}=auto: bf16 on this GPU"
        log.warning("train.mixed_precision=auto: this GPU has no bf16; training in fp32 (fp16 is opt-in)")
        return "no", f"{what}=auto: this GPU has no bf16"
    if setting in ("auto", "bf16"):
        precision, why = resolve_cpu_precision(setting, what)
        return ("bf16" if precision == "bf16" else "no"), why
    return setting, f"{what}={setting}"


def apply_tf32(enabled: bool, device: str) -> None:
    """Allow TF32 for float32 matmuls and convolutions on CUDA (``train.tf32``); nothing on CPU."""
    if device != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")


def keep_freed_memory(device: str) -> bool:
    """On a CPU run under glibc, have malloc keep freed memory in the process for reuse, so that a
    step's large buffers are not handed back to the kernel and faulted in again at the next step.

    glibc serves every block over 32 MiB with its own mmap and unmaps it when freed. The embedding
    table's gradient is such a block (the main job's student: 98,613 x 384 floats, 151 MB): each step
    allocated it afresh, and zeroing it page by page took 28 ms of a 0.26 s step (docs/BENCHMARKS.md,
    "The distillation step on CPU"). With mmap off for malloc and no trimming, the freed block is reused.
    Left alone where the user chose an allocator (``LD_PRELOAD``, glibc's ``MALLOC_*`` variables), off
    glibc, and on CUDA (the GPU's memory has its own caching allocator). Returns whether it applied.
    """
    if device != "cpu" or platform.libc_ver()[0] != "glibc" or any(v in os.environ for v in MALLOC_ENV):
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    log.info(
        "CPU: malloc keeps freed memory for reuse (mallopt: no mmap, no trim)"
        if ok
        else "CPU: mallopt refused; malloc unchanged"
    )
    return ok


def cpus_available() -> int:
    """CPUs this process may run on (its affinity mask: what SLURM's --cpus-per-task grants), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def loader_workers(setting: int | str, device: str, per_rank: int | None = None) -> int:
    """``data.num_workers`` as a number: ``auto`` is min(8, CPUs per rank - 1), at least 1, on CUDA (one
    CPU stays with the rank's own process), and 2 on CPU (where the workers compete with the training
    threads for the same cores)."""
    if setting != "auto":
        return int(setting)
    if device != "cuda":
        return CPU_WORKERS
    per_rank = cpus_per_rank() if per_rank is None else per_rank
    return max(1, min(MAX_WORKERS, per_rank - 1))


def cpus_per_rank() -> int:
    """CPUs for this rank: under srun, which starts one task per rank (launch/slurm/pretrain.sbatch),
    the task's own SLURM_CPUS_PER_TASK; else the CPUs this process may use shared by the node's ranks
    (torchrun and Accelerate start them from one task and set LOCAL_WORLD_SIZE)."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if os.environ.get("SLURM_STEP_ID") and slurm.isdigit():
        return max(1, min(int(slurm), cpus_available()))
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, cpus_available() // (int(local) if local.isdigit() and int(local) > 0 else 1))
