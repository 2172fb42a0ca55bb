"""benchmarks/pairs_study.py: every arm is a valid training config, and the report reads what eval writes."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from pipeline.cli import build_config
from pipeline.errors import ConfigError
from pipeline.evaluate.sts import STS_SETS
from pipeline.train.config import Config

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def study(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return runpy.run_path(str(BENCHMARKS / "pairs_study.py"), run_name="pairs_study")


ARMS = [
    "distill_corpus",
    "distill_pairtexts",
    "pairs",
    "distill_pairs",
    "distill_pairs_onesource",
    "distill_pairs_w001",
    "luse_pairs",
    "distill_pairtexts_top2",
    "distill_pairs_w001_top2",
]


@pytest.mark.parametrize("arm", ARMS)
def test_each_arm_parses_to_the_training_config_it_names(study, arm, monkeypatch):
    monkeypatch.chdir(BENCHMARKS.parent)  # the arms name launch/configs/distill.yaml relative to the repo
    cfg = build_config(Config, study["arm_args"](arm, seed=2, steps=150))
    assert cfg.train.seed == 2 and cfg.train.max_steps == 150
    names = [wt.term.name for wt in cfg.terms().terms]
    expected = {
        "distill_corpus": ["distill"],
        "distill_pairtexts": ["distill"],
        "pairs": ["pairs"],
        "distill_pairs": ["distill", "pairs"],
        "distill_pairs_onesource": ["distill", "pairs"],
        "distill_pairs_w001": ["distill", "pairs"],
        "luse_pairs": ["distill", "luse"],
        "distill_pairtexts_top2": ["distill"],
        "distill_pairs_w001_top2": ["distill", "pairs"],
    }[arm]
    assert names == expected
    weights = [wt.weight for wt in cfg.terms().terms]
    expected_weights = {
        "distill_pairs": [1.0, 0.1],
        "distill_pairs_w001": [1.0, 0.01],
        "luse_pairs": [1.0, 0.01],
        "distill_pairs_w001_top2": [1.0, 0.01],
    }
    assert weights == expected_weights.get(arm, weights)
    if arm == "luse_pairs":  # on pairs: no variants, no dropout views (the recipe's dropout is 0), a queue
        luse = cfg.terms().terms[1].config
        assert (cfg.data.num_variants, cfg.data.num_dropout_views, cfg.model.dropout) == (0, 0, 0.0)
        assert (luse.queue_size, luse.momentum, luse.false_negatives.same_text) == (256, 0.0, True)
    # equal compute: 128 encoded texts a step in every arm (64 pairs, or 128 corpus sentences)
    assert cfg.train.global_batch_size == (128 if arm == "distill_corpus" else 64)
    assert cfg.data.one_source_per_batch == (arm == "distill_pairs_onesource")
    top2 = arm.endswith("_top2")  # the teacher-filtered pairs, checked against the filter's record
    assert ("pairs_t0" in str(cfg.data.shards)) == (arm != "distill_corpus" and not top2)
    assert ("pairs_t2" in str(cfg.data.shards)) == top2
    assert cfg.data.pair_max_rank == (2 if top2 else 0)


def test_an_unknown_arm_is_refused_with_the_list(study):
    with pytest.raises(SystemExit, match="unknown arm 'nope'; one of distill_corpus"):
        study["arm_args"]("nope", 0, 10)


def test_a_bad_override_in_an_extra_arm_is_a_config_error(study, monkeypatch):
    monkeypatch.chdir(BENCHMARKS.parent)
    monkeypatch.setenv("ARM_SWEEP", json.dumps(["--loss=[{pairs: {temperature: -1}}]"]))
    with pytest.raises(ConfigError):
        build_config(Config, study["arm_args"]("sweep", 0, 10))


def test_report_averages_seeds_per_arm(study, tmp_path, capsys, monkeypatch):
    scores = tmp_path / "scores"
    for name, base in (("distill_pairs-s0", 40.0), ("distill_pairs-s1", 42.0), ("start", 30.0)):
        result = {
            "sts": {"model": {s: base + i for i, s in enumerate(STS_SETS)}},
            "retrieval": {"news": {"recall@10": base, "ndcg@10": base / 2}},
        }
        (scores / name).mkdir(parents=True)
        (scores / name / "eval.json").write_text(json.dumps(result))
    study["report"].__globals__["OUT"] = tmp_path
    study["report"](None)
    out = capsys.readouterr().out
    assert "distill_pairs (n=2): avg5 43.00 ± 1.41" in out
    assert "recall@10 41.00 ± 1.41" in out
    assert "start (n=1): avg5 32.00" in out
