"""export --onnx / --onnx-int8: files where sentence-transformers' ONNX backend looks, with optimum's I/O
names, checked against PyTorch at export; the torch-free encoder reproduces the PyTorch vectors."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from test_eval_fixtures import build_tiny_encoder

from pipeline.cli import main
from pipeline.model import SentenceEncoder

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

SENTENCES = ["今天天气很好。", "花呗怎么还款", "一个男人在弹吉他，" * 12, "hello world 123", "好"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    model = build_tiny_encoder(root / "model", "mean", seed=2, max_length=24)
    out = root / "st"
    assert main(["export", str(model), "--out", str(out), "--onnx-int8", "--onnx-sentences", "50"]) == 0
    return out


def test_files_io_names_and_card(exported):
    import onnx

    for name in ("onnx/model.onnx", "onnx/model_qint8_avx512_vnni.onnx"):
        graph = onnx.load(str(exported / name)).graph
        inputs = [i.name for i in graph.input]
        assert inputs[:2] == ["input_ids", "attention_mask"] and set(inputs) <= {
            "input_ids", "attention_mask", "token_type_ids"}  # fmt: skip
        assert [o.name for o in graph.output] == ["last_hidden_state"]
        dims = graph.input[0].type.tensor_type.shape.dim
        assert [d.dim_param for d in dims] == ["batch_size", "sequence_length"]  # dynamic axes
    card = (exported / "README.md").read_text(encoding="utf-8")
    assert "## ONNX" in card and "model_qint8_avx512_vnni.onnx" in card and "- onnxruntime: " in card
    from pipeline.export.onnx_export import vnni

    # what the int8 file needs, and the kernels its cosine was measured with: this CPU's
    assert "onnxruntime runs it on any x86-64 CPU with AVX2" in card
    assert f"Its cosine above was measured on a CPU with {vnni()}." in card


def test_the_int8_check_names_the_cpus_int8_instructions(monkeypatch):
    import torch

    from pipeline.export.onnx_export import vnni

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_vnni": True, "avx_vnni": False})
    assert vnni() == "AVX512-VNNI"
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    assert vnni() == "no VNNI (AVX2's 16-bit sums)"


def test_onnx_encoder_matches_pytorch(exported):
    from pipeline.export.onnx_encode import INT8_FILE, OnnxEncoder

    ours = SentenceEncoder.from_pretrained(exported).encode(SENTENCES)
    fp32 = OnnxEncoder(exported).encode(SENTENCES, batch_size=2)  # padding differs per batch: masks must work
    assert fp32.shape == ours.shape
    assert (fp32 * ours).sum(axis=1).min() >= 0.9999 and np.abs(fp32 - ours).max() <= 1e-4
    int8 = OnnxEncoder(exported, INT8_FILE).encode(SENTENCES)
    assert (int8 * ours).sum(axis=1).min() >= 0.95  # lossy, but close
    assert np.abs(int8 - ours).max() > 0  # and it is really another model


def test_onnx_encode_imports_no_torch(exported):
    code = (
        "import sys; from pipeline.export.onnx_encode import OnnxEncoder; "
        f"v = OnnxEncoder({str(exported)!r}).encode(['今天天气很好']); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(v.shape)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 32)"


@pytest.mark.skipif(importlib.util.find_spec("optimum") is None, reason="sentence-transformers' ONNX backend "
                    "needs optimum, which cannot be installed beside transformers 5 here")  # fmt: skip
def test_sentence_transformers_onnx_backend_loads_it(exported):
    from sentence_transformers import SentenceTransformer

    theirs = SentenceTransformer(str(exported), backend="onnx", device="cpu").encode(SENTENCES)
    ours = SentenceEncoder.from_pretrained(exported).encode(SENTENCES)
    assert (theirs * ours).sum(axis=1).min() >= 0.9999


def test_first_last_avg_is_refused_in_one_line(tmp_path, capsys):
    model = build_tiny_encoder(tmp_path / "m", "first_last_avg")
    assert main(["export", str(model), "--out", str(tmp_path / "st"), "--onnx"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "first_last_avg" in errors[0] and not (tmp_path / "st").exists()


def test_settings_are_recorded(exported):
    settings = json.loads((exported / "config_sentence_transformers.json").read_text())
    assert settings["similarity_fn_name"] == "cosine"
