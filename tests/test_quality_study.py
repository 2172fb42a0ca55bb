"""benchmarks/quality.py: every trained condition gets the same compute, and the table reports it."""

from __future__ import annotations

import argparse

import pytest
import yaml
from _scripts import benchmark_module


@pytest.fixture(scope="module")
def quality():
    with benchmark_module("quality") as module:
        yield module


def _args(tmp_path, **kw):
    base = dict(shards=tmp_path, sequences=192, eval_every=50, select_best=True, max_pairs=2000, eval_seed=0)
    return argparse.Namespace(**{**base, **kw})


def _option(command, key):
    found = [c.split("=", 1)[1] for c in command if c.startswith(f"--{key}=")]
    return found[-1]  # the last occurrence wins, as in the config loader


def test_every_trained_condition_encodes_the_same_sequences_per_step(quality, tmp_path):
    args = _args(tmp_path)
    trained = [c for c in quality.all_conditions().values() if c.kind == "train"]
    assert {"simcse", "luse", "default"} <= {c.name for c in trained}
    for cond in trained:
        command = quality.train_command(args, cond, seed=1, out=tmp_path / cond.name, steps=200)
        batch = int(_option(command, "train.global_batch_size"))
        assert batch * cond.views == args.sequences, cond.name
        assert _option(command, "train.max_steps") == "200"
    simcse = quality.all_conditions()["simcse"]
    command = quality.train_command(args, simcse, 1, tmp_path, 10)
    assert yaml.safe_load(_option(command, "loss")) == [{"simcse": {}}]
    assert simcse.views == 2


def test_the_default_condition_follows_the_shipped_config(quality):
    import yaml

    cfg = yaml.safe_load(quality.DEFAULT_CONFIG.read_text(encoding="utf-8"))
    default = quality.all_conditions()["default"]
    assert default.views == 1 + cfg["data"]["num_variants"] + cfg["data"]["num_dropout_views"]
    assert default.overrides == ()  # the README's configuration as it is
    # its luse term's momentum encoder adds a key forward per step (issue 33: read from `loss`)
    (term,) = cfg["loss"]
    assert term["luse"]["momentum"] > 0 and default.momentum_forward


def test_a_queue_that_is_not_a_multiple_of_the_batch_is_refused(quality, tmp_path):
    cond = quality.luse("odd", "odd", k=4, d=1, queue=100, momentum=0.0)
    with pytest.raises(SystemExit, match="multiple"):
        quality.train_command(_args(tmp_path), cond, 1, tmp_path, 10)
    with pytest.raises(SystemExit, match="multiple"):
        quality.batch_for(_args(tmp_path, sequences=100), quality.all_conditions()["luse"])


def test_table_reports_mean_and_std_over_seeds(quality, tmp_path):
    rows = [
        {"avg5": 30.0, "ATEC": 1.0, "best_step": 50.0, "loss": 1.5},
        {"avg5": 32.0, "ATEC": 3.0, "best_step": 100.0, "loss": 1.7},
    ]
    text = quality.table({"luse": rows}, quality.all_conditions(), _args(tmp_path))
    line = text.splitlines()[-1]
    assert "31.00 ± 1.41" in line and "2.00 ± 1.41" in line and "50/100" in line and "32 × 6" in line
    assert quality.mean_std([float("nan")]) == "–"


def test_student_study_rows_are_valid_configs_at_equal_compute(quality, tmp_path):
    """Every distillation-study run parses as a training config whose views match its row's count."""
    from pipeline.cli import parse_cli
    from pipeline.config import load_config
    from pipeline.train.config import Config

    args = _args(tmp_path, sequences=96, student=tmp_path / "student")
    trained = [c for c in quality.student_conditions().values() if c.kind == "train"]
    assert {"s_luse", "s_distill", "s_luse_distill"} <= {c.name for c in trained}
    for cond in trained:
        command = quality.train_command(args, cond, seed=1, out=tmp_path / cond.name, steps=100)
        assert _option(command, "model.name_or_path") == str(args.student)
        yaml_path, overrides = parse_cli(Config, command[2:])
        cfg = load_config(Config, yaml_path, overrides)
        encoded = cfg.num_views() + cfg.data.num_hard_negatives  # sequences encoded per sentence
        assert encoded == cond.views, cond.name
        assert encoded * cfg.train.global_batch_size == 96, cond.name
    main_job = quality.student_conditions()["s_distill"]
    assert main_job.overrides == () and main_job.config == quality.STUDENT_CONFIG


def test_set_overrides_reach_every_run_and_rows_still_win(quality, tmp_path):
    args = _args(tmp_path, set=["optim.fused=false", "--data.length_bucketing=false"], student=tmp_path)
    plain = quality.student_conditions()["s_distill"]
    command = quality.train_command(args, plain, 1, tmp_path, 10)
    assert _option(command, "optim.fused") == "false"
    assert _option(command, "data.length_bucketing") == "false"
    bucketed = quality.student_conditions()["s_distill_bucketed"]
    assert _option(quality.train_command(args, bucketed, 1, tmp_path, 10), "data.length_bucketing") == "true"
