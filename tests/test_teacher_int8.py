"""`teacher --dtype int8`: int8 vectors with a per-row scale beside float16 -- the round-trip error, the
bytes a row, the stage and its manifest, converting a float16 set, the training batches and the refusal
of a dtype this version does not know. Tiny model and shards, as tests/test_teacher.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from _train_data import debug_config, debug_luse, make_shards
from test_teacher import BLOCKS, MINE, build_teacher, table, teach

from pipeline.data.plan import recorded_teacher
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json
from pipeline.shards import read_manifest, read_shard, read_shard_set
from pipeline.vectors import block_teacher, encode_vectors, teacher_matrix, variant_matrices

DIM = 24


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return build_teacher(tmp_path_factory.mktemp("teacher") / "tiny-teacher")


@pytest.fixture(scope="module")
def sets(tmp_path_factory, teacher_dir) -> dict[str, Path]:
    """The same augmented shards encoded in float16 and in int8 (variants, 3 mined negatives), and the
    float16 set converted to int8."""
    root = tmp_path_factory.mktemp("int8")
    make_shards(root / "aug", BLOCKS, num_variants=3)
    teach(root / "aug", root / "fp16", teacher_dir, **MINE)
    teach(root / "aug", root / "int8", teacher_dir, dtype="int8", **MINE)
    teach(root / "fp16", root / "converted", "", dtype="int8")
    return {
        "aug": root / "aug",
        "fp16": root / "fp16",
        "int8": root / "int8",
        "converted": root / "converted",
    }


def e5_like(n: int, dim: int = 384, seed: int = 0) -> np.ndarray:
    """Unit vectors shaped like e5's: a large shared direction (pair cosines ~0.8, as e5's on our text),
    uneven spread across dimensions and heavy tails (Student t, 3 degrees of freedom), which is what
    sets a row's int8 scale and so its rounding error."""
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(dim)
    spread = np.exp(rng.normal(0, 0.7, dim))
    v = 3.0 * common / np.linalg.norm(common) + rng.standard_t(3, (n, dim)) * spread / np.sqrt(3 * dim)
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# --------------------------------------------------------------------------------------------- encoding
def test_int8_round_trip_keeps_the_direction_and_returns_unit_rows():
    vectors = e5_like(4000)
    pair = vectors[:200] @ vectors[:200].T
    upper = np.triu_indices(200, 1)
    assert 0.75 < np.median(pair[upper]) < 0.9  # e5-like: high, narrow pair cosines
    codes, scale = encode_vectors(vectors, "int8")
    assert codes.type == pa.list_(pa.int8(), 384) and scale.type == pa.float32()
    q = codes.flatten().to_numpy().reshape(-1, 384).astype(np.int32)
    assert np.all(np.abs(q).max(axis=1) == 127)  # s = max|v|: the largest value of a row is +-127
    np.testing.assert_allclose(scale.to_numpy(), np.abs(vectors).max(axis=1), rtol=1e-7)
    decoded = teacher_matrix(codes, scale)  # (N, 384) float32
    half = teacher_matrix(encode_vectors(vectors, "float16")[0])
    assert decoded.dtype == np.float32 and decoded.shape == (4000, 384)
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=1), 1.0, atol=1e-6)  # re-normalised
    assert cosines(decoded, half).min() >= 0.999
    assert cosines(decoded, vectors).min() >= 0.999
    # the pair cosines a KL target sees move by far less than their spread (5th-95th pct: 0.72-0.86)
    moved = np.abs(decoded[:200] @ decoded[:200].T - pair)[upper]
    assert moved.max() < 5e-3 and moved.mean() < 1e-3
    # an all-zero row stays zero (no division by its zero scale)
    zero = teacher_matrix(*encode_vectors(np.zeros((2, 8), np.float32), "int8"))
    assert np.array_equal(zero, np.zeros((2, 8), np.float32))


def test_bytes_per_row_of_each_dtype():
    vectors = e5_like(1000)
    half, none = encode_vectors(vectors, "float16")
    codes, scale = encode_vectors(vectors, "int8")
    assert none is None
    assert half.nbytes / 1000 == 2 * 384 == 768
    assert (codes.nbytes + scale.nbytes) / 1000 == 384 + 4 == 388


