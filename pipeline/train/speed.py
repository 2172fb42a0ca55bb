"""Speed settings resolved at start from the device: precision, TF32, loader workers, pinned memory.

Each applies only where it helps and leaves CPU runs as they were: ``mixed_precision: auto`` is bf16 on a
CUDA GPU that has it and fp32 on CPU; TF32 is a CUDA switch; ``data.num_workers: auto`` takes the CPUs
per rank on CUDA and today's 2 on CPU; batches are pinned only for a CUDA device.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

CPU_WORKERS = 2  # data.num_workers: auto on CPU, the field's default before auto existed
MAX_WORKERS = 8  # beyond this a rank's tokenising outruns any step here (docs/BENCHMARKS.md, loader)


def resolve_precision(setting: str, device: str) -> str:
    """``train.mixed_precision`` as Accelerate takes it: ``auto`` becomes bf16 on a CUDA GPU that supports
    it, else no (fp32); other values are kept."""
    if setting != "auto":
        return setting
    if device == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    if device == "cuda":
        log.warning("train.mixed_precision=auto: this GPU has no bf16; training in fp32 (fp16 is opt-in)")
    return "no"


def apply_tf32(enabled: bool, device: str) -> None:
    """Allow TF32 for float32 matmuls and convolutions on CUDA (``train.tf32``); nothing on CPU."""
    if device != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


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
