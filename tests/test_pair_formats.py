"""A user's own pair files -> pair shards (``pipeline pairs --format flag|columns``, docs/pairs.md "Your own
pairs"): every format round-trips from the fixtures in tests/fixtures/pairs, gzip or not; ``mine``'s output
feeds back in; the scored sets are kept out; every bad input is one line naming file:line, or a drop
counted by reason with its file:line."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import InputError
from pipeline.shards import read_manifest, read_shard, shard_paths

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pairs"
ROOT = Path(__file__).resolve().parents[1]
PROMPT = "为这个句子生成表示以用于检索相关文章："

# What each fixture gives: (text, positive, hard negatives) per pair.
EXPECTED = {
    "flag.jsonl": {
        ("如何更换手机屏幕", "手机屏幕碎了可以去售后网点更换原装屏幕。",
         ("手机电池不耐用时可以开启省电模式。", "这款手机支持无线充电功能。")),
        (PROMPT + "北京到上海的高铁要多久", "北京南站到上海虹桥的高铁最快约四个半小时。",
         ("上海的地铁线路覆盖了大部分城区。",)),
        (PROMPT + "北京到上海的高铁要多久", "京沪高铁全程大约需要四到六个小时。",
         ("上海的地铁线路覆盖了大部分城区。",)),
        ("煮米饭放多少水合适", "一般米和水的比例是一比一点二左右。", ()),
        # its second negative is its positive but for punctuation: not a negative
        ("猫为什么喜欢晒太阳", "猫晒太阳可以保持体温并帮助合成维生素。", ("狗需要每天带出去散步。",)),
    },
    "triplets.jsonl": {  # the first and third lines are one pair: their negatives are joined
        ("怎么学好英语口语", "多听多说并坚持每天跟读练习能提高口语。",
         ("英语语法包括时态和从句等内容。", "背单词可以用间隔重复的方法。")),
        ("感冒了应该吃什么", "感冒时多喝温水并注意休息。", ("夏天吃西瓜可以解暑。",)),
    },
    "query_answer.csv": {
        ("信用卡逾期会有什么影响", "逾期会影响个人征信，还会产生罚息。", ()),
        ("如何办理护照", "携带身份证到出入境管理部门申请办理。", ()),
    },
    "labelled.tsv": {  # --min_label 1: the row labelled 0 is kept out
        ("今天天气怎么样", "今天的天气如何", ()),
        ("明天会下雨吗", "明天有没有雨", ()),
    },
    "negatives.parquet": {
        ("附近有什么好吃的餐厅", "步行五分钟有一家评价很高的本地菜馆。",
         ("这家餐厅的装修风格很复古。", "周末的电影院人很多。")),
        ("怎样提高睡眠质量", "睡前少看手机并保持规律作息有助于睡眠。", ("早上喝咖啡能让人更清醒。",)),
    },
}  # fmt: skip
FORMAT = {"flag.jsonl": "flag"}  # the others: columns


def convert(inputs: list[Path], out: Path, fmt: str = "columns", **options) -> dict:
    """The stage run in this process; the output's manifest."""
    from pipeline.stages.pairs.run import Config, run

    assert run(Config(inputs=inputs, out=out, format=fmt, progress=False, **options)) == 0
    return read_manifest(out)


def rows(out: Path) -> list[dict]:
    return [r for path in shard_paths(out) for table in read_shard(path) for r in table.to_pylist()]


def triples(out: Path) -> set[tuple]:
    return {(r["text"], r["positive"], tuple(r.get("hard_negatives", ()))) for r in rows(out)}


def gzipped(path: Path, directory: Path) -> Path:
    out = directory / (path.name + ".gz")
    out.write_bytes(gzip.compress(path.read_bytes()))
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
def test_each_format_round_trips_into_pair_shards(tmp_path, name, compressed):
    path = FIXTURES / name
    if compressed:
        path = gzipped(path, tmp_path)
    options = {"min_label": 1.0} if name == "labelled.tsv" else {}
    manifest = convert([path], tmp_path / "out", FORMAT.get(name, "columns"), **options)
    assert triples(tmp_path / "out") == EXPECTED[name]
    counts = manifest["counts"]
    assert counts["kept"] == len(EXPECTED[name]) and manifest["stage"] == "pairs"
    assert sum(counts["records_dropped"].values()) == 0 and counts["dropped"]["eval_overlap"] == 0
    source = name.split(".")[0]
    assert {r["source"] for r in rows(tmp_path / "out")} == {source}
    assert all(e["block_sources"] == [source] for e in manifest["shards"])
    listed = max(len(n) for _, _, n in EXPECTED[name])
    assert manifest.get("hard_negatives", {}).get("k", 0) == listed
    assert ("hard_negatives" in rows(tmp_path / "out")[0]) == (listed > 0)  # the column only when listed


