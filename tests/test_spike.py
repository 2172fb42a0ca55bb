"""Loss-spike rollback (guard.spike_factor): back to the newest checkpoint before the spike, the data up
to the spike and guard.spike_skip_batches more skipped, the decision recorded; a resume repeats it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _train_data import debug_config

from pipeline.train.callbacks import Callbacks
from pipeline.train.checkpoint import Checkpointer
from pipeline.train.guard import SpikeDetector

PER_EPOCH = 6  # 96 sentences in global batches of 16
SPIKED = {9, 10, 11}  # global batch positions (epoch * PER_EPOCH + batch) whose loss is made 10x


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24], [32]], num_variants=3)


class Spiky(Callbacks):
    """The loss x10 on the SPIKED batches (their gradients too, before clipping): a spike that comes with
    the data, so skipping the data avoids it. Records the positions trained on in ``seen``."""

    def __init__(self, seen):
        self.seen = seen

    def on_batch(self, t, batch):
        self.seen.append(batch.epoch * PER_EPOCH + batch.batch)

    def on_loss(self, t, batch, out):
        return dataclasses.replace(out, total=out.total * 10) if self.seen[-1] in SPIKED else out


@pytest.fixture
def spiky():
    """The positions trained on (:class:`Spiky` records them)."""
    return []


def run_spiky(tmp_path, shards, seen, name, steps=16, **overrides):
    from accelerate.state import AcceleratorState

    from pipeline.train.run import run

    base = {
        "train.max_steps": steps, "checkpoint.every_steps": 4, "train.debug_dump": True,
        "guard.spike_factor": 2.0, "guard.spike_steps": 2, "guard.spike_history": 4,
        "guard.spike_skip_batches": 2, "train.eval_max_pairs": 16, "run_dir": str(tmp_path / name),
    }  # fmt: skip
    cfg = debug_config(tmp_path, shards, **{**base, **overrides})
    AcceleratorState._reset_state(True)
    assert run(cfg, Spiky(seen)) == 0
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    dump = json.loads((cfg.run_dir / "debug" / "rank0.json").read_text())
    return [r for r in records if r.get("event") == "spike_rollback"], dump


def test_detector_needs_a_full_history_and_consecutive_steps():
    d = SpikeDetector(factor=2.0, steps=2, history=3)
    assert not any(d.observe(s, 1.0) for s in (1, 2, 3))
    assert not d.observe(4, 5.0) and d.first == 4
    assert not d.observe(5, 1.5) and d.first is None  # one high step alone is not a spike
    assert not d.observe(6, 5.0) and d.observe(7, 5.0) and d.first == 6
    assert d.losses == [1.0, 1.0, 1.5]  # spiking steps stay out of the median


def test_a_spike_rolls_back_and_skips_its_data(tmp_path, shards, spiky):
    rollbacks, dump = run_spiky(tmp_path, shards, spiky, "run")
    # steps 10 and 11 (batches 9, 10) spike; back to step-8 (batches 0-7 used), data skipped to
    # batch 11 + 2 = 13 (epoch 2, batch 1)
    assert rollbacks == [
        {
            "event": "spike_rollback", "step": 8, "detected_at_step": 11, "spike_began": 10,
            "resumed_from": "step-00000008", "skipped_to": [2, 1],
        }
    ]  # fmt: skip
    assert spiky == [*range(11), *range(13, 21)]  # batch 11 is never trained on
    assert dump["step"] == 16 and dump["cursor"]["epoch"] == 3 and dump["cursor"]["batches"] == 3
    state = torch.load(Checkpointer(tmp_path / "run").latest() / "state.pt", weights_only=True)
    assert state["train_state"]["rollbacks"][0]["skipped_to"] == [2, 1]


def test_off_by_default(tmp_path, shards, spiky):
    rollbacks, dump = run_spiky(tmp_path, shards, spiky, "off", **{"guard.spike_factor": 0.0})
    assert rollbacks == [] and spiky == list(range(16))


@pytest.mark.parametrize("stop", [10, 13], ids=["stopped mid-spike", "stopped after the rollback"])
def test_resume_repeats_the_same_decision(tmp_path, shards, spiky, stop):
    _, full = run_spiky(tmp_path, shards, spiky, "full")
    run_spiky(tmp_path, shards, spiky, "split", steps=stop)
    rollbacks, resumed = run_spiky(tmp_path, shards, spiky, "split")
    for key in ("param_checksum", "queue_checksum", "cursor", "step", "samples_seen"):
        assert resumed[key] == full[key], key
    assert len(rollbacks) == 1 and rollbacks[0]["skipped_to"] == [2, 1]  # logged once, in whichever part
