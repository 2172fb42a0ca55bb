import json

import numpy as np
import pytest

from pipeline.errors import InputError
from pipeline.preprocess.passes import partition_of, shuffle_keys, text_ids
from pipeline.preprocess.readers import Unit, detect_format, iter_lines, line_number_base, plan_units
from pipeline.preprocess.text import (
    cjk_count,
    clean_paragraphs,
    filter_sentences,
    normalise,
    remove_whitespace,
    split_sentences,
)
from pipeline.shards import sentence_id


def test_normalise_full_width_letters_digits_but_not_chinese_punctuation():
    assert normalise("ＡＢＣ１２３％＋") == "ABC123%+"
    # ，。！？；：（）and Chinese quotes are ordinary Chinese punctuation and stay full width
    assert normalise("好，行。真的！吗？是；如：（注）“引”") == "好，行。真的！吗？是；如：（注）“引”"
    assert normalise("a\x00b\x1fc\u200bd\ufeffe\x7f") == "abcde"


def test_whitespace_removed_in_chinese_kept_between_latin_words():
    assert remove_whitespace("我 爱\t北京　天安门") == "我爱北京天安门"
    assert remove_whitespace("使用 Windows 10 系统 和 New  York") == "使用Windows 10系统和New York"
    assert clean_paragraphs(["１９９８年　新年\n\n  第二段 "]) == ["1998年新年", "第二段"]


def test_sentence_split_keeps_closing_quotes_and_terminator_runs():
    text = "他说：“好！”然后走了。真的吗？！（注）当然……后来呢；结束"
    assert split_sentences(text) == [
        "他说：“好！”",
        "然后走了。",
        "真的吗？！",
        "（注）当然……",
        "后来呢；",
        "结束",
    ]
    assert split_sentences("书名是《三体》。") == ["书名是《三体》。"]
    assert split_sentences("") == []


def test_cjk_count():
    assert cjk_count("中文abc，123𠀀") == 3  # 𠀀 is in extension B


def _lines(*objs):
    return [json.dumps(o, ensure_ascii=False).encode() for o in objs]


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"id": "1", "url": "u", "title": "t", "text": "x"}, "wiki_zh"),
        ({"news_id": "1", "keywords": "", "title": "t", "source": "s", "time": "", "content": "c"},
         "news2016zh"),
        ({"qid": "1", "category": "c", "title": "t", "desc": "", "answer": "a"}, "baike2018qa"),
        ({"qid": "1", "title": "t", "desc": "", "topic": "", "star": 1, "content": "c", "answer_id": "2",
          "answerer_tags": ""}, "webtext2019zh"),
        ({"english": "hi", "chinese": "你好"}, "translation2019zh"),
    ],
)  # fmt: skip
def test_detect_each_collection(record, expected):
    assert detect_format(_lines(record, record, record) + [b"{broken"], "f") == expected


def test_detect_plain_and_unknown_json():
    assert detect_format(["第一行。".encode(), b"123", b"second line"], "f") == "plain"
    with pytest.raises(InputError, match=r"f: JSON lines with keys \(a, b\) match none"):
        detect_format(_lines({"a": 1, "b": 2}), "f")


def test_chunks_read_every_line_once_and_name_absolute_lines(tmp_path):
    path = tmp_path / "big.txt"
    lines = [f"第{i}行" + "字" * (i % 37) for i in range(3000)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    files = [path]
    units, _ = plan_units(files, "plain", chunk_bytes=4096, max_record_bytes=1 << 20)
    assert len(units) > 10
    seen = []
    for unit in units:
        base = line_number_base(unit)
        for number, line, _ in iter_lines(unit, 1 << 20):
            seen.append(line.decode().rstrip("\n"))
            assert lines[base + number - 1] == seen[-1]  # file:line messages name the right line
    assert seen == lines


def test_over_long_line_is_flagged_not_loaded(tmp_path):
    path = tmp_path / "long.txt"
    path.write_bytes(b"ok\n" + b"x" * 50_000 + b"\nafter\n")
    unit = Unit(str(path), None, "none", 0, -1, "plain")
    got = [(n, line) for n, line, _ in iter_lines(unit, max_record_bytes=1024)]
    assert got == [(1, b"ok\n"), (2, None), (3, b"after\n")]


def test_filter_sentences_counts_each_drop_once():
    sentences = [
        "短句。",
        "这是一个足够长的中文句子。",
        "English only sentence here.",
        "长" * 31,
        "𠀀𠀁𠀂𠀃𠀄ab",
    ]
    kept, dropped = filter_sentences(sentences, min_chars=5, max_chars=30, min_cjk_ratio=0.5)
    assert kept == ["这是一个足够长的中文句子。", "𠀀𠀁𠀂𠀃𠀄ab"]  # astral ideographs are one character each
    assert dropped == {"too_short": 1, "too_long": 1, "low_cjk": 1}
    assert [cjk_count(s) for s in kept] == [12, 5]


def test_shuffle_keys_are_a_bijection_and_partitions_are_key_ranges():
    ids = np.arange(10_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    keys = shuffle_keys(ids, seed=3)
    assert len(np.unique(keys)) == len(ids)
    assert not np.array_equal(keys, shuffle_keys(ids, seed=4))
    order = np.argsort(keys)
    parts = partition_of(keys[order], 7)
    assert parts.min() == 0 and parts.max() == 6 and np.all(np.diff(parts.astype(np.int64)) >= 0)
    assert np.array_equal(
        text_ids(["你好", "世界"]), np.array([sentence_id("你好"), sentence_id("世界")], np.uint64)
    )