# --------------------------------------------------------------------------------------------- the stage
def test_stage_writes_int8_columns_and_the_manifest_says_so(sets):
    fp16, int8 = table(sets["fp16"]), table(sets["int8"])
    assert int8.schema.field("teacher").type == pa.list_(pa.int8(), DIM)
    assert int8.schema.field("teacher_scale").type == pa.float32()
    assert int8.schema.field("teacher_variants").type == pa.list_(pa.list_(pa.int8(), DIM))
    assert int8.schema.field("teacher_variant_scales").type == pa.list_(pa.float32())
    assert "teacher_scale" not in fp16.column_names and "teacher_variant_scales" not in fp16.column_names
    assert int8.column("id").equals(fp16.column("id")) and int8.column("text").equals(fp16.column("text"))
    got, want = block_teacher(int8), block_teacher(fp16)
    assert cosines(got, want).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    variants_got, variants_want = variant_matrices(int8), variant_matrices(fp16)
    assert [len(v) for v in variants_got] == [len(v) for v in int8.column("variants").to_pylist()]
    assert cosines(np.concatenate(variants_got), np.concatenate(variants_want)).min() >= 0.999
    assert sum(len(n) > 0 for n in int8.column("hard_negatives").to_pylist()) > 0.7 * int8.num_rows

    m16, m8 = read_manifest(sets["fp16"]), read_manifest(sets["int8"])
    assert m16["teacher"]["dtype"] == "float16" and m8["teacher"]["dtype"] == "int8"
    assert {k: v for k, v in m8["teacher"].items() if k != "dtype"} == {
        k: v for k, v in m16["teacher"].items() if k != "dtype"
    }
    assert "dtype" not in m16["config"] and m16["config"] == m8["config"]  # recorded once, as teacher.dtype
    # in the shards' blocks: 1 byte a value + 4 a row instead of 2 bytes a value
    assert fp16.column("teacher").nbytes == 2 * DIM * fp16.num_rows
    assert int8.column("teacher").nbytes + int8.column("teacher_scale").nbytes == (DIM + 4) * int8.num_rows


def test_converting_a_float16_set_keeps_every_other_column(sets, teacher_dir, tmp_path):
    fp16, converted, direct = table(sets["fp16"]), table(sets["converted"]), table(sets["int8"])
    assert converted.schema == direct.schema  # the same columns, in the same order, as encoding in int8
    for name in ("id", "text", "variants", "hard_negatives", "hard_negative_ids"):
        assert converted.column(name).equals(fp16.column(name)), name
    for a, b in zip(
        read_shard(sets["fp16"] / "shard-000001.tar"), read_shard(sets["converted"] / "shard-000001.tar")
    ):
        assert a.num_rows == b.num_rows  # same blocks
    assert cosines(block_teacher(converted), block_teacher(fp16)).min() >= 0.999
    assert cosines(block_teacher(converted), block_teacher(direct)).min() >= 0.9999
    manifest, source = read_manifest(sets["converted"]), read_manifest(sets["fp16"])
    assert manifest["teacher"] == {**source["teacher"], "dtype": "int8"}
    assert manifest["hard_negatives"] == source["hard_negatives"]
    assert manifest["counts"] == source["counts"] and manifest["input_stage"] == "teacher"
    teach(sets["fp16"], sets["converted"], "", dtype="int8")  # finished: a rerun does nothing
    with pytest.raises(ConfigError, match="converts float16 to --dtype int8 only"):
        teach(sets["converted"], tmp_path / "again", "", dtype="int8")
    with pytest.raises(ConfigError, match="is not the teacher of"):
        teach(sets["fp16"], tmp_path / "other", str(build_teacher(tmp_path / "other-teacher", seed=1)),
              dtype="int8")  # fmt: skip
    with pytest.raises(ConfigError, match="--model TEACHER"):
        teach(sets["aug"], tmp_path / "no-model", "", dtype="int8")


