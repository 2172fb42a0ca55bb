"""Checkpointer: atomic saves, verification and fallback, retention, exact state round trips, safe loading."""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.model import (
    SentenceEncoder,
    build_char_vocab,
    build_scratch_backbone,
    make_tokenizer,
    write_vocab,
)
from pipeline.train.checkpoint import Checkpointer, CheckpointError, check_compatible, config_differences
from pipeline.train.rng import RNGState

REPO = Path(__file__).resolve().parents[1]
TINY_BERT = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 32,
}
CONFIG = {
    "model": {"pooling": "cls", "scratch_config": "tiny.json"},
    "optim": {"lr": 1e-3, "schedule": "constant"},
    "train": {"global_batch_size": 8, "seed": 1, "log_every": 10, "max_steps": 100},
    "checkpoint": {"every_steps": 10},
    "data": {"num_workers": 2, "shards": "/data/a"},
    "run_dir": "runs/a",
}


def tiny_encoder(tmp_path: Path, layers: int = 1, seed: int = 0) -> SentenceEncoder:
    vocab_path = tmp_path / "vocab.txt"
    write_vocab(build_char_vocab(["今天天气很好", "我们去公园散步"], min_count=1), vocab_path)
    tokenizer = make_tokenizer(vocab_path)
    backbone = build_scratch_backbone({**TINY_BERT, "num_hidden_layers": layers}, tokenizer.vocab_size, seed)
    return SentenceEncoder(backbone, tokenizer, pooling="cls", max_length=16)


