"""export --whitening: BERT-whitening written as stock sentence-transformers modules (Normalize -> Dense ->
Normalize) that SentenceTransformer and our own reader both apply, within the bound that the whitening's
conditioning gives (pipeline/evaluate/whitening.py: the eigenvalue floor bounds sigma_max(W))."""

import json
import shutil

import numpy as np
import pytest
from test_eval_fixtures import build_tiny_encoder

from pipeline.cli import main
from pipeline.errors import ConfigError, InputError
from pipeline.model import SentenceEncoder

SENTENCES = ["今天天气很好。", "花呗怎么还款", "一个男人在弹吉他，" * 12, "hello world 123", "好", ""]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_encoder(tmp_path_factory.mktemp("white") / "model", "mean", seed=5, max_length=24)


def export_whitened(model_dir, out, *extra):
    argv = ["export", str(model_dir), "--out", str(out), "--whitening", "--whitening-sentences", "300"]
    return main([*argv, *extra])


def round_trip_tolerance(plain_st, plain_ours, weight, bias) -> float:
    """The largest error the whitened round trip may show, from the unwhitened one and W's conditioning.

    SentenceTransformer and our reader compute the same normalised pooled vector x up to d (measured on
    the unwhitened export of the same model: the computation before the Dense is the same). With
    y = x W^T + b, |dy| <= |d| sigma_max(W) + rounding of the product (at most H u |x| sigma_max(W) with
    u = 2^-24), and normalising y at most doubles the relative error: |d y/|y|| <= 2 |dy| / |y|.
    sigma_max(W) <= 1 / sqrt(floor * S[0]) is what the eigenvalue floor guarantees; without it, a
    near-null direction makes sigma_max(W) unbounded and this bound useless.
    """
    w = weight.astype(np.float64)  # (dim, H)
    sigma_max = np.linalg.svd(w, compute_uv=False).max()
    x = plain_ours.astype(np.float64)  # (N, H), unit rows
    d = np.linalg.norm(plain_st.astype(np.float64) - x, axis=1)  # (N,)
    rounding = x.shape[1] * 2.0**-24 * np.linalg.norm(x, axis=1) * sigma_max  # (N,)
    y = np.linalg.norm(x @ w.T + bias.astype(np.float64), axis=1)  # (N,)
    return float((2 * (d * sigma_max + rounding) / y).max())


@pytest.mark.parametrize("dim", [None, 8])
def test_whitened_export_round_trips_through_sentence_transformers(model_dir, tmp_path, dim):
    from safetensors.numpy import load_file
    from sentence_transformers import SentenceTransformer

    from pipeline.evaluate.run import corpus_sentences
    from pipeline.evaluate.whitening import EIGENVALUE_FLOOR, fit_whitening

    plain = SentenceEncoder.from_pretrained(model_dir)
    whitening = fit_whitening(plain.encode(corpus_sentences(300, 0)), dim)
    out = tmp_path / "st"
    assert export_whitened(model_dir, out, *(["--whitening-dim", str(dim)] if dim else [])) == 0
    kinds = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
    assert kinds == ["Transformer", "Pooling", "Normalize", "Dense", "Normalize"]
    dense = json.loads((out / "3_Dense" / "config.json").read_text())
    assert dense["activation_function"] == "torch.nn.modules.linear.Identity"
    # the tiny random BERT's LayerNorm makes every state sum to 0: one exact null direction, dropped
    assert (dense["in_features"], dense["out_features"]) == (32, whitening.dim)
    assert whitening.dim == (dim or 31) and whitening.dropped == (0 if dim else 1)

    theirs = SentenceTransformer(str(out), device="cpu").encode(SENTENCES, batch_size=4)
    ours = SentenceEncoder.from_pretrained(out).encode(SENTENCES)
    assert theirs.shape == ours.shape == (len(SENTENCES), whitening.dim)
    assert main(["export", str(model_dir), "--out", str(tmp_path / "plain")]) == 0
    plain_st = SentenceTransformer(str(tmp_path / "plain"), device="cpu").encode(SENTENCES, batch_size=4)
    tensors = load_file(str(out / "3_Dense" / "model.safetensors"))
    tolerance = round_trip_tolerance(plain_st, plain.encode(SENTENCES), tensors["linear.weight"],
                                     tensors["linear.bias"])  # fmt: skip
    singular = np.linalg.svd(tensors["linear.weight"].astype(np.float64), compute_uv=False)
    assert singular.max() / singular.min() <= EIGENVALUE_FLOOR**-0.5 * (1 + 1e-4)  # what the floor bounds
    assert np.abs(theirs - ours).max() <= tolerance

    # and it is the whitening eval fits: (x - mu) W on the plain model's vectors, refitted here
    expected = whitening.apply(plain.encode(SENTENCES))
    assert np.abs(expected - ours).max() <= 1e-4
    assert np.abs(plain.encode(SENTENCES)[:, : ours.shape[1]] - ours).max() > 0.1  # it did change them
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "BERT-whitened" in card and "300 sentences" in card and "dropped" in card


def test_whitened_encoder_is_not_saved_as_our_folder_and_not_whitened_twice(model_dir, tmp_path, capsys):
    out = tmp_path / "st"
    assert export_whitened(model_dir, out) == 0
    encoder = SentenceEncoder.from_pretrained(out)
    with pytest.raises(ConfigError, match="Dense"):
        encoder.save_pretrained(tmp_path / "ours")
    capsys.readouterr()
    assert export_whitened(out, tmp_path / "again") == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "already ends in a Dense" in errors[0] and "Traceback" not in err
    assert main(["export", str(out), "--out", str(tmp_path / "copy")]) == 0  # re-export keeps the Dense
    a = SentenceEncoder.from_pretrained(out).encode(SENTENCES)
    b = SentenceEncoder.from_pretrained(tmp_path / "copy").encode(SENTENCES)
    assert np.abs(a - b).max() <= 1e-6


def test_dense_modules_we_cannot_reproduce_are_refused(model_dir, tmp_path):
    out = tmp_path / "st"
    assert export_whitened(model_dir, out) == 0
    relu = tmp_path / "relu"
    shutil.copytree(out, relu)
    config_path = relu / "3_Dense" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "activation_function": "torch.nn.modules.activation.ReLU"}))
    with pytest.raises(InputError, match="activation torch.nn.modules.activation.ReLU is not supported"):
        SentenceEncoder.from_pretrained(relu)

    tanh = tmp_path / "tanh"  # the Dense default activation is reproduced, and matches sentence-transformers
    shutil.copytree(out, tanh)
    config_path = tanh / "3_Dense" / "config.json"
    config_path.write_text(json.dumps({**config, "activation_function": "torch.nn.modules.activation.Tanh"}))
    from sentence_transformers import SentenceTransformer

    theirs = SentenceTransformer(str(tanh), device="cpu").encode(SENTENCES)
    assert np.abs(theirs - SentenceEncoder.from_pretrained(tanh).encode(SENTENCES)).max() <= 1e-5

    order = tmp_path / "order"  # a Dense before the Pooling is not ours to reproduce
    shutil.copytree(out, order)
    modules = json.loads((order / "modules.json").read_text())
    modules[1], modules[3] = modules[3], modules[1]
    (order / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(InputError, match="after Pooling is supported"):
        SentenceEncoder.from_pretrained(order)
