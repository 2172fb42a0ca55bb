import json

import numpy as np
import pytest

from pipeline.errors import InputError
from pipeline.shards import sentence_id
from pipeline.stages.corpus.passes import partition_of, shuffle_keys
from pipeline.stages.corpus.readers import Unit, detect_format, iter_lines, line_number_base, plan_units
from pipeline.stages.preprocess.passes import text_ids
from pipeline.stages.preprocess.text import (
    Cleaner,
    cjk_count,
    clean_paragraphs,
    convert_language_markup,
    filter_sentences,
    normalise,
    remove_empty_brackets,
    remove_whitespace,
    split_sentences,
    strip_html,
)


def test_normalise_full_width_letters_digits_but_not_chinese_punctuation():
    assert normalise("ＡＢＣ１２３％＋") == "ABC123%+"
    # ，。！？；：（）and Chinese quotes are ordinary Chinese punctuation and stay full width
    assert normalise("好，行。真的！吗？是；如：（注）“引”") == "好，行。真的！吗？是；如：（注）“引”"
    assert normalise("a\x00b\x1fc\u200bd\ufeffe\x7f") == "abcde"


def test_whitespace_removed_in_chinese_kept_between_latin_words():
    assert remove_whitespace("我 爱\t北京　天安门") == "我爱北京天安门"
    assert remove_whitespace("使用 Windows 10 系统 和 New  York") == "使用Windows 10系统和New York"
    assert clean_paragraphs(["１９９８年　新年\n\n  第二段 "]) == ["1998年新年", "第二段"]


def test_accented_latin_keeps_its_space_and_clause_spaces_become_commas():
    # the example (a space after an accented letter used to be dropped)
    assert remove_whitespace("法国学者 René Worms 创办") == "法国学者René Worms创办"
    assert remove_whitespace("Söderling ist ein Tennisspieler") == "Söderling ist ein Tennisspieler"
    # a lone space between two Chinese clauses stands for a comma ...
    title = remove_whitespace("故宫淡季门票40元 “黑导游”卖外地客140元")
    assert title == "故宫淡季门票40元，“黑导游”卖外地客140元"
    # ... but word-segmented text (a space every word or two) is only joined
    assert remove_whitespace("我 爱 北京 天安门 广场") == "我爱北京天安门广场"


def test_wiki_language_conversion_keeps_the_simplified_variant():
    assert convert_language_markup("-{zh-cn:域;zh-tw:体}-名") == "域名"
    assert convert_language_markup("-{zh-hant:軟體; zh-hans:软件;}-工程") == "软件工程"
    assert convert_language_markup("-{zh-tw:程式碼;zh-hk:程式碼;}-") == "程式碼"  # no simplified variant
    assert convert_language_markup("村-{庄}-和-{FIFA}-") == "村庄和FIFA"
    assert convert_language_markup("罗宾·-{A|zh-hk:苏达宁;zh-hans:索德林;}-") == "罗宾·索德林"
    # a page-wide rule shows nothing
    assert convert_language_markup("-{H|zh-cn:记忆体;zh-tw:内存;}-内存条") == "内存条"
    assert convert_language_markup("-{R|zh-cn:x}-") == "zh-cn:x"  # raw
    nested = convert_language_markup("外-{zh-cn:内-{x}-层;zh-tw:內層}-，西屯-{}-里，断开的-{zh-cn:")
    assert nested == "外内x层，西屯里，断开的zh-cn:"


def test_html_tags_and_entities():
    assert strip_html("创作？<br>如果有，<BR/>写出<br />作品") == "创作？\n如果有，\n写出\n作品"
    assert strip_html("<poem>床前明月光</poem>前<nowiki>-{x}-</nowiki>后") == "\n床前明月光\n前-{x}-后"
    assert strip_html('正文<ref name="a">引用</ref>继续<ref name="b"/>。<!-- 注释 -->') == "正文继续。"
    assert strip_html("当a<b且b>c时") == "当a<b且b>c时"  # not a tag
    cleaner = Cleaner()
    assert cleaner.paragraphs("中新网3月28日电 &nbsp;据丹麦驻华大使馆&amp;中国<b>消息</b>") == [
        "中新网3月28日电，据丹麦驻华大使馆&中国消息"
    ]
    assert cleaner.audit()["rules"] == {"clause_spaces": 1, "html_entities": 1, "html_tags": 1}


def test_empty_brackets_and_separators_at_bracket_edges():
    assert remove_empty_brackets("佩图拉·克拉克，CBE（，）是英国歌手「」") == "佩图拉·克拉克，CBE是英国歌手"
    edges = remove_empty_brackets("罗宾（Robin Söderling，），协会（，OSTA）")
    assert edges == "罗宾（Robin Söderling），协会（OSTA）"
    assert remove_empty_brackets("函数f()和（注）") == "函数f和（注）"
    # in a batch the candidates are found by character classes; a bracket that opens at the end of
    # one sentence and one that closes at the start of the next are not a pair
    batch = ["第一句（）在这里。", "结尾是左括号（", "）开头是右括号", "作者（Robin，）。", "没有括号。"]
    kept, _, _, repaired = filter_sentences(batch, min_chars=1, max_chars=99, min_cjk_ratio=0.5)
    assert repaired == [("第一句（）在这里。", "第一句在这里。"), ("作者（Robin，）。", "作者（Robin）。")]
    assert kept == ["第一句在这里。", "结尾是左括号（", "）开头是右括号", "作者（Robin）。", "没有括号。"]


def test_sentence_split_does_not_cut_before_a_comma_or_after_an_ellipsis_in_brackets():
    assert split_sentences("她说：“我爱你！”，他就昏倒了。真的吗？」、对。") == [
        "她说：“我爱你！”，他就昏倒了。",
        "真的吗？」、对。",
    ]
    assert split_sentences("（甲，乙……）里开了脑洞。下一句。") == ["（甲，乙……）里开了脑洞。", "下一句。"]
    assert split_sentences("，、开头的标点不要。") == ["开头的标点不要。"]
    assert split_sentences("）」后面也是。") == ["后面也是。"]


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


def test_cjk_share_counts_words_and_numbers_not_characters():
    sentences = [
        "使用Windows 10系统的人很多。",  # 8 CJK of 10 units (old rule: 8 of 17 characters, dropped)
        "2009年10月16日，宣布George Mulligan接替路易斯·卡尔德拉。",
        "In Italy, there is no real public pressure.",
        "12.5 13.6 14.7 15.8 单位",  # numbers are units too: a table row stays out
        "2014、2015、2016",
        "ようこそ日本へ、東京です。",
        "7019元；",  # a fragment: one ideograph is not enough whatever the share
    ]
    kept, dropped, masks, _ = filter_sentences(sentences, min_chars=5, max_chars=256, min_cjk_ratio=0.5)
    assert kept == sentences[:2]
    assert dropped["low_cjk"] == 5 and masks["low_cjk"].tolist() == [False] * 2 + [True] * 5


def test_filter_sentences_counts_each_drop_once():
    sentences = [
        "短句。",
        "这是一个足够长的中文句子。",
        "English only sentence here.",
        "长" * 31,
        "𠀀𠀁𠀂𠀃𠀄ab",
    ]
    kept, dropped, _, _ = filter_sentences(sentences, min_chars=5, max_chars=30, min_cjk_ratio=0.5)
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
