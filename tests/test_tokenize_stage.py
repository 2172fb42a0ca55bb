"""`python -m pipeline tokenize`: stored ids equal the tokenizer's, the loader pads them into the same
tensors as tokenising (views, dropout views, hard negatives, teacher rows), hash checks, tasks and
restarts, token-count bucketing, and training with ids equal to training without; tiny tokenizers
built here."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from _train_data import batch_stream, debug_config, full_and_resumed, make_shards, run_and_dump

from pipeline.data.collate import FastEncoder, ViewCollator
from pipeline.data.stream import BatchStream, ShardSource, index_shards
from pipeline.data.token_ids import pad_ids, shards_have_ids, tokenizer_hash
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json
from pipeline.model import (
    SentenceEncoder,
    build_char_vocab,
    build_scratch_backbone,
    make_tokenizer,
    write_vocab,
)
from pipeline.resources import sample_sentences
from pipeline.shards import new_manifest, read_manifest, read_shard, read_shard_set, shard_name, write_shard
from pipeline.stages.tokenize import WORK_DIR, Config, run

PREFIX = "问："
BLOCKS = [[40, 24], [32], [30, 10]]
MAX_LENGTH = 24  # short enough that some sentences are truncated


def build_model(directory: Path, filler: int = 0) -> Path:
    """A tiny char-vocabulary encoder folder; ``filler`` unused tokens first push every id up by that."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_char_vocab(sample_sentences(3000) + [PREFIX])
    specials, chars = vocab[:5], vocab[5:]
    write_vocab(specials + [f"[unused{i}]" for i in range(filler)] + chars, directory / "vocab.txt")
    tokenizer = make_tokenizer(directory / "vocab.txt")
    config = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=96)  # fmt: skip
    backbone = build_scratch_backbone(config, len(tokenizer), 0)
    SentenceEncoder(backbone, tokenizer, "mean", 64, PREFIX).save_pretrained(directory)
    return directory


def with_negatives_and_teacher(src: Path, out: Path, dim: int = 8) -> Path:
    """``src``'s shards plus ``hard_negatives`` (0-3 a row) and a ``teacher`` column, as the teacher stage."""
    rng = np.random.default_rng(0)
    pool = sample_sentences(5000)[-500:]
    out.mkdir(parents=True)
    entries = []
    for i, entry in enumerate(read_manifest(src)["shards"]):
        blocks = []
        for block in read_shard(src / entry["name"]):
            n = block.num_rows
            negatives = [[pool[j] for j in rng.integers(0, len(pool), rng.integers(0, 4))] for _ in range(n)]
            vectors = rng.standard_normal((n, dim)).astype(np.float16)
            teacher = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim)
            block = block.append_column("hard_negatives", pa.array(negatives, pa.list_(pa.string())))
            blocks.append(block.append_column("teacher", teacher))
        entries.append(write_shard(out / shard_name(i), blocks, i))
    teacher = {"name": "made-up", "hash": "0" * 64, "dim": dim}
    manifest = new_manifest("teacher", {}, entries, counts={}, teacher=teacher, hard_negatives={"k": 3})
    atomic_write_json(out / "manifest.json", manifest)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("aug")
    make_shards(base, BLOCKS, num_variants=3)
    return with_negatives_and_teacher(base, tmp_path_factory.mktemp("teacher") / "out")


def tokenize(shards: Path, out: Path, model: Path, **fields) -> Config:
    cfg = Config(shards=shards, out=out, model=str(model), **{"max_length": MAX_LENGTH, **fields})
    assert run(cfg) == 0
    return cfg


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, shards, model) -> Path:
    out = tmp_path_factory.mktemp("tok") / "out"
    tokenize(shards, out, model)
    return out


def table(directory: Path) -> pa.Table:
    manifest = read_manifest(directory)
    return pa.concat_tables(b for e in manifest["shards"] for b in read_shard(directory / e["name"]))


def reference_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    enc = tokenizer([PREFIX + t for t in texts], truncation=True, max_length=MAX_LENGTH)
    return enc["input_ids"]


