"""benchmarks/byo_pairs.py prepare at a tiny size: graded query-title rows -> a FlagEmbedding training file
(positives graded >= 2, the source's own negatives graded <= 1), a held-out retrieval set that shares no
query or title with it, and nothing of the scored sets in either."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from pipeline.data.pairs import read_pairs
from pipeline.resources import EVAL_DIR

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_prepare_writes_a_flag_file_and_a_held_out_set_apart_from_it(tmp_path, monkeypatch, capsys):
    scored = read_pairs(EVAL_DIR / "LCQMC.dev.tsv")[0].text_a
    rows = [{"id": "x", "query": scored, "title": "随便一个标题", "label": "3"}]
    for q in range(60):
        rows += [{"id": f"{q}-{g}", "query": f"问题{q}怎么办", "title": f"标题{q}之{g}", "label": str(g)}
                 for g in range(4)]  # fmt: skip
    source = tmp_path / "qtr.json"
    source.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    out = tmp_path / "byo"
    argv = [str(BENCHMARKS / "byo_pairs.py"), "--out", str(out), "--eval_dir", str(EVAL_DIR), "prepare",
            "--source", str(source), "--heldout-share", "0.3"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(argv[0], run_name="__main__")
    assert "1 share a text with a scored set (left out)" in capsys.readouterr().out
    train = [json.loads(line) for line in (out / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    heldout = [line.split("\t") for line in (out / "heldout.tsv").read_text(encoding="utf-8").splitlines()]
    assert train and heldout and len(train) + len(heldout) == 60
    for r in train:
        q = r["query"].removeprefix("问题").removesuffix("怎么办")
        assert r["pos"] == [f"标题{q}之2", f"标题{q}之3"] and r["neg"] == [f"标题{q}之0", f"标题{q}之1"]
    assert all(t.endswith("之3") for _, t in heldout)  # one gold title graded 3
    assert {q for q, _ in heldout}.isdisjoint(r["query"] for r in train)
    assert scored not in {r["query"] for r in train} | {q for q, _ in heldout}
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    assert manifest["counts"]["kept"] == 2 * len(train) and manifest["hard_negatives"]["k"] == 2