class QueueLike(torch.nn.Module):
    """Stands in for the negative queue: a buffer and a pointer that must survive a restart."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keys", torch.zeros(8, 4))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def push(self, x: torch.Tensor) -> None:
        i = int(self.ptr)
        self.keys[i : i + len(x)] = x
        self.ptr.fill_((i + len(x)) % len(self.keys))


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class Setup:
    """A model, optimizer, scheduler, queue and counters wired as the trainer wires them."""

    def __init__(self, tmp_path: Path, seed: int = 0) -> None:
        self.model = tiny_encoder(tmp_path, seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.queue = QueueLike()
        self.counter = Counter()
        self.states = {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "queue": self.queue,
            "counters": self.counter,
        }
        self.rank_states = {"rng": RNGState()}

    def train_step(self) -> None:
        batch = self.model.tokenize(["今天天气很好", "我们去公园"])
        loss = self.model(**batch).sum() + torch.rand(()).item() * 0  # draws from torch's RNG too
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.queue.push(torch.randn(2, 4))
        self.counter.step += 1


def save(ckpt: Checkpointer, s: Setup, step: int, **kw) -> Path:
    return ckpt.save(step, s.model, s.states, s.rank_states, CONFIG, metrics={"samples_seen": step * 8}, **kw)


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_round_trip_restores_every_state_and_rng(tmp_path):
    s = Setup(tmp_path)
    s.model.train()
    s.train_step()
    ckpt = Checkpointer(tmp_path / "run")
    path = save(ckpt, s, 1)
    params = {k: v.clone() for k, v in s.model.state_dict().items()}
    opt_state = copy.deepcopy(s.optimizer.state_dict())
    queue = s.queue.keys.clone(), int(s.queue.ptr)
    after_save = draws()

    s.train_step()  # move everything on
    assert not torch.equal(s.queue.keys, queue[0])

    fresh = Setup(tmp_path, seed=1)  # different init: the load must overwrite it all
    info = ckpt.load(path, fresh.model, fresh.states, fresh.rank_states)
    assert info["step"] == 1 and info["samples_seen"] == 8 and info["exact"] is True
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, params[k]), k
    assert torch.equal(fresh.queue.keys, queue[0]) and int(fresh.queue.ptr) == queue[1]
    assert fresh.counter.step == 1
    assert fresh.scheduler.last_epoch == 1
    for a, b in zip(fresh.optimizer.state_dict()["state"].values(), opt_state["state"].values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert draws() == after_save  # python, numpy and torch streams continue where they were saved

    # Training on from the restored state matches training on from the original one.
    fresh.train_step()
    loaded = Setup(tmp_path, seed=2)
    ckpt.load(path, loaded.model, loaded.states, loaded.rank_states)
    draws()  # the same draws as above, so dropout masks line up
    loaded.train_step()
    for (k, a), b in zip(fresh.model.state_dict().items(), loaded.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_layout_manifest_and_model_folder(tmp_path):
    s = Setup(tmp_path)
    path = save(Checkpointer(tmp_path / "run"), s, 7)
    assert path == tmp_path / "run" / "checkpoints" / "step-00000007"
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["samples_seen"] == 56
    assert {"state.pt", "rank-0.pt", "config.yaml", "model/model.safetensors"} <= set(manifest["files"])
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-00000007"
    reloaded = SentenceEncoder.from_pretrained(path / "model")
    batch = s.model.tokenize(["今天天气很好"])
    s.model.eval()
    reloaded.eval()
    assert torch.allclose(reloaded(**batch), s.model(**batch))
    assert Checkpointer.saved_config(path) == CONFIG


def test_keep_last_and_best(tmp_path):
    s = Setup(tmp_path)
    ckpt = Checkpointer(tmp_path / "run", keep_last=2)
    for step in range(1, 6):
        save(ckpt, s, step, is_best=(step == 2))
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000002", "step-00000004", "step-00000005"]
    assert ckpt.best().name == "step-00000002"
    assert ckpt.latest().name == "step-00000005"
    no_best = Checkpointer(tmp_path / "run2", keep_last=1, keep_best=False)
    for step in range(1, 4):
        save(no_best, s, step, is_best=(step == 1))
    assert [p.name for p in no_best.checkpoints()] == ["step-00000003"]


def test_resaving_a_step_replaces_it(tmp_path):
    s = Setup(tmp_path)
    ckpt = Checkpointer(tmp_path / "run")
    save(ckpt, s, 3)
    s.counter.step = 99
    path = save(ckpt, s, 3)
    assert torch.load(path / "state.pt", weights_only=True)["counters"]["step"] == 99
    assert ckpt.latest() == path
    assert not list(ckpt.dir.glob(".*step-*"))


@pytest.mark.parametrize("damage", ["flip_state", "truncate_weights", "drop_manifest", "drop_rank_file"])
def test_corrupt_newest_falls_back_with_warning(tmp_path, caplog, damage):
    s = Setup(tmp_path)
    ckpt = Checkpointer(tmp_path / "run")
    save(ckpt, s, 1)
    second = save(ckpt, s, 2)
    if damage == "flip_state":
        data = bytearray((second / "state.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (second / "state.pt").write_bytes(bytes(data))
    elif damage == "truncate_weights":
        weights = second / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-10])
    elif damage == "drop_manifest":
        (second / "checkpoint.json").unlink()
    else:
        (second / "rank-0.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="pipeline.train.checkpoint"):
        assert ckpt.latest().name == "step-00000001"
    assert "step-00000002" in caplog.text
    with pytest.raises(CheckpointError, match="step-00000002"):
        ckpt.load(second, s.model, s.states, s.rank_states)


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert Checkpointer(tmp_path / "nothing").latest() is None


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    import pipeline.train.checkpoint as ck

    class Model:  # save_pretrained is all the checkpointer asks of a model
        def save_pretrained(self, d):
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "weights.bin").write_bytes(b"w" * 1000)

    class Blob:
        def __init__(self, n): self.x = torch.full((n,), 1.0)
        def state_dict(self): return {"x": self.x}
        def load_state_dict(self, s): self.x = s["x"]

    run, phase = Path(sys.argv[1]), sys.argv[2]
    ckpt = ck.Checkpointer(run)
    ckpt.save(1, Model(), {"blob": Blob(10)}, {}, {"a": 1})
    real_save, real_write = ck._torch_save, ck.atomic_write_bytes

    def slow_save(obj, path):  # kill while the (large) state file is half written
        with open(path, "wb") as f:
            f.write(b"partial")
            f.flush()
            print("SAVING", flush=True)
            time.sleep(60)

    def slow_manifest(path, data):  # kill after the manifest is written but before the rename
        real_write(path, data)
        if path.name == "checkpoint.json":
            print("SAVING", flush=True)
            time.sleep(60)

    if phase == "files":
        ck._torch_save = lambda o, p: slow_save(o, p) if p.name == "state.pt" else real_save(o, p)
    else:
        ck.atomic_write_bytes = slow_manifest
    ckpt.save(2, Model(), {"blob": Blob(2_000_000)}, {}, {"a": 1})
    """
)


