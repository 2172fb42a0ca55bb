"""Distillation terms, teacher positives and hard negatives against literal (loop-by-loop) formulas, the
weighted sum of loss terms, and the loop's batch plumbing (micro-batches, teacher queue)."""

import math

import pytest
import torch
import torch.nn.functional as F
from _tensors import unit
from _terms import evaluate

from pipeline.errors import ConfigError, InputError
from pipeline.losses import build_loss, distill, kl, multi_positive

TAU = 0.05


# ------------------------------------------------------------------------------------ the formulas
def test_embedding_loss_cosine_and_mse_literal():
    s, t = unit(4, 6), unit(4, 6, seed=1)
    expected_cos = sum(1 - float(s[b] @ t[b]) for b in range(4)) / 4
    assert distill.embedding_loss(s, t, "cosine").item() == pytest.approx(expected_cos)
    expected_mse = sum(float(((s[b] - t[b]) ** 2).sum()) for b in range(4)) / (4 * 6)
    assert distill.embedding_loss(s, 3 * t, "mse").item() == pytest.approx(expected_mse)  # t normalised
    assert distill.embedding_loss(t, t, "cosine").item() == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="teacher width the shards' manifest records"):
        distill.embedding_loss(s, unit(4, 5))


def kl_literal(s, t, tau_s, tau_t, queue=None, teacher_queue=None):
    """sum_c p_t log(p_t / p_s) over the other sentences (+ queue), mean over anchors, by loops."""
    b = s.shape[0]
    total = 0.0
    for i in range(b):
        s_logits = [float(s[i] @ s[c]) / tau_s for c in range(b) if c != i]
        t_logits = [float(t[i] @ t[c]) / tau_t for c in range(b) if c != i]
        if queue is not None:
            s_logits += [float(s[i] @ q) / tau_s for q in queue]
            t_logits += [float(t[i] @ q) / tau_t for q in teacher_queue]
        zs = math.log(sum(math.exp(x) for x in s_logits))
        zt = math.log(sum(math.exp(x) for x in t_logits))
        total += sum(math.exp(lt - zt) * ((lt - zt) - (ls - zs)) for ls, lt in zip(s_logits, t_logits))
    return total / b


def test_kl_loss_literal_with_and_without_queue():
    s, t = unit(5, 6), unit(5, 9, seed=1)  # the teacher may be wider: KL compares distributions
    got = kl.kl_loss(s, t, 0.07, 0.05, gather=False)
    assert got.item() == pytest.approx(kl_literal(s, t, 0.07, 0.05), rel=1e-9)
    q, tq = unit(3, 6, seed=2), unit(3, 9, seed=3)
    got = kl.kl_loss(s, t, 0.05, 0.05, queue=q, teacher_queue=tq, gather=False)
    assert got.item() == pytest.approx(kl_literal(s, t, 0.05, 0.05, q, tq), rel=1e-9)
    # the student reproducing the teacher's similarities exactly: KL 0
    assert kl.kl_loss(t, t, 0.05, 0.05, gather=False).item() == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="together"):
        kl.kl_loss(s, t, queue=q, gather=False)


def luse_literal(views, tau, teacher=None, hard=None, queue=None, project=None):
    """The listwise loss by loops: candidates = other views, hard negatives, teachers, queue."""
    n, b, _ = views.shape
    total = 0.0
    for v in range(n):
        for i in range(b):
            a = views[v, i]
            cands, positives = [], []
            for w in range(n):
                for j in range(b):
                    if (w, j) != (v, i):
                        cands.append(float(a @ views[w, j]) / tau)
                        if j == i:
                            positives.append(len(cands) - 1)
            if hard is not None:
                cands += [float(a @ hard[k, j]) / tau for k in range(hard.shape[0]) for j in range(b)]
            if teacher is not None:
                pa = a if project is None else F.normalize(project(a), dim=-1)
                for j in range(b):
                    cands.append(float(pa @ teacher[j]) / tau)
                    if j == i:
                        positives.append(len(cands) - 1)
            if queue is not None:
                cands += [float(a @ q) / tau for q in queue]
            z = math.log(sum(math.exp(c) for c in cands))
            total += -sum(cands[p] - z for p in positives) / len(positives)
    return total / (n * b)


def test_luse_teacher_positive_and_hard_negatives_literal():
    views, teacher, hard, queue = unit(3, 4, 6), unit(4, 6, seed=1), unit(2, 4, 6, seed=2), unit(3, 6, seed=3)
    got = multi_positive.compute_loss(
        views, TAU, queue=queue, gather=False, teacher=teacher, hard_negatives=hard
    )
    assert got.item() == pytest.approx(luse_literal(views, TAU, teacher, hard, queue), rel=1e-9)
    got = multi_positive.compute_loss(views, TAU, gather=False, hard_negatives=hard)
    assert got.item() == pytest.approx(luse_literal(views, TAU, hard=hard), rel=1e-9)
    # one view: the teacher is the only positive (distillation through the listwise loss)
    got = multi_positive.compute_loss(views[:1], TAU, gather=False, teacher=teacher)
    assert got.item() == pytest.approx(luse_literal(views[:1], TAU, teacher), rel=1e-9)
    with pytest.raises(ValueError, match="n_views >= 2"):
        multi_positive.compute_loss(views[:1], TAU, gather=False)