# --------------------------------------------------------------------------------------------- the stage
def test_ids_equal_the_tokenizer_and_rows_blocks_columns_are_kept(tokenized, shards, model):
    tokenizer = make_tokenizer(model / "vocab.txt")
    before, after = table(shards), table(tokenized)
    assert after.select(before.column_names).equals(before)  # every input column, row and order kept
    assert [b.num_rows for b in read_shard(tokenized / "shard-000000.tar")] == BLOCKS[0]
    assert after.schema.field("input_ids").type == pa.list_(pa.uint16())
    texts = before.column("text").to_pylist()
    assert after.column("input_ids").to_pylist() == reference_ids(tokenizer, texts)
    assert max(len(x) for x in after.column("input_ids").to_pylist()) == MAX_LENGTH  # some truncated
    for name, ids_name in (("variants", "variant_input_ids"), ("hard_negatives", "hard_negative_input_ids")):
        nested = before.column(name).to_pylist()
        got = after.column(ids_name).to_pylist()
        assert [len(g) for g in got] == [len(v) for v in nested]
        assert got == [reference_ids(tokenizer, v) if v else [] for v in nested]


def test_manifest_records_the_tokenizer_and_carries_the_teacher_records(tokenized, shards, model):
    manifest = read_manifest(tokenized)
    record = manifest["tokenizer"]
    tokenizer = make_tokenizer(model / "vocab.txt")
    assert record["hash"] == tokenizer_hash(tokenizer, PREFIX, MAX_LENGTH)
    assert record["prefix"] == PREFIX and record["max_length"] == MAX_LENGTH
    assert record["vocab_size"] == len(tokenizer) and record["dtype"] == "uint16"
    assert manifest["stage"] == "tokenize" and manifest["input_stage"] == "teacher"
    counts = manifest["counts"]
    assert counts["sentences"] == sum(map(sum, BLOCKS)) == manifest["totals"]["sentences"]
    assert counts["tokens"] == sum(len(x) for x in table(tokenized).column("input_ids").to_pylist()) + sum(
        len(y) for c in ("variant_input_ids", "hard_negative_input_ids")
        for x in table(tokenized).column(c).to_pylist() for y in x
    )  # fmt: skip
    assert counts["truncated"] > 0
    assert not (tokenized / WORK_DIR).exists()


def test_large_vocabulary_is_stored_as_uint32(tmp_path, shards):
    big = build_model(tmp_path / "big", filler=70_000)
    tokenizer = make_tokenizer(big / "vocab.txt")
    out = tmp_path / "out"
    tokenize(shards, out, big)
    got = table(out)
    assert got.schema.field("input_ids").type == pa.list_(pa.uint32())
    assert read_manifest(out)["tokenizer"]["dtype"] == "uint32"
    ids = got.column("input_ids").to_pylist()
    assert ids == reference_ids(tokenizer, got.column("text").to_pylist())
    assert max(max(x) for x in ids) > 65_535


