"""Matryoshka widths through the export: SentenceTransformer(DIR, truncate_dim=k) and our encoder give the
same re-normalised prefixes, and the model card lists the trained widths with their scores."""

import json
import re

import numpy as np
import pytest
import yaml
from test_eval_fixtures import build_fake_run, tiny_model  # noqa: F401 (fixture)

from pipeline.cli import main
from pipeline.model.encoder import SentenceEncoder

SENTENCES = ["花呗怎么还款", "花呗如何还钱", "今天天气怎么样", "一个男人在弹吉他，旁边有一只狗在睡觉。", "好"]


def _eval(model, out, dims):
    argv = ["eval", str(model), "--max-pairs", "40", "--out", str(out), "--progress", "false"]
    assert main([*argv, "--suite", "sts", "--suite", "probe", "--dims", dims]) == 0
    return json.loads((out / "eval.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("k", [32, 16, 8])
def test_truncate_dim_in_sentence_transformers_equals_our_encoder(tiny_model, tmp_path, k):  # noqa: F811
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "st"
    argv = ["export", str(tiny_model), "--out", str(out), "--matryoshka-dims", "32,16,8"]
    assert main(argv) == 0
    ours = SentenceEncoder.from_pretrained(tiny_model).encode(SENTENCES, truncate_dim=k)
    st = SentenceTransformer(str(out), device="cpu", truncate_dim=k)
    theirs = st.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True)
    assert theirs.shape == ours.shape == (len(SENTENCES), k)
    assert np.abs(theirs - ours).max() <= 1e-5
    # without normalize_embeddings the prefix is not unit length, but model.similarity is the cosine
    raw = st.encode(SENTENCES, convert_to_numpy=True)
    assert k == 32 or np.abs(np.linalg.norm(raw, axis=1) - 1).max() > 1e-3
    np.testing.assert_allclose(st.similarity(raw, raw).numpy(), ours @ ours.T, atol=1e-5)
    # and our own loader reads the exported folder with the same prefixes
    exported = SentenceEncoder.from_pretrained(out).encode(SENTENCES, truncate_dim=k)
    assert np.abs(exported - ours).max() <= 1e-5


def test_card_lists_the_run_s_trained_dims_with_their_scores(tiny_model, tmp_path):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    config["loss"] = [
        {"distill": {"loss": "cosine"}, "weight": 1.0},
        {
            "matryoshka": {"dims": [16, 8], "weights": [1.0, 1.0], "of": [], "temperature": 0.05},
            "weight": 1.0,
        },
    ]
    for path in [run / "config.yaml", *run.glob("checkpoints/step-*/config.yaml")]:
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
    result = _eval(
        run / "checkpoints" / "step-00000020", run / "checkpoints" / "step-00000020" / "eval", "32,16,8"
    )
    out = tmp_path / "st"
    assert main(["export", str(run), "--out", str(out)]) == 0
    card = (out / "README.md").read_text(encoding="utf-8")
    section = card.split("## Matryoshka dimensions")[1].split("## Evaluation")[0]
    assert "for k in 32, 16, 8" in section and "truncate_dim=16" in section
    for k in ("32", "16", "8"):
        avg5 = result["dims"][k]["sts"]["avg5"]
        accuracy = result["dims"][k]["probe"]["accuracy"]
        assert re.search(rf"\| {k} \| {avg5:.2f} \| {accuracy:.2f} \|", section), section
    assert "matryoshka" in card.split("---")[1]  # a tag of the card's metadata, as every trained term


def test_card_without_per_width_scores_says_how_to_get_them(tiny_model, tmp_path):  # noqa: F811
    out = tmp_path / "st"
    argv = ["export", str(tiny_model), "--out", str(out), "--matryoshka-dims", "8,32", "--verify", "false"]
    assert main(argv) == 0
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "eval CHECKPOINT --dims 32,8" in card
    # a model without the term and without --matryoshka-dims has no such section
    plain = tmp_path / "plain"
    assert main(["export", str(tiny_model), "--out", str(plain), "--verify", "false"]) == 0
    assert "Matryoshka" not in (plain / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "extra, message",
    [(["--matryoshka-dims", "64,16"], r"--matryoshka-dims \[64\]: the model's embeddings are 32-d"),
     (["--matryoshka-dims", "16", "--whitening", "--whitening-sentences", "50"], "rotates the space"),
     (["--matryoshka-dims", "16,0"], "'0' is not a width")],
)  # fmt: skip
def test_export_bad_dims_are_one_line(tiny_model, tmp_path, capsys, extra, message):  # noqa: F811
    code = main(["export", str(tiny_model), "--out", str(tmp_path / "st"), *extra])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and re.search(message, errors[0])
    assert not (tmp_path / "st").exists()