def test_luse_teacher_positive_through_the_projection():
    torch.manual_seed(0)
    project = torch.nn.Linear(6, 10, bias=False).double()
    views, teacher = unit(2, 3, 6), unit(3, 10, seed=1)
    got = multi_positive.compute_loss(views, TAU, gather=False, teacher=teacher, project=project)
    with torch.no_grad():
        expected = luse_literal(views, TAU, teacher, project=project)
    assert got.item() == pytest.approx(expected, rel=1e-9)
    got.backward()
    assert project.weight.grad is not None and project.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- the weighted terms
def test_objective_weights_parts_and_needs_a_teacher():
    luse = build_loss(
        [{"luse": {}, "weight": 0.5}, {"distill": {}, "weight": 2.0}, {"kl": {}, "weight": 0.3}]
    )
    views, teacher = unit(3, 4, 6), unit(4, 6, seed=1)
    parts = evaluate(luse, views, teacher=teacher, gather=False)
    assert set(parts) == {"loss", "contrastive", "distill", "kl"}
    torch.testing.assert_close(parts["contrastive"], multi_positive.compute_loss(views, 0.05, gather=False))
    torch.testing.assert_close(parts["distill"], distill.embedding_loss(views[0], teacher))
    torch.testing.assert_close(parts["kl"], kl.kl_loss(views[0], teacher, gather=False))
    expected = 0.5 * parts["contrastive"] + 2.0 * parts["distill"] + 0.3 * parts["kl"]
    torch.testing.assert_close(parts["loss"], expected)
    with pytest.raises(InputError, match="no teacher embeddings"):
        evaluate(luse, views, gather=False)
    with pytest.raises(InputError, match="hard negatives"):
        evaluate(build_loss([{"simcse": {}}]), views[:2], hard_negatives=views[:1])


def test_distillation_alone_with_a_projection_head():
    alone = build_loss([{"distill": {}, "weight": 1.0}])
    head = alone.build_head(6, teacher_dim=10)
    assert isinstance(head, torch.nn.Linear) and tuple(head.weight.shape) == (10, 6)
    assert alone.build_head(6, teacher_dim=6) is None  # equal widths
    views, teacher = unit(1, 4, 6).float(), unit(4, 10, seed=1).float()
    parts = evaluate(alone, views, teacher=teacher, head=head, gather=False)
    assert set(parts) == {"loss", "distill"}
    expected = distill.embedding_loss(F.normalize(head(views[0]), dim=-1), teacher)
    torch.testing.assert_close(parts["loss"], expected)


def test_config_validates_names_and_distillation(tmp_path):
    from pipeline.config import load_config
    from pipeline.train.config import Config

    def config(loss, **over):
        return load_config(
            Config, None, {"data.shards": str(tmp_path), "model.pooling": "mean", "loss": loss, **over}
        )

    with pytest.raises(ConfigError, match="one of luse, simcse"):
        config([{"simcsee": {}}])
    with pytest.raises(ConfigError, match="use luse or simcse"):
        config([{"cosent": {}}, {"distill": {}}], **{"data.supervised_file": "pairs.tsv"})
    with pytest.raises(ConfigError, match="teacher_positive"):
        config([{"simcse": {"teacher_positive": True}}])
    with pytest.raises(ConfigError, match="weight of term luse must be a number > 0"):
        config([{"luse": {}, "weight": 0.0}])
    with pytest.raises(ConfigError, match="distill.loss"):
        config([{"distill": {"loss": "l1"}}])


def test_config_allows_one_view_only_without_the_contrastive_term(tmp_path):
    from pipeline.config import load_config
    from pipeline.train.config import Config

    base = {
        "data.shards": str(tmp_path),
        "data.num_variants": 0,
        "data.num_dropout_views": 0,
        "model.pooling": "mean",
    }
    # luse also trains on pair shards, where the partner is a positive: sentence shards refuse it in the plan
    from _train_data import make_shards

    from pipeline.shards import read_shard_set
    from pipeline.train.plan import check_against_data

    make_shards(tmp_path, [[40]])
    with pytest.raises(ConfigError, match="at least one positive"):
        check_against_data(load_config(Config, None, base), read_shard_set(tmp_path), 1)
    alone = {"loss": [{"distill": {}}]}
    cfg = load_config(Config, None, {**base, **alone})
    assert cfg.num_views() == 1


# --------------------------------------------------------------------------------- batch plumbing
def test_micro_batches_carry_teacher_and_hard_negative_rows():
    from pipeline.data.collate import Batch

    n, m, b = 2, 2, 4
    rows = torch.arange((n + m) * b)[:, None].repeat(1, 3)  # row r holds r
    batch = Batch(
        num_views=n,
        num_hard_negatives=m,
        input_ids=rows,
        attention_mask=torch.ones_like(rows),
        teacher=torch.arange(b, dtype=torch.float32)[:, None].repeat(1, 5),
    )
    parts = batch.split(2)  # the engine's micro-batches
    assert [p.num_hard_negatives for p in parts] == [m, m]
    # micro-batch 1 holds sentences 2, 3: view v / negative j rows v*B + 2, v*B + 3 in the same block order
    assert parts[1].input_ids[:, 0].tolist() == [2, 3, 6, 7, 10, 11, 14, 15]
    assert parts[1].teacher[:, 0].tolist() == [2.0, 3.0]
