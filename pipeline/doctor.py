"""``python -m pipeline doctor``: the environment report a cluster user runs first.

One line per check, each with a verdict (``ok``, ``warn``, ``FAIL``) and, where something is wrong, the
fix: Python and torch, torch's CUDA build against the driver, the GPUs and bf16, NCCL, DeepSpeed and its
prebuilt ops, faiss, the run directory (writable, free space), and, on several SLURM tasks or with a
rendezvous address set, whether every node sees the same run directory and reaches ``MASTER_ADDR:
MASTER_PORT``, and, for gloo across nodes, that the host name does not resolve to a loopback address
(else ``GLOO_SOCKET_IFNAME`` must name the interface). The exit status is 1 when a training run would
fail (any FAIL), else 0.

    python -m pipeline doctor --run_dir /shared/runs/big
    srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 .venv/bin/python -m pipeline doctor --run_dir ...

Under srun every task runs the checks; task 0 prints the whole report, the others only their warn and
FAIL lines, prefixed with their host and task. The GPU checks are those of training itself
(pipeline/devices.py), so a run that doctor passes does not stop on them.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config import option
from pipeline.devices import CudaProbe, DeviceError, cuda_mismatch, probe_cuda, resolve_device
from pipeline.errors import ConfigError
from pipeline.io import format_size

__all__ = ["Check", "Config", "run", "run_checks"]

OK, WARN, FAIL = "ok", "warn", "FAIL"
TOKENS = ".doctor"  # RUN_DIR/.doctor/JOB.STEP/TASK: the shared-directory check's token files


@dataclass
class Config:
    run_dir: Path = option(
        Path("runs"), "The directory training will write to (free space, shared by nodes)."
    )
    device: Literal["auto", "cuda", "cpu"] = option(
        "auto", "What training will ask for (train.device): cuda or auto under a GPU allocation need a GPU."
    )
    min_free_gb: float = option(
        10.0, "FAIL when the run directory's file system has less free space than this (GB)."
    )
    wait: float = option(
        20.0,
        "Seconds the SLURM tasks wait for each other: for the others' token files in the run directory "
        "and for the rendezvous port to answer.",
    )

    def __post_init__(self) -> None:
        if self.min_free_gb < 0 or self.wait <= 0:
            raise ConfigError("doctor: min_free_gb must be >= 0 and wait > 0 seconds")


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # ok | warn | FAIL
    detail: str  # what was found, and for warn/FAIL what to do

    def line(self) -> str:
        return f"{self.verdict:<4}  {self.name:<11} {self.detail}"


# ------------------------------------------------------------------------------------------ checks
def check_python() -> Check:
    return Check("python", OK, f"{platform.python_version()} ({sys.executable})")


def check_torch(probe: CudaProbe) -> Check:
    build = f"CUDA {probe.torch_cuda}" if probe.torch_cuda else "CPU-only build"
    return Check("torch", OK, f"{probe.torch_version} ({build})")


def check_gpu(probe: CudaProbe, device: str, env: Mapping[str, str]) -> Check:
    try:
        chosen, why = resolve_device(device, probe, env)
    except DeviceError as exc:
        return Check("gpu", FAIL, str(exc))
    if chosen == "cpu":
        return Check("gpu", WARN if device != "cpu" else OK, f"none used: {why}")
    names = sorted(set(probe.device_names))
    bf16 = "bf16 yes" if probe.bf16 else "bf16 NO: use train.mixed_precision=fp16 (bf16 configs will fail)"
    verdict = OK if probe.bf16 else WARN
    return Check("gpu", verdict, f"{probe.device_count} x {', '.join(names) or 'GPU'}, {bf16}")


def check_driver(probe: CudaProbe) -> Check:
    if probe.driver_version is None and probe.driver_cuda is None:
        return Check("driver", OK if not probe.available else WARN, "no NVIDIA driver found on this host")
    found = f"{probe.driver_version or '?'} (runs CUDA {probe.driver_cuda or '?'})"
    mismatch = cuda_mismatch(probe)
    if mismatch is not None:
        return Check("driver", FAIL if mismatch[0] == "FAIL" else WARN, mismatch[1])
    against = f", torch built for CUDA {probe.torch_cuda}" if probe.torch_cuda else ""
    return Check("driver", OK, found + against)


def check_nccl(probe: CudaProbe) -> Check:
    if not probe.available:
        return Check("nccl", OK, "not used (no GPU: the gloo backend)")
    if probe.nccl_version is None:  # a broken NCCL shows here rather than at the first collective
        return Check(
            "nccl", FAIL, "torch cannot load NCCL (torch.cuda.nccl.version()): reinstall its CUDA wheel"
        )
    return Check("nccl", OK, f"NCCL {probe.nccl_version}")


def check_deepspeed() -> Check:
    try:
        deepspeed = importlib.import_module("deepspeed")
    except Exception as exc:
        return Check(
            "deepspeed", WARN, f"not importable ({type(exc).__name__}: {exc}); needed only for "
            "train.deepspeed_config: bash launch/setup.sh builds it against the installed torch",
        )  # fmt: skip
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception:
        installed_ops = {}
    prebuilt = sorted(name for name, built in installed_ops.items() if built)
    ops = ", ".join(prebuilt) if prebuilt else "none prebuilt (JIT-compiled on first use"
    if not prebuilt:
        ninja = shutil.which("ninja") is not None or importlib.util.find_spec("ninja") is not None
        compiler = shutil.which(os.environ.get("CXX", "c++")) is not None
        ops += f"; ninja {'yes' if ninja else 'NO'}, C++ compiler {'yes' if compiler else 'NO'})"
        if not (ninja and compiler):
            return Check(
                "deepspeed", WARN, f"{deepspeed.__version__}, ops {ops}: install ninja and a C++ compiler "
                "before a DeepSpeed run (its comm op is compiled at start)",
            )  # fmt: skip
    return Check("deepspeed", OK, f"{deepspeed.__version__}, ops: {ops}")


def check_faiss(probe: CudaProbe) -> Check:
    loader = logging.getLogger("faiss.loader")  # one INFO line per instruction set it tries
    level = loader.level
    loader.setLevel(logging.WARNING)
    try:
        faiss = importlib.import_module("faiss")
    except Exception as exc:
        return Check("faiss", WARN, f"not importable ({exc}): index/search/mine need faiss-cpu or faiss-gpu")
    finally:
        loader.setLevel(level)
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    kind = f"GPU build, {gpus} GPU(s)" if gpus else "CPU build"
    if probe.available and not gpus:
        return Check("faiss", WARN, f"{faiss.__version__} ({kind}) on a GPU host: mining searches on CPU")
    return Check("faiss", OK, f"{faiss.__version__} ({kind})")


def existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(run_dir: Path, min_free_gb: float) -> Check:
    where = existing_parent(run_dir)
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return Check("disk", FAIL, f"cannot read the free space of {where}: {exc}")
    need = int(min_free_gb * 1e9)
    text = f"{format_size(usage.free)} free of {format_size(usage.total)} at {where}"
    if usage.free < need:
        return Check(
            "disk", FAIL, f"{text}, below {min_free_gb:g} GB: free space or point --run_dir at a bigger "
            "file system (a checkpoint is 12-16 bytes per parameter, keep_last + 2 of them at a save)",
        )  # fmt: skip
    return Check("disk", OK, text)


def check_writable(run_dir: Path) -> Check:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".doctor-write-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        return Check("run_dir", FAIL, f"{run_dir} is not writable ({exc}): pick a --run_dir you can write")
    return Check("run_dir", OK, f"{run_dir.absolute()} writable")


# --------------------------------------------------------------------------------- several tasks
@dataclass(frozen=True)
class Task:
    """This process's place among the SLURM tasks (or torchrun ranks) that run doctor together."""

    rank: int
    world: int
    nodes: int
    tag: str  # job.step: a fresh token directory for each srun

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Task:
        rank = int(env.get("SLURM_PROCID", env.get("RANK", "0")) or 0)
        world = int(env.get("SLURM_NTASKS", env.get("WORLD_SIZE", "1")) or 1)
        nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")) or 1)
        tag = f"{env.get('SLURM_JOB_ID', 'local')}.{env.get('SLURM_STEP_ID', '0')}"
        return cls(rank, world, nodes, tag)


