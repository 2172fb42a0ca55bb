"""The one-line warning when a CUDA run's loader tokenises sentence shards on the fly
(:func:`pipeline.data.token_ids.tokenising_on_gpu`)."""

from __future__ import annotations

import logging

from pipeline.data.token_ids import tokenising_on_gpu
from pipeline.shards import read_shard_set


def test_warns_once_on_cuda_only_when_tokenising_sentence_shards(tiny_shards, caplog):
    shards = read_shard_set(tiny_shards([[16]], num_variants=1))
    with caplog.at_level(logging.WARNING, logger="pipeline.data.token_ids"):
        line = tokenising_on_gpu("cuda", shards, False, False, 48, "models/e5-small")
    assert line is not None and "\n" not in line
    assert f"--shards {shards.directory}" in line and "--model models/e5-small --max_length 48" in line
    assert [r.getMessage() for r in caplog.records] == [line]
    assert tokenising_on_gpu("cpu", shards, False, False, 48, None) is None
    assert tokenising_on_gpu("cuda", shards, True, False, 48, None) is None  # stored ids are padded
    assert tokenising_on_gpu("cuda", shards, False, True, 48, None) is None  # pair shards: no tokenize stage
    assert tokenising_on_gpu("cuda", None, False, False, 48, None) is None  # a supervised file
