"""``ShardSource.rows`` (one gather per block and column) gives what the per-value loop it replaced gave,
on shards the project's own stages wrote from the bundled corpus: preprocess, augment, teacher (a tiny
model built here, int8 and float16 columns) and tokenize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _tiny_models import build_char_encoder

from pipeline.cli import main
from pipeline.data.collate import ViewCollator
from pipeline.data.stream import ShardSource, index_shards
from pipeline.model import SentenceEncoder
from pipeline.resources import SAMPLE_CORPUS, sample_sentences

PREFIX = "问："


def per_value_rows(source: ShardSource, runs: list[tuple[int, np.ndarray]]) -> dict[str, list[Any]]:
    """The implementation before the gather: one Python step per value of every column."""
    out: dict[str, list[Any]] = {name: [] for name in source.columns}
    for block, rows in runs:
        cols = source._block(block)
        for name in source.columns:
            column = cols[name]
            out[name].extend(column[i] for i in rows)
    return out


def assert_same(new: dict[str, Any], old: dict[str, list[Any]]) -> None:
    assert new.keys() == old.keys()
    for name, values in old.items():
        got = new[name]
        assert len(got) == len(values), name
        if isinstance(got, np.ndarray):  # a vector column: (rows, D), the old rows stacked
            assert got.dtype == values[0].dtype
            np.testing.assert_array_equal(got, np.stack(values))
            continue
        assert isinstance(got, list), name
        for a, b in zip(got, values, strict=True):
            if isinstance(b, np.ndarray):  # token ids
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)
            elif isinstance(b, list) and b and isinstance(b[0], np.ndarray):  # variants' token ids
                assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
            else:
                assert a == b, name


@pytest.fixture(scope="module")
def stage_shards(tmp_path_factory) -> dict[str, Path]:
    """The bundled corpus's first lines through the stages' command lines, as run_sample.sh runs them."""
    root = tmp_path_factory.mktemp("real")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:120]) + "\n", "utf-8")
    model = build_char_encoder(
        root / "tiny", sample_sentences(3000) + [PREFIX], 24, 48, 96, 0, max_length=64, prefix=PREFIX
    )
    steps = [
        ["preprocess", str(corpus), "--out", str(root / "shards"), "--rows_per_block", "100"],
        ["augment", "--shards", str(root / "shards"), "--out", str(root / "aug"), "--num_variants", "2",
         "--progress", "false"],
        ["teacher", "--shards", str(root / "aug"), "--out", str(root / "t16"), "--model", str(model),
         "--progress", "false"],
        ["teacher", "--shards", str(root / "aug"), "--out", str(root / "t8"), "--model", str(model),
         "--dtype", "int8", "--progress", "false"],
        ["tokenize", "--shards", str(root / "t8"), "--out", str(root / "tok"), "--model", str(model),
         "--max_length", "32", "--progress", "false"],
    ]  # fmt: skip
    for argv in steps:
        assert main(argv) == 0, argv
    return {"model": model, **{name: root / name for name in ("aug", "t16", "t8", "tok")}}


@pytest.mark.parametrize("name", ["aug", "t16", "t8", "tok"])
def test_rows_equal_the_per_value_loop(stage_shards, name):
    tokenizer = SentenceEncoder.from_pretrained(stage_shards["model"]).tokenizer
    blocks = index_shards(stage_shards[name])
    assert len(blocks) >= 2
    teacher = name != "aug"
    collate = ViewCollator(tokenizer, 32, 2, 1, PREFIX, teacher=teacher, pretokenized=name == "tok")
    columns = [*collate.columns, "source"] + ["variant_ops"] * (name != "tok")
    source = ShardSource(blocks, list(dict.fromkeys(columns)))
    rng = np.random.default_rng(0)
    runs = [(b, rng.permutation(blocks[b].rows)[: 1 + b * 7 % 40]) for b in rng.permutation(len(blocks))]
    runs.append((0, np.array([], dtype=np.int64)))  # an empty run, as a batch edge can give
    runs.append((1, np.array([3, 3, 0])))  # a repeated row (mixed source order across a wrap)
    new, old = source.rows(runs), per_value_rows(source, runs)
    assert_same(new, old)
    assert isinstance(new.get("teacher", np.zeros(0)), np.ndarray)
    # the collator's batch is the same from either
    a, b = collate({k: new[k] for k in collate.columns}), collate({k: old[k] for k in collate.columns})
    for key in ("input_ids", "attention_mask", "ids") + ("teacher",) * teacher:
        np.testing.assert_array_equal(getattr(a, key).numpy(), getattr(b, key).numpy())
    assert source.rows([]) == {name: [] for name in source.columns}
