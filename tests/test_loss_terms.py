"""The loss as a list of weighted terms: parsing, one-line errors, and configs of earlier versions (the flat
``objective:`` section) read into the same runs, resumes and model cards."""

import logging

import pytest
import yaml

from pipeline.config import help_lines, load_config, to_dict
from pipeline.errors import ConfigError
from pipeline.losses import trained_loss
from pipeline.train.build import read_saved_config
from pipeline.train.checkpoint import check_compatible
from pipeline.train.config import PROJECT_ROOT, Config

CONFIGS = PROJECT_ROOT / "launch" / "configs"

# launch/configs/distill.yaml and luse_scratch.yaml (then default.yaml) as earlier versions wrote them (their
# objective sections)
OLD_DISTILL = {"name": "luse", "contrastive_weight": 0.0, "distill_weight": 1.0, "distill_loss": "cosine",
               "teacher_dim": 384}  # fmt: skip
OLD_DEFAULT = {"name": "luse", "temperature": 0.05, "queue_size": 256, "momentum": 0.995}


def old_form(path, objective, tmp_path):
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.pop("loss")
    data["data"].pop("teacher_dim", None)
    data["objective"] = objective
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(data), encoding="utf-8")
    return out


@pytest.mark.parametrize(
    "name, objective", [("distill.yaml", OLD_DISTILL), ("luse_scratch.yaml", OLD_DEFAULT)]
)
def test_an_old_config_reads_as_the_shipped_new_one(tmp_path, caplog, name, objective):
    with caplog.at_level(logging.WARNING, logger="pipeline.train.config"):
        old = load_config(Config, old_form(CONFIGS / name, objective, tmp_path))
    new = load_config(Config, CONFIGS / name)
    assert to_dict(old) == to_dict(new)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "`objective:` is deprecated; read as `loss: [{" in warnings[0]
    # the old dotted overrides still apply to a config of the new form
    over = load_config(
        Config, CONFIGS / "debug.yaml", {"objective.name": "simcse", "objective.queue_size": 0}
    )
    assert over.loss == [{"simcse": {"temperature": 0.05}, "weight": 1.0}]


def test_a_resolved_config_records_loss_only():
    cfg = load_config(Config, CONFIGS / "debug.yaml", {"objective.momentum": 0.9})
    assert cfg.loss[0]["luse"]["momentum"] == 0.9
    assert "objective" not in to_dict(cfg)  # config.yaml and checkpoints carry `loss` only
    usage = "\n".join(help_lines(Config))  # --help lists the new form only
    assert "--loss " in usage and "--objective." not in usage


def test_distillation_alone_is_one_term_with_one_view():
    cfg = load_config(Config, CONFIGS / "distill.yaml")
    assert cfg.loss == [{"distill": {"loss": "cosine"}, "weight": 1.0}]
    assert cfg.terms().main is None and cfg.num_views() == 1 and cfg.data.teacher_dim == 384