def test_tasks_and_a_rerun_give_the_same_bytes(tmp_path, shards, model, tokenized):
    out = tmp_path / "split"
    tokenize(shards, out, model, task_index=1, num_tasks=2)  # shard 1 only: no manifest yet
    assert not (out / "manifest.json").exists() and (out / "shard-000001.tar").is_file()
    (out / "shard-000001.tar").write_bytes(b"torn")  # a shard replaced after its record is redone
    # shards 0 and 2 in two worker processes, through the command line (a subprocess: the spawn pool's
    # resource tracker would otherwise outlive the test as a child of the pytest process)
    argv = [
        "--shards",
        str(shards),
        "--out",
        str(out),
        "--model",
        str(model),
        "--max_length",
        str(MAX_LENGTH),
    ]
    argv += ["--task-index", "0", "--num-tasks", "2", "--workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "pipeline", "tokenize", *argv]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "manifest.json").exists()  # shard 1 is torn: its task must redo it
    tokenize(shards, out, model, task_index=1, num_tasks=2)
    assert (out / "manifest.json").is_file()
    for name in ("shard-000000.tar", "shard-000001.tar", "shard-000002.tar"):
        assert (out / name).read_bytes() == (tokenized / name).read_bytes()
    mine, ref = read_manifest(out), read_manifest(tokenized)
    assert mine["shards"] == ref["shards"] and mine["tokenizer"] == ref["tokenizer"]
    tokenize(shards, out, model)  # complete and equal: nothing to do
    with pytest.raises(InputError, match="different config"):
        tokenize(shards, out, model, prefix="q: ")


def test_bad_input_is_one_clear_error(tmp_path, tokenized, shards, model):
    with pytest.raises(InputError, match="written by stage 'tokenize'"):
        tokenize(tokenized, tmp_path / "again", model)
    with pytest.raises(InputError, match="not a model folder"):
        tokenize(shards, tmp_path / "x", tmp_path / "missing")
    with pytest.raises(ConfigError, match="usage"):
        Config(shards=tokenized)


# --------------------------------------------------------------------------------------------- the loader
def test_padding_ids_equals_the_fast_encoder(model):
    tokenizer = make_tokenizer(model / "vocab.txt")
    texts = sample_sentences(50) + ["短", "很长的句子" * 20]
    ids, mask = FastEncoder(tokenizer, MAX_LENGTH, PREFIX)(texts)
    rows = [np.asarray(r, dtype=np.int64) for r in reference_ids(tokenizer, texts)]
    got_ids, got_mask = pad_ids(rows, tokenizer.pad_token_id)
    assert torch.equal(got_ids, ids) and torch.equal(got_mask, mask)


@pytest.mark.parametrize("window", [0, 2])
def test_batches_from_ids_equal_batches_from_text(tokenized, shards, model, window):
    """Every tensor of every rank slice of an epoch: views, dropout views, hard negatives, teacher."""
    tokenizer = make_tokenizer(model / "vocab.txt")
    assert shards_have_ids(tokenized, tokenizer, PREFIX, MAX_LENGTH)
    args = (tokenizer, MAX_LENGTH, 3, 2, PREFIX, True, 2)
    from_text, from_ids = ViewCollator(*args), ViewCollator(*args, pretokenized=True)
    assert "text" not in from_ids.columns and "input_ids" in from_ids.columns
    blocks = index_shards(tokenized)
    if window:  # the token-count order, pinned for both so that only the collation differs
        text_blocks = blocks
    else:
        text_blocks = index_shards(shards)
    compared = 0
    for rank in range(2):
        streams = [
            BatchStream(ShardSource(b, c.columns), c, 12, rank, 2, seed=5, bucket_window=window)
            for b, c in ((text_blocks, from_text), (blocks, from_ids))
        ]
        for a, b in zip(*(s.epoch_batches() for s in streams), strict=True):
            names = [f.name for f in dataclasses.fields(a)]
            set_fields = [[k for k in names if getattr(x, k) is not None] for x in (a, b)]
            assert set_fields[0] == set_fields[1] and a.num_hard_negatives == 2 and a.num_views == 1 + 3 + 2
            for key in set_fields[0]:
                value, other = getattr(a, key), getattr(b, key)
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key
            compared += 1
    assert compared == 2 * (sum(map(sum, BLOCKS)) // 12)


def test_bucketing_uses_token_counts(tokenized):
    rows = table(tokenized)
    ids = rows.column("input_ids").to_pylist()
    variants = rows.column("variant_input_ids").to_pylist()
    want = [max([len(x)] + [len(v) for v in vs]) for x, vs in zip(ids, variants)]
    got = np.concatenate([b.lengths for b in index_shards(tokenized)])
    assert got.tolist() == want and max(want) == MAX_LENGTH
    assert want != [max([len(t)] + [len(v) for v in vs]) for t, vs in  # not the characters
                    zip(rows.column("text").to_pylist(), rows.column("variants").to_pylist())]  # fmt: skip


def test_other_tokenizer_prefix_or_length_is_refused_naming_both_hashes(tokenized, shards, model, tmp_path):
    tokenizer = make_tokenizer(model / "vocab.txt")
    recorded = read_manifest(tokenized)["tokenizer"]["hash"]
    assert not shards_have_ids(shards, tokenizer, PREFIX, MAX_LENGTH)  # no ids: tokenise on the fly
    for prefix, length in ((PREFIX, MAX_LENGTH + 8), ("", MAX_LENGTH)):
        with pytest.raises(ConfigError) as err:
            shards_have_ids(tokenized, tokenizer, prefix, length)
        message = str(err.value)
        assert "\n" not in message and recorded[:16] in message and "pipeline tokenize" in message
        assert tokenizer_hash(tokenizer, prefix, length)[:16] in message
    other = make_tokenizer(build_model(tmp_path / "other", filler=3) / "vocab.txt")
    with pytest.raises(ConfigError, match="tokenizer hash"):
        shards_have_ids(tokenized, other, PREFIX, MAX_LENGTH)


# --------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("bucketing", [False, True])
def test_training_on_ids_equals_training_on_text_and_resumes_exactly(tmp_path, shards, model, bucketing):
    """The trainer pads the ids (build_stream checks the hash): the same run, step for step (without
    bucketing: with it, token counts order the batches differently from characters, by design); and a
    run stopped and resumed on ids equals the uninterrupted one."""
    out = tmp_path / "tok"
    tokenize(shards, out, model, max_length=32)

    def make_cfg(data, run_dir, steps):
        return debug_config(tmp_path, data, **{
            "run_dir": str(run_dir), "train.max_steps": steps, "train.debug_dump": True,
            "model.name_or_path": str(model), "model.pooling": None, "data.max_length": 32,
            "data.num_hard_negatives": 1, "train.eval_max_pairs": 16, "checkpoint.every_steps": 2,
            "data.length_bucketing": bucketing, "data.bucket_window": 2,
        })  # fmt: skip

    tokenizer = make_tokenizer(model / "vocab.txt")
    for data, pretokenized in ((shards, False), (out, True)):  # the trainer's own choice of path
        assert (
            batch_stream(
                make_cfg(data, tmp_path / "x", 1), read_shard_set(data), tokenizer, 0, 1, PREFIX
            ).collate.pretokenized
            is pretokenized
        )
    full, resumed = full_and_resumed(tmp_path, lambda d, s: make_cfg(out, d, s), stop=3, total=6)
    if not bucketing:
        on_text = run_and_dump(make_cfg(shards, tmp_path / "text", 6))
        assert full["param_checksum"] == on_text["param_checksum"]
        assert full["queue_checksum"] == on_text["queue_checksum"]
    assert resumed["param_checksum"] == full["param_checksum"]
    assert resumed["queue_checksum"] == full["queue_checksum"] and resumed["cursor"] == full["cursor"]
    assert full["cursor"]["bucket_window"] == (2 if bucketing else 0)


def test_finalize_only_waits_for_every_shard_and_progress_counts_sentences(tmp_path, shards, model, capsys):
    """The offline stages share one execution config (pipeline.stages.runner.Execution): tokenize too takes
    --finalize-only (refused while a shard is missing, naming it) and reports progress in sentences."""
    out = tmp_path / "fin"
    tokenize(shards, out, model, task_index=0, num_tasks=3)  # shard 0 only
    with pytest.raises(InputError, match="shard-000001.tar"):
        tokenize(shards, out, model, finalize_only=True)
    capsys.readouterr()
    tokenize(shards, out, model, progress=True)  # the other two, with the progress bar on
    err = capsys.readouterr().err
    assert "tokenize: 100%" in err  # the last line of the bar: every sentence of shards 1 and 2
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("stage", ["preprocess", "augment", "teacher", "tokenize"])
def test_every_stage_shares_the_execution_options_and_their_check(stage):
    import importlib

    from pipeline.cli import COMMANDS
    from pipeline.stages.runner import Execution

    config = importlib.import_module(COMMANDS[stage].module).Config
    assert issubclass(config, Execution)
    with pytest.raises(ConfigError, match=r"task_index must be in \[0, num_tasks\)"):
        config(**{"task_index": 3, "num_tasks": 2, **REQUIRED.get(stage, {})})


REQUIRED = {
    "augment": {"shards": Path("in"), "out": Path("out")},
    "teacher": {"shards": Path("in"), "out": Path("out"), "model": "m"},
    "tokenize": {"shards": Path("in"), "out": Path("out"), "model": "m"},
}
