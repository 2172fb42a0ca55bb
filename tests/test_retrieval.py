"""Asymmetric retrieval scoring (pipeline/evaluate/retrieval.py) and `eval --retrieval`."""

import gzip
import json

import numpy as np
import pytest
from test_eval_fixtures import build_tiny_encoder

from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.evaluate.retrieval import make_set, metrics, ranks, read_pairs, score_retrieval


def test_ranks_and_metrics_by_hand():
    documents = np.eye(4, dtype=np.float32)  # (D, dim)
    queries = np.array([[1, 0, 0, 0], [0.9, 0.5, 0, 0], [0, 0, 0, 1]], dtype=np.float32)
    gold = np.array([0, 1, 2])  # the second query ranks its document 2nd, the third ranks it last (tie 3rd+)
    rank = ranks(queries, documents, gold, block=2)
    assert rank.tolist() == [1, 2, 4]
    m = metrics(rank, k=2)
    assert m["recall@2"] == pytest.approx(100 * 2 / 3)
    assert m["ndcg@2"] == pytest.approx(100 * (1 + 1 / np.log2(3)) / 3)
    assert m["mrr@2"] == pytest.approx(100 * 1.5 / 3)


def test_make_set_dedups_documents_and_pairs():
    data = make_set("x", [("q1", "d1"), ("q2", "d1"), ("q1", "d1"), ("q3", "d2"), ("", "d3")])
    assert data.queries == ["q1", "q2", "q3"] and data.documents == ["d1", "d2"]
    assert data.gold.tolist() == [0, 0, 1]
    with pytest.raises(InputError, match="no \\(query, document\\) pair"):
        make_set("x", [("", "d")])


def test_score_retrieval_with_separate_encoders():
    data = make_set("x", [("a", "A"), ("b", "B"), ("c", "C")])
    basis = {t: np.eye(3, dtype=np.float32)[i] for i, t in enumerate("abc")}
    queries = lambda texts: np.stack([basis[t] for t in texts])  # noqa: E731
    documents = lambda texts: np.stack([basis[t.lower()] for t in texts])  # noqa: E731
    assert score_retrieval(queries, documents, data)["recall@10"] == 100.0
    swapped = lambda texts: np.stack([basis["bca"["abc".index(t.lower())]] for t in texts])  # noqa: E731
    assert score_retrieval(queries, swapped, data, k=1)["recall@1"] == 0.0


def test_read_pairs_jsonl_gz_and_tsv(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"query": "国考成绩", "desc": "国考笔试成绩放榜"}) + "\n\n")
        f.write(json.dumps({"query": "天气", "desc": "今天天气很好"}) + "\n")
    data = read_pairs(path)
    assert data.queries == ["国考成绩", "天气"] and data.name == "p"
    tsv = tmp_path / "t.tsv"
    tsv.write_text("q\td\n", encoding="utf-8")
    assert read_pairs(tsv).documents == ["d"]
    with pytest.raises(InputError, match="p.jsonl.gz:1"):
        read_pairs(path, "question", "desc")


def test_eval_retrieval_uses_the_document_prompt(tmp_path):
    from pipeline.model import SentenceEncoder

    tiny = build_tiny_encoder(tmp_path / "tiny", "mean", seed=4, max_length=24)
    model = tmp_path / "model"
    SentenceEncoder.from_pretrained(tiny, prefix="query: ").save_pretrained(model)
    st_config = model / "config_sentence_transformers.json"
    settings = json.loads(st_config.read_text())
    st_config.write_text(json.dumps({**settings, "prompts": {"query": "query: ", "passage": "passage: "}}))
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"query": f"问题{i}", "desc": f"第{i}个回答，今天天气很好。"} for i in range(12)]
    pairs.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    argv = ["eval", str(model), "--suite", "[sts]", "--sets", "[STS-B]", "--max-pairs", "20", "--retrieval",
            str(pairs), "--out", str(tmp_path / "e"), "--progress", "false"]  # fmt: skip
    assert main(argv) == 0
    found = json.loads((tmp_path / "e" / "eval.json").read_text())["retrieval"]["pairs"]
    assert found["query_prefix"] == "query: " and found["document_prefix"] == "passage: "
    assert found["queries"] == 12 and found["documents"] == 12 and 0 <= found["recall@10"] <= 100
    assert main([*argv[:-2], "--document-prefix", "query: ", "--out", str(tmp_path / "f")]) == 0
    same = json.loads((tmp_path / "f" / "eval.json").read_text())["retrieval"]["pairs"]
    assert same["document_prefix"] == "query: "
