import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _train_data import make_shards

from pipeline.data.stream import BatchStream, EpochOrder, MemorySource, ShardSource, index_shards
from pipeline.errors import ConfigError


def ids_only(rows):
    return {"ids": list(rows["id"])}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    # uneven blocks and shards: 3 shards, 7 blocks, 100 rows
    ids = make_shards(d, [[20, 13], [9, 30, 5], [17, 6]], num_variants=2)
    return d, ids


def streams(d, world, workers, G=12, seed=3, window=0):
    blocks = index_shards(d)
    return [
        BatchStream(
            ShardSource(blocks, ["id"]),
            ids_only,
            G,
            r,
            world,
            seed,
            num_workers=workers,
            bucket_window=window,
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1), (4, 2)])
def test_every_sample_once_per_epoch(shards, world, workers, window):
    d, ids = shards
    per_rank = [[b["ids"] for b in s.epoch_batches()] for s in streams(d, world, workers, window=window)]
    counts = {len(batches) for batches in per_rank}
    assert counts == {100 // 12}  # every rank takes the same number of steps
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    assert max(seen.values()) == 1
    assert len(seen) == (100 // 12) * 12  # the partial tail (4 samples) is dropped
    assert set(seen) <= set(ids)
    s = streams(d, world, workers)[0]
    assert s.dropped_per_epoch == 4 and s.cursor.epoch == 0


@pytest.mark.parametrize("window", [0, 3])
def test_order_is_world_size_free_and_seeded(shards, window):
    d, _ = shards
    one = [b["ids"] for b in streams(d, 1, 0, window=window)[0].epoch_batches()]
    two = list(zip(*[[b["ids"] for b in s.epoch_batches()] for s in streams(d, 2, 2, window=window)]))
    assert [a + b for a, b in two] == one  # rank slices of the same global batches
    other_epoch = streams(d, 1, 0, window=window)[0]
    other_epoch.cursor.epoch = 1
    assert [b["ids"] for b in other_epoch.epoch_batches()] != one
    assert [b["ids"] for b in streams(d, 1, 0, seed=4, window=window)[0].epoch_batches()] != one
    again = [b["ids"] for b in streams(d, 3, 1, window=window)[0].epoch_batches()]
    assert again == [b[:4] for b in one]  # a pure function of (seed, epoch, data): rank 0 of 3


@pytest.mark.parametrize("window", [0, 3])
def test_resume_at_other_world_size_gives_the_rest(shards, window):
    d, ids = shards
    full = [b["ids"] for b in streams(d, 1, 0, window=window)[0].epoch_batches()]
    two = streams(d, 2, 1, window=window)
    consumed = []
    iters = [iter(s) for s in two]
    for _ in range(3):
        for it in iters:
            consumed.extend(next(it)["ids"])
    assert two[0].state_dict() == two[1].state_dict()
    state = two[0].state_dict()
    assert state["batches"] == 3 and state["epoch"] == 0
    one = streams(d, 1, 2, window=window)[0]
    one.load_state_dict(state)
    rest = [i for b in one.epoch_batches() for i in b["ids"]]
    assert sorted(consumed + rest) == sorted(i for b in full for i in b)
    assert rest == [i for b in full[3:] for i in b]
    assert one.cursor.epoch == 1 and one.cursor.batches == 0


def test_cursor_from_other_batch_size_is_refused(shards):
    d, _ = shards
    state = streams(d, 1, 0, G=12)[0].state_dict()
    with pytest.raises(ConfigError, match="global_batch_size=12"):
        streams(d, 1, 0, G=10)[0].load_state_dict(state)


def test_bucketing_groups_similar_lengths_and_only_moves_samples_within_a_window(shards):
    d, _ = shards
    blocks = index_shards(d)
    length = {}
    for b in blocks:
        for i, n in zip(ShardSource([b], ["id"]).rows([(0, np.arange(b.rows))])["id"], b.lengths):
            length[i] = int(n)
    # the proxy: the most characters of the text or of any variant
    first = ShardSource(blocks[:1], ["id", "text", "variants"]).rows([(0, np.arange(blocks[0].rows))])
    assert list(blocks[0].lengths) == [
        max(len(t), *map(len, v)) for t, v in zip(first["text"], first["variants"])
    ]

    def spread(batches):  # mean over batches of (longest - shortest)
        return np.mean([max(length[i] for i in b) - min(length[i] for i in b) for b in batches])

    plain = [b["ids"] for b in streams(d, 1, 0)[0].epoch_batches()]
    bucketed = [b["ids"] for b in streams(d, 1, 0, window=4)[0].epoch_batches()]
    assert spread(bucketed) < 0.5 * spread(plain)
    for w in range(0, len(plain), 4):  # a window holds the same samples, regrouped
        assert sorted(i for b in bucketed[w : w + 4] for i in b) == sorted(
            i for b in plain[w : w + 4] for i in b
        )
    assert bucketed != plain


def test_cursor_from_other_bucketing_is_refused(shards):
    d, _ = shards
    state = streams(d, 1, 0, window=0)[0].state_dict()
    with pytest.raises(ConfigError, match="bucket_window=0"):
        streams(d, 1, 0, window=5)[0].load_state_dict(state)


def test_memory_source_buckets_by_its_text_columns():
    records = {"index": list(range(48)), "text0": ["字" * (i % 13 + 1) for i in range(48)]}
    records["text1"] = records["text0"][::-1]
    source = MemorySource(records, ["text0", "text1"])
    assert list(source.lengths[0]) == [
        max(len(a), len(b)) for a, b in zip(records["text0"], records["text1"])
    ]
    ss = [BatchStream(source, lambda r: {"ids": r["index"]}, 8, r, 2, 0, bucket_window=6) for r in range(2)]
    got = [b["ids"] for s in ss for b in s.epoch_batches()]
    assert sorted(i for b in got for i in b) == list(range(48))


def test_memory_source_same_semantics():
    records = {"index": list(range(50)), "sentence1": [str(i) for i in range(50)]}
    ss = [BatchStream(MemorySource(records), lambda r: {"ids": r["index"]}, 8, r, 2, 0) for r in range(2)]
    got = [i for s in ss for b in s.epoch_batches() for i in b["ids"]]
    assert len(got) == 48 and len(set(got)) == 48


def test_locate_matches_a_direct_permutation():
    order = EpochOrder([3, 5, 2], seed=1, epoch=0)
    flat = [(blk, int(r)) for blk, rows in order.locate(0, 10) for r in rows]
    assert sorted(flat) == sorted((b, r) for b, n in enumerate([3, 5, 2]) for r in range(n))
    parts = order.locate(2, 7)
    assert [(b, int(r)) for b, rows in parts for r in rows] == flat[2:7]
    assert np.array_equal(order.row_permutation(1), EpochOrder([3, 5, 2], 1, 0).row_permutation(1))


def test_missing_shards_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        index_shards(tmp_path / "nope")


def test_iterating_leaves_the_global_rng_alone(shards):
    """A resume creates a loader mid-run; drawing its seed from the global RNG would shift dropout."""
    import torch

    d, _ = shards
    before = torch.get_rng_state()
    for _ in streams(d, 1, 0)[0].epoch_batches():
        pass
    assert torch.equal(before, torch.get_rng_state())


def test_fast_encoder_equals_the_transformers_tokenizer(tmp_path):
    import torch
    from _train_data import sample_sentences

    from pipeline.data.collate import FastEncoder, ViewCollator
    from pipeline.model import build_char_vocab, make_tokenizer, write_vocab

    texts = sample_sentences(40)
    write_vocab(build_char_vocab(texts[:20]), tmp_path / "vocab.txt")  # unseen characters -> [UNK]
    tok = make_tokenizer(tmp_path / "vocab.txt")
    texts += ["ABC def 123", "短", "很长的句子" * 20]
    ids, mask = FastEncoder(tok, 24)(texts)
    ref = tok(texts, padding=True, truncation=True, max_length=24, return_tensors="pt")
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])
    # views: original, k variants (the original fills a missing one), d dropout copies of the original
    rows = {"id": [1, 2], "text": ["今天天气好", "明天下雨"], "variants": [["今天好", "天气好"], ["明天雨"]]}
    write_vocab(build_char_vocab(rows["text"] * 2), tmp_path / "v2.txt")
    tok = make_tokenizer(tmp_path / "v2.txt")
    out = ViewCollator(tok, 24, num_variants=2, num_dropout_views=1)(rows)
    assert out.num_views == 4 and out.input_ids.shape[0] == 8
    decoded = [tok.decode(x, skip_special_tokens=True).replace(" ", "") for x in out.input_ids]
    assert decoded == [
        "今天天气好",
        "明天下雨",
        "今天好",
        "明天雨",
        "天气好",
        "明天下雨",
        "今天天气好",
        "明天下雨",
    ]


def ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig``, from the SigIgn mask in /proc/PID/status (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_loader_workers_survive_a_preemption_signal(shards):
    """SLURM signals the whole process group: SIGUSR1's default action would kill a worker mid-epoch."""
    import os
    import signal

    import psutil

    d, _ = shards
    full = [b["ids"] for b in streams(d, 1, 0)[0].epoch_batches()]
    stream = streams(d, 1, 2)[0]
    batches = stream.epoch_batches()
    # Children left by earlier tests (a slow worker's exit, a resource tracker) are not this loader's.
    before = {p.pid for p in psutil.Process().children()}
    got = [next(batches)["ids"]]  # the workers are running now
    workers = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    # Worker 0 made the first batch, but worker 1 may still be starting (a loaded machine): signalled
    # before its worker_init_fn ran, it dies by SIGUSR1's default action, which is not what this tests.
    # Wait until the kernel shows SIGUSR1 ignored in each worker (its SigIgn mask).
    deadline = time.monotonic() + 60
    while not all(ignores(w.pid, signal.SIGUSR1) for w in workers):
        assert time.monotonic() < deadline, "a loader worker never ran worker_init_fn"
        time.sleep(0.05)
    for worker in workers:
        os.kill(worker.pid, signal.SIGUSR1)
    got += [b["ids"] for b in batches]
    assert got == full
