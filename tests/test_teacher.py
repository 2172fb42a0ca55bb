"""`python -m pipeline teacher`: the teacher column, manifest, restarts and tasks, hard negatives, the
trainer's checks and the collator's layout; on a tiny model built here and tiny shards."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from _tiny_models import build_char_encoder
from _train_data import debug_config, debug_luse

from pipeline.data.plan import recorded_teacher
from pipeline.errors import ConfigError, InputError
from pipeline.resources import sample_sentences
from pipeline.shards import read_manifest, read_shard, read_shard_set
from pipeline.stages.teacher import run as teacher_run
from pipeline.stages.teacher.negatives import MineParams, Pool, select_negatives
from pipeline.stages.teacher.run import Config, run
from pipeline.train.plan import check_against_data
from pipeline.vectors import teacher_matrix

PREFIX = "问："
BLOCKS = [[40, 24], [32], [30, 10]]
# a random tiny teacher puts most pairs at cosine 0.91-0.99: a ceiling of 0.97, a search of every row
MINE = dict(variants=True, hard_negatives=3, hn_depth=200, hn_max_similarity=0.97)


def build_teacher(directory: Path, hidden_size: int = 24, seed: int = 0) -> Path:
    texts = sample_sentences(3000) + [PREFIX]
    return build_char_encoder(directory, texts, hidden_size, 48, 96, seed, max_length=64, prefix=PREFIX)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return build_teacher(tmp_path_factory.mktemp("teacher") / "tiny-teacher")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from _train_data import make_shards

    directory = tmp_path_factory.mktemp("aug")
    make_shards(directory, BLOCKS, num_variants=3)
    return directory


def teach(shards: Path, out: Path, model: Path, **fields) -> Config:
    cfg = Config(shards=shards, out=out, model=str(model), batch_size=16, progress=False, **fields)
    assert run(cfg) == 0
    return cfg


@pytest.fixture(scope="module")
def taught(tmp_path_factory, shards, teacher_dir) -> Path:
    """The stage with variants and 3 hard negatives, once for the module."""
    out = tmp_path_factory.mktemp("taught") / "out"
    teach(shards, out, teacher_dir, **MINE)
    return out


def table(directory: Path) -> pa.Table:
    manifest = read_manifest(directory)
    return pa.concat_tables(b for e in manifest["shards"] for b in read_shard(directory / e["name"]))


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*.tar"))}


# --------------------------------------------------------------------------------------------- the stage
def test_teacher_column_equals_encode_and_keeps_rows_and_blocks(taught, shards, teacher_dir):
    from pipeline.model import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(teacher_dir)
    assert encoder.prefix == PREFIX
    out, original = table(taught), table(shards)
    assert out.column("id").equals(original.column("id")) and out.column("text").equals(
        original.column("text")
    )
    for name in read_manifest(shards)["shards"]:
        a, b = read_shard(shards / name["name"]), read_shard(taught / name["name"])
        assert [t.num_rows for t in a] == [t.num_rows for t in b]  # same blocks
    assert out.schema.field("teacher").type == pa.list_(pa.float16(), 24)
    got = teacher_matrix(out.column("teacher"))  # (N, 24)
    want = encoder.encode(out.column("text").to_pylist())
    np.testing.assert_allclose(got, want, atol=2e-3)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=2e-3)
    # teacher_variants: one vector per cached variant, equal to encoding the variant
    variants = out.column("variants").to_pylist()
    nested = out.column("teacher_variants").to_pylist()
    assert [len(v) for v in nested] == [len(v) for v in variants]
    row = next(i for i, v in enumerate(variants) if len(v) == 3)
    np.testing.assert_allclose(np.asarray(nested[row], np.float32), encoder.encode(variants[row]), atol=2e-3)


def test_manifest_records_the_teacher(taught, teacher_dir, shards):
    from pipeline.stages.teacher.identity import model_hash

    manifest = read_manifest(taught)
    t = manifest["teacher"]
    assert manifest["stage"] == "teacher"
    assert t["name"] == str(teacher_dir) and t["path"] == str(teacher_dir.resolve())
    assert t["hash"] == model_hash(teacher_dir)[0] and len(t["hash"]) == 64
    assert (t["pooling"], t["prefix"], t["dim"], t["max_length"], t["dtype"]) == (
        "mean",
        PREFIX,
        24,
        64,
        "float16",
    )
    assert t["compute_precision"] == "fp32"
    n = sum(sum(b) for b in BLOCKS)
    assert manifest["totals"]["sentences"] == manifest["counts"]["sentences"] == n
    assert manifest["hard_negatives"]["k"] == 3 and manifest["counts"]["hard_negatives"]["sentences"] == n
    assert manifest["input_config"] == read_manifest(shards)["config"]
    assert not (taught / teacher_run.WORK_DIR).exists()
    # a changed weight file changes the hash
    other = build_teacher(taught.parent / "other", seed=1)
    assert model_hash(other)[0] != t["hash"]


def test_two_tasks_and_a_killed_run_give_identical_shards(tmp_path, shards, teacher_dir, taught, monkeypatch):
    fields = MINE
    for task in (0, 1):
        teach(shards, tmp_path / "two", teacher_dir, task_index=task, num_tasks=2, **fields)
    assert shard_bytes(tmp_path / "two") == shard_bytes(taught)
    assert read_manifest(tmp_path / "two")["shards"] == read_manifest(taught)["shards"]

    # killed after one shard is encoded, and again after one shard is mined: reruns finish identically
    real_encode, real_write = teacher_run.encode_shard, teacher_run.write_shard
    calls = Counter()

    def encode_then_die(*args, **kwargs):
        calls["encode"] += 1
        if calls["encode"] == 2:
            raise KeyboardInterrupt
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(teacher_run, "encode_shard", encode_then_die)
    with pytest.raises(KeyboardInterrupt):
        teach(shards, tmp_path / "killed", teacher_dir, **fields)
    monkeypatch.setattr(teacher_run, "encode_shard", real_encode)
    import pipeline.stages.teacher.negatives as negatives

    real_mine_write = negatives.write_shard

    def write_then_die(path, blocks, index):
        if index == 1:
            raise KeyboardInterrupt
        return real_mine_write(path, blocks, index)

    monkeypatch.setattr(negatives, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        teach(shards, tmp_path / "killed", teacher_dir, **fields)
    assert not (tmp_path / "killed" / "manifest.json").exists()
    assert (tmp_path / "killed" / "shard-000000.tar").is_file()  # mined before the kill
    monkeypatch.setattr(negatives, "write_shard", real_mine_write)
    teach(shards, tmp_path / "killed", teacher_dir, **fields)
    assert shard_bytes(tmp_path / "killed") == shard_bytes(taught)
    assert real_write is teacher_run.write_shard
    teach(shards, tmp_path / "killed", teacher_dir, **fields)  # complete: a rerun does nothing


def test_two_worker_processes_match_one(tmp_path, shards, teacher_dir, taught):
    teach(shards, tmp_path / "w2", teacher_dir, workers=2)
    got, want = table(tmp_path / "w2"), table(taught)
    assert got.column("id").equals(want.column("id"))
    # the workers may use another thread count than this process: equal up to float16 rounding
    np.testing.assert_allclose(
        teacher_matrix(got.column("teacher")), teacher_matrix(want.column("teacher")), atol=1e-3
    )


def test_max_sentences_encodes_the_first_shards_that_hold_them(tmp_path, shards, teacher_dir, caplog):
    """--max-sentences: the first shards in manifest order that hold the count (64 + 32 rows for 70), the
    same rows and vectors as the whole run's; a count above the input's is all of it, said in the log;
    the manifest records the count and trains like any teacher set."""
    whole = tmp_path / "whole"
    teach(shards, whole, teacher_dir)
    with caplog.at_level("INFO", logger="pipeline.stages.teacher.run"):
        teach(shards, tmp_path / "head", teacher_dir, max_sentences=70)
    manifest = read_manifest(tmp_path / "head")
    assert [e["name"] for e in manifest["shards"]] == ["shard-000000.tar", "shard-000001.tar"]
    assert manifest["counts"]["sentences"] == 96 and manifest["config"]["max_sentences"] == 70
    assert "the first 2 of 3 shards, 96 of 136 sentences" in caplog.text
    got, want = table(tmp_path / "head"), table(whole).slice(0, 96)
    assert got.column("id").equals(want.column("id"))
    np.testing.assert_array_equal(
        teacher_matrix(got.column("teacher")), teacher_matrix(want.column("teacher"))
    )
    assert manifest["totals"]["sentences"] == 96 and read_shard_set(tmp_path / "head").has_index
    caplog.clear()
    with caplog.at_level("INFO", logger="pipeline.stages.teacher.run"):
        teach(shards, tmp_path / "all", teacher_dir, max_sentences=1000)
    assert len(read_manifest(tmp_path / "all")["shards"]) == 3
    assert "holds 136 sentences; encoding all of them" in caplog.text
    with pytest.raises(ConfigError, match="max-sentences must be >= 0"):
        Config(shards=shards, out=tmp_path / "o", model="m", max_sentences=-1)
    with pytest.raises(ConfigError, match="a conversion keeps whole"):
        teach(whole, tmp_path / "int8", teacher_dir, dtype="int8", max_sentences=10)


def test_bad_input_is_one_clear_error(tmp_path, shards, teacher_dir):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    shard = bad / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(InputError, match="shard-000001.tar fails its sha256"):
        teach(bad, tmp_path / "out", teacher_dir)
    with pytest.raises(ConfigError, match="hn-depth"):
        Config(shards=shards, out=tmp_path / "o", model="m", hard_negatives=8, hn_depth=8)
    with pytest.raises(InputError, match="different config"):
        teach(shards, tmp_path / "out", teacher_dir, variants=True)  # the unfinished run above had none


def test_cli_runs_the_stage(tmp_path, shards, teacher_dir, capsys):
    from pipeline.cli import main

    assert main(["teacher", "--shards", str(shards), "--out", str(tmp_path / "o"), "--model",
                 str(teacher_dir), "--progress=false"]) == 0  # fmt: skip
    assert read_manifest(tmp_path / "o")["stage"] == "teacher"
    assert main(["teacher", "--shards", str(shards), "--out", str(tmp_path / "p")]) == 2
    assert "--model TEACHER" in capsys.readouterr().err


def test_the_sbatch_script_as_two_array_tasks(tmp_path, shards, teacher_dir, taught):
    """launch/slurm/teacher.sbatch run by hand as tasks 1 and 0 of a 2-task array (no SLURM needed)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "array"
    for task in ("1", "0"):
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": task, "SLURM_ARRAY_TASK_COUNT": "2",
               "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
        script = str(repo / "launch" / "slurm" / "teacher.sbatch")
        args = [str(shards), str(out), str(teacher_dir), "--batch-size", "16"]
        done = subprocess.run(["bash", script, *args], env=env, cwd=repo, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert (out / "manifest.json").is_file() == (task == "0")  # the last task finalizes
    np.testing.assert_allclose(
        teacher_matrix(table(out).column("teacher")),
        teacher_matrix(table(taught).column("teacher")),
        atol=1e-3,
    )


# --------------------------------------------------------------------------------------------- negatives
def test_select_negatives_skips_self_duplicates_variants_and_the_similarity_band():
    texts = [
        "今天天气很好。",
        "今天天气很好！",
        "今天天气好。",
        "明天会下雨。",
        "我们去公园。",
        "股票上涨了。",
        "他在读书。",
    ]
    from pipeline.normalize import normalize_text

    pool = Pool(
        ids=np.arange(len(texts), dtype=np.uint64),
        texts=texts,
        keys=[normalize_text(t) for t in texts],
        variant_keys=[frozenset({normalize_text("今天天气好。")})] + [frozenset()] * (len(texts) - 1),
        vectors=np.zeros((len(texts), 2), np.float32),
        starts=[0],
    )
    params = MineParams(k=2, depth=7, max_similarity=0.9, min_similarity=0.1)
    counts = Counter()
    # ranked: itself, its punctuation twin, its own variant, a near-duplicate (0.95), then 3 candidates
    neighbours = np.array([0, 1, 2, 3, 4, 5, 6])
    sims = np.array([1.0, 0.99, 0.97, 0.95, 0.8, 0.05, 0.5])
    assert select_negatives(0, neighbours, sims, pool, params, counts) == [4, 6]
    assert (counts["self"], counts["duplicate"], counts["variant"], counts["too_similar"]) == (1, 1, 1, 1)
    assert counts["too_dissimilar"] == 1 and counts["short"] == 0
    assert select_negatives(6, np.array([6, 5, -1]), np.array([1.0, 0.5, 0.0]), pool, params, counts) == [5]
    assert counts["short"] == 1


def test_mined_negatives_in_the_shards(taught):
    out = table(taught)
    texts, ids = out.column("text").to_pylist(), out.column("id").to_numpy()
    vectors = teacher_matrix(out.column("teacher"))
    row_of = {t: i for i, t in enumerate(texts)}
    negatives, negative_ids = (
        out.column("hard_negatives").to_pylist(),
        out.column("hard_negative_ids").to_pylist(),
    )
    assert sum(len(n) == 3 for n in negatives) > 0.7 * len(texts)
    for i, (negs, nids) in enumerate(zip(negatives, negative_ids)):
        own = {texts[i], *out.column("variants")[i].as_py()}
        assert not own & set(negs)
        rows = [row_of[n] for n in negs]
        assert [int(ids[r]) for r in rows] == nids
        sims = vectors[rows] @ vectors[i]
        assert np.all(sims <= 0.97 + 1e-6)
        assert np.all(np.diff(sims) <= 1e-3)  # hardest first (float16 vectors: tiny ties)
        # nothing more similar (within the band) was skipped
        others = vectors @ vectors[i]
        band = [r for r in np.argsort(-others) if r != i and others[r] <= 0.97 and texts[r] not in own]
        assert len(negs) == min(3, len(band))
        if negs:
            assert others[band[len(negs) - 1]] <= sims[-1] + 1e-3


# --------------------------------------------------------------------------------------------- training side
def batches_carry_teacher(cfg) -> bool:
    """The data plan's answer (pipeline/train/plan.py): do the batches carry batch["teacher"]?"""
    return check_against_data(cfg, read_shard_set(cfg.data.shards), 1).teacher


def test_trainer_checks_the_teacher(tmp_path, taught, shards, teacher_dir):
    digest = read_manifest(taught)["teacher"]["hash"]
    for name in (str(teacher_dir), "tiny-teacher", digest[:10]):
        assert recorded_teacher(read_shard_set(taught), name)["hash"] == digest
    with pytest.raises(ConfigError, match="data.teacher='e5-small' but .*tiny-teacher"):
        recorded_teacher(read_shard_set(taught), "e5-small")
    with pytest.raises(ConfigError, match="python -m pipeline teacher"):
        recorded_teacher(read_shard_set(shards), "tiny-teacher")
    with pytest.raises(ConfigError, match="num_hard_negatives=4 but .*caches 3"):
        recorded_teacher(read_shard_set(taught), None, num_hard_negatives=4)
    cfg = debug_config(tmp_path, taught, **{"data.teacher": "another-teacher"})
    with pytest.raises(ConfigError, match="another-teacher"):
        batches_carry_teacher(cfg)
    assert batches_carry_teacher(debug_config(tmp_path, taught, **{"loss": [*debug_luse(), {"distill": {}}]}))
    assert not batches_carry_teacher(debug_config(tmp_path, taught))
    wide = {"data.teacher": "tiny-teacher", "loss": [*debug_luse(), {"distill": {}}], "data.teacher_dim": 384}
    with pytest.raises(ConfigError, match="teacher_dim=384 but .* has 24 dimensions"):
        batches_carry_teacher(debug_config(tmp_path, taught, **wide))
    with pytest.raises(ConfigError, match="pair file"):
        debug_config(tmp_path, taught, **{"data.teacher": "x", "loss": [{"cosent": {}}],
                                          "data.supervised_file": str(tmp_path / "p.tsv")})  # fmt: skip


def test_collator_emits_teacher_and_hard_negative_rows(taught, teacher_dir):
    from pipeline.data.collate import ViewCollator
    from pipeline.data.stream import ShardSource, index_shards
    from pipeline.model import SentenceEncoder

    tokenizer = SentenceEncoder.from_pretrained(teacher_dir).tokenizer
    k, d, m = 2, 1, 3
    collate = ViewCollator(tokenizer, 64, k, d, PREFIX, teacher=True, num_hard_negatives=m)
    source = ShardSource(index_shards(taught), collate.columns)
    runs = [(0, np.array([5, 1, 30])), (1, np.array([2, 0]))]  # rows of two blocks
    rows = source.rows(runs)
    batch = collate(rows)
    b, n = 5, 1 + k + d
    assert batch.num_views == n and batch.num_hard_negatives == m
    assert batch.input_ids.shape[0] == (n + m) * b
    full = table(taught)
    by_id = {int(i): r for r, i in enumerate(full.column("id").to_numpy())}
    vectors = teacher_matrix(full.column("teacher"))
    want = np.stack([vectors[by_id[int(i)]] for i in np.asarray(rows["id"], dtype=np.uint64)])
    assert batch.teacher.dtype == torch.float32 and batch.teacher.shape == (b, 24)
    np.testing.assert_array_equal(batch.teacher.numpy(), want)

    def tokens(row: int) -> list[int]:
        return batch.input_ids[row][batch.attention_mask[row].bool()].tolist()

    for i in range(b):
        assert tokens((1 + k) * b + i) == tokens(i)  # the dropout view repeats view 0
        for j in range(m):
            negs = rows["hard_negatives"][i]
            text = negs[j] if j < len(negs) else rows["text"][(i + 1) % b]
            ids, mask = collate.encode([text])
            assert tokens(n * b + j * b + i) == ids[0][mask[0].bool()].tolist()


def test_training_steps_on_teacher_shards(tmp_path, taught):
    from pipeline.train.build import build
    from pipeline.train.loop import train_step

    cfg = debug_config(tmp_path, taught, **{
        "data.teacher": "tiny-teacher", "data.num_hard_negatives": 2, "data.num_workers": 0,
        "loss": [*debug_luse(queue_size=0), {"distill": {}}], "data.teacher_dim": 24,
    })  # fmt: skip
    t = build(cfg)
    batch = next(iter(t.stream))
    assert batch.teacher.shape[1] == 24 and batch.num_hard_negatives == 2
    out = train_step(t, batch)
    assert torch.isfinite(out["loss"]) and torch.isfinite(out["distill_loss"])
    t.close()
    assert json.loads(json.dumps(read_manifest(taught)["teacher"]))["dim"] == 24


def test_the_readme_snippet_reads_the_columns(taught, monkeypatch):
    """shards/README.md's pyarrow-only reader works on our output (readers without our code)."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "shards" / "README.md").read_text(encoding="utf-8")
    snippet = next(c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "teacher" in c)
    monkeypatch.chdir(taught)
    scope: dict = {}
    exec(snippet, scope)
    last = list(read_shard(taught / "shard-000000.tar"))[-1]  # the snippet's loop ends on it
    np.testing.assert_array_equal(scope["vectors"], teacher_matrix(last.column("teacher")))
    assert scope["negatives"] == last.column("hard_negatives").to_pylist()


def test_one_record_of_a_shard_set(taught, shards, tmp_path):
    from pipeline.shards import read_shard_set

    info = read_shard_set(taught)  # the teacher stage over augmented shards
    assert (info.stage, info.num_variants, info.hard_negatives, info.teacher_dim) == ("teacher", 3, 3, 24)
    assert info.teacher["hash"] == read_manifest(taught)["teacher"]["hash"] and info.has_index
    assert read_shard_set(info) is info and info.tokenizer is None
    plain = read_shard_set(shards)  # augment: k from its own config, no teacher
    assert (plain.stage, plain.num_variants, plain.hard_negatives, plain.teacher) == ("augment", 3, 0, None)
    with pytest.raises(ConfigError, match="is not a directory"):
        read_shard_set(tmp_path / "none")
    # every check that needs the data, in one call: too many variants, a teacher the set does not hold
    from pipeline.train.plan import check_against_data

    with pytest.raises(ConfigError, match="num_variants=4 but the shards in"):
        check_against_data(debug_config(tmp_path, taught, **{"data.num_variants": 4}), info, 1)
    with pytest.raises(ConfigError, match="has no teacher embeddings"):
        check_against_data(debug_config(tmp_path, shards, **{"data.teacher": "tiny-teacher"}), plain, 1)


def test_each_worker_takes_its_share_of_the_cpus_this_process_may_use(tmp_path, monkeypatch):
    """A SLURM task granted 8 CPUs of a larger node: 4 workers get 2 threads each, not node cores / 4."""
    import os

    import torch

    from pipeline.stages.teacher import run as teacher_run

    monkeypatch.setattr(teacher_run, "load_teacher", lambda cfg, device: device)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    cfg = teacher_run.Config(shards=tmp_path, out=tmp_path / "out", model="m")
    assert teacher_run.EncodeWork(cfg, "cpu").load(4) == "cpu"
    assert torch.get_num_threads() == 2
