"""False-negative control (pipeline/losses/false_negatives.py) in luse and luse_bce: which candidates each
rule masks (literal small examples), bit-exactness when nothing collides, the config and the logged count.
The queue's ids round trip is in tests/test_queue.py, two gloo ranks in tests/test_distributed_gloo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tensors import leaf, unit
from _terms import evaluate

from pipeline.data.collate import text_hashes
from pipeline.errors import ConfigError
from pipeline.losses import build_loss, multi_positive, pairwise_bce
from pipeline.losses.false_negatives import FalseNegativeConfig, Guide, make_guide

TAU = 0.05


def literal_luse(emb, tau, tags, queue=None, queue_tags=None, teacher=None, queue_teacher=None, margin=None):
    """Loop over anchors; a candidate is dropped when it is not the anchor's sentence but shares a tag with
    it (any column of ``tags``), or the teacher scores it above 1 - margin. Returns (loss, dropped)."""
    n, b, _ = emb.shape
    total, dropped = 0.0, 0

    def false_negative(i, tag, t):
        same = tag is not None and bool((tags[i] == tag).any())
        close = margin is not None and t is not None and float(teacher[i] @ t) > 1 - margin
        return same or close

    for v in range(n):
        for i in range(b):
            a = emb[v, i]
            cands, positive_cols = [], []
            for w in range(n):
                for j in range(b):
                    if (w, j) == (v, i):
                        continue
                    if j != i and false_negative(i, tags[j], None if teacher is None else teacher[j]):
                        dropped += 1
                        continue
                    if j == i:
                        positive_cols.append(len(cands))
                    cands.append(torch.dot(a, emb[w, j]) / tau)
            for q in range(0 if queue is None else len(queue)):
                qt = None if queue_teacher is None else queue_teacher[q]
                if false_negative(i, None if queue_tags is None else queue_tags[q], qt):
                    dropped += 1
                    continue
                cands.append(torch.dot(a, queue[q]) / tau)
            log_z = torch.logsumexp(torch.stack(cands), 0)
            total = total - sum(cands[c] - log_z for c in positive_cols) / (n - 1)
    return total / (n * b), dropped


# ------------------------------------------------------------------------------------- which are masked
def test_same_id_masks_the_stale_queued_key_and_the_duplicate_in_the_batch():
    emb, queue = unit(3, 4, 8, seed=1), unit(5, 8, seed=2)
    ids = torch.tensor([10, 11, 12, 10])  # sentence 3 is sentence 0 again
    queue_ids = torch.tensor([12, 99, 11, 98, 97])  # stale keys of sentences 2 and 1
    guide = Guide(tags=ids[:, None], queue_tags=queue_ids[:, None])
    counts = {}
    x = leaf(emb)
    ours = multi_positive.compute_loss(x, TAU, queue=queue, gather=False, guide=guide, counts=counts)
    y = leaf(emb)
    ref, dropped = literal_luse(y, TAU, ids[:, None], queue, queue_ids[:, None])
    torch.testing.assert_close(ours, ref)
    ours.backward(), ref.backward()
    torch.testing.assert_close(x.grad, y.grad)
    # by hand: the 3 views of sentence 0 and of sentence 3 each drop the other's 3 views (2 * 3 * 3 = 18),
    # each view of sentences 1 and 2 drops one queued key (2 * 3 = 6)
    assert dropped == 24 and counts["false_negatives"].item() == 24.0
    # and the masked loss differs from the unmasked one: the rule does something
    assert not torch.isclose(ours, multi_positive.compute_loss(emb, TAU, queue=queue, gather=False))


def test_an_anchor_keeps_its_own_views_as_positives():
    emb = unit(2, 3, 8, seed=3)
    guide = Guide(tags=torch.tensor([[5], [6], [7]]))  # every sentence's id equals its own views' id
    counts = {}
    masked = multi_positive.compute_loss(emb, TAU, gather=False, guide=guide, counts=counts)
    assert torch.equal(masked, multi_positive.compute_loss(emb, TAU, gather=False))
    assert counts["false_negatives"].item() == 0


def test_same_text_masks_normalised_duplicates_under_other_ids():
    texts = ["你好！ 世界", "今天天气很好", "你好世界", "另一句话"]
    hashes = text_hashes(texts)
    assert hashes[0] == hashes[2] and len(set(hashes.tolist())) == 3
    emb, queue = unit(2, 4, 8, seed=4), unit(3, 8, seed=5)
    queue_hashes = torch.stack([hashes[1], text_hashes(["别的"])[0], text_hashes(["今天天气很好。"])[0]])
    config = FalseNegativeConfig(same_id=True, same_text=True)
    ids = torch.tensor([1, 2, 3, 4])
    guide = make_guide(config, ids, hashes, torch.tensor([7, 8, 9]), queue_hashes)
    counts = {}
    ours = multi_positive.compute_loss(emb, TAU, queue=queue, gather=False, guide=guide, counts=counts)
    tags = torch.stack([ids, hashes], dim=1)
    ref, dropped = literal_luse(
        emb, TAU, tags, queue, torch.stack([torch.tensor([7, 8, 9]), queue_hashes], 1)
    )
    torch.testing.assert_close(ours, ref)
    # sentences 0 and 2 drop each other's 2 views (2 * 2 * 2); sentence 1's views drop queue rows 0 and 2
    assert dropped == 12 and counts["false_negatives"].item() == 12


def test_teacher_margin_drops_what_the_teacher_scores_as_close_as_a_positive():
    emb, queue = unit(2, 4, 8, seed=6), unit(3, 8, seed=7)
    teacher = F.normalize(torch.tensor([[1.0, 0, 0], [0.99, 0.14, 0], [0, 1.0, 0], [0, 0, 1.0]]), dim=-1)
    queue_teacher = F.normalize(torch.tensor([[0, 0.2, 0.98], [1.0, 0, 0.05], [0.5, 0.5, 0.5]]), dim=-1)
    guide = Guide(teacher=teacher, queue_teacher=queue_teacher, teacher_margin=0.05)
    counts = {}
    ours = multi_positive.compute_loss(emb, TAU, queue=queue, gather=False, guide=guide, counts=counts)
    no_tags = torch.arange(4)[:, None]  # distinct: only the teacher rule drops
    ref, dropped = literal_luse(
        emb, TAU, no_tags, queue, None, teacher.double(), queue_teacher.double(), margin=0.05
    )
    torch.testing.assert_close(ours, ref)
    # teacher cosines above 0.95: sentences 0-1 (0.990), 0 and queue row 1 (0.999), 1 and queue row 1
    # (0.989), 3 and queue row 0 (0.98): 2 * 2 * 2 in the batch + 2 * 3 from the queue
    assert dropped == 14 and counts["false_negatives"].item() == 14


def test_luse_bce_drops_the_pairs_of_a_duplicate_and_keeps_the_denominator():
    emb = unit(2, 3, 8, seed=8)
    ids = torch.tensor([4, 5, 4])
    counts = {}
    ours = pairwise_bce.compute_loss(emb, gather=False, guide=Guide(tags=ids[:, None]), counts=counts)
    # literal: every pair's BCE, the pairs (views of sentence 0, views of sentence 2) and back weigh 0
    rows = emb.reshape(6, 8)
    sentence = torch.arange(6) % 3
    total = 0.0
    for a in range(6):
        for c in range(6):
            cos = torch.tensor(0.99999, dtype=emb.dtype) if a == c else rows[a] @ rows[c]
            p = (1 + cos) / 2
            if sentence[a] == sentence[c]:
                total = total - torch.log(p)
            elif ids[sentence[a]] != ids[sentence[c]]:
                total = total - torch.log(1 - p)
    torch.testing.assert_close(ours, total / 36)
    assert counts["false_negatives"].item() == 8  # 2 views x 2 views, both directions


# ------------------------------------------------------------------------- bit for bit without collisions
@pytest.mark.parametrize("teacher_positive", [False, True])
def test_luse_without_collisions_is_bit_identical(teacher_positive):
    emb, queue, hard = unit(3, 4, 8, seed=9), unit(6, 8, seed=10), unit(2, 4, 8, seed=11)
    teacher = unit(4, 8, seed=12) if teacher_positive else None
    guide = Guide(
        tags=torch.tensor([[1, 11], [2, 12], [3, 13], [4, 14]]), queue_tags=torch.arange(20, 32).view(6, 2)
    )
    results = []
    for g in (None, guide):
        x, h = leaf(emb.float()), leaf(hard.float())
        loss = multi_positive.compute_loss(
            x, TAU, queue=queue.float(), gather=True, teacher=teacher, hard_negatives=h, guide=g
        )
        loss.backward()
        results.append((loss, x.grad, h.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_luse_bce_without_collisions_is_bit_identical():
    emb = unit(3, 4, 8, seed=13).float()
    results = []
    for g in (None, Guide(tags=torch.tensor([[1], [2], [3], [4]]))):
        x = leaf(emb)
        loss = pairwise_bce.compute_loss(x, gather=True, guide=g)
        loss.backward()
        results.append((loss, x.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ the term and config
def test_term_defaults_masks_by_id_and_reports_the_count():
    loss = build_loss([{"luse": {"queue_size": 8}}])
    config = loss.terms[0].config  # the luse term's
    assert config.false_negatives == FalseNegativeConfig(same_id=True, same_text=False, teacher_margin=None)
    out = dict(
        views=unit(2, 3, 8, seed=14).float(),
        queue=unit(4, 8, seed=15).float(),
        ids=torch.tensor([1, 2, 3]),
        text_hashes=torch.tensor([7, 8, 9]),
        queue_ids=torch.tensor([3, 3, 5, 6]),
        queue_text_hashes=torch.tensor([7, 0, 0, 0]),
        gather=False,
    )
    parts = evaluate(loss, **out)
    assert parts["false_negatives"].item() == 4  # sentence 2's two views, queue rows 0 and 1
    on = build_loss([{"luse": {"queue_size": 8, "false_negatives": {"same_text": True}}}])
    assert evaluate(on, **out)["false_negatives"].item() == 6  # and sentence 0's views, queue row 0
    off = build_loss([{"luse": {"queue_size": 8, "false_negatives": {"same_id": False}}}])
    assert "false_negatives" not in evaluate(off, **out)


def test_config_errors_and_missing_inputs():
    with pytest.raises(ConfigError, match="teacher_margin"):
        build_loss([{"luse_bce": {"false_negatives": {"teacher_margin": -0.1}}}])
    with pytest.raises(ConfigError, match="unknown config key"):
        build_loss([{"luse": {"false_negatives": {"same_ids": True}}}])
    loss = build_loss([{"luse_bce": {"false_negatives": {"same_text": True}}}])
    with pytest.raises(ValueError, match="text hashes"):
        evaluate(loss, unit(2, 3, 8).float(), ids=torch.tensor([1, 2, 3]), gather=False)
    assert build_loss([{"luse": {"false_negatives": {"teacher_margin": 0.05}}}]).reads("teacher")


# ------------------------------------------------------------------------------------------ in training
def test_a_second_epoch_meets_its_own_stale_keys_and_the_run_logs_how_many_were_masked(tmp_path, tiny_shards):
    """96 sentences, 6 steps of 16 per epoch, a queue of all 96 keys (momentum 0): in epoch 1 no anchor
    has a key queued; in epoch 2 the queue holds its own sentences' keys from epoch 1, which are masked."""
    import json

    from _train_data import debug_config

    from pipeline.train.run import run

    shards = tiny_shards([[40, 24], [32]], num_variants=3)
    luse = {"luse": {"temperature": 0.05, "queue_size": 96, "momentum": 0.0}}
    cfg = debug_config(
        tmp_path,
        shards,
        **{"loss": [luse], "train.max_steps": 12, "train.log_every": 1, "train.eval_every": 0},
        **{"train.eval_max_pairs": 32},
    )
    assert run(cfg) == 0
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    masked = {r["step"]: r["false_negatives_count"] for r in records if "false_negatives_count" in r}
    assert sorted(masked) == list(range(1, 13))
    assert all(masked[s] == 0 for s in range(1, 7))  # distinct sentences, none queued yet
    assert sum(masked[s] for s in range(7, 13)) > 0 and all(v % 1 == 0 for v in masked.values())


