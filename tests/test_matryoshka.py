"""The matryoshka term: its value against a literal transcription of the formula, its one-line config
errors, and a debug run that trains with it (2-process equality: tests/test_matryoshka_gloo.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from _terms import evaluate

from pipeline.errors import ConfigError
from pipeline.losses import build_loss, multi_positive


def unit(g, *shape):
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


def kl_prefix_literal(student, teacher, dim, tau_s, tau_t):
    """mean_b KL(softmax_c(t_b.t_c / tau_t) || softmax_c(p_b.p_c / tau_s)) over c != b, p = the re-normalised
    ``dim``-prefix of the student; plain Python loops."""
    rows = student.tolist()
    prefixes = []
    for row in rows:
        cut = row[:dim]
        norm = math.sqrt(sum(x * x for x in cut))
        prefixes.append([x / norm for x in cut])
    t = teacher.tolist()
    n = len(rows)
    total = 0.0
    for b in range(n):
        others = [c for c in range(n) if c != b]
        s_logits = [sum(x * y for x, y in zip(prefixes[b], prefixes[c])) / tau_s for c in others]
        t_logits = [sum(x * y for x, y in zip(t[b], t[c])) / tau_t for c in others]
        s_z = math.log(sum(math.exp(v) for v in s_logits))
        t_z = math.log(sum(math.exp(v) for v in t_logits))
        total += sum(math.exp(tl - t_z) * ((tl - t_z) - (sl - s_z)) for sl, tl in zip(s_logits, t_logits))
    return total / n


def test_matryoshka_of_distill_and_luse_equals_the_literal_formula():
    g = torch.Generator().manual_seed(0)
    views = unit(g, 3, 5, 12)  # (n, B, H)
    teacher = unit(g, 5, 7)  # a 7-d teacher: the prefix is compared by its in-batch similarities
    queue = unit(g, 4, 12)
    loss = build_loss(
        [
            {"luse": {"temperature": 0.1, "queue_size": 4}, "weight": 1.0},
            {"distill": {}, "weight": 0.5},
            {"matryoshka": {"dims": [8, 4], "weights": [1.0, 0.25], "temperature": 0.2}, "weight": 2.0},
        ]
    )
    head = loss.build_head(12, 7).double()  # the full width is distilled through the projection
    parts = evaluate(loss, views, teacher=teacher, queue=queue, head=head, gather=False)

    expected = 0.0
    for dim, w in ((8, 1.0), (4, 0.25)):
        cut = [
            [[x / math.sqrt(sum(y * y for y in r[:dim])) for x in r[:dim]] for r in v] for v in views.tolist()
        ]
        cut_queue = F.normalize(queue[:, :dim], dim=-1)
        luse = multi_positive.compute_loss(
            torch.tensor(cut, dtype=torch.float64), 0.1, queue=cut_queue, gather=False
        )
        distill = kl_prefix_literal(views[0], teacher, dim, 0.2, 0.2)
        expected += w * (1.0 * luse.item() + 0.5 * distill)
    assert parts["matryoshka"].item() == pytest.approx(expected, rel=1e-9)
    # the term is added to the others, weighted as a whole
    total = parts["contrastive"] + 0.5 * parts["distill"] + 2.0 * parts["matryoshka"]
    assert parts["loss"].item() == pytest.approx(total.item(), rel=1e-12)


def test_matryoshka_of_kl_uses_the_kl_terms_temperatures_and_its_queue_pair():
    g = torch.Generator().manual_seed(1)
    views = unit(g, 1, 6, 10)
    teacher = unit(g, 6, 10)
    queue, teacher_queue = unit(g, 3, 10), unit(g, 3, 10)
    loss = build_loss(
        [
            {"kl": {"teacher_temperature": 0.05, "student_temperature": 0.1}},
            {"matryoshka": {"dims": [5], "of": ["kl"]}},
        ]
    )
    value = evaluate(loss, views, teacher=teacher, queue=queue, teacher_queue=teacher_queue, gather=False)[
        "matryoshka"
    ]
    # literal: the candidates are the 5 other sentences then the 3 queued ones
    s = F.normalize(views[0, :, :5], dim=-1)
    sq = F.normalize(queue[:, :5], dim=-1)
    total = 0.0
    for b in range(6):
        others = [c for c in range(6) if c != b]
        s_logits = [float(s[b] @ s[c]) / 0.1 for c in others] + [float(s[b] @ k) / 0.1 for k in sq]
        t_logits = [float(teacher[b] @ teacher[c]) / 0.05 for c in others] + [
            float(teacher[b] @ k) / 0.05 for k in teacher_queue
        ]
        s_z = math.log(sum(math.exp(v) for v in s_logits))
        t_z = math.log(sum(math.exp(v) for v in t_logits))
        total += sum(math.exp(t - t_z) * ((t - t_z) - (v - s_z)) for v, t in zip(s_logits, t_logits))
    assert value.item() == pytest.approx(total / 6, rel=1e-9)


def test_a_prefix_as_wide_as_the_model_repeats_a_contrastive_term():
    g = torch.Generator().manual_seed(2)
    views = unit(g, 2, 4, 6)
    loss = build_loss([{"simcse": {}}, {"matryoshka": {"dims": [6]}}])
    parts = evaluate(loss, views, gather=False)
    torch.testing.assert_close(parts["matryoshka"], parts["contrastive"])


def test_gradients_reach_only_the_prefix_dims_of_a_small_prefix():
    g = torch.Generator().manual_seed(3)
    views = unit(g, 3, 4, 8).requires_grad_(True)
    loss = build_loss([{"luse": {}}, {"matryoshka": {"dims": [3]}}])
    evaluate(loss, views, gather=False)["matryoshka"].backward()
    assert views.grad[..., 3:].abs().max() == 0 and views.grad[..., :3].abs().max() > 0


@pytest.mark.parametrize(
    "entries, message",
    [
        (
            [{"luse": {}}, {"matryoshka": {"dims": [64, 128]}}],
            r"matryoshka.dims \[64, 128\] must be distinct and sorted",
        ),
        ([{"luse": {}}, {"matryoshka": {"dims": [128, 128]}}], "must be distinct and sorted"),
        ([{"luse": {}}, {"matryoshka": {"dims": [128, 64], "weights": [1.0]}}], "has 1 values for 2 dims"),
        ([{"luse": {}}, {"matryoshka": {"dims": [128, 64], "weights": [1.0, 0.0]}}], "must all be > 0"),
        ([{"luse": {}}, {"matryoshka": {"dims": []}}], "matryoshka.dims is empty"),
        ([{"luse": {}}, {"matryoshka": {"of": ["distill"]}}], "names distill, not a term of this run"),
        (
            [{"luse": {}}, {"mlm": {}}, {"matryoshka": {"of": ["mlm"]}}],
            r"cannot take mlm \(it has no embedding\)",
        ),
        ([{"mlm": {}}, {"matryoshka": {}}], "no term of this run"),
        ([{"luse": {"teacher_positive": True}}, {"matryoshka": {}}], "drop teacher_positive"),
        ([{"luse": {}}, {"matryoshka": {"dimz": [3]}}], "Did you mean 'loss\\[1\\].matryoshka.dims'"),
    ],
)
def test_config_errors_are_one_line(entries, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_loss(entries)
    assert "\n" not in str(err.value)


def test_dims_wider_than_the_model_are_refused_before_training():
    loss = build_loss([{"luse": {}}, {"matryoshka": {"dims": [512, 128]}}])
    with pytest.raises(ConfigError, match=r"the model's embeddings are 384-d; keep every dim <= 384"):
        loss.build_head(384, 0)
    assert build_loss([{"luse": {}}, {"matryoshka": {"dims": [384, 128]}}]).build_head(384, 0) is None


def test_the_resolved_config_records_the_weights():
    from pipeline.losses.terms import as_entries

    loss = build_loss([{"distill": {}}, {"matryoshka": {"dims": [256, 64]}, "weight": 0.5}])
    assert as_entries(loss.terms)[1] == {
        "matryoshka": {"dims": [256, 64], "weights": [1.0, 1.0], "of": [], "temperature": 0.05},
        "weight": 0.5,
    }
    assert loss.reads("teacher") and loss.main is None and loss.num_views(2, 1) == 1


def test_a_debug_run_trains_with_the_matryoshka_term(tmp_path, tiny_shards):
    import json

    from _train_data import debug_config

    from pipeline.train.run import run

    loss = [
        {"luse": {"temperature": 0.05, "queue_size": 32}},
        {"matryoshka": {"dims": [16, 8]}, "weight": 0.5},
    ]
    cfg = debug_config(tmp_path, tiny_shards([[40, 24]], num_variants=3), **{"loss": loss})
    assert run(cfg) == 0
    steps = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in steps if "matryoshka_loss" in r]
    assert len(logged) == 10 and all(math.isfinite(r["matryoshka_loss"]) for r in logged)
    for r in logged:  # the total is the weighted sum of the logged terms
        assert r["loss"] == pytest.approx(r["contrastive_loss"] + 0.5 * r["matryoshka_loss"], rel=1e-4)


def test_an_old_objective_section_keeps_the_matryoshka_term():
    from pipeline.losses import TERMS
    from pipeline.losses.legacy import apply_legacy_objective

    entries = [{"distill": {}, "weight": 1.0}, {"matryoshka": {"dims": [128]}, "weight": 0.5}]
    patched = apply_legacy_objective(entries, {"distill_weight": 2.0}, TERMS)
    assert patched == [{"distill": {}, "weight": 2.0}, {"matryoshka": {"dims": [128]}, "weight": 0.5}]
