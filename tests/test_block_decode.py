"""What a loader worker decodes of a block: the columns its batches read, id columns as views of one array."""

import numpy as np
import pyarrow as pa
import pytest
from _train_data import make_shards, with_teacher

from pipeline.data.collate import ViewCollator
from pipeline.data.stream import ShardSource, index_shards, read_block
from pipeline.data.token_ids import RaggedIds, ragged_rows
from pipeline.model import build_char_vocab, make_tokenizer
from pipeline.model.vocab import write_vocab
from pipeline.resources import sample_sentences


@pytest.fixture(scope="module")
def teacher_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("decode")
    make_shards(d / "s", [[12, 7]], num_variants=2)
    return with_teacher(d / "s", d / "t", dim=8)


def test_ragged_rows_equal_the_python_lists_flat_nested_sliced_chunked_and_empty():
    flat = pa.array([[3, 4, 5], [], [7], [8, 9]], pa.list_(pa.uint32()))
    nested = pa.array([[[1, 2], [3]], [], [[4, 5, 6]], [[], [7]]], pa.list_(pa.list_(pa.uint32())))
    for column in (flat, flat.slice(1, 3), pa.chunked_array([flat.slice(0, 2), flat.slice(2)])):
        rows = ragged_rows(column)
        assert isinstance(rows, RaggedIds)
        assert [r.tolist() for r in rows] == column.to_pylist()
        assert all(r.dtype == np.int64 for r in rows)
    for column in (nested, nested.slice(1, 3)):
        assert [[t.tolist() for t in r] for r in ragged_rows(column)] == column.to_pylist()
    assert len(ragged_rows(pa.array([], pa.list_(pa.uint32())))) == 0


def test_a_block_read_for_columns_holds_just_those_with_the_same_values(teacher_shards):
    ref = index_shards(teacher_shards)[0]
    whole = read_block(ref)
    part = read_block(ref, {"id", "teacher", "not a column"})
    assert part.column_names == [c for c in whole.column_names if c in ("id", "teacher")]
    assert part.equals(whole.select(part.column_names))


@pytest.mark.parametrize("num_variants", [0, 2])
def test_variants_are_decoded_only_when_a_view_uses_them(tmp_path, teacher_shards, num_variants):
    write_vocab(build_char_vocab(sample_sentences(200)), tmp_path / "vocab.txt")
    collate = ViewCollator(make_tokenizer(tmp_path / "vocab.txt"), 32, num_variants, 0, teacher=True)
    assert ("variants" in collate.columns) == (num_variants > 0)
    rows = ShardSource(index_shards(teacher_shards), collate.columns).rows([(0, np.arange(5))])
    assert set(rows) == set(collate.columns) and rows["teacher"].shape == (5, 8)
    batch = collate(rows)
    assert batch.input_ids.shape[0] == 5 * (1 + num_variants) and batch.teacher.shape == (5, 8)
