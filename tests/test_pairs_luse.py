"""luse on pair shards (issue 35, Build item 3; docs/pairs.md "Training on pairs", docs/objectives.md):
each pair's views are (anchor, positive, d dropout re-encodings of the anchor); the multi-positive target
puts 1/(n-1) on the partner and the dropout views; the candidates are every other view of the global batch
and the queue, less the pairs of the anchor's group (and, with same_text, a text equal to either side).
Literal references, an independent loop implementation, two gloo processes against one, and a tiny
training run on the bundled pairs that resumes exactly and refuses what does not fit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from _gloo import spawn_ranks
from _tensors import leaf, unit
from _terms import evaluate
from test_pairs_train import pair_config, pair_data  # noqa: F401 (pair_data: the module's fixture)

from pipeline.errors import ConfigError
from pipeline.losses import build_loss
from pipeline.losses.false_negatives import FalseNegativeConfig, pair_guide
from pipeline.losses.multi_positive import compute_loss

# anchors a_i and positives p_i (unit vectors), as tests/test_pairs_train.py; the dots by hand:
#   a1.a2 = 0    a1.a3 = 0.6   a2.a3 = 0.8   p1.p2 = 0.6   p1.p3 = 0.8   p2.p3 = 0.96
#   a1.p1 = 0.8  a1.p2 = 0     a1.p3 = 0.28
#   a2.p1 = 0.6  a2.p2 = 1     a2.p3 = 0.96
#   a3.p1 = 0.96 a3.p2 = 0.8   a3.p3 = 0.936
A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
P = torch.tensor([[0.8, 0.6], [0.0, 1.0], [0.28, 0.96]])
TAU = 0.5  # logits = 2 * cosine


def lse(*xs: float) -> float:
    return math.log(sum(math.exp(x) for x in xs))


def fn_config(same_id: bool = True, same_text: bool = False) -> FalseNegativeConfig:
    return FalseNegativeConfig(same_id=same_id, same_text=same_text)


def luse(views, groups=None, hashes=None, positive_hashes=None, queue=None, queue_groups=None,
         queue_hashes=None, same_text=False, counts=None, gather=False, same_id=True):  # fmt: skip
    """The luse term's loss on a pair batch, through pair_guide as the term builds it."""
    guide = None
    if groups is not None:
        guide = pair_guide(fn_config(same_id, same_text), groups, hashes, positive_hashes, views.shape[0],
                           queue_groups, queue_hashes)  # fmt: skip
    return compute_loss(views, TAU, queue=queue, gather=gather, guide=guide, counts=counts)


def loop_reference(views, tau, groups, hashes=None, positive_hashes=None, queue=None, queue_groups=None,
                   queue_hashes=None):  # fmt: skip
    """Anchor by anchor: views (n, B, H), view 1 the positive; a candidate is dropped when it is another
    pair of the anchor's group, or (hashes given) its text hashes like either side of the anchor's pair.
    Queued keys are anchors. Returns (loss, dropped)."""
    n, b, _ = views.shape
    text = lambda v, j: None if hashes is None else (positive_hashes if v == 1 else hashes)[j]  # noqa: E731
    total, dropped = 0.0, 0

    def false_negative(i, group, candidate_text):
        own = () if hashes is None else (hashes[i], positive_hashes[i])
        return group == groups[i] or any(candidate_text == h for h in own)

    for v in range(n):
        for i in range(b):
            cands, positives = [], []
            for w in range(n):
                for j in range(b):
                    if (w, j) == (v, i):
                        continue
                    if j != i and false_negative(i, groups[j], text(w, j)):
                        dropped += 1
                        continue
                    if j == i:
                        positives.append(len(cands))
                    cands.append(torch.dot(views[v, i], views[w, j]) / tau)
            for q in range(0 if queue is None else len(queue)):
                if false_negative(i, queue_groups[q], None if queue_hashes is None else queue_hashes[q]):
                    dropped += 1
                    continue
                cands.append(torch.dot(views[v, i], queue[q]) / tau)
            log_z = torch.logsumexp(torch.stack(cands), 0)
            total = total - sum(cands[c] - log_z for c in positives) / (n - 1)
    return total / (n * b), dropped