@pytest.mark.parametrize(
    "loss, message",
    [
        ([], "loss: no terms"),
        ([{"luse": {"temprature": 0.1}}], "unknown config key 'loss\\[0\\].luse.temprature'. Did you mean"),
        ([{"luse": {}}, {"luse": {}}], "appears twice"),
        ([{"luse": {}}, {"simcse": {}}], "luse and simcse each decide"),
        ([{"luse": {}, "mlm": {}}], "expected one term and a weight"),
        ([{"kl": {"teacher_temperature": 0}}], "kl.teacher_temperature"),
        ([{"luse": {}}, {"mlm": {}, "weight": "high"}], "weight of term mlm must be a number > 0"),
    ],
)
def test_bad_terms_are_one_line_errors(tmp_path, loss, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(Config, CONFIGS / "debug.yaml", {"data.shards": str(tmp_path), "loss": loss})
    assert "\n" not in str(info.value)


def test_old_fields_that_would_change_the_run_are_refused_without_luse(tmp_path):
    base = {"data.shards": str(tmp_path), "loss": [{"simcse": {}}]}
    with pytest.raises(ConfigError, match="objective.queue_size applies to luse only"):
        load_config(Config, CONFIGS / "debug.yaml", {**base, "objective.queue_size": 32})
    # an old field of a term the run does not have, at any value, changed nothing before either
    cfg = load_config(Config, CONFIGS / "debug.yaml", {**base, "objective.distill_loss": "mse"})
    assert cfg.loss == [{"simcse": {"temperature": 0.05}, "weight": 1.0}]


def test_a_checkpoint_of_an_old_config_resumes_and_its_card_names_what_was_trained(tmp_path):
    # config.yaml of an earlier version's distillation run: every field of its objective section written
    every = {"temperature": 0.05, "queue_size": 0, "momentum": 0.0, "cosent_scale": 20.0, "num_labels": 3,
             "mlm_weight": 0.0, "mlm_probability": 0.15, "kl_weight": 0.0, "kl_teacher_temperature": 0.05,
             "kl_student_temperature": 0.05, "teacher_positive": False}  # fmt: skip
    saved = yaml.safe_load(old_form(CONFIGS / "distill.yaml", {**every, **OLD_DISTILL}, tmp_path).read_text())
    new = load_config(Config, CONFIGS / "distill.yaml")
    assert read_saved_config(saved) == to_dict(new)  # so check_compatible finds no difference
    # config.yaml of the version before this one: an `objective:` block of nulls beside `loss`
    nulls = {**to_dict(new), "objective": {k: None for k in [*every, *OLD_DISTILL]}}
    assert read_saved_config(nulls) == to_dict(new)
    check_compatible(read_saved_config(nulls), to_dict(new))
    # issue 24: the distillation run's card said "objective: luse, temperature 0.05"
    card = trained_loss({"objective": {**OLD_DISTILL, "temperature": 0.05}})
    assert card["loss"] == "distill (loss: cosine)" and card["terms"] == ["distill"]
    assert card["objective"] is None and card["temperature"] is None
    mixed = trained_loss({"loss": [{"luse": {"queue_size": 256}, "weight": 1.0}, {"mlm": {}, "weight": 0.1}]})
    assert mixed["loss"] == "luse (queue_size: 256) + 0.1 x mlm" and mixed["queue_size"] == 256


def test_luse_bce_trains_end_to_end(tmp_path, tiny_shards):
    import json
    import math

    from _train_data import debug_config

    from pipeline.train.run import run

    cfg = debug_config(tmp_path, tiny_shards([[40, 24]], num_variants=3), **{"loss": [{"luse_bce": {}}]})
    assert cfg.num_views() == 4 and cfg.terms().shard_views(2, 1) == (2, 1)  # as luse: 1 + k + d
    with pytest.raises(ConfigError, match="luse_bce needs at least one positive"):
        debug_config(tmp_path, tmp_path, **{"loss": [{"luse_bce": {}}], "data.num_variants": 0,
                                            "data.num_dropout_views": 0})  # fmt: skip
    assert run(cfg) == 0
    steps = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)


def test_a_checkpoint_from_when_the_trainer_held_the_queue_resumes_into_the_term(tmp_path, tiny_shards):
    """Up to 80883ac the Trainer held the negative queue and the momentum encoder and checkpointed them as
    ``queue`` and ``momentum_encoder``; the luse term holds them now and restores them from those names
    (state.pt's layout is unchanged). The old layout is built by hand: the two as standalone objects."""
    import torch
    from _train_data import debug_config, debug_luse

    from pipeline.losses.queue import MomentumEncoder, NegativeQueue
    from pipeline.train.build import build

    shards = tiny_shards([[32], [32]], num_variants=2)
    cfg = lambda: debug_config(tmp_path, shards, loss=debug_luse(queue_size=32, momentum=0.9))  # noqa: E731
    t = build(cfg())
    g = torch.Generator().manual_seed(0)
    queue = NegativeQueue(32, t.encoder.dim)  # 80883ac's Trainer.queue, 16 keys enqueued
    queue.enqueue(torch.nn.functional.normalize(torch.randn(16, t.encoder.dim, generator=g), dim=-1),
                  torch.arange(16), torch.arange(16) + 100)  # fmt: skip
    momentum = MomentumEncoder(t.encoder)  # its Trainer.momentum_encoder, moved away from the online copy
    with torch.no_grad():
        for p in momentum.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    old = {k: v for k, v in t.states().items() if k not in ("queue", "momentum_encoder")}
    old.update(queue=queue, momentum_encoder=momentum)
    t.checkpointer.save(1, t.encoder, old, t.rank_states(), t.run_config, samples_seen=16)
    t.close()

    resumed = build(cfg())
    luse = resumed.loss.terms["luse"]
    assert torch.equal(luse.queue.keys, queue.keys) and luse.queue.fill == 16
    assert torch.equal(luse.queue.ids, queue.ids) and torch.equal(luse.queue.text_hashes, queue.text_hashes)
    for ours, saved in zip(luse.momentum_encoder.state_dict().values(), momentum.state_dict().values()):
        assert torch.equal(ours, saved)
    assert not hasattr(resumed, "queue") and not hasattr(resumed, "momentum_encoder")
    resumed.close()


