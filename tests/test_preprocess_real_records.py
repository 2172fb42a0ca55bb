"""Preprocess on real public records of the five nlp_chinese_corpus collections and CLUECorpusSmall.

The records (tests/fixtures/real_records; sources, commits and licences in
pipeline/resources/README.md) carry what the corpora really contain: MediaWiki conversion markup,
HTML tags and entities, quotes closed mid-sentence, brackets the wiki extractor emptied, Latin
product and person names, clause-separating spaces, a truncated answer, a wiki title line,
traditional characters and one malformed line. Each test pins one class of issue 23.
"""

import re

import pytest
from _real_records import CLUE_SENTENCES, real_layout

from pipeline.shards import read_manifest, read_shard
from pipeline.stages.preprocess.run import Config, run

SENTENCE_REASONS = (
    "too_short", "too_long", "low_cjk", "title", "truncated", "eval_overlap", "duplicate", "near_duplicate"
)
RECORD_REASONS = ("empty", "invalid_utf8", "bad_json", "missing_field", "too_long_record", "unreadable")


def _texts(out) -> list[str]:
    manifest = read_manifest(out)
    return [t for e in manifest["shards"] for b in read_shard(out / e["name"]) for t in b["text"].to_pylist()]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    inputs = real_layout(root / "in")
    out = root / "out"
    run(Config(inputs=[inputs], out=out, sentences_per_shard=1000, rows_per_block=100))
    return read_manifest(out), _texts(out), inputs


