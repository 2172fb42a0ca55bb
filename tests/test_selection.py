"""Checkpoint selection on STS-B valid plus teacher agreement on training rows held out of the stream
(data.holdout_rows, train.select_on; pipeline/data/holdout.py, pipeline/train/evaluation.py)."""

import json

import numpy as np
import pytest
from _train_data import debug_config, with_teacher

from pipeline.data.holdout import HeldOut
from pipeline.errors import ConfigError
from pipeline.evaluate.agreement import teacher_agreement
from pipeline.shards import read_shard, sentence_id, shard_paths

DISTILL = {"loss": [{"distill": {}}], "data.num_variants": 0, "data.num_dropout_views": 0}


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what build() sets for the loader workers


@pytest.fixture(scope="module")
def teacher_shards(tiny_shards, tmp_path_factory):
    return with_teacher(tiny_shards([[40, 24], [32]], num_variants=0), tmp_path_factory.mktemp("t") / "t", 24)


def shard_texts(directory):
    """Every row's text, block by block in manifest order."""
    return [table.column("text").to_pylist() for path in shard_paths(directory) for table in read_shard(path)]


def test_agreement_is_100_for_the_teacher_itself_and_lower_for_noise():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((30, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    held = HeldOut([f"s{i}" for i in range(30)], vectors, "test")
    lookup = {f"s{i}": v for i, v in enumerate(vectors)}
    same = teacher_agreement(lambda texts: np.stack([lookup[t] for t in texts]), held)
    assert same["teacher_agreement_spearman"] == pytest.approx(100.0)
    assert same["teacher_cosine"] == pytest.approx(1.0)
    noise = rng.standard_normal((30, 5)).astype(np.float32)
    other = teacher_agreement(lambda texts: noise / np.linalg.norm(noise, axis=1, keepdims=True), held)
    assert abs(other["teacher_agreement_spearman"]) < 30 and "teacher_cosine" not in other  # widths differ


def test_held_out_blocks_never_reach_a_batch_and_are_what_the_score_reads(tmp_path, teacher_shards):
    from pipeline.train.build import build

    blocks = shard_texts(teacher_shards)  # blocks of 40, 24 and 32 rows
    cfg = debug_config(tmp_path, teacher_shards, **DISTILL, **{"data.holdout_rows": 20})
    t = build(cfg)
    try:
        assert t.stream.num_items == 64  # the last block (32 rows, at least 20) is out of the stream
        assert t.holdout.texts == blocks[2][:20] and t.holdout.teacher.shape == (20, 24)
        held = {sentence_id(text) for text in blocks[2]}
        batches, seen = iter(t.stream), set()
        for _ in range(2 * t.stream.batches_per_epoch):  # two epochs
            seen.update(next(batches).ids.tolist())
        assert len(seen) == 64 and not seen & held
    finally:
        t.close()


def test_selection_on_the_mean_picks_the_best_checkpoint_and_logs_both(tmp_path, teacher_shards):
    from pipeline.train.run import run

    over = {**DISTILL, "data.holdout_rows": 20, "train.select_on": "sts_b+teacher", "train.max_steps": 6,
            "train.eval_every": 2, "train.final_model": "best", "checkpoint.every_steps": 0}  # fmt: skip
    cfg = debug_config(tmp_path, teacher_shards, **{**over, "train.eval_max_pairs": 32})
    assert run(cfg) == 0
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4, 6]
    for e in evals:
        mean = (e["sts_b_valid_spearman"] + e["teacher_agreement_spearman"]) / 2
        assert e["selection_score"] == pytest.approx(mean)
        assert "teacher_cosine" not in e  # the 32-wide student, the 24-wide teacher
    best = max(evals, key=lambda e: e["selection_score"])
    (final,) = [r for r in records if r.get("event") == "final_model"]
    assert final["select_on"] == "sts_b+teacher" and final["sts_b_valid_spearman"] is None
    assert final["step"] == best["step"]
    assert final["selection_score"] == pytest.approx(best["selection_score"])


@pytest.mark.parametrize(
    "over, message",
    [
        ({"train.select_on": "sts_b+teacher"}, "set data.holdout_rows"),
        ({"data.holdout_rows": 10}, "needs batches with teacher vectors"),
    ],
)
def test_mistakes_are_one_line(tmp_path, tiny_shards, over, message):
    from pipeline.train.build import build

    shards = tiny_shards([[16], [16]], num_variants=2)
    with pytest.raises(ConfigError, match=message):
        build(debug_config(tmp_path, shards, **over))


def test_holding_out_every_block_is_refused(tmp_path, teacher_shards):
    from pipeline.train.build import build

    with pytest.raises(ConfigError, match="data.holdout_rows=90 but .* set data.holdout_rows to at most 56"):
        build(debug_config(tmp_path, teacher_shards, **DISTILL, **{"data.holdout_rows": 90}))


def test_holdout_rows_is_bounded_because_the_score_compares_every_pair(tmp_path, teacher_shards):
    with pytest.raises(ConfigError, match=r"data.holdout_rows must be in \[0, 2048\], got 5000"):
        debug_config(tmp_path, teacher_shards, **DISTILL, **{"data.holdout_rows": 5000})