def check_shared_run_dir(run_dir: Path, task: Task, wait: float) -> Check:
    """Each task writes a token file with its host into RUN_DIR/.doctor/JOB.STEP/ and waits up to
    ``wait`` s to see every other task's: a task that cannot is on a node that does not share it."""
    folder = run_dir / TOKENS / task.tag
    host = socket.gethostname()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{task.rank}.tmp").write_text(host, encoding="utf-8")
        os.replace(folder / f"{task.rank}.tmp", folder / str(task.rank))
    except OSError as exc:
        return Check("shared_dir", FAIL, f"cannot write a token into {folder}: {exc}")
    deadline = time.monotonic() + wait
    while True:
        seen = {p.name: p for p in folder.iterdir() if p.name.isdigit()} if folder.is_dir() else {}
        missing = [r for r in range(task.world) if str(r) not in seen]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    hosts = sorted({_read(p) for p in seen.values()})
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        return Check(
            "shared_dir", FAIL, f"{run_dir.absolute()} on {host} does not show the tokens of task(s) {shown} "
            f"after {wait:g} s (seen from: {', '.join(hosts)}): the run directory must be on a file system "
            "every node mounts at the same path (checkpoints and the tokenizer are written by one rank, "
            "read by all)",
        )  # fmt: skip
    return Check(
        "shared_dir", OK, f"all {task.world} tasks see {run_dir.absolute()} (hosts: {', '.join(hosts)})"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return "?"


def check_rendezvous(env: Mapping[str, str], task: Task, wait: float) -> Check | None:
    """Task 0 must be able to open MASTER_PORT; every other task must reach MASTER_ADDR:MASTER_PORT.

    Under srun task 0 listens on the port for ``wait`` s while the others connect; alone, a rank > 0
    (RANK) only connects, so whoever should listen there must be up.
    """
    addr, port_text = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port_text:
        if task.world > 1:
            return Check(
                "rendezvous", WARN, "MASTER_ADDR/MASTER_PORT unset: launch/slurm/pretrain.sbatch sets them"
            )
        return None
    port = int(port_text)
    target = f"{addr}:{port}"
    if task.nodes > 1 and (addr.startswith("127.") or addr in ("localhost", "::1")):
        return Check(
            "rendezvous", FAIL, f"MASTER_ADDR={addr} on a {task.nodes}-node job: every node would look for "
            "the rendezvous on itself; set it to the first node's address (the sbatch uses the first host "
            "of SLURM_JOB_NODELIST; accelerate launch: --main_process_ip)",
        )  # fmt: skip
    if task.rank == 0:
        try:
            server = socket.create_server(("", port), reuse_port=False)
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else str(exc)
            return Check(
                "rendezvous", FAIL, f"task 0 on {socket.gethostname()} cannot listen on port {port} ({why}): "
                "pick another MASTER_PORT (the sbatch derives it from the job id)",
            )  # fmt: skip
        if task.world > 1:
            threading.Thread(target=_serve, args=(server, wait), daemon=True).start()
            time.sleep(wait)  # the others connect meanwhile
        else:
            server.close()
        return Check("rendezvous", OK, f"task 0 can listen on port {port} ({target})")
    deadline = time.monotonic() + wait
    error: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, wait)):
                return Check("rendezvous", OK, f"reached {target}")
        except OSError as exc:
            error = exc
            time.sleep(0.5)
    return Check(
        "rendezvous", FAIL, f"cannot reach {target} from {socket.gethostname()} within {wait:g} s ({error}): "
        "MASTER_ADDR must be the first node's address as the other nodes see it (not 127.0.0.1), and the "
        "port open between nodes",
    )  # fmt: skip


