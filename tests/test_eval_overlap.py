"""The scored sets stay zero-shot: no sentence the main job trains on occurs in an evaluation file.

The main job (launch/run_sample.sh) preprocesses the bundled corpus and distils on every sentence of
it; the model card and the README call its five STS scores zero-shot. This test builds the same shards
and compares every kept sentence, and every text of the bundled pair collections, with every sentence
of the bundled evaluation files (all splits of the five scored sets, STS-B's train and valid too), by
:func:`pipeline.normalize.normalize_text` (spacing, width, case and punctuation ignored).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from pipeline.normalize import normalize_text
from pipeline.shards import read_shard, shard_paths

REPO = Path(__file__).resolve().parent.parent
RESOURCES = REPO / "pipeline" / "resources"
# The five scored sets, every split the repository holds (a pair file: sentence1, sentence2, label).
SCORED = ("ATEC.test", "BQ.dev", "LCQMC.dev", "PAWSX.dev", "STS-B.train", "STS-B.valid", "STS-B.test")
MAIN_JOB_CORPUS = ("peoples_daily_199801.txt", "taobao_dialogues.jsonl")


def eval_keys() -> dict[str, str]:
    """Every evaluation sentence's key -> the file it came from."""
    keys: dict[str, str] = {}
    for name in SCORED:
        with open(RESOURCES / "eval" / f"{name}.tsv", encoding="utf-8") as f:
            for line in f:
                for text in line.rstrip("\n").split("\t")[:2]:
                    keys.setdefault(normalize_text(text), name)
    keys.pop("", None)
    return keys


def overlap(texts: set[str], keys: dict[str, str]) -> list[tuple[str, str]]:
    return sorted((text, keys[text]) for text in texts if text in keys)


def test_eval_keys_are_read():
    keys = eval_keys()
    # 47,852 pairs; many sentences repeat across pairs, so fewer keys than 2 x pairs but tens of thousands
    assert len(keys) > 40_000
    assert set(keys.values()) == set(SCORED)


def test_main_job_training_sentences_do_not_occur_in_the_evaluation_sets(tmp_path):
    out = tmp_path / "shards"
    corpus = [str(RESOURCES / "corpus" / name) for name in MAIN_JOB_CORPUS]
    cmd = [sys.executable, "-m", "pipeline", "preprocess", *corpus, "--out", str(out),
           "--sentences_per_shard", "8000", "--rows_per_block", "1000", "--progress", "false"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    kept = {normalize_text(text) for path in shard_paths(out) for table in read_shard(path)
            for text in table.column("text").to_pylist()}  # fmt: skip
    assert len(kept) > 60_000  # the whole sample, not an empty or truncated run
    assert overlap(kept, eval_keys()) == []


def test_bundled_pair_collections_do_not_occur_in_the_evaluation_sets():
    """The pair stage's bundled sample (titles, questions, answers, translations) is training text too:
    each field whole and each of its lines."""
    keys = eval_keys()
    texts: set[str] = set()
    for path in sorted((RESOURCES / "corpus" / "pairs").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                fields = [v for v in record.values() if isinstance(v, str)]
                texts.update(normalize_text(part) for v in fields for part in (v, *v.splitlines()))
    texts.discard("")
    assert len(texts) > 1_000
    assert overlap(texts, keys) == []


def test_overlap_finds_a_planted_sentence():
    keys = eval_keys()
    planted = next(iter(keys))
    assert overlap({planted, "这句话不在任何评测集里出现过的样子吧"}, keys) == [(planted, keys[planted])]
