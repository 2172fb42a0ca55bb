"""Readers for supervised pair and triple files: the bundled STS-B train set, JSONL, and bad lines."""

import json
import logging

import pytest

from pipeline.data.pairs import NLI_LABELS, Pair, Triple, read_pairs, read_triples
from pipeline.errors import InputError
from pipeline.resources import EVAL_DIR


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_bundled_sts_b_train_reads_completely():
    pairs = read_pairs(EVAL_DIR / "STS-B.train.tsv")
    raw_lines = (EVAL_DIR / "STS-B.train.tsv").read_text(encoding="utf-8").splitlines()
    assert len(pairs) == sum(1 for line in raw_lines if line.strip())
    first = raw_lines[0].split("\t")
    assert pairs[0] == Pair(first[0], first[1], float(first[2]))
    assert {p.label for p in pairs} <= {0.0, 1.0, 2.0, 3.0, 4.0, 5.0}


def test_tsv_pairs_strip_text_and_accept_crlf_and_bom(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_bytes("\ufeff 你好 \t您好\t4.5\r\n\r\n再见\t拜拜\t0\r\n".encode())
    assert read_pairs(path) == [Pair("你好", "您好", 4.5), Pair("再见", "拜拜", 0.0)]


def test_jsonl_pairs_and_text_labels_through_a_map(tmp_path):
    path = write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"sentence1": "甲", "sentence2": "乙", "label": 1, "id": 7}, ensure_ascii=False),
            json.dumps({"sentence1": "丙", "sentence2": "丁", "label": "neutral"}, ensure_ascii=False),
            json.dumps({"sentence1": "戊", "sentence2": "己", "label": "0.5"}, ensure_ascii=False),
        ],
    )
    pairs = read_pairs(path, label_map=NLI_LABELS)
    assert [p.label for p in pairs] == [1.0, 2.0, 0.5]
    with pytest.raises(InputError, match=r"p.jsonl:2: label 'neutral' is not a number; pass label_map"):
        read_pairs(path)


def test_triples_from_tsv_and_jsonl(tmp_path):
    tsv = write(tmp_path / "t.tsv", ["一个人在跑步\t有人在运动\t没有人在动"])
    jsonl = write(
        tmp_path / "t.jsonl",
        [json.dumps({"anchor": "a", "positive": "b", "negative": "c"})],
    )
    assert read_triples(tsv) == [Triple("一个人在跑步", "有人在运动", "没有人在动")]
    assert read_triples(jsonl) == [Triple("a", "b", "c")]


@pytest.mark.parametrize(
    "line,problem",
    [
        ("只有两列\t1", "expected 3 tab-separated columns (text_a, text_b, label), got 2"),
        ("a\tb\tc\td", "expected 3 tab-separated columns (text_a, text_b, label), got 4"),
        ("a\tb\thigh", "label 'high' is not a number"),
        ("a\tb\tnan", "label 'nan' is not a finite number"),
        ("a\t  \t1", "text_b is empty"),
    ],
)
def test_bad_tsv_line_names_file_line_and_problem(tmp_path, line, problem):
    path = write(tmp_path / "bad.tsv", ["好\t很好\t3", line])
    with pytest.raises(InputError, match="bad.tsv:2: " + problem.replace("(", r"\(").replace(")", r"\)")):
        read_pairs(path)


@pytest.mark.parametrize(
    "record,problem",
    [
        ('{"sentence1": "a", "sentence2": "b"}', "missing key\\(s\\) label"),
        ('["a", "b", 1]', "expected a JSON object, got list"),
        ("{not json", "not valid JSON"),
        ('{"sentence1": "a", "sentence2": 3, "label": 1}', "text_b must be a string"),
        ('{"sentence1": "a", "sentence2": "b", "label": true}', "label must be a number"),
    ],
)
def test_bad_jsonl_line_names_file_line_and_problem(tmp_path, record, problem):
    path = write(tmp_path / "bad.jsonl", ['{"sentence1": "a", "sentence2": "b", "label": 1}', record])
    with pytest.raises(InputError, match="bad.jsonl:2: " + problem):
        read_pairs(path)


