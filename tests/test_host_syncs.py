"""No host sync on a training step that does not log (pipeline/train/loop.py): ``.item()``, ``.tolist()``,
``.cpu()``, ``float()``/``int()``/``bool()`` of a tensor are counted per step of a tiny CPU run (the
momentum encoder, the queue, the guard on); steps between log steps make none. And the guard's verdict
read at log steps (fused AdamW) skips a NaN step like the per-step verdict does."""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter

import pytest
import torch
from _train_data import debug_config, debug_luse
from test_nonfinite import Poison

from pipeline.data.stream import BatchStream
from pipeline.train.callbacks import Callbacks, OnBatch

LOG_EVERY = 4
STEPS = 8


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24], [32]], num_variants=3)


def cfg_for(tmp_path, shards, name, **overrides):
    base = {
        "train.max_steps": STEPS,
        "train.log_every": LOG_EVERY,
        "loss": debug_luse(momentum=0.9),  # a momentum encoder and a queue
        "optim.fused": True,  # the guard's verdict stays on the device
        "train.debug_dump": True,
        "train.eval_max_pairs": 16,
        "run_dir": str(tmp_path / name),
    }
    return debug_config(tmp_path, shards, **{**base, **overrides})


def train(cfg, on_batch=None):
    from accelerate.state import AcceleratorState

    from pipeline.train.run import run

    AcceleratorState._reset_state(True)
    code = run(cfg, on_batch)
    return code, json.loads((cfg.run_dir / "debug" / "rank0.json").read_text()) if code == 0 else None


class PerStep(Callbacks):
    """The guard's verdict read at every step, never deferred."""

    defer_verdicts = False


class Verdicts(OnBatch):
    """``on_batch`` as given; each verdict the guard reads noted in ``order``."""

    def __init__(self, on_batch, order):
        super().__init__(on_batch)
        self.order = order

    def on_verdict(self, t, check):
        self.order.append("verdict")
        return check