# --------------------------------------------------------------------------------------------- training
def test_both_dtypes_give_the_same_training_batches(sets, tmp_path):
    from pipeline.train.build import build
    from pipeline.train.loop import train_step

    batches = {}
    for dtype in ("fp16", "int8"):
        cfg = debug_config(tmp_path / dtype, sets[dtype], **{
            "data.teacher": "tiny-teacher", "data.num_workers": 0, "data.teacher_dim": DIM,
            "loss": [*debug_luse(queue_size=0), {"distill": {}}],
        })  # fmt: skip
        t = build(cfg)
        batch = next(iter(t.stream))
        batches[dtype] = batch
        assert batch.teacher.dtype == torch.float32 and batch.teacher.shape[1] == DIM
        out = train_step(t, batch)
        assert torch.isfinite(out["distill_loss"])
        t.close()
    half, int8 = batches["fp16"], batches["int8"]
    assert torch.equal(half.ids, int8.ids)  # the same rows: the int8 set has the same blocks
    torch.testing.assert_close(int8.teacher.norm(dim=1), torch.ones(len(int8.ids)), atol=1e-6, rtol=0)
    assert torch.nn.functional.cosine_similarity(int8.teacher, half.teacher).min() >= 0.999


# --------------------------------------------------------------------------------------------- refusals
def test_a_dtype_this_version_does_not_know_is_one_line(sets, tmp_path):
    import shutil

    future = tmp_path / "future"
    shutil.copytree(sets["int8"], future)
    manifest = read_manifest(future)
    manifest["teacher"]["dtype"] = "int4"
    atomic_write_json(future / "manifest.json", manifest)
    with pytest.raises(InputError, match="stored as 'int4', which this version cannot read") as caught:
        recorded_teacher(read_shard_set(future), "tiny-teacher")
    assert "\n" not in str(caught.value)
    with pytest.raises(InputError, match="int4"):
        teach(future, tmp_path / "conv", "", dtype="int8")
    # a column of another value type (e.g. float32 vectors) is refused where it is decoded
    floats = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(48, np.float32)), DIM)
    with pytest.raises(InputError, match="stored as float: this version reads float16 or int8"):
        teacher_matrix(floats)
    codes, _ = encode_vectors(e5_like(2, DIM), "int8")
    with pytest.raises(InputError, match="without their scale column"):
        teacher_matrix(codes)
    with pytest.raises(ConfigError, match="--dtype"):
        teach(sets["aug"], tmp_path / "x", "m", dtype="int4")


def test_the_readme_snippet_reads_int8_vectors(sets, monkeypatch):
    """shards/README.md's pyarrow-only reader decodes int8 as our decoder does."""
    readme = (Path(__file__).resolve().parents[1] / "shards" / "README.md").read_text(encoding="utf-8")
    snippet = next(c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "teacher" in c)
    monkeypatch.chdir(sets["int8"])
    scope: dict = {}
    exec(snippet, scope)
    last = list(read_shard(sets["int8"] / "shard-000000.tar"))[-1]  # the snippet's loop ends on it
    np.testing.assert_allclose(scope["vectors"], block_teacher(last), atol=1e-7)


def test_the_study_row_trains_on_the_int8_copy_at_equal_compute(sets, tmp_path):
    """benchmarks/quality.py's s_distill_int8: the main job's row on the converted set, nothing else."""
    import argparse

    from _scripts import benchmark_module

    with benchmark_module("quality") as quality:
        args = argparse.Namespace(
            shards=sets["fp16"], sequences=64, eval_every=25, select_best=True, student=tmp_path / "student"
        )
        rows = quality.student_conditions()
        plain = quality.train_command(args, rows["s_distill"], 1, tmp_path / "a", 100)
        int8 = quality.train_command(args, rows["s_distill_int8"], 1, tmp_path / "b", 100)
        assert f"--data.shards={sets['fp16']}" in plain
        assert f"--data.shards={sets['fp16'].parent / 'fp16-int8'}" in int8
        differ = {a for a in plain if a not in int8} | {b for b in int8 if b not in plain}
        assert {d.split("=")[0] for d in differ} == {"--data.shards", "--run_dir"}
        quality.ensure_int8_shards(args)  # converts --shards once, without the model
        assert read_manifest(sets["fp16"].parent / "fp16-int8")["teacher"]["dtype"] == "int8"
