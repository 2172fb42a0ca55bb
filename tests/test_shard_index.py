"""The per-shard block index: what training plans an epoch from instead of reading every block."""

import json

import numpy as np
import pytest
from _train_data import make_shards

from pipeline.cli import main as cli_main
from pipeline.data.stream import BatchStream, ShardSource, index_shards, read_block
from pipeline.errors import InputError
from pipeline.shards import MANIFEST, SET_INDEX, index_name, iter_blocks, read_manifest, row_lengths


@pytest.fixture(params=["set index", "shard indexes"])
def shards(tmp_path, request):
    """A shard set as the stages write it (one index for the set), and as sets finished before the set
    index existed (each shard's own index only)."""
    d = tmp_path / "shards"
    make_shards(d, [[20, 13], [9, 30, 5], [17, 6]], num_variants=2)
    if request.param == "shard indexes":
        manifest = json.loads((d / MANIFEST).read_text())
        (d / manifest.pop("index")["name"]).unlink()
        (d / MANIFEST).write_text(json.dumps(manifest))
    return d


def blocks_by_reading(d):
    """What the index must say, found the slow way: every block of every shard read and measured."""
    out = []
    for entry in read_manifest(d)["shards"]:
        for member, table in iter_blocks(d / entry["name"]):
            out.append((entry["name"], member.offset_data, member.size, table.num_rows, row_lengths(table)))
    return out


def test_index_matches_the_blocks_and_the_manifest_lists_it(shards):
    refs = index_shards(shards)
    expected = blocks_by_reading(shards)
    assert [(r.path.rsplit("/", 1)[1], r.offset, r.size, r.rows) for r in refs] == [e[:4] for e in expected]
    for ref, e in zip(refs, expected):
        assert np.array_equal(ref.lengths, e[4])
        assert ref.lengths.max() > 5  # characters of text/variants, not a placeholder
    manifest = read_manifest(shards)
    for entry in manifest["shards"]:
        assert entry["index"]["name"] == index_name(entry["name"])
        assert (shards / entry["index"]["name"]).stat().st_size == entry["index"]["bytes"]
    if "index" in manifest:
        assert manifest["index"]["name"] == SET_INDEX
        assert [r.block for r in refs] == [0, 1, 0, 1, 2, 0, 1]
    assert [read_block(r).num_rows for r in refs] == [e[3] for e in expected]


def test_start_reads_no_block_but_a_damaged_block_is_refused_when_read(shards):
    """Garbage of the right size passes the start (nothing is hashed) and fails at its first read."""
    victim = shards / "shard-000001.tar"
    data = bytearray(victim.read_bytes())
    refs = index_shards(shards)
    first = next(r for r in refs if r.path.endswith("shard-000001.tar"))
    data[first.offset + first.size // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    refs = index_shards(shards)  # still fine: the shard's size is right and its index untouched
    with pytest.raises(InputError, match=r"shard-000001\.tar block 0 fails its CRC-32 check"):
        read_block(next(r for r in refs if r.path.endswith("shard-000001.tar")))
    unchecked = index_shards(shards, verify=False)
    assert all(r.crc32 is None for r in unchecked)


@pytest.mark.parametrize("workers", [0, 2])
def test_damaged_block_stops_the_stream_with_one_line_naming_it(shards, workers):
    refs = index_shards(shards)
    victim = refs[3]  # shard 1, block 1
    with open(victim.path, "r+b") as f:
        f.seek(victim.offset + 7)
        byte = f.read(1)
        f.seek(victim.offset + 7)
        f.write(bytes([byte[0] ^ 1]))
    stream = BatchStream(ShardSource(refs, ["id"]), lambda rows: {"n": len(rows["id"])}, 10, 0, 1, 0, workers)
    with pytest.raises(InputError) as raised:
        for _ in stream.epoch_batches():
            pass
    message = str(raised.value)
    assert "\n" not in message and "shard-000001.tar block 1 fails its CRC-32" in message


def test_truncated_shard_and_modified_index_are_refused_at_start_naming_the_file(shards):
    victim = shards / "shard-000002.tar"
    victim.write_bytes(victim.read_bytes()[:-512])
    with pytest.raises(InputError, match=r"shard-000002\.tar has \d+ bytes, the manifest says"):
        index_shards(shards)
    index = shards / (read_manifest(shards).get("index", {}).get("name") or "shard-000000.idx")
    data = bytearray(index.read_bytes())
    data[-100] ^= 1
    index.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"{index.name} fails its sha256 check"):
        index_shards(shards)


def test_old_shard_sets_get_a_command_and_the_command_adds_identical_indexes(shards, capsys):
    before = [(r.path, r.offset, r.size, r.rows, r.crc32, r.lengths.tolist()) for r in index_shards(shards)]
    manifest = json.loads((shards / MANIFEST).read_text())
    for entry in manifest["shards"]:
        (shards / entry.pop("index")["name"]).unlink()
    if "index" in manifest:
        (shards / manifest.pop("index")["name"]).unlink()
    (shards / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"without a block index .*python -m pipeline shards index"):
        index_shards(shards)
    assert cli_main(["shards", "index", str(shards)]) == 0
    assert "wrote 3 block index(es)" in capsys.readouterr().out
    after = [(r.path, r.offset, r.size, r.rows, r.crc32, r.lengths.tolist()) for r in index_shards(shards)]
    assert after == before
    assert read_manifest(shards)["index"]["name"] == SET_INDEX  # the command writes the set's index too
    assert cli_main(["shards", "index", str(shards)]) == 0  # a rerun has nothing left to do
    assert "wrote 0 block index(es), 3 already there" in capsys.readouterr().out
