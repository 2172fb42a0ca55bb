"""Dynamic int8 inference (pipeline/model/int8.py) and the teacher stage's ``--precision int8``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny_models import build_char_encoder

from pipeline.errors import ConfigError
from pipeline.model.int8 import int8_layers, quantize_int8
from pipeline.resources import sample_sentences
from pipeline.shards import read_manifest, read_shard
from pipeline.stages.teacher.run import Config, precision_for, run
from pipeline.vectors import teacher_matrix

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    texts = sample_sentences(2000)
    folder = tmp_path_factory.mktemp("int8") / "teacher"
    return build_char_encoder(folder, texts, 32, 64, 96, seed=3, max_length=64)


def test_every_linear_layer_but_the_narrowing_ones_is_chosen(teacher_dir):
    from pipeline.model import SentenceEncoder

    backbone = SentenceEncoder.from_pretrained(teacher_dir).backbone
    chosen = set(int8_layers(backbone))
    every = {n for n, m in backbone.named_modules() if isinstance(m, torch.nn.Linear)}
    # BERT's layers: query, key, value, attention.output.dense (32 -> 32), intermediate.dense (32 -> 64)
    # are chosen; output.dense (64 -> 32), the feed-forward's second layer, is not
    narrowing = {n for n in every if n.endswith(".output.dense") and ".attention." not in n}
    assert narrowing and chosen == every - narrowing
    assert {n.rsplit(".", 1)[-1] for n in chosen} >= {"query", "key", "value", "dense"}
    quantized, count = quantize_int8(backbone)
    assert count == len(chosen)
    kinds = {n: m._get_name() for n, m in quantized.named_modules() if n in every}
    assert all(kinds[n] == "DynamicQuantizedLinear" for n in chosen)
    assert all(kinds[n] == "Linear" for n in narrowing)


def test_int8_vectors_stay_close_to_fp32_and_repeat_exactly(teacher_dir):
    from pipeline.model import SentenceEncoder

    texts = sample_sentences(300)
    fp32 = SentenceEncoder.from_pretrained(teacher_dir).encode(texts)
    encoder = SentenceEncoder.from_pretrained(teacher_dir)
    quantize_int8(encoder.backbone)
    first, second = encoder.encode(texts), encoder.encode(texts)
    np.testing.assert_array_equal(first, second)
    cosines = (first * fp32).sum(axis=1)
    assert cosines.min() > 0.98, cosines.min()
    assert not np.array_equal(first, fp32)  # int8 did run


def encode_in_subprocess(teacher_dir: Path, out: Path, env: dict[str, str]) -> np.ndarray:
    code = (
        "import sys, numpy as np\n"
        "from pipeline.model import SentenceEncoder\n"
        "from pipeline.model.int8 import quantize_int8\n"
        "from pipeline.resources import sample_sentences\n"
        "e = SentenceEncoder.from_pretrained(sys.argv[1]); quantize_int8(e.backbone)\n"
        "np.save(sys.argv[2], e.encode(sample_sentences(200)))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(teacher_dir), str(out)], check=True, cwd=REPO,
                   env={**os.environ, **env}, timeout=300)  # fmt: skip
    return np.load(out)


def test_int8_vectors_do_not_depend_on_the_instruction_set(teacher_dir, tmp_path):
    """FBGEMM held to AVX2 gives what its AVX-512 / VNNI kernels give, so a teacher set encoded on one
    CPU matches another's (on a CPU with AVX2 only both runs take the same kernels)."""
    native = encode_in_subprocess(teacher_dir, tmp_path / "native.npy", {})
    avx2 = encode_in_subprocess(teacher_dir, tmp_path / "avx2.npy", {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"})
    np.testing.assert_allclose(native, avx2, atol=1e-6)


def test_the_teacher_stage_in_int8(tmp_path, teacher_dir, caplog):
    from _train_data import make_shards

    from pipeline.model import SentenceEncoder

    shards = tmp_path / "aug"
    make_shards(shards, [[40, 24], [30]])
    cfg = Config(shards=shards, out=tmp_path / "t8", model=str(teacher_dir), precision="int8", progress=False)
    with caplog.at_level("INFO"):
        assert run(cfg) == 0
    assert "computing in int8 on cpu (--precision=int8: dynamic int8 linear layers" in caplog.text
    manifest = read_manifest(cfg.out)
    assert manifest["teacher"]["compute_precision"] == "int8"
    blocks = [b for e in manifest["shards"] for b in read_shard(cfg.out / e["name"])]
    texts = [t for b in blocks for t in b.column("text").to_pylist()]
    got = np.concatenate([teacher_matrix(b.column("teacher")) for b in blocks])
    encoder = SentenceEncoder.from_pretrained(teacher_dir)
    quantize_int8(encoder.backbone)
    np.testing.assert_allclose(got, encoder.encode(texts), atol=2e-3)  # float16 storage
    assert "sentences/s, int8)" in caplog.text  # each shard's line
    assert json.loads(json.dumps(manifest["config"]))["precision"] == "int8"


def test_int8_is_a_cpu_option():
    assert precision_for("cpu", "int8") == "int8"
    with pytest.raises(ConfigError, match="--precision int8 is a CPU option"):
        precision_for("cuda", "int8")