def test_flag_positives_share_their_querys_group_and_counts_say_what_left(tmp_path):
    manifest = convert([FIXTURES / "flag.jsonl"], tmp_path / "out", "flag")
    by_text: dict[str, set[int]] = {}
    for r in rows(tmp_path / "out"):
        by_text.setdefault(r["text"], set()).add(r["group"])
        assert r["kind"] == "user" and r["batch_key"] == ""
    assert all(len(groups) == 1 for groups in by_text.values()) and len(by_text) == 4
    negatives = manifest["counts"]["negatives"]
    assert negatives["listed"] == 6 and negatives["kept"] == 5  # the cat's second negative is its positive
    assert negatives["dropped"]["negative_is_positive"] == 1
    sample = manifest["audit"]["samples"]["negative_is_positive"][0]
    assert sample.startswith(f"{FIXTURES / 'flag.jsonl'}:4:")  # file and line
    assert manifest["counts"]["records"] == 4 and manifest["counts"]["pairs_extracted"] == 5


def test_mines_output_feeds_back_in_as_one_pair_with_all_its_negatives(tmp_path):
    from collections import Counter

    from pipeline.search.mine import write_triples

    mined = tmp_path / "triples.jsonl"
    anchor, positive = "怎么学好英语口语", "多听多说并坚持每天跟读练习能提高口语。"
    negatives = ["英语语法包括时态和从句等内容。", "背单词可以用间隔重复的方法。", "看美剧可以练习听力。"]
    write_triples(mined, [(anchor, positive, n) for n in negatives], Counter())
    manifest = convert([mined], tmp_path / "out")
    assert triples(tmp_path / "out") == {(anchor, positive, tuple(negatives))}
    assert manifest["counts"]["dropped"]["duplicate"] == 2 and manifest["hard_negatives"]["k"] == 3