def test_each_term_holds_its_own_state_in_its_state_dict():
    """The loss is built once as modules: luse owns its queue and momentum encoder, kl its teacher queue,
    in their own state_dicts; the checkpoint names are the ones the terms declare."""
    import torch

    from pipeline.losses import build_loss
    from pipeline.losses.terms import TermContext, TrainLoss

    plan = build_loss([{"luse": {"queue_size": 8, "momentum": 0.9}}, {"kl": {}, "weight": 0.5}])
    encoder = torch.nn.Linear(4, 4)
    loss = TrainLoss(plan, TermContext(encoder, 4, 6, plan.needs))
    luse, kl = loss.terms["luse"], loss.terms["kl"]
    assert {"queue.keys", "queue.ids", "momentum_encoder.encoder.weight"} <= set(luse.state_dict())
    assert set(kl.state_dict()) >= {"teacher_queue.keys"} and kl.teacher_queue.keys.shape == (8, 6)
    assert loss.states() == {"queue": luse.queue, "momentum_encoder": luse.momentum_encoder,
                             "teacher_queue": kl.teacher_queue}  # fmt: skip
    assert loss.parts == {"contrastive", "kl"} and loss.report() == {"queue_fill": 0.0}


def test_luse_lends_its_queue_to_kl_and_matryoshka_holds_the_built_terms():
    """After an enqueue, kl's value is its formula over luse's queued keys and its own teacher rows (lent
    through one record); matryoshka calls the same term modules the run built, not copies."""
    import torch
    import torch.nn.functional as F

    from pipeline.data.collate import Batch
    from pipeline.losses import build_loss
    from pipeline.losses.kl import kl_loss
    from pipeline.losses.terms import Rows, TermContext, TrainLoss

    plan = build_loss([{"luse": {"queue_size": 8}}, {"kl": {}, "weight": 0.5}, {"matryoshka": {"dims": [2]}}])
    loss = TrainLoss(plan, TermContext(torch.nn.Identity(), 4, 6, plan.needs))
    luse, kl, matryoshka = loss.terms["luse"], loss.terms["kl"], loss.terms["matryoshka"]
    assert luse.lent is kl.lent is matryoshka.lent
    assert luse.lent.queue is luse.queue and kl.lent.teacher_queue is kl.teacher_queue
    assert matryoshka.inner == [luse, kl] and not list(matryoshka.children())  # held, not registered twice
    g = torch.Generator().manual_seed(0)
    views = F.normalize(torch.randn(2, 3, 4, generator=g), dim=-1)  # (n, B, H)
    tokens = torch.ones(6, 1, dtype=torch.long)
    batch = Batch(tokens, tokens, num_views=2, ids=torch.arange(3), teacher=torch.randn(3, 6, generator=g))
    rows = Rows.of(views.reshape(6, 4), batch, None)
    loss.after_micro_batch(views.reshape(6, 4), {}, batch)  # luse's keys and kl's teacher rows, row for row
    out = loss.compute(rows, batch)
    expected = kl_loss(
        views[0], batch.teacher, queue=views[0], teacher_queue=batch.teacher, gather=False
    )
    torch.testing.assert_close(out.parts["kl"], expected)


def test_the_loss_says_what_every_batch_carries_in_one_place():
    import torch

    from pipeline.losses import build_loss
    from pipeline.losses.terms import Columns

    luse = build_loss([{"luse": {"false_negatives": {"same_text": True}}}, {"mlm": {"probability": 0.2}}])
    assert luse.columns(2, 1) == Columns("shards", 2, 1, False, True, 0.2, 1, None)
    alone = build_loss([{"distill": {}}])  # the originals only: no variants, no dropout views
    assert alone.columns(2, 1) == Columns("shards", 0, 0, True, False, None, 1, None)
    cosent = build_loss([{"cosent": {}}])
    assert cosent.columns(0, 0).source == "pairs" and cosent.columns(0, 0).label_dtype == torch.float32
