"""``python -m pipeline doctor``: each condition a cluster run would fail on is flagged FAIL with its fix
and makes the exit status 1: no GPU where one was requested, a driver older than torch's CUDA build, a
run directory the nodes do not share (two "nodes" = two processes with different directories), an
unreachable rendezvous (a closed local port), a nearly full disk. GPUs and drivers are faked probes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import namedtuple

import pytest

import pipeline.doctor as doctor
from pipeline.cli import main as cli_main
from pipeline.devices import CudaProbe
from pipeline.doctor import FAIL, OK, WARN, Config, Task, check_gloo_interface, check_rendezvous, run_checks
from pipeline.train.config import PROJECT_ROOT

GPU_VARS = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS", "SLURM_GPUS_PER_NODE",
            "SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK", "CUDA_VISIBLE_DEVICES")  # fmt: skip
TASK_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_NUM_NODES",
             "SLURM_NNODES", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def gpu_host(**fields) -> CudaProbe:
    base = dict(
        torch_version="2.13.0+cu130",
        torch_cuda="13.0",
        available=True,
        device_count=8,
        device_names=("NVIDIA H100 80GB HBM3",) * 8,
        bf16=True,
        driver_version="580.65.06",
        driver_cuda="13.0",
        device_files=tuple(f"/dev/nvidia{i}" for i in range(8)),
        hostname="gpu-node-1",
        nccl_version="2.27.7",
    )
    return CudaProbe(**{**base, **fields})


@pytest.fixture
def clean_env(monkeypatch):
    """One process outside SLURM, no GPU variables: each test adds what it simulates."""
    for name in GPU_VARS + TASK_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def by_name(checks):
    return {c.name: c for c in checks}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_healthy_gpu_host_passes(tmp_path, clean_env):
    checks = by_name(run_checks(Config(run_dir=tmp_path / "run"), env={}, probe=gpu_host()))
    assert checks["gpu"].verdict == OK and "8 x NVIDIA H100 80GB HBM3, bf16 yes" in checks["gpu"].detail
    assert checks["driver"].verdict == OK and "580.65.06 (runs CUDA 13.0)" in checks["driver"].detail
    assert checks["run_dir"].verdict == OK and checks["disk"].verdict == OK
    assert "shared_dir" not in checks and "rendezvous" not in checks  # one process, no rendezvous set
    assert not [c for c in checks.values() if c.verdict == FAIL]


def test_no_gpu_where_one_was_requested_fails(tmp_path, clean_env, capsys):
    clean_env.setenv("SLURM_JOB_GPUS", "0,1")
    no_device = gpu_host(available=False, device_files=(), driver_version=None, driver_cuda=None)
    clean_env.setattr(doctor, "probe_cuda", lambda env: no_device)
    assert cli_main(["doctor", f"--run_dir={tmp_path / 'run'}"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("FAIL  gpu"))
    assert "GPUs were allocated (SLURM_JOB_GPUS=0,1)" in line and "has no NVIDIA device or driver" in line
    assert "doctor: 1 FAIL: a training run would fail" in out


def test_no_gpu_and_none_requested_is_a_warning_not_a_failure(tmp_path, clean_env):
    probe = gpu_host(available=False, torch_cuda=None, torch_version="2.13.0+cpu", device_files=(),
                     driver_version=None, driver_cuda=None)  # fmt: skip
    checks = by_name(run_checks(Config(run_dir=tmp_path), env={}, probe=probe))
    assert checks["gpu"].verdict == WARN and "training on CPU" in checks["gpu"].detail
    assert checks["nccl"].verdict == OK and "gloo" in checks["nccl"].detail


def test_driver_older_than_torchs_cuda_build_fails(tmp_path, clean_env):
    probe = gpu_host(available=False, driver_version="535.104.05", driver_cuda="12.2")
    checks = by_name(run_checks(Config(run_dir=tmp_path, device="cuda"), env={}, probe=probe))
    assert checks["driver"].verdict == FAIL
    assert "driver 535.104.05 runs CUDA up to 12.2 but torch 2.13.0+cu130 is built for CUDA 13.0" in (
        checks["driver"].detail
    )
    assert checks["gpu"].verdict == FAIL and "train.device=cuda but torch sees no GPU" in checks["gpu"].detail
    # an older minor version runs (minor-version compatibility): a warning
    minor = gpu_host(torch_cuda="12.8", driver_cuda="12.4")
    assert by_name(run_checks(Config(run_dir=tmp_path), env={}, probe=minor))["driver"].verdict == WARN


def test_a_gpu_without_nccl_fails(tmp_path):
    checks = by_name(run_checks(Config(run_dir=tmp_path), env={}, probe=gpu_host(nccl_version=None)))
    assert checks["nccl"].verdict == FAIL and checks["gpu"].verdict == OK
    healthy = by_name(run_checks(Config(run_dir=tmp_path), env={}, probe=gpu_host()))
    assert healthy["nccl"].detail == "NCCL 2.27.7"


def test_a_gpu_without_bf16_warns(tmp_path):
    checks = by_name(run_checks(Config(run_dir=tmp_path), env={}, probe=gpu_host(bf16=False)))
    assert checks["gpu"].verdict == WARN and "use train.mixed_precision=fp16" in checks["gpu"].detail


def test_a_nearly_full_disk_fails(tmp_path, clean_env, capsys):
    usage = namedtuple("usage", "total used free")
    clean_env.setattr(doctor.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 2 * 10**9, 2 * 10**9))
    assert cli_main(["doctor", f"--run_dir={tmp_path / 'run'}", "--device=cpu", "--min_free_gb=10"]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("FAIL  disk"))
    assert "below 10 GB: free space or point --run_dir at a bigger file system" in line


def test_an_unreachable_rendezvous_fails():
    port = _free_port()  # nothing listens there
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    check = check_rendezvous(env, Task(rank=1, world=2, nodes=1, tag="t"), wait=1.0)
    assert check.verdict == FAIL and f"cannot reach 127.0.0.1:{port}" in check.detail
    assert "MASTER_ADDR must be the first node's address" in check.detail


def test_a_loopback_rendezvous_on_several_nodes_fails_and_multinode_yaml_has_none():
    import yaml

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    check = check_rendezvous(env, Task(rank=0, world=16, nodes=2, tag="t"), wait=1.0)
    assert check.verdict == FAIL and "MASTER_ADDR=127.0.0.1 on a 2-node job" in check.detail
    multinode = yaml.safe_load((PROJECT_ROOT / "launch" / "accelerate" / "multinode.yaml").read_text())
    assert multinode["main_process_ip"].endswith(".invalid")  # never resolves: a forgotten override shows


def test_a_rendezvous_port_in_use_on_task_0_fails():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        check = check_rendezvous(env, Task(rank=0, world=1, nodes=1, tag="t"), wait=1.0)
    assert check.verdict == FAIL and f"cannot listen on port {port} (in use)" in check.detail


def _two_nodes(dirs, wait=4):
    """Two doctor processes as srun would start them on two nodes (task 0 and 1 of job 77)."""
    port = _free_port()
    procs = []
    for rank, run_dir in enumerate(dirs):
        env = {k: v for k, v in os.environ.items() if k not in GPU_VARS + TASK_VARS}
        env.update(
            SLURM_JOB_ID="77",
            SLURM_STEP_ID="0",
            SLURM_NTASKS="2",
            SLURM_PROCID=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )  # fmt: skip (one SLURM node as far as the rendezvous goes: 127.0.0.1 is right on one machine)
        cmd = [sys.executable, "-m", "pipeline", "doctor", f"--run_dir={run_dir}", "--device=cpu"]
        cmd.append(f"--wait={wait}")
        procs.append(subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True))
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


@pytest.mark.slow
def test_two_nodes_that_share_the_run_dir_and_reach_the_rendezvous_pass(tmp_path):
    (rc0, out0), (rc1, out1) = _two_nodes([tmp_path / "shared", tmp_path / "shared"])
    assert rc0 == 0 and rc1 == 0, (out0, out1)
    assert "ok    shared_dir  all 2 tasks see" in out0 and "ok    rendezvous  task 0 can listen" in out0
    assert "FAIL" not in out1  # task 1 prints only its warn and FAIL lines


@pytest.mark.slow
def test_two_nodes_with_different_run_dirs_fail(tmp_path):
    (rc0, out0), (rc1, out1) = _two_nodes([tmp_path / "node0", tmp_path / "node1"])
    assert rc0 == 1 and rc1 == 1, (out0, out1)
    assert "does not show the tokens of task(s) 1" in out0 and "FAIL  shared_dir" in out0
    assert "task 1] FAIL  shared_dir" in out1 and "does not show the tokens of task(s) 0" in out1


def test_gloo_across_nodes_on_a_loopback_host_name_fails_unless_an_interface_is_named(monkeypatch):
    """Debian maps the host name to 127.0.1.1: gloo would advertise it and the nodes would not meet."""
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    cpu = gpu_host(available=False, device_count=0)
    two_nodes = Task(rank=0, world=2, nodes=2, tag="t")
    check = check_gloo_interface({}, two_nodes, cpu, "auto")
    assert check.verdict == FAIL and "node-a resolves to 127.0.1.1" in check.detail
    assert "GLOO_SOCKET_IFNAME" in check.detail
    assert check_gloo_interface({"GLOO_SOCKET_IFNAME": "eth0"}, two_nodes, cpu, "auto") is None
    assert check_gloo_interface({}, Task(rank=0, world=2, nodes=1, tag="t"), cpu, "auto") is None
    assert check_gloo_interface({}, two_nodes, gpu_host(), "auto") is None  # NCCL picks its own interface
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.7")
    assert check_gloo_interface({}, two_nodes, cpu, "cpu").verdict == OK
