"""``eval --dims``: STS and the probe on re-normalised prefixes of one encoding, and the encoder's
``truncate_dim``."""

import json
import re

import numpy as np
import pytest
from test_eval_fixtures import tiny_model  # noqa: F401 (fixture)

from pipeline.cli import main
from pipeline.errors import ConfigError
from pipeline.evaluate.sts import load_sts_sets, pair_cosine, spearman100
from pipeline.model.encoder import SentenceEncoder, truncate_normalise


def _argv(model, out, *extra):
    return ["eval", str(model), "--max-pairs", "40", "--out", str(out), "--progress", "false", *extra]


def test_eval_dims_scores_each_prefix(tiny_model, tmp_path, capsys):  # noqa: F811
    argv = _argv(tiny_model, tmp_path / "out", "--suite", "sts", "--suite", "probe", "--dims", "8,32,16")
    assert main(argv) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text(encoding="utf-8"))
    assert list(result["dims"]) == ["32", "16", "8"]  # largest first
    assert result["config"]["dims"] == [32, 16, 8]
    # the full width is the model's own row; a prefix of 8 is not
    assert result["dims"]["32"]["sts"] == result["sts"]["model"]
    assert result["dims"]["32"]["probe"] == {k: v for k, v in result["probe"].items() if k != "data"}
    assert result["dims"]["8"]["sts"] != result["sts"]["model"]
    # the 8-d score by hand: the first 8 dims, re-normalised, then cosine and Spearman
    encoder = SentenceEncoder.from_pretrained(tiny_model)
    stsb = next(s for s in load_sts_sets(["STS-B"])).subsample(40, 0)
    v1 = encoder.encode(stsb.sentence1)[:, :8]
    v2 = encoder.encode(stsb.sentence2)[:, :8]
    v1 /= np.linalg.norm(v1, axis=1, keepdims=True)
    v2 /= np.linalg.norm(v2, axis=1, keepdims=True)
    by_hand = spearman100(pair_cosine(v1, v2), stsb.labels)
    assert result["dims"]["8"]["sts"]["STS-B"] == pytest.approx(by_hand, abs=1e-6)
    five = [result["dims"]["16"]["sts"][n] for n in ("ATEC", "BQ", "LCQMC", "PAWSX", "STS-B")]
    assert result["dims"]["16"]["sts"]["avg5"] == pytest.approx(np.mean(five))
    assert 0 <= result["dims"]["8"]["probe"]["accuracy"] <= 100
    md = (tmp_path / "out" / "eval.md").read_text(encoding="utf-8")
    assert "Matryoshka dimensions" in md and "| 16 |" in md and "probe accuracy" in md
    assert "| 8 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "dims, message",
    [("64,16", r"--dims \[64\]: the model's embeddings are 32-d"), ("16,x", "'x' is not a width"),
     ("16,16", "repeats a width")],
)  # fmt: skip
def test_eval_bad_dims_are_one_line(tiny_model, tmp_path, capsys, dims, message):  # noqa: F811
    code = main(_argv(tiny_model, tmp_path / "out", "--suite", "sts", "--dims", dims))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1
    assert re.search(message, errors[0])


def test_encode_truncate_dim_is_the_renormalised_prefix(tiny_model):  # noqa: F811
    encoder = SentenceEncoder.from_pretrained(tiny_model)
    texts = ["花呗怎么还款", "花呗如何还钱", "今天天气怎么样"]
    full = encoder.encode(texts)
    short = encoder.encode(texts, truncate_dim=12)
    assert short.shape == (3, 12) and np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-6)
    np.testing.assert_allclose(
        short, full[:, :12] / np.linalg.norm(full[:, :12], axis=1, keepdims=True), atol=1e-7
    )
    assert truncate_normalise(full, None) is full
    with pytest.raises(ConfigError, match="truncate_dim 33: the embeddings are 32-d"):
        encoder.encode(texts, truncate_dim=33)


def test_dims_forms_of_the_command_line():
    from pipeline.evaluate.run import parse_dims

    assert parse_dims(["384,128"], "--dims") == [384, 128]  # --dims 384,128
    assert parse_dims(128, "--dims") == [128]  # --dims 128 (YAML reads an int)
    assert parse_dims([64, "256"], "--dims") == [256, 64]  # repeated flags, any order
