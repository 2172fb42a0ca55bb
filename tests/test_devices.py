"""Where a run computes: train.device, the GPU-request check and its one-line reasons, the start-up
line, one-GPU-per-task bindings. GPUs, drivers and SLURM allocations are faked (env dicts, probes,
monkeypatch); the end-to-end checks train the debug config on this machine's CPU."""

from __future__ import annotations

import logging

import pytest
from _train_data import debug_config

from pipeline.cli import main as cli_main
from pipeline.devices import (
    CudaProbe,
    DeviceError,
    bind_local_device,
    cuda_mismatch,
    gpu_allocation,
    resolve_device,
)
from pipeline.errors import ConfigError
from pipeline.train.config import PROJECT_ROOT, TrainConfig

DEBUG = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"


def probe(**fields) -> CudaProbe:
    """A GPU host as torch would see it; override what the case needs."""
    base = dict(
        torch_version="2.13.0+cu130",
        torch_cuda="13.0",
        available=False,
        driver_version="580.65.06",
        driver_cuda="13.0",
        device_files=("/dev/nvidia0",),
        hostname="gpu-node-7",
    )
    return CudaProbe(**{**base, **fields})


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[32], [32]], num_variants=2)


# ------------------------------------------------------------------------------ what was asked for
@pytest.mark.parametrize(
    "env, found",
    [
        ({}, None),
        ({"SLURM_JOB_GPUS": "0,1,2,3"}, "SLURM_JOB_GPUS=0,1,2,3"),
        ({"SLURM_STEP_GPUS": "0"}, "SLURM_STEP_GPUS=0"),  # an id, not a count
        ({"SLURM_GPUS_ON_NODE": "8"}, "SLURM_GPUS_ON_NODE=8"),
        ({"SLURM_GPUS_ON_NODE": "0"}, None),
        ({"SLURM_TRES_PER_TASK": "cpu=4"}, None),
        ({"SLURM_TRES_PER_TASK": "cpu=4,gres/gpu=1"}, "SLURM_TRES_PER_TASK=cpu=4,gres/gpu=1"),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES=0,1"),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
    ],
)
def test_gpu_allocation_reads_slurm_and_cuda_visible_devices(env, found):
    assert gpu_allocation(env) == found


def test_cpu_is_cpu_and_auto_without_a_request_falls_back_and_says_so():
    assert resolve_device("cpu", probe(available=True)) == ("cpu", "train.device=cpu")
    device, why = resolve_device("auto", probe(available=False, device_files=(), driver_version=None), env={})
    assert device == "cpu" and "no GPU allocated or visible, training on CPU" in why
    assert resolve_device("auto", probe(available=True), env={})[0] == "cuda"
    assert resolve_device("cuda", probe(available=True), env={})[0] == "cuda"


@pytest.mark.parametrize(
    "requested, fake, env, message",
    [
        (  # the wheel has no CUDA at all
            "cuda",
            probe(torch_version="2.13.0+cpu", torch_cuda=None),
            {},
            "train.device=cuda but torch sees no GPU: torch 2.13.0+cpu is a CPU-only build",
        ),
        (  # a CUDA 13 wheel on a node whose driver runs CUDA 12.2
            "auto",
            probe(driver_version="535.104.05", driver_cuda="12.2"),
            {"SLURM_JOB_GPUS": "0"},
            "GPUs were allocated (SLURM_JOB_GPUS=0) but torch sees none: NVIDIA driver 535.104.05 runs "
            "CUDA up to 12.2 but torch 2.13.0+cu130 is built for CUDA 13.0: install a torch built for CUDA "
            "<= 12.2",
        ),
        (  # SLURM says GPUs, the node has no NVIDIA device
            "auto",
            probe(device_files=(), driver_version=None, driver_cuda=None),
            {"SLURM_GPUS_ON_NODE": "4"},
            "SLURM_GPUS_ON_NODE=4 says GPUs were allocated, but gpu-node-7 has no NVIDIA device or driver",
        ),
        (  # nothing requested, nothing there, and cuda asked for
            "cuda",
            probe(device_files=(), driver_version=None, driver_cuda=None),
            {},
            "no GPU was allocated and gpu-node-7 has no NVIDIA device or driver (no /dev/nvidia*): request",
        ),
        (
            "cuda",
            probe(visible_devices=""),
            {"CUDA_VISIBLE_DEVICES": ""},
            "CUDA_VISIBLE_DEVICES='' hides every GPU on gpu-node-7",
        ),
        (  # everything looks right, torch still says no: the CUDA init error is passed on
            "cuda",
            probe(init_error="CUDA initialization: Unexpected error from cudaGetDeviceCount()"),
            {},
            "cannot use the GPUs of gpu-node-7 (driver 580.65.06, devices /dev/nvidia0): CUDA initialization",
        ),
    ],
    ids=["cpu_build", "driver_too_old", "allocated_no_device", "none_requested", "hidden", "init_error"],
)
def test_a_gpu_request_without_a_gpu_fails_with_why_and_what_to_do(requested, fake, env, message):
    with pytest.raises(DeviceError) as caught:
        resolve_device(requested, fake, env)
    text = str(caught.value)
    assert message in text, text
    assert "\n" not in text and "train.device=cpu" in text  # one line; the way out is named


