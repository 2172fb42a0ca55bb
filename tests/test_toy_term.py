"""A new loss term takes one file (tests/toy_term.py) and one registry line: it parses from a config,
trains end to end beside luse, logs its value, checkpoints its buffer and resumes to the same bits."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _train_data import debug_config, debug_luse, full_and_resumed
from toy_term import Uniformity

from pipeline.errors import ConfigError
from pipeline.losses import TERMS, build_loss


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(TERMS, Uniformity.name, Uniformity)  # the one registry line


def test_without_its_registry_line_the_term_is_unknown_and_a_term_must_say_its_name():
    with pytest.raises(ConfigError, match="unknown term 'uniformity'"):
        build_loss([{"luse": {}}, {"uniformity": {}}])
    from pipeline.losses.terms import LossTerm

    with pytest.raises(TypeError, match="loss term .*Nameless sets no name and no config_class"):

        class Nameless(LossTerm):
            def forward(self, rows, batch):
                return rows.views.sum()


def test_the_toy_term_parses_and_computes_its_formula(registered):
    with pytest.raises(ConfigError, match="uniformity.t must be > 0"):
        build_loss([{"uniformity": {"t": 0}}])
    with pytest.raises(ConfigError, match="loss\\[0\\].uniformity.tt"):
        build_loss([{"uniformity": {"tt": 1}}])
    plan = build_loss([{"uniformity": {"t": 2}}])
    assert plan.main is None and plan.needs == type(plan.needs)() and Uniformity.summary().startswith("Wang")
    from _terms import evaluate

    # two orthogonal unit vectors: ||x - y||^2 = 2, so uniformity = log exp(-2 t) = -4
    views = torch.eye(2, 3)[None]  # (1, B=2, H=3)
    assert evaluate(plan, views)["uniformity"].item() == pytest.approx(-4.0)
    # the same vector twice: distance 0, log 1 = 0 (the least uniform)
    same = torch.ones(1, 2, 3) / math.sqrt(3)
    assert evaluate(plan, same)["uniformity"].item() == pytest.approx(0.0, abs=1e-6)
    views = torch.nn.functional.normalize(torch.randn(1, 5, 4), dim=-1).requires_grad_()
    evaluate(plan, views)["uniformity"].backward()
    assert torch.isfinite(views.grad).all() and views.grad.abs().sum() > 0


def test_the_toy_term_trains_beside_luse_and_resumes_with_its_buffer(registered, tmp_path, tiny_shards):
    shards = tiny_shards([[40, 24]], num_variants=2)
    loss = [*debug_luse(), {"uniformity": {"t": 2.0}, "weight": 0.1}]

    def make(run_dir, steps):
        overrides = {"loss": loss, "run_dir": str(run_dir), "train.max_steps": steps,
                     "train.debug_dump": True, "checkpoint.every_steps": 3}  # fmt: skip
        return debug_config(tmp_path, shards, **overrides)

    full, resumed = full_and_resumed(tmp_path, make, stop=3, total=6)
    assert full["uniformity_steps"] == resumed["uniformity_steps"] == 6  # restored at 3, counted on to 6
    assert full["param_checksum"] == resumed["param_checksum"]
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    values = [r["uniformity_loss"] for r in records if "uniformity_loss" in r]
    assert len(values) == 6 and all(math.isfinite(v) and v <= 0 for v in values)
    saved = torch.load(tmp_path / "full" / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)
    assert int(saved["uniformity"]["steps"]) == 6