# ------------------------------------------------------------------------------------------ the formula
def test_two_views_no_masking_equals_the_literal_numbers():
    got = luse(torch.stack([A, P]), groups=torch.arange(3))  # unique groups: nothing masked
    per_anchor = [  # each view an anchor; candidates: the five other views
        -1.6 + lse(1.6, 0.0, 1.2, 0.0, 0.56),  # a1: p1 | a2 a3 p2 p3
        -2.0 + lse(2.0, 0.0, 1.6, 1.2, 1.92),  # a2: p2 | a1 a3 p1 p3
        -1.872 + lse(1.872, 1.2, 1.6, 1.92, 1.6),  # a3: p3 | a1 a2 p1 p2
        -1.6 + lse(1.6, 1.2, 1.92, 1.2, 1.6),  # p1: a1 | a2 a3 p2 p3
        -2.0 + lse(2.0, 0.0, 1.6, 1.2, 1.92),  # p2: a2 | a1 a3 p1 p3
        -1.872 + lse(1.872, 0.56, 1.92, 1.6, 1.92),  # p3: a3 | a1 a2 p1 p2
    ]
    assert got.item() == pytest.approx(sum(per_anchor) / 6, rel=1e-6)
    # the pairs term (partner side only as candidates) differs: luse also pushes same-side texts apart
    from pipeline.losses.pairs import compute_loss as pairs_loss

    assert got.item() != pytest.approx(pairs_loss(A, P, TAU, gather=False).item(), rel=1e-3)


def test_group_masking_removes_exactly_the_same_group_candidates_and_counts_them():
    counts: dict = {}
    got = luse(torch.stack([A, P]), groups=torch.tensor([7, 7, 9]), counts=counts)  # pairs 1, 2: one record
    per_anchor = [  # a2 and p2 leave the softmax of a1 and p1, and a1, p1 that of a2 and p2
        -1.6 + lse(1.6, 1.2, 0.56),  # a1: p1 | a3 p3
        -2.0 + lse(2.0, 1.6, 1.92),  # a2: p2 | a3 p3
        -1.872 + lse(1.872, 1.2, 1.6, 1.92, 1.6),  # a3: nothing masked
        -1.6 + lse(1.6, 1.92, 1.6),  # p1: a1 | a3 p3
        -2.0 + lse(2.0, 1.6, 1.92),  # p2: a2 | a3 p3
        -1.872 + lse(1.872, 0.56, 1.92, 1.6, 1.92),  # p3: nothing masked
    ]
    assert got.item() == pytest.approx(sum(per_anchor) / 6, rel=1e-6)
    assert counts["false_negatives"].item() == 8  # 2 views x 2 candidates, for each of pairs 1 and 2
    # same_id off: the group rule is off, the loss is the unmasked one
    plain = luse(torch.stack([A, P]))
    assert torch.equal(luse(torch.stack([A, P]), groups=torch.tensor([7, 7, 9]), same_id=False), plain)
    assert torch.equal(luse(torch.stack([A, P]), groups=torch.arange(3)), plain)  # all-False: bit for bit


def test_same_text_masks_a_candidate_equal_to_either_side_of_the_pair():
    hashes, positive_hashes = torch.tensor([1, 2, 3]), torch.tensor([10, 11, 10])  # p3's text is p1's
    counts: dict = {}
    got = luse(torch.stack([A, P]), torch.arange(3), hashes, positive_hashes, same_text=True, counts=counts)
    ref, dropped = loop_reference(torch.stack([A, P]).double(), TAU, [0, 1, 2], hashes.tolist(),
                                  positive_hashes.tolist())  # fmt: skip
    assert dropped == 4 and counts["false_negatives"].item() == 4  # p3 for a1, p1; p1 for a3, p3
    per_anchor = [
        -1.6 + lse(1.6, 0.0, 1.2, 0.0),  # a1: p1 | a2 a3 p2 (p3 masked)
        -2.0 + lse(2.0, 0.0, 1.6, 1.2, 1.92),  # a2: nothing masked
        -1.872 + lse(1.872, 1.2, 1.6, 1.6),  # a3: p3 | a1 a2 p2 (p1 masked)
        -1.6 + lse(1.6, 1.2, 1.92, 1.2),  # p1: a1 | a2 a3 p2
        -2.0 + lse(2.0, 0.0, 1.6, 1.2, 1.92),  # p2: nothing masked
        -1.872 + lse(1.872, 0.56, 1.92, 1.92),  # p3: a3 | a1 a2 p2
    ]
    assert got.item() == pytest.approx(sum(per_anchor) / 6, rel=1e-6)
    assert ref.item() == pytest.approx(sum(per_anchor) / 6, rel=1e-6)  # the loop agrees with the numbers
    off = luse(torch.stack([A, P]), torch.arange(3), hashes, positive_hashes, same_text=False)
    assert torch.equal(off, luse(torch.stack([A, P])))


