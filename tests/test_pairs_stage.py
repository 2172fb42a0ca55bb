"""The pairs stage (`python -m pipeline pairs`) and the teacher's consistency filter over its shards.

Real-format records of the five collections (tests/fixtures/real_records, the README's example
records) and the bundled real pair sample (pipeline/resources/corpus/pairs) go through the real
readers; small synthetic records pin the rules: groups, drop reasons, dedup, the too-easy rule.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from _real_records import real_layout

from pipeline.errors import ConfigError
from pipeline.normalize import key_text, normalize_text
from pipeline.resources import ROOT as RESOURCES
from pipeline.shards import block_index, read_manifest, read_shard, read_shard_set, set_index
from pipeline.stages.pairs.extract import group_id, too_easy
from pipeline.stages.pairs.passes import PAIR_REASONS, PAIR_SCHEMA, RECORD_REASONS
from pipeline.stages.pairs.run import Config, run

BUNDLED = RESOURCES / "corpus" / "pairs"


def rows(out: Path) -> list[dict]:
    manifest = read_manifest(out)
    return [r for e in manifest["shards"] for b in read_shard(out / e["name"]) for r in b.to_pylist()]


def stage(inputs: list[Path], out: Path, **options) -> dict:
    options.setdefault("progress", False)
    assert run(Config(inputs=inputs, out=out, **options)) == 0
    return read_manifest(out)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def accounted(counts: dict) -> None:
    """Every extracted pair is kept or dropped for one reason; every record gives pairs or a reason."""
    assert counts["pairs_extracted"] == counts["kept"] + sum(counts["dropped"][r] for r in PAIR_REASONS)
    assert counts["records"] == counts["records_with_pairs"] + sum(
        counts["dropped"][r] for r in RECORD_REASONS
    )
    for source in counts["by_source"].values():
        assert source["pairs_extracted"] == source["kept"] + sum(
            n for r, n in source["dropped"].items() if r in PAIR_REASONS
        )


# --------------------------------------------------------------------------------------------- rules
def test_key_text_is_normalize_text():
    texts = [
        "ＡＢＣ１２３！ 你好，世界。",
        "𠀀汉字\u200b𠀁",
        "Ⅻ ﬁ ㍿ ℃",
        "Straße ΣΑΣ",
        "a\u0301 e\u200d\u0301",
        "",
        "  ",
        "Ａ\u0301…",
        "\u00a0x\u3000y",
        "①②㍿",
        "（你好）：“是”！",
    ]
    for path in sorted(BUNDLED.glob("*.gz")):  # every text field of the bundled real records
        texts += [v for line in gzip.open(path) for v in json.loads(line).values() if isinstance(v, str)]
    assert [key_text(t) for t in texts] == [normalize_text(t) for t in texts]


@pytest.mark.parametrize(
    ("a", "b", "easy"),
    [
        ("故宫门票40元", "故宫门票40元", True),  # equal
        ("故宫淡季门票40元黑导游", "故宫淡季门票40元黑导游卖外地客", True),  # a prefix of 11 of 15 chars
        (
            "经济学",
            "经济学是一门对产品和服务的生产分配以及消费进行研究的社会科学",
            False,
        ),  # a title at its start
        ("今天北京天气怎么样", "北京今天天气怎么样", False),  # same characters, few shared 3-grams
        ("北京今天的天气怎么样啊", "北京今天的天气怎么样呀", True),  # 3-gram Jaccard 0.8
        ("", "任何文字", True),
    ],
)
def test_too_easy_rule(a, b, easy):
    assert too_easy(a, b, prefix_ratio=0.5, jaccard=0.6) is easy


def test_options_are_checked():
    with pytest.raises(ConfigError, match="no inputs"):
        Config(inputs=[])
    with pytest.raises(ConfigError, match="max_anchor_chars"):
        Config(inputs=[Path("x")], min_anchor_chars=10, max_anchor_chars=5)
    with pytest.raises(ConfigError, match="easy_jaccard"):
        Config(inputs=[Path("x")], easy_jaccard=1.5)


# --------------------------------------------------------------------------------------------- real records
@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    inputs = real_layout(root / "in")
    out = root / "out"
    manifest = stage([inputs], out, pairs_per_shard=4, rows_per_block=2)
    return manifest, rows(out), out


def test_every_collection_gives_its_pairs_with_groups_and_batch_keys(real_run):
    manifest, found, _ = real_run
    by = {(r["source"], r["kind"]): r for r in found}
    assert set(by) == {
        ("webtext2019zh", "question-answer"),
        ("baike2018qa", "question-answer"),
        ("news2016zh", "title-lead"),
        ("wiki_zh", "title-paragraph"),
        ("translation2019zh", "zh-en"),
    }
    web = by["webtext2019zh", "question-answer"]
    # title + desc (its <br> gone) as the anchor, the answer without its cut-off tail as the positive
    assert (
        web["text"] == "AlphaGo只会下围棋吗？阿法狗能写小说吗？"
        "那么现在会不会有智能机器人能从事文学创作？如果有，能写出什么水平的作品？"
    )
    assert web["positive"].startswith("AlphaGo只会下围棋，因为它的设计目的") and web["positive"].endswith(
        "。"
    )
    assert (web["group"], web["batch_key"]) == (group_id("webtext2019zh", "65618973"), "机器人")
    baike = by["baike2018qa", "question-answer"]
    assert (baike["batch_key"], baike["group"]) == (
        "生活知识",
        group_id("baike2018qa", "qid_2540946131115409959"),
    )
    assert baike["positive"].startswith("你好！当然是冬天进补好的了")
    news = by["news2016zh", "title-lead"]
    assert (news["text"], news["batch_key"]) == ("故宫淡季门票40元，“黑导游”卖外地客140元", "新华网")
    assert news["positive"].startswith("近日有网友微博爆料称") and len(news["positive"]) <= 256
    wiki = by["wiki_zh", "title-paragraph"]
    assert (wiki["text"], wiki["batch_key"]) == ("经济学", "")
    assert (
        wiki["positive"] == "经济学是一门对产品和服务的生产、分配以及消费进行研究的社会科学。"
        "西方语言中的“经济学”一词源于古希腊的。"
    )
    zh = by["translation2019zh", "zh-en"]
    assert zh["positive"] == "In Italy, there is no real public pressure for a new, fairer tax system."
    # the news record's desc is the cut-off start of its content: one pair stays (title <-> lead)
    counts = manifest["counts"]
    assert counts["by_source"]["news2016zh"]["dropped"] == {"bad_json": 1, "sibling_duplicate": 1}
    assert counts["kept_by_kind"] == {"question-answer": 2, "title-lead": 1, "title-paragraph": 1, "zh-en": 1}
    accounted(counts)
    # the ids are the pair keys, the text column the anchor
    assert len({r["id"] for r in found}) == len(found) == counts["kept"] == 5


def test_shards_manifest_and_block_indexes_are_readable(real_run):
    manifest, found, out = real_run
    assert manifest["stage"] == "pairs" and manifest["totals"]["sentences"] == len(found)
    assert len(manifest["shards"]) == 2  # 5 pairs, 4 per shard, 2 per block
    for entry in manifest["shards"]:
        index = block_index(out, entry)  # checks the index file's sha256 against the manifest
        blocks = list(read_shard(out / entry["name"]))
        assert [b.num_rows for b in blocks] == [index.rows[i] for i in range(len(index))]
        assert all(b.schema.names == PAIR_SCHEMA.names for b in blocks)
        assert [int(n) for n in index.lengths(0)] == [len(t) for t in blocks[0]["text"].to_pylist()]
    assert read_shard_set(out).stage == "pairs" and set_index(out, manifest) is not None


# --------------------------------------------------------------------------------------------- rules in a run
def synthetic(root: Path) -> Path:
    answer = "要多喝水，注意休息，如果三天后还发烧就去医院看看。"
    fever = "先量一下体温，超过三十八度五就吃退烧药，多喝温水，睡觉时别捂得太厚，第二天还不退就去医院。"
    records = [
        (1, "感冒了怎么办", answer),
        (1, "感冒了怎么办", "吃点药，睡一觉就好了，不用太担心。"),
        (2, "感冒了 怎么办？", answer.replace("，", ", ")),  # qid 1's first pair under normalize_text
        (3, "发烧了应该怎么处理才好呢", fever),
        (
            4,
            "发烧了应该怎么处理才好呢",
            fever.replace("温水", "热水"),
        ),  # one character changed: a near duplicate
        (5, "好", answer),
        (6, "为什么天是蓝的", "对。"),
        (7, "Why is the sky blue", answer),
        (8, "今天北京天气怎么样", "今天北京天气怎么样啊"),
    ]
    topic = {1: "健康", 2: "健康", 3: "健康", 4: "健康"}
    rows = [
        {
            "qid": q,
            "title": t,
            "desc": "",
            "topic": topic.get(q, ""),
            "star": 1,
            "content": c,
            "answer_id": 10 * q + i,
        }
        for i, (q, t, c) in enumerate(records)
    ]
    write_jsonl(root / "web.json", [*rows, {"qid": 9, "title": "缺了回答"}])
    return root


def test_groups_duplicates_and_drop_reasons(tmp_path):
    manifest = stage([synthetic(tmp_path / "in")], tmp_path / "out", near_duplicates=True)
    found = rows(tmp_path / "out")
    counts = manifest["counts"]
    dropped = {k: v for k, v in counts["dropped"].items() if v}
    assert dropped == {
        "anchor_too_short": 1,  # "好"
        "positive_too_short": 1,  # "对。"
        "anchor_low_cjk": 1,  # an English question
        "too_easy": 1,  # the answer repeats the question
        "duplicate": 1,  # qid 2 = qid 1's first pair under normalize_text
        "near_duplicate": 1,  # qid 3 vs 4
        "missing_field": 1,  # qid 9 has no content
    }
    accounted(counts)
    # qid 1's two answers are two positives of one group
    groups = [r["group"] for r in found if r["text"].startswith("感冒了")]
    assert sorted(groups) == [group_id("webtext2019zh", "1")] * 2
    assert {r["batch_key"] for r in found} == {"健康"}
    assert counts["kept"] == len(found) == 3


def test_two_tasks_give_the_bytes_of_one_run(tmp_path):
    inputs = [synthetic(tmp_path / "in"), BUNDLED]
    one = tmp_path / "one"
    stage(inputs, one, near_duplicates=True, pairs_per_shard=500, rows_per_block=100)
    two = tmp_path / "two"
    for phase in ("split", "dedup", "shards", "finalize"):
        for task in (1, 0):
            options = dict(near_duplicates=True, pairs_per_shard=500, rows_per_block=100, progress=False)
            cfg = Config(inputs=inputs, out=two, phase=phase, task_index=task, num_tasks=2, **options)
            assert run(cfg) == 0
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir()) and len(names) > 3
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in names)


# ------------------------------------------------------------------------------------- the bundled sample
def test_bundled_real_pairs_go_through_the_readers_and_stay_out_of_the_eval_sets(tmp_path):
    manifest = stage([BUNDLED], tmp_path / "out")
    counts = manifest["counts"]
    assert set(counts["by_source"]) == {"baike2018qa", "translation2019zh", "wiki_zh"}
    assert counts["by_source"]["baike2018qa"]["records"] == 800
    assert counts["by_source"]["translation2019zh"]["records"] == 1500
    assert counts["by_source"]["wiki_zh"]["records"] == 300
    assert set(counts["kept_by_kind"]) == {"question-answer", "question-desc", "zh-en", "title-paragraph"}
    assert counts["kept"] > 2500
    accounted(counts)
    eval_texts = set()
    for directory in (RESOURCES / "eval",):
        for path in directory.rglob("*.tsv"):
            for line in path.read_text(encoding="utf-8").splitlines():
                eval_texts.update(normalize_text(c) for c in line.split("\t") if len(normalize_text(c)) >= 2)
    found = rows(tmp_path / "out")
    assert not [
        r
        for r in found
        if normalize_text(r["text"]) in eval_texts or normalize_text(r["positive"]) in eval_texts
    ]
    total = sum(p.stat().st_size for p in BUNDLED.glob("*.gz"))
    assert total < 1 << 20


# ------------------------------------------------------------------------------------- consistency filter
def test_pair_scores_rank_against_the_pool_without_the_group():
    from pipeline.stages.teacher.consistency import pair_scores, windows

    assert [w.tolist() for w in windows(np.arange(7), 3)] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [w.tolist() for w in windows(np.arange(2), 3)] == [[0, 1]]
    e = np.eye(4, dtype=np.float32)
    anchors = np.stack([e[0], e[1], e[2], e[0]])
    positives = np.stack([e[1], e[1], e[2], e[0]])  # pair 0's partner is far; pair 3 is its twin
    groups = np.array([1, 2, 3, 4], dtype=np.uint64)
    s = pair_scores(anchors, positives, ["a"] * 4, groups, pool=8)
    assert s.rank.tolist() == [2, 1, 1, 1] and s.pool.tolist() == [4, 4, 4, 4]
    assert s.cosine.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert s.keep(1).tolist() == [False, True, True, True] and s.keep(0).all()
    # the same anchor-positive pair in another group of the same record is no competitor
    s = pair_scores(anchors, positives, ["a"] * 4, np.array([1, 2, 3, 1], dtype=np.uint64), pool=8)
    assert s.rank.tolist()[0] == 1 and s.pool.tolist() == [3, 4, 4, 3]
    # other sources never share a pool
    s = pair_scores(anchors, positives, ["a", "a", "a", "b"], groups, pool=8)
    assert s.rank.tolist()[0] == 1 and s.pool.tolist() == [3, 3, 3, 1]


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory) -> Path:
    from _tiny_models import build_char_encoder

    texts = []
    for path in sorted(BUNDLED.glob("*.gz")):
        for line in gzip.open(path, "rt", encoding="utf-8"):
            texts += [v for v in json.loads(line).values() if isinstance(v, str)][:6]
    return build_char_encoder(tmp_path_factory.mktemp("teacher") / "tiny", texts, 24, 48, 260, max_length=64)


def test_consistency_filter_keeps_top_k_and_stores_scores(tmp_path, tiny_teacher):
    from pipeline.model import SentenceEncoder
    from pipeline.stages.teacher.consistency import pair_scores
    from pipeline.stages.teacher.run import Config as TeacherConfig
    from pipeline.stages.teacher.run import run as teacher_run
    from pipeline.vectors import teacher_matrix

    inputs = tmp_path / "in"
    inputs.mkdir()
    with gzip.open(BUNDLED / "translation2019zh_tatoeba.jsonl.gz", "rt", encoding="utf-8") as f:
        (inputs / "tatoeba.json").write_text("".join(f.readlines()[:300]), encoding="utf-8")
    shutil.copy(BUNDLED / "wiki_zh_csl.jsonl.gz", inputs)
    pairs = tmp_path / "pairs"
    stage([inputs], pairs, pairs_per_shard=300, rows_per_block=100)
    out = tmp_path / "taught"
    cfg = TeacherConfig(shards=pairs, out=out, model=str(tiny_teacher), batch_size=64, progress=False,
                        pair_top_k=2, pair_pool=16)  # fmt: skip
    assert teacher_run(cfg) == 0
    manifest = read_manifest(out)
    counts = manifest["counts"]
    total = read_manifest(pairs)["counts"]["kept"]
    assert counts["positives_encoded"] == total == counts["pairs_kept"] + counts["pairs_dropped_consistency"]
    assert 0 < counts["pairs_dropped_consistency"] < total  # a random tiny teacher drops many, not all
    assert manifest["pair_filter"]["k"] == 2 and manifest["input_stage"] == "pairs"
    kept = rows(out)
    assert len(kept) == counts["pairs_kept"] == manifest["totals"]["sentences"]
    assert all(r["pair_rank"] <= 2 for r in kept)
    # the scores are those of the model's own embeddings, ranked as consistency.py says
    encoder = SentenceEncoder.from_pretrained(tiny_teacher)
    shard = read_manifest(pairs)["shards"][0]
    table = pa.concat_tables(read_shard(pairs / shard["name"]))
    a = encoder.encode(table["text"].to_pylist(), batch_size=64)
    p = encoder.encode(table["positive"].to_pylist(), batch_size=64)
    expected = pair_scores(a, p, table["source"].to_pylist(), table["group"].to_numpy(), 16)
    got = {r["id"]: r for r in kept}
    for i, pair_id in enumerate(table["id"].to_pylist()):
        if pair_id in got:
            assert abs(got[pair_id]["pair_cosine"] - expected.cosine[i]) < 1e-3
            assert abs(int(got[pair_id]["pair_rank"]) - int(expected.rank[i])) <= 1  # fp ties at most
    taught = pa.concat_tables(read_shard(out / manifest["shards"][0]["name"]))
    vectors = teacher_matrix(taught["teacher_positive"])
    assert vectors.shape == (taught.num_rows, 24) and np.allclose(
        np.linalg.norm(vectors, axis=1), 1, atol=1e-2
    )

    # An int8 copy is still pair shards (training reads both sides, by source); tokenize refuses them.
    from pipeline.errors import InputError
    from pipeline.shards import read_shard_set
    from pipeline.stages.tokenize import Config as TokenizeConfig
    from pipeline.stages.tokenize import run as tokenize_run

    int8 = tmp_path / "int8"
    assert teacher_run(TeacherConfig(shards=out, out=int8, dtype="int8", progress=False)) == 0
    converted = read_manifest(int8)
    assert converted["input_stage"] == "pairs" and converted["pair_filter"] == manifest["pair_filter"]
    sources = [e["block_sources"] for e in manifest["shards"]]
    assert [e["block_sources"] for e in converted["shards"]] == sources
    assert read_shard_set(int8).holds_pairs
    with pytest.raises(InputError, match="holds pair shards"):
        tokenize_run(TokenizeConfig(shards=int8, out=tmp_path / "ids", model=str(tiny_teacher)))


def test_plain_text_gives_neighbouring_sentences_only_when_asked(tmp_path):
    from _real_records import CLUE_DOCUMENTS

    off = stage([CLUE_DOCUMENTS], tmp_path / "off")
    assert off["counts"]["kept"] == 0 and off["counts"]["pairs_extracted"] == 0
    on = stage([CLUE_DOCUMENTS], tmp_path / "on", plain_neighbours=True)
    found = rows(tmp_path / "on")
    assert on["counts"]["kept"] == len(found) > 10
    assert {(r["source"], r["kind"], r["batch_key"]) for r in found} == {("plain", "neighbour", "")}
    accounted(on["counts"])
    # a pair is two consecutive sentences of one line: under normalize_text they follow each other in
    # the raw line, unless cleaning removed something between or inside them (markup, empty brackets)
    lines = {key_text(line) for line in CLUE_DOCUMENTS.read_text(encoding="utf-8").splitlines()}
    adjacent = [any(key_text(r["text"]) + key_text(r["positive"]) in line for line in lines) for r in found]
    assert sum(adjacent) >= 0.8 * len(found)


def test_a_stopped_run_resumes_to_the_same_bytes(tmp_path):
    inputs = [synthetic(tmp_path / "in"), BUNDLED]
    options = dict(near_duplicates=True, pairs_per_shard=700, rows_per_block=100, progress=False)
    clean = tmp_path / "clean"
    assert run(Config(inputs=inputs, out=clean, **options)) == 0
    stopped = tmp_path / "stopped"
    for phase in ("split", "dedup", "shards"):
        assert run(Config(inputs=inputs, out=stopped, phase=phase, **options)) == 0
    work = stopped / ".work"
    # as if killed: a unit, a partition and a shard lose their completion records, a shard its bytes
    (work / "split" / "unit-000001.json").unlink()
    (work / "dedup" / "part-000000.json").unlink()
    (stopped / "shard-000001.tar").write_bytes(b"truncated")
    assert run(Config(inputs=inputs, out=stopped, **options)) == 0
    names = sorted(p.name for p in clean.iterdir())
    assert names == sorted(p.name for p in stopped.iterdir()) and "shard-000001.tar" in names
    assert all((clean / n).read_bytes() == (stopped / n).read_bytes() for n in names)


def test_two_worker_processes_give_the_bytes_of_one(tmp_path):
    inputs = [synthetic(tmp_path / "in"), BUNDLED]
    options = dict(near_duplicates=True, pairs_per_shard=700, rows_per_block=100)
    stage(inputs, tmp_path / "one", **options)
    stage(inputs, tmp_path / "two", workers=2, **options)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir()) and len(names) > 4
    assert all((tmp_path / "one" / n).read_bytes() == (tmp_path / "two" / n).read_bytes() for n in names)
