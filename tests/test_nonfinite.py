"""The non-finite guard (pipeline/train/guard.py): a NaN batch is skipped without touching anything, too
many in a row stop the run with its own exit code, a non-finite checkpoint is never written, and exact
resume holds through skipped steps."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from _train_data import debug_config, debug_luse

from pipeline.train import guard
from pipeline.train.callbacks import OnBatch
from pipeline.train.checkpoint import Checkpointer, verify_checkpoint


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24], [32]], num_variants=3)


class Poison:
    """An ``on_batch`` hook: the batches at ``positions`` ((epoch, batch) pairs) get NaN embeddings in
    the online encoder's forward (the momentum encoder, a copy made before, is not hooked)."""

    def __init__(self, positions):
        self.positions, self.active, self.hooked, self.seen = set(positions), False, False, []

    def __call__(self, t, batch):
        if not self.hooked:
            embeddings = t.module.encoder.backbone.embeddings
            embeddings.register_forward_hook(lambda _m, _i, out: out * math.nan if self.active else None)
            self.hooked = True
        self.active = (batch.epoch, batch.batch) in self.positions
        self.seen.append((batch.epoch, batch.batch))


def cfg_for(tmp_path, shards, name, **overrides):
    base = {
        "train.max_steps": 8,
        "loss": debug_luse(momentum=0.9),  # a momentum encoder and a queue, both must stay untouched
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


def events(run_dir, name):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == name], [r for r in records if "loss" in r]


def final_parameters(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "model" / "model.safetensors")


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_nan_batch_is_skipped_exactly_like_a_forced_skip(tmp_path, shards, monkeypatch, precision):
    """The NaN run equals a clean run whose verdict is forced to 'skip' at the same batch: nothing of the
    NaN step leaked into the weights, AdamW's moments, the momentum encoder or the queue."""
    bad = (0, 3)
    poisoned = Poison([bad])
    code, dump = train(cfg_for(tmp_path, shards, "nan", **{"train.mixed_precision": precision}), poisoned)
    assert code == 0 and dump["step"] == 8
    skips, steps = events(tmp_path / "nan", "nonfinite_skip")
    assert [(s["epoch"], s["batch"], s["skipped"]) for s in skips] == [(0, 3, 1)]
    assert [s["step"] for s in steps] == list(range(1, 9)) and all(math.isfinite(s["loss"]) for s in steps)
    assert poisoned.seen[:5] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)] and len(poisoned.seen) == 9
    weights = final_parameters(tmp_path / "nan")
    assert all(torch.isfinite(w).all() for w in weights.values())

    clean = Poison([])  # same batches, nothing poisoned; the verdict at (0, 3) says "skip"

    class ForcedSkip(OnBatch):
        def on_verdict(self, t, check):
            return guard.StepCheck(False, 0.0) if clean.seen[-1] == bad else check

    code, ref = train(
        cfg_for(tmp_path, shards, "forced", **{"train.mixed_precision": precision}), ForcedSkip(clean)
    )
    assert code == 0
    assert dump["param_checksum"] == ref["param_checksum"] and dump["queue_checksum"] == ref["queue_checksum"]
    assert dump["cursor"] == ref["cursor"] and dump["samples_seen"] == ref["samples_seen"] == 8 * 16
    ref_weights = final_parameters(tmp_path / "forced")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_without_the_guard_the_nan_spreads_and_the_checkpoint_is_refused(tmp_path, shards):
    from pipeline.train.guard import NonFiniteError

    cfg = cfg_for(tmp_path, shards, "off", **{"guard.max_nonfinite_steps": 0, "checkpoint.every_steps": 2})
    with pytest.raises(NonFiniteError, match="refusing to write checkpoint step-00000004.*step-00000002"):
        train(cfg, Poison([(0, 3)]))
    ckpt = Checkpointer(cfg.run_dir)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000002"]
    verify_checkpoint(ckpt.latest())
    assert not list(ckpt.dir.glob(".tmp-*"))


