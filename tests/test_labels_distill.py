"""Labels beside distillation: a supervised term (cosent) and distill in one run, on a labelled pair file and
the teacher stage's vectors of it (``pipeline teacher --pairs_file``, pipeline/data/labelled.py)."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _tiny_models import build_char_encoder
from _train_data import debug_config

from pipeline.errors import ConfigError
from pipeline.resources import sample_sentences

N_PAIRS = 48


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what build() sets for the loader workers


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    texts = sample_sentences(2 * N_PAIRS)
    path = tmp_path_factory.mktemp("labels") / "pairs.tsv"
    lines = [f"{texts[2 * i]}\t{texts[2 * i + 1] if i % 2 else texts[2 * i][1:]}\t{1 - i % 2}"
             for i in range(N_PAIRS)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, pairs_file):
    texts = [t for line in pairs_file.read_text(encoding="utf-8").splitlines() for t in line.split("\t")[:2]]
    return build_char_encoder(tmp_path_factory.mktemp("teacher") / "tiny-teacher", texts, 24, 48, 64)


@pytest.fixture(scope="module")
def vectors_dir(tmp_path_factory, pairs_file, teacher_dir):
    from pipeline.stages.teacher.run import Config, run

    out = tmp_path_factory.mktemp("vectors") / "pairs.teacher"
    assert run(Config(pairs_file=pairs_file, out=out, model=str(teacher_dir), progress=False)) == 0
    return out


def labels_config(tmp_path, pairs_file, vectors_dir, **overrides):
    over = {
        "loss": [{"cosent": {}}, {"distill": {}}],
        "data.shards": None,
        "data.supervised_file": str(pairs_file),
        "data.supervised_teacher": str(vectors_dir),
        "train.eval_max_pairs": 32,
        **overrides,
    }
    return debug_config(tmp_path, None, **over)


def test_the_teacher_stage_encodes_both_sides_of_every_record(pairs_file, vectors_dir, teacher_dir):
    from pipeline.data.labelled import read_pair_teacher
    from pipeline.model import SentenceEncoder

    found = read_pair_teacher(vectors_dir, pairs_file)
    assert found.rows == N_PAIRS and found.dim == 24 and found.teacher["name"] == str(teacher_dir)
    first, second = found.vectors()
    rows = [line.split("\t") for line in pairs_file.read_text(encoding="utf-8").splitlines()]
    teacher = SentenceEncoder.from_pretrained(teacher_dir)
    for side, got in ((0, first), (1, second)):
        want = teacher.encode([r[side] for r in rows])
        np.testing.assert_allclose(got, want, atol=2e-3)  # stored as float16


def test_a_batch_is_labelled_pairs_with_both_sides_teacher_rows_and_both_terms_get_gradients(
    tmp_path, pairs_file, vectors_dir
):
    from pipeline.data.labelled import read_pair_teacher
    from pipeline.losses.distill import embedding_loss
    from pipeline.train.build import build
    from pipeline.train.engines import term_loss

    t = build(labels_config(tmp_path, pairs_file, vectors_dir))
    try:
        batch = next(iter(t.stream))
        first, second = read_pair_teacher(vectors_dir, pairs_file).vectors()
        index = batch.ids.numpy()  # each pair's record in the file
        assert batch.num_views == 2 and batch.labels is not None
        np.testing.assert_array_equal(batch.teacher.numpy(), first[index])  # text 1's teacher row
        np.testing.assert_array_equal(batch.teacher_positive.numpy(), second[index])  # text 2's
        assert t.module.head is not None  # the 32-wide student is projected to the 24-wide teacher

        rows = t.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)  # (2B, H)
        out = term_loss(t, rows, batch)
        assert set(out.parts) == {"contrastive", "distill"}
        b = batch.num_sentences
        student = F.normalize(t.module.head(rows), dim=-1)  # (2B, D_t)
        sides = [  # text 1 to its teacher row, text 2 to its own
            embedding_loss(student[:b], batch.teacher),
            embedding_loss(student[b:], batch.teacher_positive),
        ]
        torch.testing.assert_close(out.parts["distill"], sum(sides) / 2)
        assert 0 < batch.labels.sum() < b  # both labels: the cosent term has pairs to rank
        torch.testing.assert_close(out.total, out.parts["contrastive"] + out.parts["distill"])

        out.parts["distill"].backward(retain_graph=True)  # distillation alone reaches encoder and projection
        encoder_grad = [p.grad for p in t.module.encoder.parameters() if p.grad is not None]
        assert encoder_grad and any(g.abs().sum() > 0 for g in encoder_grad)
        assert t.module.head.weight.grad.abs().sum() > 0
        t.optimizer.zero_grad(set_to_none=True)
        out.parts["contrastive"].backward()  # and so does the labelled term
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.module.encoder.parameters())
    finally:
        t.close()


def test_cosent_and_distill_train_together(tmp_path, pairs_file, vectors_dir):
    from pipeline.train.run import run

    cfg = labels_config(tmp_path, pairs_file, vectors_dir, **{"train.max_steps": 8})
    assert run(cfg) == 0
    steps = [
        r for r in map(json.loads, (cfg.run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert len(steps) == 8 and steps[-1]["samples_seen"] == 8 * 16
    assert all(math.isfinite(r["contrastive_loss"]) and math.isfinite(r["distill_loss"]) for r in steps)
    assert steps[-1]["distill_loss"] < steps[0]["distill_loss"]  # the student moves towards the teacher
    saved = (cfg.run_dir / "config.yaml").read_text(encoding="utf-8")
    assert "supervised_teacher" in saved and "distill" in saved


def test_mistakes_are_one_line_naming_the_field(tmp_path, pairs_file, vectors_dir):
    base = {"data.shards": None, "data.supervised_file": str(pairs_file)}
    with pytest.raises(ConfigError, match="without teacher vectors; .* set data.supervised_teacher"):
        debug_config(tmp_path, None, **{**base, "loss": [{"cosent": {}}, {"distill": {}}]})
    with pytest.raises(ConfigError, match="add both terms or unset it"):
        debug_config(tmp_path, None, **{**base, "loss": [{"cosent": {}}], "data.supervised_teacher": "x"})
    with pytest.raises(ConfigError, match="cosent and luse each decide the batch's data and views"):
        debug_config(tmp_path, None, **{**base, "loss": [{"cosent": {}}, {"luse": {}}]})
    with pytest.raises(ConfigError, match="the mlm term read the shards"):
        labels_config(tmp_path, pairs_file, vectors_dir, loss=[{"cosent": {}}, {"distill": {}}, {"mlm": {}}])

    from pipeline.train.build import build

    other = tmp_path / "other.tsv"
    other.write_text(pairs_file.read_text(encoding="utf-8") + "多一行\t再一行\t1\n", encoding="utf-8")
    rerun = "vectors of another file .*`python -m pipeline teacher --pairs_file "
    with pytest.raises(ConfigError, match=rerun):
        build(labels_config(tmp_path, other, vectors_dir))
    with pytest.raises(ConfigError, match="data.teacher='e5-small' but .*tiny-teacher"):
        build(labels_config(tmp_path, pairs_file, vectors_dir, **{"data.teacher": "e5-small"}))
    with pytest.raises(ConfigError, match="supervised_teacher: .*manifest.json does not exist"):
        build(labels_config(tmp_path, pairs_file, tmp_path))


def test_data_holdout_rows_keeps_the_last_records_out_with_their_teacher_rows(
    tmp_path, pairs_file, vectors_dir
):
    """train.select_on: sts_b+teacher on a labelled file: its last records, both texts, never in a batch."""
    from pipeline.data.labelled import read_pair_teacher
    from pipeline.train.build import build

    over = {"data.holdout_rows": 8, "train.select_on": "sts_b+teacher"}
    t = build(labels_config(tmp_path, pairs_file, vectors_dir, **over))
    try:
        rows = [line.split("\t") for line in pairs_file.read_text(encoding="utf-8").splitlines()]
        first, second = read_pair_teacher(vectors_dir, pairs_file).vectors()
        assert t.stream.num_items == N_PAIRS - 8
        assert t.holdout.texts == [r[0] for r in rows[-8:]] + [r[1] for r in rows[-8:]]
        np.testing.assert_array_equal(t.holdout.teacher, np.concatenate([first[-8:], second[-8:]]))
        batches = iter(t.stream)
        seen = {i for _ in range(2 * t.stream.batches_per_epoch) for i in next(batches).ids.tolist()}
        # 40 records, batches of 16: 32 a shuffled epoch; never one of the last 8
        assert len(seen) >= 32 and seen <= set(range(N_PAIRS - 8))
    finally:
        t.close()


def test_sup_simcse_trains_with_distillation_on_triples(tmp_path, teacher_dir):
    """A triple file's anchor and positive get teacher vectors (teacher --pairs_file --triples); the
    negatives are not distilled."""
    from pipeline.stages.teacher.run import Config
    from pipeline.stages.teacher.run import run as teach
    from pipeline.train.run import run

    texts = sample_sentences(3 * 32)
    triples = tmp_path / "triples.tsv"
    lines = [f"{texts[3 * i]}\t{texts[3 * i][1:]}\t{texts[3 * i + 2]}" for i in range(32)]
    triples.write_text("\n".join(lines) + "\n", encoding="utf-8")
    vectors = tmp_path / "triples.teacher"
    stage = Config(pairs_file=triples, triples=True, out=vectors, model=str(teacher_dir), progress=False)
    assert teach(stage) == 0
    over = {"loss": [{"sup_simcse": {}}, {"distill": {}}], "train.max_steps": 3}
    cfg = labels_config(tmp_path, triples, vectors, **over)
    assert run(cfg) == 0
    steps = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert len(steps) == 3
    assert all(r["distill_loss"] > 0 and math.isfinite(r["contrastive_loss"]) for r in steps)