def test_driver_mismatch_verdicts():
    assert cuda_mismatch(probe(driver_cuda="13.0")) is None
    assert cuda_mismatch(probe(driver_cuda="13.1")) is None
    assert cuda_mismatch(probe(driver_cuda=None)) is None  # unknown: no verdict
    verdict, text = cuda_mismatch(probe(driver_cuda="12.8"))
    assert verdict == "FAIL" and "driver >= 580.65.06" in text and "whl/cu128" in text
    verdict, _ = cuda_mismatch(probe(torch_cuda="12.8", driver_cuda="12.2"))
    assert verdict == "warn"  # minor-version compatibility


def test_deprecated_cpu_flag_reads_as_device_cpu():
    assert TrainConfig(cpu=True).device == "cpu"
    assert TrainConfig().device == "auto" and TrainConfig().collective_timeout == 600.0
    with pytest.raises(ConfigError, match="contradicts train.device=cuda"):
        TrainConfig(cpu=True, device="cuda")
    with pytest.raises(ConfigError, match="collective_timeout must be > 0"):
        TrainConfig(collective_timeout=0)


# ------------------------------------------------------------------------------ one GPU per task
def test_one_gpu_per_task_uses_cuda0_whatever_the_local_rank():
    env = {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}
    assert bind_local_device(env, device_count=1) == 0
    assert env["LOCAL_RANK"] == "0" and env["PIPELINE_LOCAL_RANK"] == "3"  # DeepSpeed reads LOCAL_RANK


def test_all_gpus_per_task_keep_their_local_rank_and_too_few_fail():
    env = {"LOCAL_RANK": "2"}
    assert bind_local_device(env, device_count=8) == 2 and env == {"LOCAL_RANK": "2"}
    with pytest.raises(DeviceError, match=r"LOCAL_RANK 5 but this process sees only 4 GPUs"):
        bind_local_device({"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, device_count=4)


def test_build_accelerator_binds_cuda0_for_a_second_rank_on_one_visible_gpu(monkeypatch, tmp_path, shards):
    """A rank with LOCAL_RANK=1 that sees one GPU sets cuda:0 before the process group exists."""
    import torch

    import pipeline.train.build as build

    chosen = []

    def set_device(index):
        chosen.append(index)
        raise StopBuild  # nothing past this point can run without a GPU

    monkeypatch.setattr(build, "probe_cuda", lambda: probe(available=True, device_count=1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = debug_config(tmp_path, shards, **{"train.cpu": False, "train.device": "cuda"})
    with pytest.raises(StopBuild):
        build.build_accelerator(cfg)
    assert chosen == [0]


class StopBuild(Exception):
    pass


# ------------------------------------------------------------------------------ end to end
def test_a_gpu_run_without_gpus_fails_before_anything_is_built(monkeypatch, tmp_path, shards, capsys):
    """`auto` under a SLURM GPU allocation on a node whose driver is too old: exit 2, one line, before
    the process group, the run directory or the model."""
    import pipeline.train.build as build

    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1")
    monkeypatch.setattr(build, "probe_cuda", lambda: probe(driver_version="535.104.05", driver_cuda="12.2"))
    monkeypatch.setattr(build, "build_encoder", lambda cfg: pytest.fail("the model was built"))
    argv = ["train", "--config", str(DEBUG), f"--data.shards={shards}", f"--run_dir={tmp_path / 'run'}"]
    assert cli_main([*argv, "--train.cpu=false", "--train.device=auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: train.device=auto and GPUs were allocated (SLURM_JOB_GPUS=0,1)"), err
    assert "driver 535.104.05 runs CUDA up to 12.2" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_cuda_on_this_cpu_torch_fails_with_the_real_probe(tmp_path, shards, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    argv = ["train", "--config", str(DEBUG), f"--data.shards={shards}", f"--run_dir={tmp_path / 'run'}"]
    assert cli_main([*argv, "--train.cpu=false", "--train.device=cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: train.device=cuda but torch sees no GPU: ") and "\n" not in err


def test_a_real_cpu_run_logs_one_device_line(tmp_path, shards, caplog):
    from pipeline.train.run import run

    cfg = debug_config(tmp_path, shards, **{"train.max_steps": 2, "train.eval_max_pairs": 16})
    with caplog.at_level(logging.INFO):
        assert run(cfg) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start: ")]
    assert len(lines) == 1, lines
    line = lines[0]
    for part in (
        "start: device cpu (train.device=cpu)",
        "backend none (one process)",
        "1 process on 1 node",
        "precision fp32",
        "torch 2.",
        "collective timeout 600 s",
    ):
        assert part in line, line
