"""Listed hard negatives of a user's pairs train as such: the pairs term against a loop reference, empty
slots and equal texts left out; luse on the same batches (its queue too); a FlagEmbedding file from the
bundled pairs through ``pipeline pairs --format flag`` and a tiny run of each; and a teacher of another
width end to end: its vectors through the teacher stage, distilled through the projection, exported."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _terms import evaluate

from pipeline.errors import ConfigError
from pipeline.losses import build_loss
from pipeline.losses.pairs import compute_loss
from pipeline.resources import ROOT as RESOURCES

BUNDLED = RESOURCES / "corpus" / "pairs" / "baike2018qa_toyhom_medical.jsonl.gz"
TAU = 0.5


def reference(anchors, positives, negatives, mask, hashes=None, negative_hashes=None) -> float:
    """The anchor -> positive direction by a loop: each anchor's softmax over every positive and every
    listed negative of the batch (empty slots and, with hashes, a negative equal to a side of the pair
    left out)."""
    b, m = anchors.shape[0], negatives.shape[0]
    total = 0.0
    for i in range(b):
        logits = [float(anchors[i] @ positives[j]) / TAU for j in range(b)]
        for j in range(m):
            for k in range(b):
                sides = () if hashes is None else (int(hashes[0][i]), int(hashes[1][i]))
                equal = hashes is not None and int(negative_hashes[k, j]) in sides
                if mask[k, j] and not equal:
                    logits.append(float(anchors[i] @ negatives[j, k]) / TAU)
        total += -logits[i] + math.log(sum(math.exp(x) for x in logits))
    return total / b


def unit(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


def test_listed_negatives_join_every_anchors_candidates_and_empty_slots_leave():
    a, p, n = unit(4, 6, seed=0), unit(4, 6, seed=1), unit(2, 4, 6, seed=2)  # B = 4, m = 2
    mask = torch.tensor([[True, True], [True, False], [False, False], [True, True]])  # (B, m)
    got = compute_loss(a, p, TAU, symmetric=False, gather=False, hard_negatives=n, negative_mask=mask)
    assert got.item() == pytest.approx(reference(a, p, n, mask), rel=1e-9)
    full = compute_loss(a, p, TAU, symmetric=False, gather=False, hard_negatives=n)  # no mask: every slot
    assert full.item() == pytest.approx(reference(a, p, n, torch.ones(4, 2, dtype=torch.bool)), rel=1e-9)
    plain = compute_loss(a, p, TAU, symmetric=False, gather=False)
    assert full.item() > got.item() > plain.item()  # every negative adds to the denominator
    # both directions: the second keeps the anchors as its candidates
    both = compute_loss(a, p, TAU, gather=False, hard_negatives=n, negative_mask=mask)
    back = compute_loss(p, a, TAU, symmetric=False, gather=False)
    assert both.item() == pytest.approx((got.item() + back.item()) / 2, rel=1e-9)
    # an empty slot gets no gradient, a listed one does
    leaf = n.clone().requires_grad_()
    compute_loss(a, p, TAU, symmetric=False, gather=False, hard_negatives=leaf, negative_mask=mask).backward()
    assert torch.all(leaf.grad[1, 1] == 0) and torch.all(leaf.grad[:, 2] == 0)  # (m, B, H): the empty slots
    assert leaf.grad[0, 0].abs().sum() > 0


def test_a_negative_equal_to_a_side_of_the_pair_is_masked_and_counted():
    a, p, n = unit(3, 5, seed=3), unit(3, 5, seed=4), unit(1, 3, 5, seed=5)
    mask = torch.ones(3, 1, dtype=torch.bool)
    anchor_hashes, positive_hashes = torch.tensor([1, 2, 3]), torch.tensor([11, 12, 13])
    negative_hashes = torch.tensor([[12], [99], [98]])  # pair 0's negative is pair 1's positive
    counts: dict = {}
    got = compute_loss(a, p, TAU, False, False, None, anchor_hashes, positive_hashes, counts, n, mask,
                       negative_hashes)  # fmt: skip
    want = reference(a, p, n, mask, (anchor_hashes, positive_hashes), negative_hashes)
    assert got.item() == pytest.approx(want, rel=1e-9) and counts["false_negatives"].item() == 1


def test_the_pairs_term_reads_the_batchs_negatives_and_luse_leaves_empty_slots_out():
    a, p, n = unit(3, 4, seed=6), unit(3, 4, seed=7), unit(2, 3, 4, seed=8)
    mask = torch.tensor([[True, False], [True, True], [False, False]])
    columns = {"groups": torch.arange(3), "hard_negative_mask": mask}
    pairs = build_loss([{"pairs": {"temperature": TAU, "symmetric": False, "same_text": False}}])
    got = evaluate(pairs, torch.stack([a, p]), n, gather=False, **columns)["loss"]
    assert got.item() == pytest.approx(reference(a, p, n, mask), rel=1e-9)
    assert "hard_negatives" in pairs.terms[0].term.reads(pairs.terms[0].config)
    # luse on a pair batch: every slot empty is the loss without negatives, bit for bit
    luse = build_loss([{"luse": {"temperature": TAU}}])
    views = torch.stack([a, p])
    nothing = torch.zeros(3, 2, dtype=torch.bool)
    empty = evaluate(luse, views, n, gather=False, **{**columns, "hard_negative_mask": nothing})
    none = evaluate(luse, views, gather=False, groups=torch.arange(3))
    assert torch.equal(empty["loss"], none["loss"])
    leaf = n.clone().requires_grad_()
    evaluate(luse, views, leaf, gather=False, **columns)["loss"].backward()
    assert torch.all(leaf.grad[1, 0] == 0) and torch.all(leaf.grad[:, 2] == 0)
    assert leaf.grad[0, 1].abs().sum() > 0


# ----------------------------------------------------------------------------------------- end to end
def flag_file(path: Path, records: int = 96, negatives: int = 2, seed: int = 0) -> Path:
    """A FlagEmbedding file of the bundled medical QA: each title with its answer, and the answers of
    ``negatives`` other records as its listed negatives (every 5th record lists one fewer)."""
    rows = [json.loads(line) for line in gzip.open(BUNDLED, "rt", encoding="utf-8")][:records]
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i, r in enumerate(rows):
            others = rng.sample([x["answer"] for j, x in enumerate(rows) if j != i], negatives - (i % 5 == 0))
            line = {"query": r["title"], "pos": [r["answer"]], "neg": others}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def user_pairs(tmp_path_factory):
    from pipeline.stages.pairs.run import Config, run

    root = tmp_path_factory.mktemp("user_pairs")
    source = flag_file(root / "medical.jsonl")
    out = root / "pairs"
    assert run(Config(inputs=[source], out=out, format="flag", progress=False, pairs_per_shard=48)) == 0
    return {"root": root, "source": source, "pairs": out}


def user_config(tmp_path: Path, shards: Path, loss: list[dict], **overrides):
    from _train_data import DEBUG_CONFIG

    from pipeline.config import load_config
    from pipeline.train.config import Config

    base = {"data.shards": str(shards), "run_dir": str(tmp_path / "run"), "loss": loss,
            "data.num_variants": 0, "data.num_dropout_views": 0, "data.num_hard_negatives": 2,
            "train.max_steps": 4, "data.length_bucketing": False}  # fmt: skip
    return load_config(Config, DEBUG_CONFIG, {**base, **overrides})


def test_batches_carry_the_listed_negatives_after_the_views(user_pairs, tmp_path):
    from _train_data import batch_stream

    from pipeline.model import build_char_vocab, make_tokenizer, write_vocab
    from pipeline.shards import read_shard_set

    cfg = user_config(tmp_path, user_pairs["pairs"], [{"pairs": {}}])
    vocab = tmp_path / "vocab.txt"
    write_vocab(build_char_vocab(user_pairs["source"].read_text(encoding="utf-8").splitlines()), vocab)
    batch = next(iter(batch_stream(cfg, read_shard_set(cfg.data.shards), make_tokenizer(vocab))))
    b = cfg.train.global_batch_size
    assert batch.num_views == 2 and batch.num_hard_negatives == 2 and batch.input_ids.shape[0] == 4 * b
    assert batch.hard_negative_mask.shape == (b, 2) and batch.hard_negative_text_hashes.shape == (b, 2)
    assert batch.hard_negative_mask[:, 0].all() and not batch.hard_negative_mask[:, 1].all()  # 1 in 5: one
    empty = ~batch.hard_negative_mask[:, 1]
    assert (batch.attention_mask[3 * b :][empty].sum(dim=1) == 2).all()  # an empty slot: [CLS] [SEP] alone
    with pytest.raises(ConfigError, match="no loss term takes hard negatives"):
        user_config(tmp_path, user_pairs["pairs"], [{"distill": {}}])
    from pipeline.stages.pairs.run import Config, run

    without = tmp_path / "without.jsonl"  # pairs that list no negatives
    without.write_text("".join(json.dumps({"query": f"q{i}", "pos": [f"p{i}"]}) + "\n" for i in range(40)))
    assert run(Config(inputs=[without], out=tmp_path / "none", format="flag", progress=False)) == 0
    cfg = user_config(tmp_path, tmp_path / "none", [{"pairs": {}}])
    with pytest.raises(ConfigError, match="list no hard negatives"):
        batch_stream(cfg, read_shard_set(cfg.data.shards), make_tokenizer(vocab))


@pytest.mark.parametrize(
    "loss", [[{"pairs": {}}], [{"luse": {"queue_size": 32, "momentum": 0.9}}]], ids=["pairs", "luse-queue"]
)
def test_a_user_flag_file_trains_with_its_listed_negatives(user_pairs, tmp_path, loss):
    from _train_data import run_and_dump

    overrides = {"train.debug_dump": True, "model.dropout": 0.1}
    if "luse" in loss[0]:
        overrides["data.num_dropout_views"] = 1
    cfg = user_config(tmp_path, user_pairs["pairs"], loss, **overrides)
    dump = run_and_dump(cfg)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    assert len(losses) == 4 and all(np.isfinite(v) and v > 0 for v in losses)
    if "luse" in loss[0]:
        assert dump["queue_fill"] == 32  # the MoCo queue filled with the anchors' keys


def test_a_teacher_of_another_width_with_its_prompt_distils_a_user_file_to_an_export(user_pairs, tmp_path):
    """Any teacher: a model folder of width 24 with its own prompt (the prefix it encodes every text
    with) over the user's pair shards; the 32-wide student is distilled through the projection (a head
    trained beside it, never exported) with the pairs term on the listed negatives; the export loads."""
    from _tiny_models import build_char_encoder
    from _train_data import run_and_dump

    from pipeline.cli import main
    from pipeline.model import SentenceEncoder
    from pipeline.shards import read_manifest, read_shard, shard_paths
    from pipeline.stages.teacher.run import Config as TeacherConfig
    from pipeline.stages.teacher.run import run as teacher_run

    texts = [line for line in user_pairs["source"].read_text(encoding="utf-8").splitlines()]
    teacher = build_char_encoder(tmp_path / "teacher", texts, 24, 48, 260, max_length=64, prefix="查询：")
    taught = tmp_path / "taught"
    assert teacher_run(TeacherConfig(shards=user_pairs["pairs"], out=taught, model=str(teacher),
                                     batch_size=64, progress=False)) == 0  # fmt: skip
    record = read_manifest(taught)["teacher"]
    assert record["dim"] == 24 and record["prefix"] == "查询："
    block = next(read_shard(shard_paths(taught)[0]))
    assert {"teacher", "teacher_positive", "hard_negatives"} <= set(block.column_names)  # negatives kept

    loss = [{"distill": {}}, {"pairs": {}, "weight": 0.1}]
    overrides = {"data.teacher_dim": 24, "checkpoint.every_steps": 4, "train.final_model": "last",
                 "train.debug_dump": True}  # fmt: skip
    cfg = user_config(tmp_path, taught, loss, **overrides)
    run_and_dump(cfg)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "distill_loss" in r]
    assert len(steps) == 4
    assert all(np.isfinite(r["distill_loss"]) and r["contrastive_loss"] > 0 for r in steps)
    state = torch.load(cfg.run_dir / "checkpoints" / "step-00000004" / "state.pt", weights_only=True)
    assert state["head"]["weight"].shape == (24, 32)  # the projection: student width -> teacher width
    out = tmp_path / "export"
    assert main(["export", str(cfg.run_dir), "--out", str(out), "--verify", "false"]) == 0
    student = SentenceEncoder.from_pretrained(out)
    assert student.dim == 32  # the student's own width: the projection stays behind
    vectors = student.encode(["如何更换手机屏幕"], batch_size=1)
    assert np.isfinite(np.asarray(vectors)).all()
