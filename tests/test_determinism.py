"""train.deterministic (pipeline/train/determinism.py): the switches it sets, and that on CPU it changes
nothing in the results (the same weights as a run without it; its resume bit-exact).

No GPU here: what the switches do to CUDA kernels is not tested in this file.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from _train_data import debug_config, debug_luse, full_and_resumed, run_and_dump

from pipeline.train.determinism import CUBLAS_WORKSPACE, enable_determinism


@pytest.fixture
def restore_switches():
    """enable_determinism changes process-wide switches: put every one back after the test."""
    b, c = torch.backends.cudnn, torch.backends.cuda
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        b.deterministic,
        b.benchmark,
        c.flash_sdp_enabled(),
        c.mem_efficient_sdp_enabled(),
        c.cudnn_sdp_enabled(),
        c.math_sdp_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    det, b.deterministic, b.benchmark, flash, mem, cudnn_sdp, math, cublas = saved
    torch.use_deterministic_algorithms(det)
    c.enable_flash_sdp(flash)
    c.enable_mem_efficient_sdp(mem)
    c.enable_cudnn_sdp(cudnn_sdp)
    c.enable_math_sdp(math)
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def test_off_changes_nothing(restore_switches, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    enable_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert torch.backends.cuda.flash_sdp_enabled()


def test_on_sets_every_switch(restore_switches, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the attention switches need CUDA
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # not a deterministic value: replaced, with a line
    torch.backends.cudnn.benchmark = True
    with caplog.at_level(logging.INFO, logger="pipeline.train.determinism"):
        enable_determinism(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    c = torch.backends.cuda
    assert not (c.flash_sdp_enabled() or c.mem_efficient_sdp_enabled() or c.cudnn_sdp_enabled())
    assert c.math_sdp_enabled()
    text = caplog.text
    assert "CUBLAS_WORKSPACE_CONFIG=:0:0 replaced" in text and "math backend only" in text


def test_without_cuda_cpu_attention_is_left_as_it_was(restore_switches):
    # The SDPA switches also reach CPU's flash kernel (different last bits): without CUDA they stay.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 96, 32) for _ in range(3))
    before = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert not torch.cuda.is_available()
    enable_determinism(True)
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v), before)


def test_a_deterministic_value_already_set_is_kept(restore_switches, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    enable_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_cuda_initialised_first_is_said(restore_switches, monkeypatch, caplog):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger="pipeline.train.determinism"):
        enable_determinism(True)
    assert "CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set" in caplog.text


@pytest.mark.slow
def test_on_cpu_the_weights_equal_a_run_without_it_and_its_resume_is_exact(
    restore_switches, tmp_path, tiny_shards
):
    shards = tiny_shards([[40, 24], [32]], num_variants=3)
    common = {"loss": debug_luse(momentum=0.9), "train.debug_dump": True, "train.eval_max_pairs": 16}

    def cfg(run_dir, steps, deterministic):
        overrides = {**common, "run_dir": str(run_dir), "train.max_steps": steps}
        return debug_config(tmp_path, shards, **overrides, **{"train.deterministic": deterministic})

    plain = run_and_dump(cfg(tmp_path / "plain", 6, False))
    full, resumed = full_and_resumed(tmp_path, lambda d, s: cfg(d, s, True), stop=3, total=6)
    assert torch.are_deterministic_algorithms_enabled()  # the runs did switch it on
    assert full["param_checksum"] == plain["param_checksum"]  # on CPU: the same weights, bit for bit
    assert full["queue_checksum"] == plain["queue_checksum"]
    assert resumed["step"] == 6 and resumed["param_checksum"] == full["param_checksum"]
    assert resumed["queue_checksum"] == full["queue_checksum"] and resumed["cursor"] == full["cursor"]
