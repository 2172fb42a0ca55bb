"""The pairs stage's fast paths give what the plain ones give: ``key_texts`` is ``key_text`` (hence
``normalize_text``) text by text, the batched sibling rule of news2016zh drops the same pairs and
cuts pass 1 into the same batches as deciding it record by record, and ``lead`` (split only as far
as the budget reaches) returns what splitting every sentence first returned."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from pipeline import normalize
from pipeline.normalize import key_text, key_texts, normalize_text
from pipeline.resources import ROOT as RESOURCES
from pipeline.shards import read_manifest, read_shard
from pipeline.stages.pairs import extract, passes
from pipeline.stages.pairs.extract import PairRules, too_easy
from pipeline.stages.pairs.run import Config, run
from pipeline.stages.preprocess.text import LEADING, ends_sentence, split_sentences

EDGE = [
    "ＡＢＣ１２３！ 你好，世界。",
    "𠀀汉字\u200b𠀁",
    "Ⅻ ﬁ ㍿ ℃ ㎏ ™",
    "Straße ΣΑΣ ẞ ŉ",
    "a\u0301 e\u200d\u0301",
    "",
    "  ",
    "Ａ\u0301…",
    "\u00a0x\u3000y",
    "①②㍿",
    "（你好）：“是”！……",
    "가\u11a8 ᄀ\u1161 \u1100\u1161\u11a8",
    "\uf900\uf901 豈",
    "a\x1fb",  # the batch separator inside a text
    "\ud800 lone surrogate",
    "\u0958 क\u093c",
]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pools = [
        (0x20, 0x3000),
        (0, 0x10000),
        (0x4E00, 0x4E80),
        (0x10000, 0x30000),
        (0x300, 0x370),
        (0xFF00, 0xFFF0),
    ]
    return [
        "".join(chr(rng.randrange(*rng.choice(pools))) for _ in range(rng.randrange(0, 12))) for _ in range(n)
    ]


def test_key_texts_is_key_text():
    texts = list(EDGE)
    for path in sorted((RESOURCES / "corpus" / "pairs").glob("*.gz")):
        texts += [v for line in gzip.open(path) for v in json.loads(line).values() if isinstance(v, str)]
    texts += _random_texts(3000, 0)
    expected = [key_text(t) for t in texts]
    assert expected[: len(EDGE)] == [normalize_text(t) for t in EDGE]
    for size in (1, 2, 7, 100, len(texts)):
        got = [k for i in range(0, len(texts), size) for k in key_texts(texts[i : i + size])]
        assert got == expected, size
    assert key_texts([]) == []
    # what the sibling rule relies on: a text mapped code unit by code unit has its prefixes' keys
    # as prefixes of its key
    assert normalize.mapped_keys(texts)[1] == [False] * len(texts)  # EDGE holds the separator
    texts = [t for t in texts if normalize._SEP not in t]
    keys, by_map = normalize.mapped_keys(texts)
    assert keys == [key_text(t) for t in texts] and 0 < by_map.count(False) < len(texts) // 2
    for text, key, mapped in zip(texts, keys, by_map, strict=True):
        if mapped:
            for cut in {1, 2, len(text) // 3, len(text) // 2, len(text) - 1}:
                assert key.startswith(key_text(text[:cut])), (text, cut)


def test_key_map_covers_the_bmp():
    """Every BMP character alone, and after a letter and before a combining mark (where NFKC could
    join it with a neighbour): the map's verdict holds or sends the text to ``key_text``."""
    texts = [chr(cp) for cp in range(0x10000)]
    texts += [f"A{chr(cp)}\u0301" for cp in range(0, 0x10000, 3)]
    assert key_texts(texts) == [key_text(t) for t in texts]


def _news(i: int, rng: random.Random) -> dict:
    lead = f"第{i}条新闻的正文第一句写得很长很长。" + "这是第二句。" * rng.randrange(1, 4)
    kind = rng.randrange(3)
    desc = lead[:12] if kind == 0 else (f"完全不同的摘要内容{i}号，说的是另一件事。" if kind == 1 else "")
    return {"news_id": f"n{i}", "title": f"标题{i}号新闻", "desc": desc, "source": "s", "content": lead}


