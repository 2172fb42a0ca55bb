"""SentenceEncoder.encode: texts tokenised once, batched by token count, put back in input order."""

import numpy as np
import pytest
import torch
from test_eval_fixtures import build_tiny_encoder

from pipeline.model import SentenceEncoder

TEXTS = ["今天天气很好", "好", "股市大跌，投资者纷纷抛售手中的股票", "我饿了", "今天天气很好",
         "天气不错啊朋友们", "人民日报社论", "花呗怎么还款", "额度不够怎么办呢？", "延期一天"]  # fmt: skip


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    folder = build_tiny_encoder(tmp_path_factory.mktemp("enc") / "tiny", pooling="mean")
    return SentenceEncoder.from_pretrained(folder).eval()


def test_batched_encode_equals_one_text_at_a_time_in_input_order(encoder):
    batched = encoder.encode(TEXTS, batch_size=3)  # batches mix lengths: padding must not leak in
    single = np.concatenate([encoder.encode([t]) for t in TEXTS])
    np.testing.assert_allclose(batched, single, atol=1e-6)
    np.testing.assert_array_equal(batched[0], batched[4])  # a repeated text, the same row
    assert batched.dtype == np.float32 and batched.shape == (len(TEXTS), encoder.dim)


def test_encode_pads_as_the_tokenizer_does(encoder):
    """The hand-padded batches equal the tokenizer's own padded batch, row for row."""
    padded = encoder.tokenize(TEXTS)
    with torch.inference_mode():
        want = encoder(**padded).numpy()
    np.testing.assert_allclose(encoder.encode(TEXTS, batch_size=4), want, atol=1e-6)
    unpadded = encoder.tokenize(TEXTS, pad=False)
    assert [len(ids) for ids in unpadded["input_ids"]] == padded["attention_mask"].sum(1).tolist()


def test_bf16_autocast_stays_near_fp32_and_reports_batches(encoder):
    seen = []
    fp32 = encoder.encode(TEXTS, batch_size=4)
    bf16 = encoder.encode(TEXTS, batch_size=4, bf16=True, report=seen.append)
    assert seen == [4, 4, 2]
    np.testing.assert_allclose(np.linalg.norm(bf16, axis=1), 1.0, atol=1e-5)  # renormalised in fp32
    assert (bf16 * fp32).sum(1).min() > 0.99
    assert not np.array_equal(bf16, fp32)  # autocast did run


def test_encode_nothing_and_truncate(encoder):
    assert encoder.encode([]).shape == (0, encoder.dim)
    cut = encoder.encode(TEXTS[:3], truncate_dim=8)
    assert cut.shape == (3, 8)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
