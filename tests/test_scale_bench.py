"""benchmarks/scale.py: its synthetic training shards are what the pipeline's own stages would write."""

from __future__ import annotations

import numpy as np
import pytest
from _scripts import benchmark_module

from pipeline.data.stream import index_shards
from pipeline.data.token_ids import shards_have_ids
from pipeline.shards import read_manifest, row_lengths


@pytest.fixture(scope="module")
def scale():
    with benchmark_module("scale") as module:
        yield module


def test_synthetic_ids_are_the_tokenizers_and_variants_delete_one_character(scale, tmp_path):
    from transformers import AutoTokenizer

    model = scale.tiny_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(0)
    table = scale.synthetic_block(rng, 40, np.array([3, 30, 80, 200]), teacher=True)
    rows = table.to_pylist()
    for row in rows:
        expected = tokenizer(row["text"], truncation=True, max_length=scale.MAX_LENGTH)["input_ids"]
        assert row["input_ids"] == expected
        assert len(row["variants"]) == scale.NUM_VARIANTS
        for variant, ids in zip(row["variants"], row["variant_input_ids"]):
            assert len(variant) == len(row["text"]) - 1
            assert any(row["text"][:i] + row["text"][i + 1 :] == variant for i in range(len(row["text"])))
            assert ids == tokenizer(variant, truncation=True, max_length=scale.MAX_LENGTH)["input_ids"]
        assert np.linalg.norm(np.asarray(row["teacher"], dtype=np.float32)) == pytest.approx(1, abs=2e-3)
    assert row_lengths(table).max() == scale.MAX_LENGTH  # long rows are truncated like the tokenizer does


def test_training_shards_are_accepted_by_the_trainers_checks(scale, tmp_path):
    from transformers import AutoTokenizer

    model = scale.tiny_model(tmp_path)
    out = tmp_path / "train"
    scale.training_shards(out, 9000, teacher=False, model=model, workers=1)
    assert read_manifest(out)["totals"]["sentences"] == 9000
    assert sum(b.rows for b in index_shards(out)) == 9000
    assert shards_have_ids(out, AutoTokenizer.from_pretrained(model), "", scale.MAX_LENGTH)