def test_dropout_views_and_the_queue_against_the_loop_reference_values_and_gradients():
    b = 5
    anchors, positives = unit(b, 8, seed=1), unit(b, 8, seed=2)
    dropout = torch.nn.functional.normalize(anchors + 0.1 * unit(b, 8, seed=3), dim=-1)  # a re-encoding
    views = torch.stack([anchors, positives, dropout])  # (3, B, H)
    queue = unit(4, 8, seed=4)
    groups = torch.tensor([1, 2, 1, 3, 4])  # pairs 0 and 2 from one record
    hashes, positive_hashes = torch.tensor([20, 21, 22, 23, 24]), torch.tensor([30, 31, 32, 20, 34])
    queue_groups, queue_hashes = torch.tensor([2, 9, 1, 8]), torch.tensor([40, 41, 42, 30])
    x = leaf(views)
    counts: dict = {}
    got = luse(x, groups, hashes, positive_hashes, queue, queue_groups, queue_hashes, same_text=True,
               counts=counts)  # fmt: skip
    got.backward()
    y = leaf(views)
    ref, dropped = loop_reference(y, TAU, groups.tolist(), hashes.tolist(), positive_hashes.tolist(), queue,
                                  queue_groups.tolist(), queue_hashes.tolist())  # fmt: skip
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-10)
    assert torch.allclose(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    assert counts["false_negatives"].item() == dropped > 0
    # the group rule alone on the queue: group 2 queued (row 0) is masked for pair 1's 3 views, group 1
    # (row 2) for those of pairs 0 and 2
    only_queue: dict = {}
    luse(views, groups, queue=queue, queue_groups=queue_groups, counts=only_queue)
    in_batch: dict = {}
    luse(views, groups, counts=in_batch)
    assert only_queue["false_negatives"].item() - in_batch["false_negatives"].item() == 3 * (2 + 1)


def test_the_term_on_a_pair_step_output_with_distill():
    """loss: [{luse}, {distill}] on a pair batch: luse over the views and groups, distill both sides."""
    teacher, teacher_positive = A.clone(), P.clone()  # the student's own vectors: distill is 0
    loss = build_loss([{"luse": {"temperature": TAU}}, {"distill": {}}])
    assert loss.data == "shards" and loss.main.pair_views is not None
    parts = evaluate(loss, torch.stack([A, P]), gather=False, groups=torch.tensor([7, 7, 9]), teacher=teacher,
                     teacher_positive=teacher_positive)  # fmt: skip
    assert parts["distill"].item() == pytest.approx(0.0, abs=1e-6)
    assert parts["contrastive"].item() == pytest.approx(
        luse(torch.stack([A, P]), groups=torch.tensor([7, 7, 9])).item(), rel=1e-6
    )
    assert parts["false_negatives"].item() == 8
    same_text = build_loss([{"luse": {"false_negatives": {"same_text": True}}}])
    assert same_text.needs.text_hashes
    with pytest.raises(ValueError, match="text hashes of both sides"):
        evaluate(same_text, torch.stack([A, P]), gather=False, groups=torch.arange(3))


# ------------------------------------------------------------------------------------ two gloo processes
WORLD, B, H = 2, 3, 8


def global_inputs() -> dict[str, torch.Tensor]:
    return {
        "views": unit(3, WORLD * B, H, seed=11),  # anchor, positive, a dropout view
        "groups": torch.tensor([1, 2, 3, 2, 5, 6]),  # group 2 on both ranks: masked across devices
        "hashes": torch.tensor([10, 11, 12, 13, 14, 15]),
        "positive_hashes": torch.tensor([20, 21, 22, 23, 20, 25]),  # pair 4's positive = pair 0's text
        "queue": unit(6, H, seed=12),
        "queue_groups": torch.tensor([5, 7, 8, 1, 9, 9]),
        "queue_hashes": torch.tensor([30, 31, 21, 33, 34, 35]),  # row 2: pair 1's positive's text
    }


def run_case(x: dict[str, torch.Tensor], views: torch.Tensor, gather: bool, counts: dict) -> torch.Tensor:
    return luse(views, x["groups"], x["hashes"], x["positive_hashes"], x["queue"], x["queue_groups"],
                x["queue_hashes"], same_text=True, counts=counts, gather=gather)  # fmt: skip


def _body(rank: int) -> dict:
    local = global_inputs()  # the queue is the same on every rank; the pairs are rank-major
    for k in ("groups", "hashes", "positive_hashes"):
        local[k] = local[k][rank * B : (rank + 1) * B]
    views = leaf(local["views"][:, rank * B : (rank + 1) * B])
    counts: dict = {}
    loss = run_case(local, views, True, counts)
    loss.backward()
    return {"loss": loss.detach(), "count": counts["false_negatives"], "grad": views.grad / WORLD}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(tmp_path_factory, "pairs_luse_gloo", _body, WORLD)


@pytest.mark.slow
def test_two_gloo_processes_give_the_single_process_loss_and_gradients(ranks):
    x = global_inputs()
    views = leaf(x["views"])
    counts: dict = {}
    loss = run_case(x, views, False, counts)
    loss.backward()
    assert torch.stack([r["loss"] for r in ranks]).mean().item() == pytest.approx(loss.item(), rel=1e-12)
    grads = torch.cat([r["grad"] for r in ranks], dim=1)  # (3, W * B, H), rank-major like the batch
    assert torch.allclose(grads, views.grad, rtol=1e-10, atol=1e-13)
    assert sum(r["count"].item() for r in ranks) == counts["false_negatives"].item() > 0


# ------------------------------------------------------------------------------------------- end to end
LOSS = [{"distill": {}},
        {"luse": {"temperature": 0.05, "queue_size": 32, "momentum": 0.9,
                  "false_negatives": {"same_text": True}}, "weight": 0.1}]  # fmt: skip


def test_pair_batches_for_luse_carry_the_dropout_views(pair_data, tmp_path):  # noqa: F811
    from test_pairs_train import _batches

    cfg = pair_config(tmp_path, pair_data["taught"], LOSS, **{"data.num_dropout_views": 1})
    (batch,) = _batches(cfg, 1, pair_data["teacher"])
    b = cfg.train.global_batch_size
    assert batch.num_views == 3 and batch.input_ids.shape[0] == 3 * b
    assert torch.equal(batch.input_ids[2 * b :], batch.input_ids[:b])  # the anchors' tokens again
    assert not torch.equal(batch.input_ids[b : 2 * b], batch.input_ids[:b])
    for key in ("groups", "text_hashes", "positive_text_hashes"):
        assert getattr(batch, key).shape == (b,)
    assert batch.teacher_positive.shape == (b, 24)
    (two,) = _batches(pair_config(tmp_path, pair_data["taught"], LOSS), 1, pair_data["teacher"])
    assert two.num_views == 2 and torch.equal(two.input_ids, batch.input_ids[: 2 * b])


def test_tiny_train_distill_plus_luse_on_pairs_resumes_exactly(pair_data, tmp_path):  # noqa: F811
    """4 steps uninterrupted == 2 steps, stop, resume to 4 (queue of the anchors' keys with their groups,
    momentum encoder, cursor): the same weights, queue and losses."""
    from _train_data import full_and_resumed

    def make_cfg(run_dir, steps):
        return pair_config(tmp_path, pair_data["taught"], LOSS, **{
            "data.num_dropout_views": 1, "train.debug_dump": True, "run_dir": str(run_dir),
            "train.max_steps": steps, "data.one_source_per_batch": True})  # fmt: skip

    full, resumed = full_and_resumed(tmp_path, make_cfg, stop=2, total=4)
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "contrastive_loss" in r]
    assert len(steps) == 4 and all(
        np.isfinite(r["contrastive_loss"]) and r["contrastive_loss"] > 0 for r in steps
    )
    assert all(np.isfinite(r["distill_loss"]) for r in steps) and "false_negatives_count" in steps[0]
    assert resumed["step"] == 4 and resumed["cursor"] == full["cursor"]
    assert resumed["queue_checksum"] == full["queue_checksum"] is not None
    assert resumed["param_checksum"] == full["param_checksum"]
    # the queue keeps the anchors' groups as their ids (what the group rule compares), not the pair ids
    from pipeline.shards import read_manifest, read_shard

    groups, pair_ids = set(), set()
    for entry in read_manifest(pair_data["taught"])["shards"]:
        for block in read_shard(pair_data["taught"] / entry["name"]):
            groups.update(np.asarray(block.column("group").to_pylist(), np.uint64).view(np.int64).tolist())
            pair_ids.update(np.asarray(block.column("id").to_pylist(), np.uint64).view(np.int64).tolist())
    latest = (tmp_path / "full" / "checkpoints" / "latest").read_text().strip()
    queue = torch.load(tmp_path / "full" / "checkpoints" / latest / "state.pt", weights_only=True)["queue"]
    queued = queue["ids"].tolist()
    assert len(queued) == 32 and set(queued) <= groups and not set(queued) & (pair_ids - groups)
    split = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in split if "loss" in r][-2:] == [r["loss"] for r in records if "loss" in r][-2:]


