"""Training start-up resolves the config once: file paths when the config is made, the device and its
speed settings into one DeviceSetup, the saved config once (config.yaml and every checkpoint)."""

from __future__ import annotations

import pytest
import yaml
from _train_data import debug_config

from pipeline.config import load_config, to_dict
from pipeline.devices import CudaProbe
from pipeline.errors import ConfigError
from pipeline.train.config import PROJECT_ROOT, Config
from pipeline.train.speed import resolve_setup

DEBUG = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"
NO_GPU = CudaProbe(torch_version="2", torch_cuda=None, available=False)


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[32]], num_variants=2)


def test_file_fields_are_resolved_from_the_project_root_when_the_config_is_made(
    tmp_path, monkeypatch, shards
):
    monkeypatch.chdir(tmp_path)  # launch/... does not exist from here
    over = {"data.shards": str(shards), "train.deepspeed_config": "launch/deepspeed/zero2.json"}
    cfg = load_config(Config, DEBUG, over)
    assert cfg.model.scratch_config == PROJECT_ROOT / "launch" / "configs" / "model_tiny.json"
    assert cfg.train.deepspeed_config == PROJECT_ROOT / "launch" / "deepspeed" / "zero2.json"
    # from the project root the path stays as written (config.yaml keeps it)
    monkeypatch.chdir(PROJECT_ROOT)
    assert str(load_config(Config, DEBUG, over).train.deepspeed_config) == "launch/deepspeed/zero2.json"
    # a path found nowhere is kept as given, and refused where the file is read
    missing = load_config(Config, DEBUG, {**over, "train.deepspeed_config": "nowhere/zero9.json"})
    assert str(missing.train.deepspeed_config) == "nowhere/zero9.json"
    with pytest.raises(ConfigError, match=r"train.deepspeed_config: nowhere/zero9.json does not exist"):
        resolve_setup(missing, NO_GPU)


def test_the_device_setup_on_cpu_resolves_auto_and_fills_the_deepspeed_batch_sizes(
    tmp_path, shards, monkeypatch
):
    from pipeline import precision

    no_bf16 = precision.CpuBf16(False, "no native bf16 (test)")
    monkeypatch.setattr(precision, "cpu_bf16", lambda *a, **k: no_bf16)  # auto: fp32 on such a CPU
    over = {
        "train.mixed_precision": "auto",
        "optim.fused": "auto",
        "train.deepspeed_config": "launch/deepspeed/zero2.json",
        "train.global_batch_size": 16,
        "train.grad_accum_steps": 2,
        "optim.grad_clip": 0.5,
    }
    setup = resolve_setup(debug_config(tmp_path, shards, **over), NO_GPU)
    assert (setup.device, setup.why, setup.mixed_precision, setup.fused) == (
        "cpu",
        "train.device=cpu",
        "no",
        False,
    )
    ds = setup.deepspeed
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (
        16,
        8,
    )  # one rank, 2 micro-batches
    assert (ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (2, 0.5)
    assert ds["bf16"]["check_grad_overflow"] is True  # the guard reads the engine's verdict
    assert resolve_setup(debug_config(tmp_path, shards), NO_GPU).deepspeed is None


def test_config_yaml_and_the_trainer_hold_the_resolved_config_computed_once(tmp_path, shards):
    from accelerate.state import AcceleratorState

    from pipeline.train.build import build

    cfg = debug_config(tmp_path, shards, **{"optim.fused": "auto", "train.eval_max_pairs": 8})
    AcceleratorState._reset_state(True)
    trainer = build(cfg)
    try:
        assert trainer.run_config == to_dict(cfg) and trainer.run_config["optim"]["fused"] is False
        written = yaml.safe_load((cfg.run_dir / "config.yaml").read_text(encoding="utf-8"))
        assert written == trainer.run_config
    finally:
        trainer.close()


def test_a_run_started_in_the_project_root_resumes_from_elsewhere(tmp_path, monkeypatch, shards):
    """config.yaml keeps a path as written where it exists; a resume from another working directory
    resolves the saved config's paths as it resolves its own, so the two name the same files."""
    from pipeline.train.build import read_saved_config
    from pipeline.train.checkpoint import check_compatible

    over = {"data.shards": str(shards), "train.deepspeed_config": "launch/deepspeed/zero2.json"}
    monkeypatch.chdir(PROJECT_ROOT)
    saved = to_dict(load_config(Config, DEBUG, over))
    assert saved["train"]["deepspeed_config"] == "launch/deepspeed/zero2.json"
    monkeypatch.chdir(tmp_path)
    current = to_dict(load_config(Config, DEBUG, over))
    assert current["train"]["deepspeed_config"] == str(PROJECT_ROOT / "launch" / "deepspeed" / "zero2.json")
    assert read_saved_config(saved) == current
    check_compatible(read_saved_config(saved), current)  # no difference, so no refusal
    other = {**saved, "train": {**saved["train"], "deepspeed_config": "launch/deepspeed/zero1.json"}}
    with pytest.raises(ConfigError, match="train.deepspeed_config"):
        check_compatible(read_saved_config(other), current)  # another file still is one
