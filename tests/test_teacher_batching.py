"""The teacher stage's batching: texts tokenised once and batched by token count write the same vectors,
in the same rows, as the per-batch tokenisation of character-sorted texts it replaced (fp32 and bf16)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from test_teacher import build_teacher, teach

from pipeline.model import SentenceEncoder
from pipeline.shards import read_manifest, read_shard
from pipeline.stages.teacher.run import encode_texts
from pipeline.vectors import teacher_matrix


def char_sorted_reference(encoder, texts: list[str], batch_size: int, bf16: bool) -> np.ndarray:
    """The stage's encoding before it batched by token count (commit 80883ac), kept here as the yardstick."""
    out = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    order = np.argsort([-len(t) for t in texts], kind="stable")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.inference_mode(), autocast:
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            batch = encoder.tokenize([texts[i] for i in idx])
            out[idx] = F.normalize(encoder(**batch).float(), dim=-1).numpy()
    return out


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return build_teacher(tmp_path_factory.mktemp("teacher") / "tiny-teacher")


@pytest.mark.parametrize("precision, atol", [("fp32", 1e-6), ("bf16", 2e-2)])
def test_token_count_batches_equal_the_char_sorted_batches(teacher, precision, atol):
    from pipeline.resources import sample_sentences

    encoder = SentenceEncoder.from_pretrained(teacher).eval()
    texts = sample_sentences(300)
    got = encode_texts(encoder, texts, 16, precision)
    want = char_sorted_reference(encoder, texts, 16, precision == "bf16")
    np.testing.assert_allclose(got, want, atol=atol)  # bf16: batch shapes differ, rounding does too
    assert (got * want).sum(1).min() > (1 - 1e-6 if precision == "fp32" else 0.999)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_the_stage_writes_the_reference_vectors_in_row_order(tmp_path, teacher):
    from _train_data import make_shards

    shards = tmp_path / "aug"
    make_shards(shards, [[40, 24], [32]], num_variants=2)
    out = tmp_path / "out"
    teach(shards, out, teacher)
    encoder = SentenceEncoder.from_pretrained(teacher).eval()
    for entry in read_manifest(out)["shards"]:
        table = pa.concat_tables(read_shard(out / entry["name"]))
        texts = table.column("text").to_pylist()
        want = char_sorted_reference(encoder, texts, 16, bf16=False).astype(np.float16)
        np.testing.assert_allclose(teacher_matrix(table.column("teacher")), want, atol=1e-3)
        assert (teacher_matrix(table.column("teacher")) == want.astype(np.float32)).mean() > 0.99
