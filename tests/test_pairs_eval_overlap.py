"""The pairs stage drops a pair one of whose sides is a sentence of the five scored sets (--exclude_eval,
reason eval_overlap): counted exactly, per source, the rest kept, the same bytes with two workers."""

from __future__ import annotations

from pathlib import Path

from test_pairs_stage import BUNDLED, accounted, rows, stage, write_jsonl

from pipeline.data.eval_overlap import eval_index
from pipeline.normalize import normalize_text
from pipeline.resources import EVAL_DIR

# real first-column sentences of the bundled evaluation files (LCQMC dev, ATEC test, STS-B test, BQ dev)
EVAL_QUESTION = "开初婚未育证明怎么弄？"
EVAL_QUESTION_VARIANT = "借呗还款的账单日?"  # ATEC's "借呗还款的账单日" with a question mark
EVAL_ANSWER = "一群男人在海滩上踢足球。"


def _question(i: int) -> str:
    return f"第{i}个问题应该怎么办理才好"


def _answer(i: int) -> str:
    return f"这是第{i}个回答，先去窗口领表格，再按要求填写并提交材料。"


def write_fixture(root: Path) -> Path:
    """baike2018qa records: title ↔ answer pairs (and title + desc when desc adds something)."""
    records = [
        {"qid": str(i), "category": "c", "title": _question(i), "desc": "", "answer": _answer(i)}
        for i in range(10)
    ]
    records += [
        {"qid": "20", "category": "c", "title": EVAL_QUESTION, "desc": "", "answer": _answer(20)},
        {"qid": "21", "category": "c", "title": EVAL_QUESTION_VARIANT, "desc": "", "answer": _answer(21)},
        {"qid": "22", "category": "c", "title": _question(22), "desc": "", "answer": EVAL_ANSWER},
    ]
    return write_jsonl(root / "baike.json", records)


def test_fixture_sentences_are_what_they_claim():
    index = eval_index(EVAL_DIR)
    assert all(normalize_text(t) in index for t in (EVAL_QUESTION, EVAL_QUESTION_VARIANT, EVAL_ANSWER))
    assert not any(normalize_text(t) in index for i in range(30) for t in (_question(i), _answer(i)))


def test_pairs_with_an_eval_sentence_dropped_and_counted(tmp_path):
    write_fixture(tmp_path / "in")
    manifest = stage([tmp_path / "in"], tmp_path / "on")
    counts = manifest["counts"]
    accounted(counts)
    assert counts["dropped"]["eval_overlap"] == 3
    assert counts["by_source"]["baike2018qa"]["dropped"] == {"eval_overlap": 3}
    assert sorted(r["text"] for r in rows(tmp_path / "on")) == sorted(_question(i) for i in range(10))
    assert len(manifest["audit"]["samples"]["eval_overlap"]) == 3

    off = stage([tmp_path / "in"], tmp_path / "off", exclude_eval=False)
    assert off["counts"]["dropped"]["eval_overlap"] == 0 and off["counts"]["kept"] == 13
    assert {EVAL_QUESTION, EVAL_QUESTION_VARIANT} <= {r["text"] for r in rows(tmp_path / "off")}


def test_two_workers_give_the_bytes_of_one(tmp_path):
    inputs = [write_fixture(tmp_path / "in"), BUNDLED]
    common = dict(pairs_per_shard=500, rows_per_block=100)
    one = stage(inputs, tmp_path / "one", **common)
    stage(inputs, tmp_path / "two", workers=2, **common)
    assert one["counts"]["dropped"]["eval_overlap"] >= 3
    for name in ["manifest.json", *(e["name"] for e in one["shards"])]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