@pytest.mark.parametrize("phase", ["files", "manifest"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, phase):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(run), phase], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout.readline().strip() == "SAVING"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    ckpt = Checkpointer(run)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000001"]  # the half-written one is invisible
    assert list(ckpt.dir.glob(".tmp-step-00000002"))  # ...and it did exist
    assert ckpt.latest().name == "step-00000001"
    assert (ckpt.dir / "latest").read_text().strip() == "step-00000001"
    # The next save cleans the leftover up.
    s = Setup(tmp_path)
    save(ckpt, s, 2)
    assert not list(ckpt.dir.glob(".tmp-*"))
    assert ckpt.latest().name == "step-00000002"


class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickled_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = Setup(tmp_path)
    ckpt = Checkpointer(tmp_path / "run")
    path = save(ckpt, s, 1)
    with open(path / "state.pt", "wb") as f:
        pickle.dump({"optimizer": Evil()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load(path, s.model, s.states, s.rank_states, verify=False)
    assert not (tmp_path / "pwned").exists()


def test_weights_must_match_the_architecture(tmp_path):
    s = Setup(tmp_path)
    ckpt = Checkpointer(tmp_path / "run")
    path = save(ckpt, s, 1)
    bigger = tiny_encoder(tmp_path, layers=2)
    with pytest.raises(CheckpointError, match="missing .*encoder.layer.1"):
        ckpt.load(path, bigger, {}, {})


def test_missing_state_is_an_error(tmp_path):
    s = Setup(tmp_path)
    ckpt = Checkpointer(tmp_path / "run")
    path = save(ckpt, s, 1)
    with pytest.raises(CheckpointError, match="no state for momentum"):
        ckpt.load(path, s.model, {**s.states, "momentum": Counter()}, s.rank_states)


def test_other_world_size_keeps_shared_state_but_not_rank_streams(tmp_path, caplog):
    s = Setup(tmp_path)
    ckpt = Checkpointer(tmp_path / "run")
    s.counter.step = 5
    path = save(ckpt, s, 5)
    manifest = json.loads((path / "checkpoint.json").read_text())
    manifest["world_size"] = 2  # as if written by two processes
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fresh = Setup(tmp_path)
    fresh.rank_states = {"rng": RNGState()}
    torch.manual_seed(123)
    with caplog.at_level(logging.WARNING):
        info = ckpt.load(path, fresh.model, fresh.states, fresh.rank_states)
    assert info["exact"] is False and fresh.counter.step == 5
    assert torch.equal(torch.rand(3), expected)  # RNG left as seeded here, not replaced by rank 0's
    assert "written by 2 processes and is resumed by 1" in caplog.text


def test_check_compatible_lists_every_altering_difference():
    new = json.loads(json.dumps(CONFIG))
    new["optim"]["lr"] = 2e-3
    new["train"]["global_batch_size"] = 16
    new["model"]["pooling"] = "mean"
    new["train"]["log_every"] = 1
    with pytest.raises(ConfigError) as err:
        check_compatible(CONFIG, new)
    message = str(err.value)
    for text in (
        "optim.lr: 0.001 -> 0.002",
        "train.global_batch_size: 8 -> 16",
        "model.pooling: 'cls' -> 'mean'",
    ):
        assert text in message
    assert "log_every" not in message
    assert "--run_dir" in message and "3 setting(s)" in message


def test_check_compatible_allows_harmless_changes():
    new = json.loads(json.dumps(CONFIG))
    new["train"]["log_every"] = 1
    new["train"]["max_steps"] = 500  # extending the run
    new["checkpoint"]["every_steps"] = 3
    new["data"]["num_workers"] = 0
    new["run_dir"] = "/elsewhere/run"
    check_compatible(CONFIG, new)
    altering, harmless = config_differences(CONFIG, new)
    assert altering == [] and len(harmless) == 5
    new["train"]["seed"] = 2
    new["data"]["shards"] = "/data/b"
    new["objective"] = {"queue_size": 64}  # a section the old run did not have
    altering, _ = config_differences(CONFIG, new)
    assert altering == [
        "data.shards: '/data/a' -> '/data/b'",
        "objective.queue_size: '<absent>' -> 64",
        "train.seed: 1 -> 2",
    ]


def test_a_checkpoint_from_before_a_field_existed_resumes_at_its_earlier_behaviour():
    """data.holdout_rows, data.supervised_teacher and train.select_on (issue 44) are absent from earlier
    checkpoints' configs: absent reads as the value that does what the run did then, anything else alters."""
    new = json.loads(json.dumps(CONFIG))
    new["data"].update(holdout_rows=0, supervised_teacher=None)
    new["train"]["select_on"] = "sts_b"
    check_compatible(CONFIG, new)
    new["data"]["holdout_rows"] = 1000
    altering, _ = config_differences(CONFIG, new)
    assert altering == ["data.holdout_rows: 0 -> 1000"]


def test_a_new_run_length_alters_a_decaying_schedule():
    for schedule in ("linear", "cosine"):
        old = json.loads(json.dumps(CONFIG))
        old["optim"]["schedule"] = schedule
        new = json.loads(json.dumps(old))
        new["train"]["max_steps"] = 500
        altering, harmless = config_differences(old, new)
        assert harmless == []
        assert altering == [
            f"train.max_steps: 100 -> 500 (the {schedule} schedule decays to 0 at the last step)"
        ]
        with pytest.raises(ConfigError, match="train.max_steps"):
            check_compatible(old, new)


class FakeEngine:
    """What the checkpointer uses of a DeepSpeed engine, with a chosen data-parallel size."""

    def __init__(self, dp: int, stage: int = 2) -> None:
        self.dp_world_size, self.stage, self.loaded = dp, stage, None

    def zero_optimization_stage(self) -> int:
        return self.stage

    def save_checkpoint(self, directory: str, tag: str, save_latest: bool = True) -> None:
        Path(directory, tag).mkdir(parents=True)
        Path(directory, tag, "zero_pp_rank_0_optim_states.pt").write_bytes(b"shard")

    def load_checkpoint(self, directory: str, tag: str, **kwargs) -> None:
        self.loaded = Path(directory, tag)


def test_deepspeed_engine_checkpoint_and_world_size_rules(tmp_path):
    s = Setup(tmp_path)
    saving = Checkpointer(tmp_path / "run", engine=FakeEngine(dp=2))
    path = saving.save(1, s.model, s.states, s.rank_states, CONFIG)
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["deepspeed"] == {"zero_stage": 2, "dp_world_size": 2}
    assert "deepspeed/engine/zero_pp_rank_0_optim_states.pt" in manifest["files"]
    same = FakeEngine(dp=2)
    Checkpointer(tmp_path / "run", engine=same).load(path, s.model, s.states, s.rank_states)
    assert same.loaded == path / "deepspeed" / "engine"
    with pytest.raises(
        CheckpointError, match="shards for 2 data-parallel ranks but this run has 1.*Resume with 2"
    ):
        Checkpointer(tmp_path / "run", engine=FakeEngine(dp=1)).load(path, s.model, s.states, s.rank_states)
    with pytest.raises(CheckpointError, match="written under DeepSpeed"):
        Checkpointer(tmp_path / "run").load(path, s.model, s.states, s.rank_states)
    plain = save(Checkpointer(tmp_path / "plain"), s, 1)
    with pytest.raises(CheckpointError, match="written without DeepSpeed"):
        Checkpointer(tmp_path / "plain", engine=FakeEngine(dp=1)).load(
            plain, s.model, s.states, s.rank_states
        )
    # ZeRO-0 keeps no shards: any process count may resume it.
    zero0 = Checkpointer(tmp_path / "zero0", engine=FakeEngine(dp=2, stage=0))
    path0 = zero0.save(1, s.model, s.states, s.rank_states, CONFIG)
    Checkpointer(tmp_path / "zero0", engine=FakeEngine(dp=1, stage=0)).load(
        path0, s.model, s.states, s.rank_states
    )
