"""GPU-speed settings resolved from the device (pipeline/train/speed.py): on CPU a run is as it was."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import load_config
from pipeline.train import speed
from pipeline.train.config import PROJECT_ROOT, Config


def test_auto_settings_leave_a_cpu_run_as_it_was():
    assert speed.resolve_precision("auto", "cpu") == "no"
    assert speed.resolve_precision("bf16", "cpu") == "bf16"  # distill.yaml: CPU bf16 autocast, as before
    assert speed.loader_workers("auto", "cpu") == speed.CPU_WORKERS == 2
    assert speed.loader_workers(3, "cuda") == 3
    before = torch.get_float32_matmul_precision()
    speed.apply_tf32(True, "cpu")
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize(("per_rank", "workers"), [(1, 1), (2, 1), (4, 3), (16, 8), (64, 8)])
def test_auto_workers_on_cuda_from_the_cpus_per_rank(per_rank, workers):
    assert speed.loader_workers("auto", "cuda", per_rank=per_rank) == workers


def test_cpus_per_rank_under_torchrun_and_under_srun(monkeypatch):
    monkeypatch.setattr(speed, "cpus_available", lambda: 32)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert speed.cpus_per_rank() == 8  # one task holds the node's CPUs for its 4 ranks
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    assert speed.cpus_per_rank() == 6  # srun: one task (and CPU set) per rank


def test_default_yaml_asks_for_the_gpu_settings():
    cfg = load_config(Config, PROJECT_ROOT / "launch" / "configs" / "default.yaml", {})
    assert (cfg.train.mixed_precision, cfg.optim.fused, cfg.data.num_workers) == ("auto", "auto", "auto")
    assert cfg.train.tf32 is True
    overridden = load_config(
        Config, PROJECT_ROOT / "launch" / "configs" / "default.yaml", {"data.num_workers": 4}
    )
    assert overridden.data.num_workers == 4
