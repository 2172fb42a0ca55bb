"""Speed settings resolved from the device (pipeline/train/speed.py): the GPU ones leave a CPU run as it
was; on CPU, malloc keeps freed memory and a bf16 training forward takes SDPA's math kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from pipeline.config import load_config
from pipeline.train import speed
from pipeline.train.build import autocast_bf16_on_cpu
from pipeline.train.config import PROJECT_ROOT, Config


def test_auto_settings_leave_a_cpu_run_as_it_was():
    # mixed_precision: auto on CPU follows the CPU (tests/test_precision.py)
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
    cfg = load_config(Config, PROJECT_ROOT / "launch" / "configs" / "default.yaml", {})  # the cluster recipe
    assert (cfg.train.mixed_precision, cfg.optim.fused, cfg.data.num_workers) == ("auto", True, "auto")
    assert (cfg.train.device, cfg.train.compile, cfg.train.pad_to_multiple_of) == ("cuda", "default", 16)
    assert cfg.train.tf32 is True
    overridden = load_config(
        Config, PROJECT_ROOT / "launch" / "configs" / "default.yaml", {"data.num_workers": 4}
    )
    assert overridden.data.num_workers == 4


# A block over glibc's 32 MiB mmap threshold allocated, zeroed and freed each "step", as a step does with
# the embedding table's gradient: the minor page faults of each of 16 steps, with or without
# keep_freed_memory. The first steps settle the heap (a freed block can be a few bytes short of the next
# 64-byte-aligned request until it merges with its neighbours, depending on where the heap starts: 1-3
# steps in ~160 runs here, later once in CI), so every one of the last 8 steps must reuse the block.
FAULTS = """
import resource, sys, torch
from pipeline.train import speed
if sys.argv[1] == "keep":
    assert speed.keep_freed_memory("cpu")
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.zeros(64 << 20, dtype=torch.uint8)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def allocation_faults(mode: str) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k not in speed.MALLOC_ENV}
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [int(f) for f in out.stdout.split()[-16:]]


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_keep_freed_memory_reuses_a_large_freed_block():
    plain = allocation_faults("plain")
    if min(plain) < 1000:
        pytest.skip(f"{plain} faults for 64 MiB: this kernel maps it in huge pages, nothing to compare")
    kept = allocation_faults("keep")
    # steps 9-16: each reuses the freed 16,384 pages instead of faulting them in again
    assert max(kept[8:]) < 0.05 * min(plain), f"faults kept {kept}, plain {plain}"


def test_keep_freed_memory_leaves_gpus_and_a_chosen_allocator_alone(monkeypatch):
    assert not speed.keep_freed_memory("cuda")
    monkeypatch.setenv("LD_PRELOAD", "libjemalloc.so.2")
    assert not speed.keep_freed_memory("cpu")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 16)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def attention_ops(module: nn.Module, grad: bool) -> set[str]:
    x, mask = torch.randn(4, 10, 32), torch.ones(4, 1, 10, 10, dtype=torch.bool)
    mask[:2, ..., 7:] = False
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.set_grad_enabled(grad):
        out = module(x, mask)
        if grad:
            out.backward()
    return {e.name for e in prof.events() if "attention" in e.name or e.name == "aten::_softmax"}


def test_cpu_bf16_training_forward_computes_attention_with_the_math_kernel():
    module = Attention()
    autocast_bf16_on_cpu(module)
    training = attention_ops(module, grad=True)
    assert "aten::_softmax" in training  # the math kernel's softmax, and its backward
    assert not any("flash" in name for name in training), training
    # Without gradients (a momentum encoder's keys) the flash kernel stays: its forward is the faster.
    assert any("flash" in name for name in attention_ops(module, grad=False))