def test_micro_batches_carry_each_sentences_id_and_text_hash():
    from pipeline.data.collate import Batch

    b, n = 4, 2
    batch = Batch(
        num_views=n,
        input_ids=torch.arange(n * b)[:, None],  # row v * B + i
        attention_mask=torch.ones(n * b, 1, dtype=torch.long),
        ids=torch.tensor([10, 11, 12, 13]),
        text_hashes=torch.tensor([-1, -2, -3, -4]),
    )
    first, second = batch.split(2)  # the engine's micro-batches
    assert first.input_ids.flatten().tolist() == [0, 1, 4, 5]  # sentences 0 and 1, both views
    assert first.ids.tolist() == [10, 11] and second.ids.tolist() == [12, 13]
    assert second.text_hashes.tolist() == [-3, -4]


@pytest.mark.parametrize("same_text", [False, True])
def test_batches_carry_text_hashes_only_when_a_same_text_rule_reads_them(tmp_path, tiny_shards, same_text):
    """Hashing every text costs the loader workers and the queue a gather per step: the trainer's
    collator computes them only for a run whose luse term has false_negatives.same_text on."""
    from _train_data import batch_stream, debug_config

    from pipeline.shards import read_shard_set
    from pipeline.train.build import build_encoder

    shards = tiny_shards([[40, 24], [32]], num_variants=3)
    rule = {"same_id": True, "same_text": same_text}
    luse = {"luse": {"temperature": 0.05, "queue_size": 32, "false_negatives": rule}}
    cfg = debug_config(tmp_path, shards, **{"loss": [luse], "data.num_workers": 0})
    encoder = build_encoder(cfg)
    stream = batch_stream(cfg, read_shard_set(shards), encoder.tokenizer, 0, 1, encoder.prefix)
    batch = next(iter(stream))
    assert (batch.text_hashes is not None) is same_text and batch.ids.dtype == torch.int64
    if same_text:
        assert batch.text_hashes.shape == batch.ids.shape and batch.text_hashes.dtype == torch.int64
