"""Training on pair shards (issue 35 item 3, docs/pairs.md "Training on pairs"): the pairs term against
literal references, group and text masking, distillation of both sides, and a tiny end-to-end run on
pair shards built from the bundled real pairs by the pairs stage and a tiny teacher."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _terms import evaluate

from pipeline.errors import ConfigError
from pipeline.losses.pairs import compute_loss
from pipeline.resources import ROOT as RESOURCES

BUNDLED = RESOURCES / "corpus" / "pairs"

# anchors a_i and positives p_i (unit vectors); a . p by hand:
#   a1.p1 = 0.8   a1.p2 = 0     a1.p3 = 0.28
#   a2.p1 = 0.6   a2.p2 = 1     a2.p3 = 0.96
#   a3.p1 = 0.96  a3.p2 = 0.8   a3.p3 = 0.936
A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
P = torch.tensor([[0.8, 0.6], [0.0, 1.0], [0.28, 0.96]])
TAU = 0.5  # logits = 2 * cosine
e = math.exp


def lse(*xs: float) -> float:
    return math.log(sum(e(x) for x in xs))


# anchor -> positive (rows of the table above), positive -> anchor (its columns); logits are 2x the dots
AP = [-1.6 + lse(1.6, 0.0, 0.56), -2.0 + lse(1.2, 2.0, 1.92), -1.872 + lse(1.92, 1.6, 1.872)]
PA = [-1.6 + lse(1.6, 1.2, 1.92), -2.0 + lse(0.0, 2.0, 1.6), -1.872 + lse(0.56, 1.92, 1.872)]


def test_loss_matches_the_literal_reference_both_directions_and_one():
    both = compute_loss(A, P, TAU, symmetric=True, gather=False)
    one = compute_loss(A, P, TAU, symmetric=False, gather=False)
    assert both.item() == pytest.approx(sum(a + p for a, p in zip(AP, PA)) / 6, rel=1e-6)
    assert one.item() == pytest.approx(sum(AP) / 3, rel=1e-6)
    assert one.item() != pytest.approx(both.item(), rel=1e-3)  # the second direction counts


def test_a_candidate_of_the_anchors_group_is_never_a_negative_and_is_counted():
    groups = torch.tensor([7, 7, 9])  # pairs 1 and 2 come from one record
    counts: dict = {}
    got = compute_loss(A, P, TAU, symmetric=True, gather=False, groups=groups, counts=counts)
    ap = [-1.6 + lse(1.6, 0.56), -2.0 + lse(2.0, 1.92), AP[2]]  # p2 leaves anchor 1's softmax, p1 anchor 2's
    pa = [-1.6 + lse(1.6, 1.92), -2.0 + lse(2.0, 1.6), PA[2]]
    assert got.item() == pytest.approx(sum(a + p for a, p in zip(ap, pa)) / 6, rel=1e-6)
    assert counts["false_negatives"].item() == 4  # (1, 2) and (2, 1) in each direction


def test_equal_texts_under_other_groups_are_masked_and_unique_groups_change_nothing():
    anchor_hashes, positive_hashes = torch.tensor([1, 2, 3]), torch.tensor([10, 11, 10])  # p3's text is p1's
    counts: dict = {}
    got = compute_loss(A, P, TAU, True, False, torch.arange(3), anchor_hashes, positive_hashes, counts)
    ap = [-1.6 + lse(1.6, 0.0), AP[1], -1.872 + lse(1.6, 1.872)]  # p3 leaves anchor 1's, p1 anchor 3's
    assert got.item() == pytest.approx(sum(a + p for a, p in zip(ap, PA)) / 6, rel=1e-6)
    assert counts["false_negatives"].item() == 2
    plain = compute_loss(A, P, TAU, True, False)
    assert torch.equal(compute_loss(A, P, TAU, True, False, torch.arange(3)), plain)  # all-False mask


def test_the_term_reads_views_groups_and_hashes_and_refuses_a_batch_without_groups():
    from pipeline.losses import build_loss

    loss = build_loss([{"pairs": {"temperature": TAU}}])
    assert loss.data == "pair_shards" and loss.unsupervised and loss.needs.text_hashes
    hashes = {"text_hashes": torch.tensor([1, 2, 3]), "positive_text_hashes": torch.tensor([4, 5, 6])}
    parts = evaluate(loss, torch.stack([A, P]), gather=False, groups=torch.tensor([7, 7, 9]), **hashes)
    ap = [-1.6 + lse(1.6, 0.56), -2.0 + lse(2.0, 1.92), AP[2]]
    pa = [-1.6 + lse(1.6, 1.92), -2.0 + lse(2.0, 1.6), PA[2]]
    assert parts["loss"].item() == pytest.approx(sum(a + p for a, p in zip(ap, pa)) / 6, rel=1e-6)
    assert parts["false_negatives"].item() == 4
    with pytest.raises(ValueError, match="group"):
        evaluate(loss, torch.stack([A, P]), gather=False)
    with pytest.raises(ConfigError, match="temperature"):
        build_loss([{"pairs": {"temperature": 0}}])


def test_distill_reads_both_sides_of_a_pair_batch():
    from pipeline.losses import build_loss

    teacher = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    teacher_positive = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    loss = build_loss([{"distill": {}}])
    views = torch.stack([A, P])
    got = evaluate(loss, views, teacher=teacher, teacher_positive=teacher_positive, gather=False)
    anchors = [1 - 1.0, 1 - 1.0, 1 - 0.6]  # 1 - cos(a_i, t_i)
    positives = [1 - 0.6, 1 - 1.0, 1 - 0.28]  # 1 - cos(p_i, t+_i)
    assert got["loss"].item() == pytest.approx((sum(anchors) / 3 + sum(positives) / 3) / 2, rel=1e-6)
    # a sentence batch (no teacher_positive) distils its originals as before
    alone = evaluate(loss, views[:1], teacher=teacher, gather=False)["loss"]
    assert alone.item() == pytest.approx(sum(anchors) / 3, rel=1e-6)


# --------------------------------------------------------------------------------------------- end to end
def _pairs_stage(inputs: list[Path], out: Path, **options) -> dict:
    from pipeline.shards import read_manifest
    from pipeline.stages.pairs.run import Config, run

    assert run(Config(inputs=inputs, out=out, progress=False, **options)) == 0
    return read_manifest(out)


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    """The bundled real pairs through the pairs stage, then a tiny teacher over both sides."""
    from _tiny_models import build_char_encoder

    from pipeline.stages.teacher.run import Config as TeacherConfig
    from pipeline.stages.teacher.run import run as teacher_run

    root = tmp_path_factory.mktemp("pairs_train")
    texts = []
    for path in sorted(BUNDLED.glob("*.gz")):
        for line in gzip.open(path, "rt", encoding="utf-8"):
            texts += [v for v in json.loads(line).values() if isinstance(v, str)][:6]
    teacher = build_char_encoder(root / "teacher", texts, 24, 48, 260, max_length=64)
    pairs = root / "pairs"
    _pairs_stage([BUNDLED], pairs, pairs_per_shard=600, rows_per_block=100)
    taught = root / "taught"
    cfg = TeacherConfig(shards=pairs, out=taught, model=str(teacher), batch_size=64, progress=False)
    assert teacher_run(cfg) == 0
    return {"pairs": pairs, "taught": taught, "teacher": teacher}


def pair_config(tmp_path: Path, shards: Path, loss: list[dict], **overrides):
    from _train_data import DEBUG_CONFIG

    from pipeline.config import load_config
    from pipeline.train.config import Config

    base = {"data.shards": str(shards), "run_dir": str(tmp_path / "run"), "loss": loss,
            "data.num_variants": 0, "data.num_dropout_views": 0, "data.teacher_dim": 24,
            "train.max_steps": 4, "data.length_bucketing": False}  # fmt: skip
    return load_config(Config, DEBUG_CONFIG, {**base, **overrides})


def _batches(cfg, n: int, teacher: Path) -> list[dict]:
    from _train_data import batch_stream

    from pipeline.model import SentenceEncoder
    from pipeline.shards import read_shard_set

    tokenizer = SentenceEncoder.from_pretrained(teacher).tokenizer  # any tokenizer: the teacher's
    stream = batch_stream(cfg, read_shard_set(cfg.data.shards), tokenizer, 0, 1)
    out = []
    for batch in stream:
        out.append(batch)
        if len(out) == n:
            return out
    return out


def test_pair_batches_carry_both_sides_groups_hashes_and_teachers(pair_data, tmp_path):
    loss = [{"distill": {}}, {"pairs": {"temperature": 0.05}, "weight": 0.1}]
    cfg = pair_config(tmp_path, pair_data["taught"], loss)
    (batch,) = _batches(cfg, 1, pair_data["teacher"])
    b = cfg.train.global_batch_size
    assert batch.num_views == 2 and batch.input_ids.shape[0] == 2 * b
    for key in ("groups", "ids", "text_hashes", "positive_text_hashes"):
        assert getattr(batch, key).shape == (b,) and getattr(batch, key).dtype == torch.int64
    assert batch.teacher.shape == batch.teacher_positive.shape == (b, 24)
    assert not torch.equal(batch.teacher, batch.teacher_positive)
    assert not torch.equal(batch.text_hashes, batch.positive_text_hashes)
    # distillation alone on pair shards reads both texts and both teachers too (the study's control)
    alone_cfg = pair_config(tmp_path, pair_data["taught"], [{"distill": {}}])
    (alone,) = _batches(alone_cfg, 1, pair_data["teacher"])
    assert alone.num_views == 2 and alone.teacher_positive is not None and alone.text_hashes is None
    assert torch.equal(alone.input_ids, batch.input_ids)  # the same order and texts


def test_the_loss_and_the_shards_must_fit(pair_data, tmp_path):
    from _train_data import batch_stream, make_shards

    from pipeline.shards import read_shard_set

    sentences = tmp_path / "sentences"
    make_shards(sentences, [[40]])
    cfg = pair_config(tmp_path, sentences, [{"pairs": {}}])
    with pytest.raises(ConfigError, match="pair shards"):
        batch_stream(cfg, read_shard_set(sentences), None, 0, 1)
    cfg = pair_config(tmp_path, pair_data["taught"], [{"luse_bce": {}}], **{"data.num_dropout_views": 1})
    with pytest.raises(ConfigError, match="holds pairs"):
        batch_stream(cfg, read_shard_set(pair_data["taught"]), None, 0, 1)


def test_tiny_train_on_pair_shards_distill_plus_pairs(pair_data, tmp_path):
    from _train_data import run_and_dump

    loss = [{"distill": {}}, {"pairs": {"temperature": 0.05}, "weight": 0.1}]
    cfg = pair_config(tmp_path, pair_data["taught"], loss, **{"train.debug_dump": True})
    dump = run_and_dump(cfg)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "contrastive_loss" in r]
    assert len(steps) == 4 and all(np.isfinite(r["distill_loss"]) for r in steps)
    assert all(r["contrastive_loss"] > 0 for r in steps)
    assert "false_negatives_count" in steps[0]
    assert dump["step"] == 4 and dump["cursor"]["batches"] == 4


@pytest.mark.parametrize("sources", [True, False], ids=["one-source", "mixed"])
def test_tiny_train_distillation_alone_on_pair_shards(pair_data, tmp_path, sources):
    """The study's control arm: distill alone on the same pairs, both sides, by source or mixed."""
    from _train_data import run_and_dump

    cfg = pair_config(tmp_path, pair_data["taught"], [{"distill": {}}],
                      **{"train.debug_dump": True, "data.one_source_per_batch": sources})  # fmt: skip
    dump = run_and_dump(cfg)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    assert len(losses) == 4 and all(0 < v < 2 for v in losses)  # 1 - cos, averaged over both sides
    assert dump["cursor"]["source_mode"] == ("batch" if sources else "mixed")
