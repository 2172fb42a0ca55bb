"""The run's length: train.max_steps, train.max_samples (in sentences, whatever the batch or the corpus
size) or train.epochs; a mistake is one line; a changed length on resume is refused unless the learning
rate is constant, and a checkpoint written before train.max_samples existed resumes."""

import json

import pytest
from _train_data import make_shards

from pipeline.cli import main as cli_main
from pipeline.config import load_config, to_dict
from pipeline.errors import ConfigError
from pipeline.train.checkpoint import check_compatible
from pipeline.train.config import PROJECT_ROOT, Config

DEBUG = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"


@pytest.mark.parametrize(
    "overrides, batches_per_epoch, steps",
    [
        ({"train.max_steps": 7}, 5, 7),
        ({"train.max_steps": 0, "train.max_samples": 48}, 5, 3),  # 3 batches of 16
        ({"train.max_steps": 0, "train.max_samples": 49}, 5, 4),  # the last batch counted whole
        ({"train.max_steps": 0, "train.epochs": 3}, 5, 15),
        ({"train.max_steps": 0, "train.max_samples": 48, "train.global_batch_size": 8}, 5, 6),
    ],
)
def test_total_steps(overrides, batches_per_epoch, steps):
    cfg = load_config(Config, DEBUG, overrides)
    assert cfg.train.total_steps(batches_per_epoch) == steps


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.max_samples": 100}, "train.max_steps (10) and train.max_samples (100) both set"),
        ({"train.max_steps": 0, "train.max_samples": -1}, "train.max_samples must be >= 0"),
    ],
)
def test_length_mistakes_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(Config, DEBUG, overrides)


def test_a_run_given_in_samples_stops_at_their_steps(tmp_path, capsys):
    shards = tmp_path / "shards"
    make_shards(shards, [[32], [32]], num_variants=2)
    run = tmp_path / "run"
    argv = ["train", "--config", str(DEBUG), f"--data.shards={shards}", f"--run_dir={run}",
            "--train.max_steps=0", "--train.max_samples=40", "--train.eval_max_pairs=16"]  # fmt: skip
    assert cli_main(argv) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps[-1] == 3  # ceil(40 / 16): 48 samples, more than the 40 asked for, fewer than an epoch's 64


def test_a_new_length_on_resume_is_refused_unless_the_rate_is_constant():
    saved = to_dict(load_config(Config, DEBUG, {"train.max_steps": 0, "train.max_samples": 480}))
    longer = to_dict(load_config(Config, DEBUG, {"train.max_steps": 0, "train.max_samples": 960}))
    check_compatible(saved, longer)  # debug.yaml's schedule is constant: a longer run is harmless
    saved["optim"]["schedule"] = longer["optim"]["schedule"] = "linear"
    with pytest.raises(ConfigError, match="train.max_samples: 480 -> 960 \\(the linear schedule decays"):
        check_compatible(saved, longer)


def test_a_checkpoint_from_before_max_samples_resumes():
    current = to_dict(load_config(Config, DEBUG))
    saved = json.loads(json.dumps(current))
    del saved["train"]["max_samples"]  # written by a version without the field
    saved["optim"]["schedule"] = current["optim"]["schedule"] = "linear"
    check_compatible(saved, current)  # absent reads as 0: no difference, nothing refused