@pytest.mark.parametrize("flush", [1, 2, 3, 5, 16, 1 << 14])
def test_batched_sibling_rule_matches_record_by_record(tmp_path: Path, monkeypatch, flush: int):
    rng = random.Random(flush)
    records = [_news(i, rng) for i in range(60)]
    path = tmp_path / "news2016zh.json"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")

    # the old rule, record by record: sibling verdicts and the batch cuts pass 1 made with them
    rules = PairRules()
    cleaner = passes.Cleaner()
    expected_batches, batch, expected_dropped = [], 0, 0
    for r in records:
        found = extract.EXTRACTORS["news2016zh"](r, cleaner, rules, None)
        for c in found:
            if c.sibling is not None:
                d, b = key_text(c.positive), key_text(c.sibling.positive)
                if c.sibling.positive and (
                    b.startswith(d) or too_easy(d, b, rules.easy_prefix_ratio, rules.easy_jaccard)
                ):
                    expected_dropped += 1
                    continue
            batch += 1
        if batch >= flush:
            expected_batches.append(batch)
            batch = 0
    if batch:
        expected_batches.append(batch)
    assert 0 < expected_dropped < 60

    seen: list[int] = []
    original = passes._filter_and_add
    monkeypatch.setattr(passes, "FLUSH_PAIRS", flush)
    monkeypatch.setattr(
        passes,
        "_filter_and_add",
        lambda source, candidates, *a: (seen.append(len(candidates)), original(source, candidates, *a)),
    )
    out = tmp_path / "out"
    assert run(Config(inputs=[path], out=out, progress=False)) == 0
    assert seen == expected_batches
    counts = read_manifest(out)["counts"]
    assert counts["dropped"]["sibling_duplicate"] == expected_dropped
    assert counts["pairs_extracted"] == sum(1 + bool(r["desc"]) for r in records)
    kinds = [
        row["kind"]
        for e in read_manifest(out)["shards"]
        for b in read_shard(out / e["name"])
        for row in b.to_pylist()
    ]
    assert kinds.count("title-desc") == sum(bool(r["desc"]) for r in records) - expected_dropped


def _lead_one_split(cleaner, value: str, budget: int, first_paragraph=False, cut_tail=False):
    """``extract.lead`` as it was, every sentence split first: the reference."""
    limit = int(extract.RAW_SLACK * budget) + 64
    raw_cut = len(value) > limit
    value = value[:limit] if raw_cut else value
    paragraphs = cleaner.paragraphs(value)
    paragraphs = paragraphs[:1] if first_paragraph else paragraphs
    sentences = [s for p in paragraphs for s in split_sentences(p)]
    if (raw_cut or cut_tail) and len(sentences) > 1 and not ends_sentence(sentences[-1]):
        sentences.pop()
    out, total = [], 0
    for sentence in sentences:
        if out and total + len(sentence) > budget:
            return "".join(out), True
        out.append(sentence)
        total += len(sentence)
    return "".join(out), raw_cut


def test_lead_splits_lazily_to_the_same_result():
    rng = random.Random(3)
    alphabet = "甲乙丙丁。！？；!?;…”’」』）)】》，、,：: \n\"'ab"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(4000)]
    for path in sorted((RESOURCES / "corpus" / "pairs").glob("*.gz")):
        texts += [v for line in gzip.open(path) for v in json.loads(line).values() if isinstance(v, str)]
    cleaner = passes.Cleaner()
    for text in texts:
        # what the fast path relies on: the sentences join back into the paragraph less its lead
        for paragraph in cleaner.paragraphs(text):
            assert "".join(split_sentences(paragraph)) == paragraph.lstrip(LEADING)
        for budget in (3, 10, 30, 256):
            for first, tail in ((False, False), (False, True), (True, False)):
                expected = _lead_one_split(cleaner, text, budget, first, tail)
                assert extract.lead(cleaner, text, budget, first, tail) == expected, (text, budget)