class SyncCounter:
    """Counts host syncs per step: from the moment a batch is handed to the loop until the next is asked
    for (the step, and the loop's bookkeeping after it), data loading excluded."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.per_step: list[Counter] = []
        self.active = False
        for name in self.METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        original = BatchStream.__iter__

        def counting_iter(stream):
            for batch in original(stream):
                self.per_step.append(Counter())
                self.active = True
                yield batch
                self.active = False

        monkeypatch.setattr(BatchStream, "__iter__", counting_iter)

    def _counting(self, name, method):
        counter = self

        def wrapper(tensor, *args, **kwargs):
            if counter.active:
                frame = sys._getframe(1).f_code
                # transformers (5.x) reads padding_mask.all() in every BERT forward, to skip the attention
                # mask of an unpadded batch: a sync inside the model, outside the loop (docs/training.md)
                where = (
                    "transformers_mask"
                    if frame.co_filename.endswith("transformers/masking_utils.py")
                    else name
                )
                if frame.co_name == "log_step" and frame.co_filename.endswith("pipeline/train/loop.py"):
                    where = f"log_step.{name}"  # the log step's own reads of the logged values
                counter.per_step[-1][where] += 1
            return method(tensor, *args, **kwargs)

        return wrapper


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_steps_between_log_steps_make_no_host_sync(tmp_path, shards, monkeypatch, precision):
    counter = SyncCounter(monkeypatch)
    code, dump = train(cfg_for(tmp_path, shards, "count", **{"train.mixed_precision": precision}))
    counter.active = False
    assert code == 0 and dump["step"] == STEPS
    assert len(counter.per_step) == STEPS  # no skip: one batch per step
    quiet = [step for step in range(1, STEPS + 1) if step % LOG_EVERY]
    assert quiet == [1, 2, 3, 5, 6, 7]
    # none from the loop, the guard, the queue, the momentum encoder or the losses; the online and the
    # momentum encoder's forwards each make transformers' one
    expected = {"transformers_mask": 2}
    assert {step: dict(counter.per_step[step - 1]) for step in quiet} == {step: expected for step in quiet}
    # the log steps do read back (the loss, the guard's verdicts): the counter sees syncs where they are
    assert all(sum(counter.per_step[step - 1].values()) > 0 for step in (LOG_EVERY, STEPS))
    # and the log step reads every logged value (loss, parts, counts, alignment, uniformity) in one transfer
    for step in (LOG_EVERY, STEPS):
        own = {k: v for k, v in counter.per_step[step - 1].items() if k.startswith("log_step.")}
        assert own == {"log_step.tolist": 1}, (step, dict(counter.per_step[step - 1]))


def test_the_prepared_mask_reaches_the_momentum_encoder(tmp_path, shards, monkeypatch):
    """With the prepared mask (here asked by train.pad_to_multiple_of; a CUDA run always gets it) neither
    the online encoder nor its momentum copy leaves transformers a mask to check: a quiet step makes no
    sync at all."""
    counter = SyncCounter(monkeypatch)
    code, dump = train(cfg_for(tmp_path, shards, "prepared", **{"train.pad_to_multiple_of": 8}))
    counter.active = False
    assert code == 0 and dump["step"] == STEPS
    quiet = [step for step in range(1, STEPS + 1) if step % LOG_EVERY]
    assert {step: dict(counter.per_step[step - 1]) for step in quiet} == {step: {} for step in quiet}


def test_the_deferred_verdict_changes_nothing_in_a_clean_run(tmp_path, shards, monkeypatch):
    """Read at log steps or at every step, a run without a non-finite step ends bit-identical."""
    code, deferred = train(cfg_for(tmp_path, shards, "deferred"))
    assert code == 0
    code, per_step = train(cfg_for(tmp_path, shards, "per_step"), PerStep())
    assert code == 0
    for key in ("param_checksum", "queue_checksum", "cursor", "step", "samples_seen"):
        assert deferred[key] == per_step[key], key


def test_a_nan_step_found_at_the_log_step_is_skipped_and_taken_back(tmp_path, shards):
    """The NaN at batch 3 (step 4, a log step) and at batch 5 (found at the next log step): both skipped
    on the device, counted, taken back from the step counter; 8 steps still take 8 applied updates."""
    poisoned = Poison([(0, 3), (0, 5)])
    code, dump = train(cfg_for(tmp_path, shards, "nan"), poisoned)
    assert code == 0 and dump["step"] == STEPS and dump["samples_seen"] == STEPS * 16
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in records if r.get("event") == "nonfinite_skip"]
    assert [(s["epoch"], s["batch"], s["skipped"], s["consecutive"]) for s in skips] == [
        (0, 3, 1, 1),
        (0, 5, 2, 1),
    ]
    assert len(poisoned.seen) == STEPS + 2
    losses = [r for r in records if "loss" in r]
    assert losses and all(math.isfinite(r["loss"]) for r in losses)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "nan" / "model" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_under_deepspeed_bf16_nothing_waits_between_forward_and_backward(tmp_path, shards, monkeypatch):
    """ZeRO-2 bf16 skips a step with non-finite gradients itself: the guard reads the loss after the
    engine's backward and step (no sync before the backward), and still counts the NaN batch's skip."""
    import socket

    from accelerate import Accelerator

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext")))
    order = []
    backward = Accelerator.backward
    monkeypatch.setattr(
        Accelerator,
        "backward",
        lambda self, loss, **kw: order.append("backward") or backward(self, loss, **kw),
    )
    overrides = {
        "train.deepspeed_config": "launch/deepspeed/zero2.json",
        "train.mixed_precision": "bf16",
        "train.max_steps": 5,
        "train.log_every": 1,
        "optim.fused": False,
    }
    code, dump = train(cfg_for(tmp_path, shards, "ds", **overrides), Verdicts(Poison([(0, 3)]), order))
    assert code == 0 and dump["step"] == 5
    assert order == ["backward", "verdict"] * 6  # 5 applied steps and the skipped one
    records = [json.loads(line) for line in (tmp_path / "ds" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["batch"]) for r in records if r.get("event") == "nonfinite_skip"] == [(0, 3)]
    from safetensors.torch import load_file

    assert all(
        torch.isfinite(w).all() for w in load_file(tmp_path / "ds" / "model" / "model.safetensors").values()
    )