def test_non_strict_skips_counts_and_warns(tmp_path, caplog):
    path = write(tmp_path / "mixed.tsv", ["a\tb\t1", "broken", "c\td\t2", "e\t\t3"])
    with caplog.at_level(logging.WARNING, logger="pipeline.data.pairs"):
        pairs = read_pairs(path, strict=False)
    assert [p.text_a for p in pairs] == ["a", "c"]
    assert "skipped 2 bad line(s) of 4" in caplog.text and "mixed.tsv:2:" in caplog.text


def test_missing_empty_and_unknown_format(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_pairs(tmp_path / "nope.tsv")
    with pytest.raises(InputError, match="no valid pair records"):
        read_pairs(write(tmp_path / "empty.tsv", ["", "  "]))
    with pytest.raises(InputError, match="no valid triple records; first problem: .*all_bad.tsv:1"):
        read_triples(write(tmp_path / "all_bad.tsv", ["x\ty"]), strict=False)
    with pytest.raises(InputError, match="unknown pair format '.csv'"):
        read_pairs(write(tmp_path / "p.csv", ["a,b,1"]))
    latin = tmp_path / "latin.tsv"
    latin.write_bytes("caf\xe9\tb\t1\n".encode("latin-1"))
    with pytest.raises(InputError, match="not UTF-8"):
        read_pairs(latin)


def test_a_non_utf8_line_is_one_bad_record_not_the_whole_file(tmp_path, caplog):
    path = tmp_path / "mixed.tsv"
    path.write_bytes("好\t很好\t3\n".encode() + b"caf\xe9\tb\t1\n" + "坏\t不好\t0\n".encode())
    with caplog.at_level(logging.WARNING, logger="pipeline.data.pairs"):
        pairs = read_pairs(path, strict=False)
    assert [p.text_a for p in pairs] == ["好", "坏"]
    assert "mixed.tsv:2: not UTF-8" in caplog.text
    with pytest.raises(InputError, match="mixed.tsv:2: not UTF-8"):
        read_pairs(path)


def test_aliases_lists_of_positives_and_optional_labels(tmp_path):
    rows = [{"query": "问", "pos": ["答一", "答二"]}, {"anchor": "甲", "positive": "乙", "score": 2}]
    path = write(tmp_path / "p.jsonl", [json.dumps(r, ensure_ascii=False) for r in rows])
    assert read_pairs(path, require_label=False) == [
        Pair("问", "答一", None),
        Pair("问", "答二", None),
        Pair("甲", "乙", 2.0),
    ]
    with pytest.raises(InputError, match=r"p.jsonl:1: missing key\(s\) label \(or score\)"):
        read_pairs(path)
    tsv = write(tmp_path / "p.tsv", ["一\t二", "三\t四\t1"])
    assert [p.label for p in read_pairs(tsv, require_label=False)] == [None, 1.0]
    with pytest.raises(InputError, match=r"p.tsv:1: expected 3 tab-separated columns"):
        read_pairs(tsv)


def test_a_cblue_json_array_reads_as_records_and_names_a_bad_one(tmp_path):
    """CHIP-STS (text1/text2) and KUAKE-QQR (query1/query2) come as one JSON array, labels as strings."""
    chip = tmp_path / "CHIP-STS_train.json"
    chip.write_text(json.dumps([{"id": "1", "text1": "甲", "text2": "乙", "label": "1", "category": "x"}]))
    kuake = tmp_path / "KUAKE-QQR_train.json"
    kuake.write_text(json.dumps([{"id": "s1", "query1": "丙", "query2": "丁", "label": "2"},
                                 {"id": "s2", "query1": "戊", "query2": "", "label": "0"}]))  # fmt: skip
    assert read_pairs(chip) == [Pair("甲", "乙", 1.0)]
    assert read_pairs(kuake, strict=False) == [Pair("丙", "丁", 2.0)]
    with pytest.raises(InputError, match=r"KUAKE-QQR_train.json:record 2: text_b is empty"):
        read_pairs(kuake)