def test_field_paragraphs_is_cleaner_paragraphs():
    from pipeline.stages.preprocess import text

    def touched(c: str) -> bool:  # what some cleaning rule acts on, asked of the rules' own patterns
        spaces = text.WHITESPACE_RE.match(c) and c not in extract._BREAKS
        return bool(text.CONTROL_RE.match(c) or text._FULL_WIDTH_RE.match(c) or spaces or c in "<&{}")

    pattern = extract.NEEDS_CLEANING
    assert [cp for cp in range(0x110000) if pattern.match(chr(cp))] == [
        cp for cp in range(0x110000) if touched(chr(cp))
    ]
    rng = random.Random(4)
    alphabet = (
        "甲乙。，Ａ１ａ \u3000\u00a0\t\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\u200b"
        "<b>&amp;-{zh-cn:甲;zh-tw:乙}-（）"
    )
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30))) for _ in range(4000)]
    clean = "甲乙。，ab\n\r\u2028\u2029"  # clean lines, one or many: the shortcuts' own paths
    texts += ["".join(rng.choice(clean) for _ in range(rng.randrange(0, 12))) for _ in range(2000)]
    spaced = "甲乙丙丁戊己庚辛“”。，ab1 "  # one line whose only cleaning is its spaces (clause commas too)
    texts += ["".join(rng.choice(spaced) for _ in range(rng.randrange(0, 40))) for _ in range(4000)]
    spaced += "\u3000\n\r"  # and many lines, ideographic spaces too (normalised to spaces first)
    texts += ["".join(rng.choice(spaced) for _ in range(rng.randrange(0, 60))) for _ in range(4000)]
    for path in sorted((RESOURCES / "corpus" / "pairs").glob("*.gz")):
        texts += [v for line in gzip.open(path) for v in json.loads(line).values() if isinstance(v, str)]
    fast, slow = passes.Cleaner(), passes.Cleaner()
    assert [extract.field_paragraphs(fast, t) for t in texts] == [slow.paragraphs(t) for t in texts]
    assert fast.audit() == slow.audit() and slow.rules["clause_spaces"] > 100


def test_pair_ids_and_group_ids_are_the_plain_blake2b():
    import hashlib

    def plain(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")

    texts = [t for t in _random_texts(700, 5) if not any(0xD800 <= ord(c) < 0xE000 for c in t)][:500]
    assert len(texts) == 500
    a_keys, p_keys = texts[:250], texts[250:]
    expected = [plain(f"{a}\x1f{p}") for a, p in zip(a_keys, p_keys, strict=True)]
    assert [extract.pair_id(a, p) for a, p in zip(a_keys, p_keys, strict=True)] == expected
    ids = extract.pair_ids(a_keys, p_keys)
    assert ids.dtype == np.uint64 and ids.tolist() == expected
    assert extract.pair_ids([], []).tolist() == []
    for source in ("news2016zh", "wiki_zh"):
        assert [extract.group_id(source, t) for t in texts] == [plain(f"{source}\x1f{t}") for t in texts]


def test_space_rules_written_space_first_match_the_lookbehind_forms():
    """preprocess's whitespace rules, rewritten to start with the space (a fast literal scan), find the
    same spaces as the forms that start with a lookbehind (kept here as the reference)."""
    import re

    from pipeline.stages.preprocess import text

    latin, cjk = "A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f", text._CJK
    drop = re.compile(rf"(?<![{latin}0-9.,;:!?%)\]'\"]) | (?![{latin}0-9(\['\"])")
    gap = re.compile(rf"(?<=[{cjk}”」』）》]) (?=[{cjk}“「『（《])")
    rng = random.Random(6)
    alphabet = "  甲乙aZé0.,;:!?%)](['\"”」』）》“「『（《，。x"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 16))) for _ in range(20000)]
    for path in sorted((RESOURCES / "corpus" / "pairs").glob("*.gz")):
        texts += [v for line in gzip.open(path) for v in json.loads(line).values() if isinstance(v, str)]
    for t in texts:
        assert text._DROP_SPACE_RE.sub("", t) == drop.sub("", t), t
        assert [m.span() for m in text._CLAUSE_GAP_RE.finditer(t)] == [m.span() for m in gap.finditer(t)], t


def test_parse_json_is_json_loads():
    """Values and error messages: the record audit quotes the error."""
    lines = [
        '{"a": "甲", "b": [1, 2.5, null]}\n',
        '{"a": 1}',
        '{"a": 1}\r\n',
        ' {"a": 1}\n',
        '{"a": 1} \n',
        '{"a": 1}\n\n',
        '{"a": 1} x\n',
        '{"a": 1}{"b": 2}\n',
        "\ufeff{}\n",
        '"text"\n',
        "[1, 2]\n",
        "12\n",
        "{'a': 1}\n",
        '{"a": }\n',
        '{"a": "\\ud800"}\n',
        '{"a": "\\x"}\n',
        "nul\n",
        "\n",
        "",
    ]
    for line in lines:
        try:
            expected = ("value", json.loads(line))
        except ValueError as exc:
            expected = ("error", str(exc))
        try:
            got = ("value", passes._parse_json(line))
        except ValueError as exc:
            got = ("error", str(exc))
        assert got == expected, line


def test_cyclic_gc_pause_restores_the_state():
    import gc

    assert gc.isenabled()
    with passes._cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), passes._cyclic_gc_paused():
        raise RuntimeError("a unit failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with passes._cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()