def test_pairs_and_negatives_of_the_scored_sets_are_dropped_and_counted(tmp_path):
    from pipeline.data.pairs import read_pairs
    from pipeline.resources import EVAL_DIR

    scored = read_pairs(EVAL_DIR / "STS-B.valid.tsv")[:2]
    rice, answer = "煮米饭放多少水合适", "一般米和水的比例是一比一点二左右。"
    lines = [
        {"query": "如何更换手机屏幕", "pos": [scored[0].text_a]},  # a positive of a scored set
        {"query": rice, "pos": [answer], "neg": [scored[1].text_b, "狗需要散步。"]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    manifest = convert([path], tmp_path / "out", "flag")
    assert triples(tmp_path / "out") == {(rice, answer, ("狗需要散步。",))}
    counts = manifest["counts"]
    assert counts["dropped"]["eval_overlap"] == 1
    assert counts["negatives"]["dropped"]["negative_eval_overlap"] == 1
    assert manifest["audit"]["samples"]["eval_overlap"][0].startswith(f"{path}:1: a text of STS-B.valid")
    kept = convert([path], tmp_path / "kept", "flag", exclude_eval=False)["counts"]
    assert kept["kept"] == 2 and kept["negatives"]["kept"] == 2  # without the check both stay


# ------------------------------------------------------------------------------------------- bad input
BAD_LINES = [  # (reason counted, the second line of a --format flag file, what its message says)
    ("bad_json", b'{"query": "q", "pos": ["p"]', "not valid JSON"),
    ("missing_field", b'{"query": "q", "neg": ["n"]}', "missing key 'pos'"),
    ("wrong_type", b'{"query": "q", "pos": "p"}', "pos must be a list of strings, got str"),
    ("wrong_type", b'{"query": "q", "pos": ["p"], "neg": [3]}', "neg[0] must be a string, got int"),
    ("empty_positive_list", b'{"query": "q", "pos": []}', "pos is an empty list"),
    ("empty_text", b'{"query": "  ", "pos": ["p"]}', "query is empty"),
    ("empty_text", b'{"query": "q", "pos": ["p", ""]}', "pos[1] is empty"),
    ("invalid_utf8", b'{"query": "\xff\xfe", "pos": ["p"]}', "not UTF-8 text"),
]
BAD_IDS = [f"{reason}{i}" for i, (reason, *_) in enumerate(BAD_LINES)]
GOOD = '{"query": "煮米饭放多少水合适", "pos": ["一般米和水的比例是一比一点二左右。"]}'


@pytest.mark.parametrize("reason, line, said", BAD_LINES, ids=BAD_IDS)
def test_a_bad_flag_line_is_refused_with_strict_or_dropped_and_counted(tmp_path, reason, line, said):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + line + b"\n")
    with pytest.raises(InputError, match="^" + re.escape(f"{path}:2: {said}")) as error:
        convert([path], tmp_path / "strict", "flag", strict=True)
    assert "\n" not in str(error.value)
    manifest = convert([path], tmp_path / "out", "flag")
    assert manifest["counts"]["records_dropped"][reason] == 1 and manifest["counts"]["kept"] == 1
    (sample,) = manifest["audit"]["samples"][reason]
    assert sample.startswith(f"{path}:2: {said}")


def test_bad_rows_of_columns_files_name_their_line(tmp_path):
    csv_path = tmp_path / "qa.csv"
    csv_path.write_text('query,answer\n问题一,答案一\n问题二,答案二,多出一列\n问题三,""\n', encoding="utf-8")
    manifest = convert([csv_path], tmp_path / "csv")
    dropped = manifest["counts"]["records_dropped"]
    assert dropped["wrong_columns"] == 1 and dropped["empty_text"] == 1 and manifest["counts"]["kept"] == 1
    assert manifest["audit"]["samples"]["wrong_columns"][0].startswith(f"{csv_path}:3: 3 fields")
    assert manifest["audit"]["samples"]["empty_text"][0] == f"{csv_path}:4: answer is empty"
    tsv_path = tmp_path / "scored.tsv"
    tsv_path.write_text("sentence1\tsentence2\tlabel\n甲句\t乙句\t很像\n丙句\t丁句\t1\n", encoding="utf-8")
    with pytest.raises(InputError, match="^" + re.escape(f"{tsv_path}:2: label '很像' is not a number")):
        convert([tsv_path], tmp_path / "tsv", min_label=0.5, strict=True)
    counts = convert([tsv_path], tmp_path / "tsv2", min_label=0.5)["counts"]
    assert counts["records_dropped"]["bad_label"] == 1 and counts["kept"] == 1


@pytest.mark.parametrize(
    "name, body, options, said",
    [
        ("cols.csv", "text,reply\n甲,乙\n", {}, r"unknown column layout \(text, reply\); name the query and"),
        ("cols.jsonl", '{"q": "甲", "a": "乙"}\n', {}, r"unknown column layout \(q, a\)"),
        ("pairs.txt", "甲\t乙\n", {}, "unknown pair file suffix"),
        ("scored.tsv", "sentence1\tsentence2\tlabel\n甲\t乙\t1\n", {}, "has a label column; pass"),
        ("flag.csv", "query,pos\n甲,乙\n", {"fmt": "flag"}, "--format flag reads JSON lines"),
        ("empty.csv", "", {}, "empty; a CSV/TSV pair file's first row names its columns"),
        ("huge.csv", "query,answer\n甲," + "长" * 140_000 + "\n", {}, r":2: not readable as delimited text"),
    ],
)
def test_a_file_the_stage_cannot_read_is_one_line_naming_it(tmp_path, name, body, options, said):
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    with pytest.raises(InputError, match=said) as error:
        convert([path], tmp_path / "out", **options)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_parquet_column_that_is_not_text_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"anchor": [1, 2], "positive": ["甲", "乙"]}), path)
    with pytest.raises(InputError, match=re.escape(f"{path}: column anchor holds int64, not text")):
        convert([path], tmp_path / "out")


def test_corpus_options_are_refused_and_an_output_is_never_clobbered(tmp_path):
    with pytest.raises(InputError, match="--near_duplicates applies to --format corpus"):
        convert([FIXTURES / "flag.jsonl"], tmp_path / "out", "flag", near_duplicates=True)
    convert([FIXTURES / "flag.jsonl"], tmp_path / "out", "flag")
    with pytest.raises(InputError, match="is not empty .* or pass --overwrite"):
        convert([FIXTURES / "flag.jsonl"], tmp_path / "out", "flag")
    assert convert([FIXTURES / "triplets.jsonl"], tmp_path / "out", overwrite=True)["counts"]["kept"] == 2


def test_the_command_line_says_one_line_and_no_traceback(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("text,reply\n甲,乙\n", encoding="utf-8")
    shutil.copy(FIXTURES / "flag.jsonl", tmp_path / "flag.jsonl")
    out = str(tmp_path / "o")
    argv = [sys.executable, "-m", "pipeline", "pairs", "--format", "columns", str(path), "--out", out]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown column layout (text, reply)" in lines[0]
    argv[5:7] = ["flag", str(tmp_path / "flag.jsonl")]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pairs done: kept 5 of 5 pairs from 4 records (5 hard negatives)" in done.stderr