def test_formats_detected_and_every_record_accounted(real_run):
    manifest, texts, inputs = real_run
    counts, dropped = manifest["counts"], manifest["counts"]["dropped"]
    assert counts["sentences_split"] == counts["kept"] + sum(dropped[r] for r in SENTENCE_REASONS)
    assert counts["records"] == counts["records_with_text"] + sum(dropped[r] for r in RECORD_REASONS)
    assert counts["kept"] == len(texts) == len(set(texts)) > 300
    # the README's structure line of news2016zh (single quotes) is the one malformed real line
    assert dropped["bad_json"] == 1
    assert manifest["audit"]["samples"]["bad_json"] == [
        f"{inputs}/new2016zh/news2016zh_valid.json.gz:2: bad_json: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    ]


def test_no_wiki_conversion_markup_html_or_entities_kept(real_run):
    manifest, texts, _ = real_run
    markup = re.compile(r"-\{|\}-|<[A-Za-z/!][^<>]*>|&(?:#\d+|[A-Za-z]+);")
    assert [t for t in texts if markup.search(t)] == []
    # the simplified variant of each -{...}- block is what remains, and a ";" inside it splits nothing
    assert "同时，在XBOX版中制作组还添加了一些传奇巨星，例如贝利和丹尼斯·博格坎普。" in texts
    assert any(t.startswith("罗宾·索德林（Robin Söderling），瑞典职业男子网球运动员") for t in texts)
    assert any("恐怖小说《魔女嘉莉》。" in t for t in texts)
    shilin = "相较于今日行政区，其范围大致包括垦地里西南部凸出部分、芳草里、西屯里西北部"
    assert any(t.startswith(shilin) for t in texts)
    # <br> in a webtext2019zh description separates two sentences; both are kept
    assert {"那么现在会不会有智能机器人能从事文学创作？", "如果有，能写出什么水平的作品？"} <= set(texts)
    rules = manifest["audit"]["rules"]
    assert rules["wiki_markup"] >= 5 and rules["html_tags"] >= 1 and rules["html_entities"] >= 3
    assert manifest["audit"]["samples"]["html_tags"][0]["before"].count("<br>") == 1


def test_no_sentence_starts_with_a_closing_mark_or_separator(real_run):
    _, texts, _ = real_run
    assert [t for t in texts if t[0] in "，、,：:；;）)」』”’》】〕〗〉"] == []
    # closing quote + comma: the sentence goes on
    assert "然后他等了五年，向心爱的公主表白说：“公主，我爱你！”，公主说了一个字，王子就昏倒了。" in texts
    quotes = "留意到照片的网友留言称，“好奇金色的瓶子是什么？”，“Ready Q是什么意思？”，"
    assert any(t.startswith(quotes) for t in texts)
    # an ellipsis closing an enumeration in brackets does not end the sentence
    assert any("雷蒙吕克，斯多葛主义……）里开了脑洞" in t for t in texts)


def test_no_empty_brackets(real_run):
    manifest, texts, _ = real_run
    empty = re.compile(r"[（(][\s，,、；;：:]*[）)]|「」|『』|【】|《》|“”")
    assert [t for t in texts if empty.search(t)] == []
    assert "另，本人今年高二是09年注册的号。" in texts
    assert any("UDF是由光学储存技术协会（OSTA）开发并维护的。" in t for t in texts)
    assert manifest["audit"]["rules"]["empty_brackets"] >= 5


def test_chinese_with_latin_names_kept_english_dropped(real_run):
    manifest, texts, _ = real_run
    for sentence in [
        "2009年10月16日，宣布George Mulligan接替路易斯·卡尔德拉。",
        "自1997年起，保守党的彭德森（Owen Paterson）一直连任。",
        "Mac OS X不能以VAT方式载入，相似于发生在Sony Mavica摄影机的一样。",
        "其实，照片中的金色瓶子就是Handok出品的Ready Q。",
    ]:
        assert sentence in texts  # each has under 50% CJK characters: the old filter dropped it
    assert not [t for t in texts if not re.search(r"[\u4e00-\u9fff]", t)]
    assert "I don't think this is true." not in texts
    assert manifest["counts"]["dropped"]["low_cjk"] >= 3
    assert "What can I learn right now" in manifest["audit"]["samples"]["low_cjk"][0]


def test_spaces_between_clauses_become_commas(real_run):
    manifest, texts, _ = real_run
    assert "故宫淡季门票40元，“黑导游”卖外地客140元" in texts  # news2016zh title
    assert any(t.startswith("不过，秋季进补要注意“四忌”，一忌多多益善。") for t in texts)  # baike2018qa
    assert manifest["audit"]["rules"]["clause_spaces"] >= 3


def test_truncated_answer_and_wiki_title_dropped_and_counted(real_run):
    manifest, texts, _ = real_run
    dropped, samples = manifest["counts"]["dropped"], manifest["audit"]["samples"]
    assert not [t for t in texts if t.endswith("那是人工智能领域一个")]
    assert dropped["truncated"] == 1 and samples["truncated"][0].endswith("那是人工智能领域一个")
    previous = "AlphaGo不会写小说，它是专用的，不会做跨出它领域的其它事情，比如语音识别，人脸识别，"
    assert previous + "自动驾驶，写小说或者理解小说。" in texts
    assert "经济学" not in texts and dropped["title"] == 1 and samples["title"] == ["经济学"]


def test_traditional_to_simplified_is_an_option(tmp_path):
    run(Config(inputs=[CLUE_SENTENCES], out=tmp_path / "kept"))
    run(Config(inputs=[CLUE_SENTENCES], out=tmp_path / "simplified", to_simplified=True))
    kept, simplified = _texts(tmp_path / "kept"), _texts(tmp_path / "simplified")
    # by default the text stays as written
    assert any(t.startswith("這家生意挺好的過了下午一點客人依舊絡繹不絕") for t in kept)
    assert any(t.startswith("这家生意挺好的过了下午一点客人依旧络绎不绝") for t in simplified)
    assert not any(t.startswith("這家") for t in simplified)
    audit = read_manifest(tmp_path / "simplified")["audit"]
    assert audit["rules"]["to_simplified"] >= 2 and "這家" in audit["samples"]["to_simplified"][0]["before"]
    assert read_manifest(tmp_path / "kept")["audit"]["rules"]["to_simplified"] == 0