@pytest.mark.parametrize(
    "loss, overrides, match",
    [
        ([{"luse": {"teacher_positive": True}}], {}, "teacher_positive and luse.false"),
        ([{"luse": {"false_negatives": {"teacher_margin": 0.1}}}], {}, "teacher_margin take the teacher"),
        ([{"luse": {}}], {"data.num_variants": 2}, "pair shards cache no EDA variants"),
        ([{"luse_bce": {}}], {"data.num_dropout_views": 1}, "holds pairs"),
    ],
    ids=["teacher_positive", "teacher_margin", "variants", "luse_bce"],
)
def test_bad_combinations_are_one_config_error_line(pair_data, tmp_path, loss, overrides, match):  # noqa: F811
    from pipeline.shards import read_shard_set
    from pipeline.train.plan import check_against_data

    cfg = pair_config(tmp_path, pair_data["taught"], loss, **overrides)
    with pytest.raises(ConfigError, match=match) as error:
        check_against_data(cfg, read_shard_set(pair_data["taught"]), 1)
    assert "\n" not in str(error.value)


def test_luse_without_positives_is_still_refused_on_sentence_shards(tmp_path):
    from _train_data import debug_config, make_shards

    from pipeline.shards import read_shard_set
    from pipeline.train.plan import check_against_data

    make_shards(tmp_path / "sentences", [[40]])
    cfg = debug_config(
        tmp_path, tmp_path / "sentences", **{"data.num_variants": 0, "data.num_dropout_views": 0}
    )
    with pytest.raises(ConfigError, match="luse needs at least one positive") as error:
        check_against_data(cfg, read_shard_set(tmp_path / "sentences"), 1)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"train.gradcache_chunk_size": 8},
        {"loss": [*LOSS, {"matryoshka": {"dims": [16], "of": ["luse"]}}]},
        {"train.grad_accum_steps": 2, "loss": [{"luse": {"queue_size": 16}}]},
    ],
    ids=["gradcache", "matryoshka", "grad_accum"],
)
def test_luse_on_pairs_trains_with_gradcache_matryoshka_and_accumulation(pair_data, tmp_path, overrides):  # noqa: F811
    """The other ways a step reaches the loss carry the pairs' groups too: finite losses, masks counted."""
    from _train_data import run_and_dump

    options = {"data.num_dropout_views": 1, "train.debug_dump": True, "train.max_steps": 2, **overrides}
    cfg = pair_config(tmp_path, pair_data["taught"], options.pop("loss", LOSS), **options)
    assert run_and_dump(cfg)["step"] == 2
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in steps)
    assert all("false_negatives_count" in r for r in steps)