def test_k_consecutive_nonfinite_steps_stop_with_exit_code_70(tmp_path, shards, capsys):
    """From batch 3 on every batch is NaN: 3 steps done, a checkpoint at step 2, then 4 skips in a row
    stop the run with exit code 70, naming step-00000002 -- which is intact -- and nothing saved after."""
    import sys

    from accelerate.state import AcceleratorState

    from pipeline.train.config import PROJECT_ROOT

    sys.path.insert(0, str(PROJECT_ROOT / "launch"))
    from pretrain import main

    AcceleratorState._reset_state(True)
    run_dir = tmp_path / "k"
    argv = [
        f"--data.shards={shards}", f"--run_dir={run_dir}", "--train.max_steps=8", "--train.cpu=true",
        "--checkpoint.every_steps=2", "--guard.max_nonfinite_steps=4", "--train.eval_max_pairs=16",
        "--config", str(PROJECT_ROOT / "launch" / "configs" / "debug.yaml"),
    ]  # fmt: skip
    code = main(argv, Poison([(e, b) for e in range(3) for b in range(6) if (e, b) >= (0, 3)]))
    assert code == guard.EXIT_CODE_NONFINITE == 70
    err = [
        x[x.index("error:") :] for x in capsys.readouterr().err.splitlines() if "error:" in x
    ]  # after tqdm's \r
    assert len(err) == 1 and "4 consecutive steps had a non-finite loss" in err[0]
    assert "checkpoints/step-00000002" in err[0] and "epoch 1, batch 0" in err[0]  # 6 batches an epoch
    ckpt = Checkpointer(run_dir)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000002"]
    verify_checkpoint(ckpt.latest())
    skips, steps = events(run_dir, "nonfinite_skip")
    assert [s["consecutive"] for s in skips] == [1, 2, 3, 4] and max(s["step"] for s in steps) == 3


def test_resume_through_a_skipped_step_is_exact(tmp_path, shards):
    """Stopped at step 5 (after the skip at batch 3, a checkpoint at step 4) and resumed to 8: the same
    parameters, queue, cursor and skip count as the uninterrupted run."""
    overrides = {"checkpoint.every_steps": 2, "optim.schedule": "constant"}
    code, full = train(cfg_for(tmp_path, shards, "full", **overrides), Poison([(0, 3)]))
    assert code == 0
    code, _ = train(
        cfg_for(tmp_path, shards, "split", **{**overrides, "train.max_steps": 5}), Poison([(0, 3)])
    )
    assert code == 0
    code, resumed = train(cfg_for(tmp_path, shards, "split", **overrides), Poison([(0, 3)]))
    assert code == 0
    for key in ("param_checksum", "queue_checksum", "cursor", "step", "samples_seen"):
        assert resumed[key] == full[key], key
    state = torch.load(Checkpointer(tmp_path / "split").latest() / "state.pt", weights_only=True)
    assert state["train_state"]["nonfinite_skipped"] == 1


def test_under_deepspeed_a_nan_batch_is_skipped_and_counted(tmp_path, shards, monkeypatch):
    """DeepSpeed steps inside backward: the guard judges the loss first, so the NaN batch never reaches
    the engine; the run goes on, counts the skip, and ends with finite weights (one process, gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext")))
    poisoned = Poison([(0, 3)])
    overrides = {"train.deepspeed_config": "launch/deepspeed/zero2.json", "train.max_steps": 6}
    code, dump = train(cfg_for(tmp_path, shards, "ds", **overrides), poisoned)
    assert code == 0 and dump["step"] == 6
    skips, steps = events(tmp_path / "ds", "nonfinite_skip")
    assert [(s["epoch"], s["batch"]) for s in skips] == [(0, 3)]
    assert [s["step"] for s in steps] == list(range(1, 7)) and all(math.isfinite(s["loss"]) for s in steps)
    assert all(torch.isfinite(w).all() for w in final_parameters(tmp_path / "ds").values())
