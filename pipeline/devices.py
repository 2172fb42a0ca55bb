"""Where a run computes, and why it cannot compute where it was asked to.

A GPU job whose torch sees no GPU must not train on CPU without a word. :func:`probe_cuda` reads what a
cluster user needs to know (torch build, driver, device files, GPUs, bf16) cheaply and without raising;
:func:`resolve_device` turns ``train.device`` (auto | cuda | cpu) and the job's GPU allocation into a
device or one :class:`DeviceError` line that says why there is no GPU and what to do;
:func:`bind_local_device` makes one-GPU-per-task bindings work (each process sees one device whatever its
LOCAL_RANK). ``python -m pipeline doctor`` reports the same probe line by line.

Every function takes its inputs (environment, probe) as arguments with the live values as defaults, so
tests fake a cluster without touching torch.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import re
import socket
import subprocess
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pipeline.errors import PipelineError

__all__ = [
    "CudaProbe",
    "DeviceError",
    "bind_local_device",
    "cuda_mismatch",
    "gpu_allocation",
    "probe_cuda",
    "resolve_device",
    "why_no_cuda",
]

log = logging.getLogger(__name__)

# The oldest Linux driver that runs any toolkit of a CUDA major version (NVIDIA's "minor version
# compatibility" table), for the message that asks for a newer driver.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# CUDA_VISIBLE_DEVICES values that hide every GPU ("NoDevFiles": SLURM's value when no GPU is bound)
HIDDEN = ("", "-1", "none", "NoDevFiles")
# Environment variables through which SLURM says GPUs were allocated to the job, job step or task.
SLURM_GPU_VARS = (
    "SLURM_STEP_GPUS",
    "SLURM_JOB_GPUS",
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK",
    "SLURM_TRES_PER_TASK",
)
CPU_HINT = "or set --train.device=cpu to train on CPU"


class DeviceError(PipelineError):
    """The run asked for GPUs and finds none usable (or a binding it cannot honour)."""


@dataclass(frozen=True)
class CudaProbe:
    """What this process can see of the GPUs; every field is None or empty where it cannot be read."""

    torch_version: str
    torch_cuda: str | None  # torch.version.cuda: the CUDA the wheel was built for; None = a CPU build
    available: bool  # torch.cuda.is_available()
    device_count: int = 0
    device_names: tuple[str, ...] = ()
    bf16: bool | None = None  # torch.cuda.is_bf16_supported() on device 0
    driver_version: str | None = None  # e.g. "580.65.06"
    driver_cuda: str | None = None  # the newest CUDA the driver runs, e.g. "13.0"
    device_files: tuple[str, ...] = ()  # /dev/nvidia0, /dev/nvidia1, ... (not nvidiactl, nvidia-uvm)
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES as set, None if unset
    init_error: str | None = None  # torch's CUDA initialisation warning, if it gave one
    nccl_version: str | None = None  # torch.cuda.nccl.version(), read when a GPU is available
    hostname: str = field(default_factory=socket.gethostname)


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = re.findall(r"\d+", text)
    return tuple(int(p) for p in parts[:2]) if parts else None


def _driver_version() -> str | None:
    """The kernel driver's version from /proc (no subprocess), else nvidia-smi's."""
    try:
        text = open("/proc/driver/nvidia/version", encoding="utf-8").read()
        found = re.search(r"Kernel Module(?: for \w+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    out = _nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _driver_cuda() -> str | None:
    """The newest CUDA the installed driver runs (cuDriverGetVersion of libcuda, else nvidia-smi's header).

    libcuda answers without a GPU and without creating a context: cheap, and safe before fork.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return f"{version.value // 1000}.{(version.value % 1000) // 10}"
    except (OSError, AttributeError):
        pass
    found = re.search(r"CUDA Version:\s*(\d+\.\d+)", _nvidia_smi([]) or "")
    return found.group(1) if found else None


def _nvidia_smi(args: list[str]) -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a wheel without NCCL, or a library that does not load
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def probe_cuda(env: Mapping[str, str] | None = None) -> CudaProbe:
    """Read torch's build, the driver and the GPUs of this process (never raises; a second or less)."""
    env = os.environ if env is None else env
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    init_error = next((str(w.message) for w in caught if "CUDA" in str(w.message)), None)
    files = tuple(sorted(f for f in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", f)))
    has_driver = bool(files) or os.path.exists("/proc/driver/nvidia/version")
    names: tuple[str, ...] = ()
    count, bf16, nccl = 0, None, None
    if available:
        count = torch.cuda.device_count()
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
        bf16 = bool(torch.cuda.is_bf16_supported())
        nccl = _nccl_version()
    return CudaProbe(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        available=available,
        device_count=count,
        device_names=names,
        bf16=bf16,
        driver_version=_driver_version() if has_driver else None,
        driver_cuda=_driver_cuda() if has_driver else None,
        device_files=files,
        visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        init_error=init_error,
        nccl_version=nccl,
    )


def gpu_allocation(env: Mapping[str, str] | None = None) -> str | None:
    """``NAME=value`` of the first variable that says GPUs were allocated to this job, else None.

    SLURM sets SLURM_*GPUS* when a job asks for GPUs (``--gpus*``, ``--gres=gpu``); a
    CUDA_VISIBLE_DEVICES naming devices counts too (it is how launchers and schedulers bind GPUs).
    """
    env = os.environ if env is None else env
    for name in SLURM_GPU_VARS:
        value = env.get(name, "").strip()
        if name == "SLURM_TRES_PER_TASK" and "gpu" not in value:
            continue
        is_count = name not in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")  # the others count GPUs; those list ids
        if value and value not in ("(null)", "N/A") and not (is_count and value == "0"):
            return f"{name}={value}"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in HIDDEN:
        return f"CUDA_VISIBLE_DEVICES={visible}"
    return None


def cuda_mismatch(probe: CudaProbe) -> tuple[str, str] | None:
    """``(verdict, message)`` when the driver is older than torch's CUDA build: "FAIL" for an older
    major version (nothing runs), "warn" for an older minor one (runs under minor-version
    compatibility, except kernels that need the newer toolkit); None when fine or unknown."""
    built, runs = _version_tuple(probe.torch_cuda), _version_tuple(probe.driver_cuda)
    if built is None or runs is None or runs >= built:
        return None
    need = MIN_DRIVER.get(built[0])
    need_text = f" (driver >= {need})" if need else ""
    fix = (
        f"install a torch built for CUDA <= {probe.driver_cuda} (pip install torch=={_base(probe)} "
        f"--index-url https://download.pytorch.org/whl/cu{runs[0]}{runs[1]}, or the nearest older cuXYZ "
        f"there) or ask for a driver that runs "
        f"CUDA {probe.torch_cuda}{need_text}"
    )
    driver = f"NVIDIA driver {probe.driver_version or '?'} runs CUDA up to {probe.driver_cuda}"
    if runs[0] < built[0]:
        return "FAIL", f"{driver} but torch {probe.torch_version} is built for CUDA {probe.torch_cuda}: {fix}"
    older = f"older than torch's CUDA {probe.torch_cuda} (minor-version compatibility)"
    return "warn", f"{driver}, {older}: {fix}"


def _base(probe: CudaProbe) -> str:
    return probe.torch_version.split("+")[0]


def why_no_cuda(probe: CudaProbe, allocation: str | None) -> str:
    """Why torch sees no GPU, and what to do: one line (no trailing period)."""
    host = probe.hostname
    if probe.torch_cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"torch {probe.torch_version} is a CPU-only build (torch.version.cuda is None): install the CUDA "
            f"build for this cluster's driver (pip install torch=={_base(probe)} --index-url "
            f"https://download.pytorch.org/whl/cuXYZ, XYZ <= the CUDA `nvidia-smi` shows; docs/training.md), "
            f"{CPU_HINT}"
        )
    if probe.visible_devices is not None and probe.visible_devices.strip() in HIDDEN:
        return (
            f"CUDA_VISIBLE_DEVICES={probe.visible_devices!r} hides every GPU on {host}: unset it or name the "
            f"GPUs to use, {CPU_HINT}"
        )
    if not probe.device_files and probe.driver_version is None:
        if allocation:
            return (
                f"{allocation} says GPUs were allocated, but {host} has no NVIDIA device or driver (no "
                f"/dev/nvidia*): check that the job step binds its GPUs (srun inherits --gpus-per-node only "
                f"from the allocation; add --gpus-per-task or --gres=gpu to srun), {CPU_HINT}"
            )
        return (
            f"no GPU was allocated and {host} has no NVIDIA device or driver (no /dev/nvidia*): request GPUs "
            f"(sbatch --gpus-per-node=N, srun --gpus-per-task=1), {CPU_HINT}"
        )
    mismatch = cuda_mismatch(probe)
    if mismatch is not None:
        return f"{mismatch[1]}, {CPU_HINT}"
    detail = f": {probe.init_error.strip().splitlines()[0]}" if probe.init_error else ""
    driver = probe.driver_version or "unknown"
    return (
        f"torch {probe.torch_version} (CUDA {probe.torch_cuda}) cannot use the GPUs of {host} (driver "
        f"{driver}, devices {', '.join(probe.device_files) or 'none'}){detail}: run `python -m pipeline "
        f"doctor` on that node for the details, {CPU_HINT}"
    )


def resolve_device(
    requested: str, probe: CudaProbe | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """``("cuda" | "cpu", why)`` for ``train.device`` = auto | cuda | cpu, or :class:`DeviceError`.

    A run that asked for GPUs (``cuda``, or ``auto`` with GPUs allocated to the job) and finds none
    fails with the reason; ``auto`` without an allocation and without a GPU trains on CPU and says so.
    """
    if requested == "cpu":
        return "cpu", "train.device=cpu"
    probe = probe_cuda(env) if probe is None else probe
    if probe.available:
        return "cuda", f"train.device={requested}"
    allocation = gpu_allocation(env)
    if requested == "cuda":
        raise DeviceError(f"train.device=cuda but torch sees no GPU: {why_no_cuda(probe, allocation)}")
    if allocation is not None:
        raise DeviceError(
            f"train.device=auto and GPUs were allocated ({allocation}) but torch sees none: "
            f"{why_no_cuda(probe, allocation)}"
        )
    return "cpu", "train.device=auto: no GPU allocated or visible, training on CPU"


def bind_local_device(env: dict[str, str] | None = None, device_count: int | None = None) -> int:
    """The CUDA device index of this process, made consistent for Accelerate and DeepSpeed.

    With one GPU bound per task (``srun --gpus-per-task=1``) every process sees one device, cuda:0,
    whatever its LOCAL_RANK; DeepSpeed and Accelerate's NCCL barrier would ask for cuda:LOCAL_RANK.
    LOCAL_RANK is then rewritten to the index it can use (the original stays in PIPELINE_LOCAL_RANK).
    A process that sees several GPUs but fewer than its LOCAL_RANK is a launch mistake: DeviceError.
    """
    env = os.environ if env is None else env
    count = torch.cuda.device_count() if device_count is None else device_count
    local = int(env.get("LOCAL_RANK", "0") or 0)
    if count < 1 or local < count:
        return local if count >= 1 else 0
    if count == 1:
        env["PIPELINE_LOCAL_RANK"] = str(local)
        env["LOCAL_RANK"] = "0"
        log.info("LOCAL_RANK %d sees one GPU (one GPU bound per task): using cuda:0", local)
        return 0
    raise DeviceError(
        f"LOCAL_RANK {local} but this process sees only {count} GPUs (CUDA_VISIBLE_DEVICES="
        f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}): start one process per GPU of the node "
        "(--ntasks-per-node = GPUs per node) or bind one GPU per task (srun --gpus-per-task=1)"
    )