def check_gloo_interface(env: Mapping[str, str], task: Task, probe: CudaProbe, device: str) -> Check | None:
    """gloo across nodes advertises the address this host's name resolves to: a loopback one (Debian's
    127.0.1.1 for the host name, or 127.0.0.1) makes every node connect to itself, and start-up fails
    with a gloo traceback, at once or minutes later. GLOO_SOCKET_IFNAME names the interface to use."""
    gloo = device == "cpu" or not probe.available
    if task.nodes < 2 or not gloo or env.get("GLOO_SOCKET_IFNAME"):
        return None
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        return Check(
            "gloo_iface", FAIL, f"the host name {host} does not resolve ({exc}) and GLOO_SOCKET_IFNAME is "
            "unset: set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on (e.g. eth0, ib0)",
        )  # fmt: skip
    if address.startswith("127."):
        return Check(
            "gloo_iface", FAIL, f"gloo on {task.nodes} nodes: the host name {host} resolves to {address}, a "
            "loopback address the other nodes cannot reach; set GLOO_SOCKET_IFNAME to the interface the "
            "nodes reach each other on (e.g. eth0, ib0; `ip -br addr` lists them)",
        )  # fmt: skip
    return Check("gloo_iface", OK, f"gloo will advertise {address} ({host})")


def _serve(server: socket.socket, wait: float) -> None:
    server.settimeout(0.5)
    deadline = time.monotonic() + wait
    with server:
        while time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
                conn.close()
            except OSError:
                continue


# ------------------------------------------------------------------------------------------ run
def run_checks(
    cfg: Config, env: Mapping[str, str] | None = None, probe: CudaProbe | None = None
) -> list[Check]:
    env = os.environ if env is None else env
    probe = probe_cuda(env) if probe is None else probe
    task = Task.from_env(env)
    checks: list[Callable[[], Check | None]] = [
        check_python,
        lambda: check_torch(probe),
        lambda: check_gpu(probe, cfg.device, env),
        lambda: check_driver(probe),
        lambda: check_nccl(probe),
        check_deepspeed,
        lambda: check_faiss(probe),
        lambda: check_writable(cfg.run_dir),
        lambda: check_disk(cfg.run_dir, cfg.min_free_gb),
    ]
    if task.world > 1:
        checks.append(lambda: check_shared_run_dir(cfg.run_dir, task, cfg.wait))
    checks.append(lambda: check_rendezvous(env, task, cfg.wait))
    checks.append(lambda: check_gloo_interface(env, task, probe, cfg.device))
    results = []
    for check in checks:
        result = check()
        if result is not None:
            results.append(result)
    return results


def run(cfg: Config) -> int:
    task = Task.from_env(os.environ)
    results = run_checks(cfg)
    failed = [c for c in results if c.verdict == FAIL]
    if task.rank == 0:
        for c in results:
            print(c.line(), flush=True)
        verdict = f"{len(failed)} FAIL: a training run would fail" if failed else "no FAIL"
        warned = sum(c.verdict == WARN for c in results)
        print(
            f"doctor: {verdict}, {warned} warn ({socket.gethostname()}, task 0 of {task.world})", flush=True
        )
    else:
        for c in results:
            if c.verdict != OK:
                print(f"[{socket.gethostname()} task {task.rank}] {c.line()}", flush=True)
    return 1 if failed else 0
