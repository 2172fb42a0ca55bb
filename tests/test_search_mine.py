"""Hard-negative mining: rank range, skipping positives and near-duplicates, seeding, output format."""

import json
from collections import Counter

import numpy as np
import pytest
from test_search import build_tiny_model, corpus_lines

from pipeline.cli import main
from pipeline.data.pairs import read_triples
from pipeline.normalize import normalize_text
from pipeline.search import SearchIndex
from pipeline.search.mine import mine_negatives


def test_normalize_text_ignores_case_width_space_and_punctuation():
    assert normalize_text("ＡＢｃ 你好！") == normalize_text("abc你好!") == "abc你好"
    assert normalize_text("你好") != normalize_text("你们好")


def build_index(model, texts, out, *extra):
    path = out.parent / f"{out.name}.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["index", str(model), "--input", str(path), "--out", str(out), *extra]) == 0
    return SearchIndex.load(out, device="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def test_every_candidate_except_positive_anchor_and_duplicates(model, tmp_path):
    texts = corpus_lines(50, skip=500)
    pairs = [(texts[0], texts[1]), (texts[10], texts[20])]
    variants = [
        texts[1] + "！",
        " ".join(texts[20][:3]) + texts[20][3:] + "。",
    ]  # near-duplicates of positives
    index = build_index(model, texts + variants, tmp_path / "small")
    counts = Counter()
    # Range = the whole corpus, no cosine filter, room for every candidate: what is left is exactly
    # the corpus minus the anchor, the positive and its near-duplicate.
    triples = mine_negatives(index, pairs, 1, len(index), 100, 1.0, 0, counts)
    for anchor, positive in pairs:
        negatives = [n for a, p, n in triples if (a, p) == (anchor, positive)]
        assert len(negatives) == len(set(negatives)) == len(index) - 3
        expected = {
            t
            for t in index.texts
            if normalize_text(t) not in {normalize_text(anchor), normalize_text(positive)}
        }
        assert set(negatives) == expected
    assert counts["skipped_positive"] == 4 and counts["skipped_anchor"] == 2
    assert counts["short"] == 2 and counts["triples"] == len(triples)


@pytest.fixture(scope="module")
def mining(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mine")
    texts = corpus_lines(400, skip=1000)
    # Whitened: an untrained model's raw cosines are all ~0.9-0.99; the filter would remove everything.
    index = build_index(model, texts, tmp / "idx", "--reduce", "whitening", "--reduce-dim", "16")
    pairs = tmp / "pairs.tsv"
    rows = [f"{texts[i]}\t{texts[i + 1]}\t1" for i in range(0, 60, 3)]
    pairs.write_text("\n".join(rows[:10] + [""] + rows[10:]) + "\n", encoding="utf-8")
    return index, tmp / "idx", pairs


def mine_cli(index_dir, pairs, outs, *extra):
    argv = ["mine", str(index_dir), "--input", str(pairs), "--rank-start", "3", "--rank-end", "12"]
    argv += ["--num-negatives", "3", "--max-similarity", "0.3"] + list(extra)
    for out in outs:
        argv += ["--out", str(out)]
    return main(argv)


def test_negatives_come_from_the_rank_range_and_pass_the_filters(mining, tmp_path, capsys):
    index, index_dir, pairs = mining
    outs = [tmp_path / "t.jsonl", tmp_path / "t.tsv"]
    assert mine_cli(index_dir, pairs, outs) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["counts"]
    triples = read_triples(outs[0])
    assert triples == read_triples(outs[1])  # both formats hold the same triples, in the reader's format
    assert counts["pairs"] == 20 and counts["blank"] == 1 and counts["triples"] == len(triples)
    per_pair = Counter((t.anchor, t.positive) for t in triples)
    assert len(per_pair) + counts.get("no_negative", 0) == 20
    assert len(per_pair) >= 15 and counts["skipped_similar"] > 0  # the filters bite, but leave negatives
    assert max(per_pair.values()) <= 3
    for (anchor, positive), n in per_pair.items():
        hits = index.search([anchor], k=12)[0]
        window = {h.text for h in hits[2:12]}
        negatives = [t.negative for t in triples if (t.anchor, t.positive) == (anchor, positive)]
        assert set(negatives) <= window, "a negative outside ranks 3..12"
        assert all(
            normalize_text(neg) not in {normalize_text(positive), normalize_text(anchor)} for neg in negatives
        )
        cosine = index.embed(negatives) @ index.embed([positive])[0]
        assert np.all(cosine <= 0.3 + 1e-5)


def test_mining_is_seeded(mining, tmp_path, capsys):
    _, index_dir, pairs = mining
    runs = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        assert mine_cli(index_dir, pairs, [tmp_path / f"{name}.jsonl"], "--seed", seed) == 0
        runs[name] = (tmp_path / f"{name}.jsonl").read_text(encoding="utf-8")
    capsys.readouterr()
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_mine_bad_input_is_one_line(mining, tmp_path, capsys):
    _, index_dir, _ = mining
    bad = tmp_path / "bad.tsv"
    bad.write_text("一\t二\n只有一列\n", encoding="utf-8")
    assert mine_cli(index_dir, bad, [tmp_path / "x.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "bad.tsv:2: expected 2 or 3 tab-separated columns" in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert mine_cli(index_dir, bad, [tmp_path / "x.csv"]) == 2
    assert "name it *.jsonl or *.tsv" in capsys.readouterr().err
