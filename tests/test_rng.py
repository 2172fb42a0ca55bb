"""pipeline/train/rng.py: CUDA RNG states across a change in the number of visible GPUs (faked).

No GPU here: torch.cuda's generator functions are replaced by a fake with N devices, each holding a
state tensor, so the mapping logic is what is tested, not CUDA itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.train import rng


class FakeCuda:
    """``count`` devices, each with a state tensor; the current device is ``current``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0) -> None:
        self.states = [torch.tensor([100 + i], dtype=torch.uint8) for i in range(count)]
        self.current = current
        m = monkeypatch
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: len(self.states))
        m.setattr(torch.cuda, "current_device", lambda: self.current)
        m.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        m.setattr(torch.cuda, "set_rng_state_all", self.set_all)
        m.setattr(torch.cuda, "set_rng_state", self.set_one)

    def set_all(self, states: list[torch.Tensor]) -> None:
        assert len(states) == len(self.states)  # as torch: one state per device
        self.states = [s.clone() for s in states]

    def set_one(self, state: torch.Tensor, device: int) -> None:
        assert 0 <= device < len(self.states), f"device {device} is not visible"
        self.states[device] = state.clone()


def saved_state(monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> dict:
    with monkeypatch.context() as m:
        fake = FakeCuda(m, count, current)
        fake.states = [torch.tensor([i], dtype=torch.uint8) for i in range(count)]  # 0, 1, ... per device
        return rng.capture_rng_state()


def test_capture_records_the_rank_device(monkeypatch):
    state = saved_state(monkeypatch, count=4, current=2)
    assert [int(s) for s in state["cuda"]] == [0, 1, 2, 3]
    assert state["cuda_device"] == 2


def test_same_count_restores_every_device(monkeypatch):
    state = saved_state(monkeypatch, count=2, current=1)
    fake = FakeCuda(monkeypatch, count=2, current=1)
    rng.restore_rng_state(state)
    assert [int(s) for s in fake.states] == [0, 1]


def test_fewer_gpus_restores_the_rank_own_state_onto_its_device(monkeypatch, caplog):
    # Saved by the rank on device 3 of 8 visible; requeued with one GPU bound per task: it sees 1.
    state = saved_state(monkeypatch, count=8, current=3)
    fake = FakeCuda(monkeypatch, count=1, current=0)
    with caplog.at_level(logging.INFO, logger="pipeline.train.rng"):
        rng.restore_rng_state(state)
    assert [int(s) for s in fake.states] == [3]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "8 devices, 1 visible" in lines[0] and "device 3" in lines[0], lines


def test_more_gpus_restores_onto_the_current_device_only(monkeypatch):
    state = saved_state(monkeypatch, count=1, current=0)
    fake = FakeCuda(monkeypatch, count=4, current=2)
    rng.restore_rng_state(state)
    assert [int(s) for s in fake.states] == [100, 101, 0, 103]


def test_old_checkpoint_without_device_maps_state_i_to_device_i(monkeypatch, caplog):
    state = saved_state(monkeypatch, count=4, current=0)
    del state["cuda_device"]
    fake = FakeCuda(monkeypatch, count=2)
    with caplog.at_level(logging.WARNING, logger="pipeline.train.rng"):
        rng.restore_rng_state(state)
    assert [int(s) for s in fake.states] == [0, 1]
    assert len(caplog.records) == 1 and "4 devices but 2 are visible" in caplog.records[0].getMessage()


def test_a_damaged_device_index_fails_with_one_line(monkeypatch):
    state = saved_state(monkeypatch, count=2, current=1)
    state["cuda_device"] = 5
    FakeCuda(monkeypatch, count=1)
    with pytest.raises(PipelineError, match="names CUDA device 5") as err:
        rng.restore_rng_state(state)
    assert "\n" not in str(err.value)


def test_no_cuda_now_leaves_cuda_alone(monkeypatch):
    state = saved_state(monkeypatch, count=2, current=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: pytest.fail("touched CUDA"))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda *a: pytest.fail("touched CUDA"))
    torch.rand(5)  # move the CPU generator on: the restore must bring it back
    rng.restore_rng_state(state)
    assert torch.equal(torch.get_rng_state(), state["torch"])
