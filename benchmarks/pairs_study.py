"""The pairs study: what training on the corpus's structured pairs adds to the main job's student.

Stages (each skipped when its output exists, so a rerun continues):

``prepare``
    Converts ``../shared/data/pairs/`` into the collections' formats (``pairs_convert.py``), drops
    every record that shares a text with an evaluation set, and splits each source by group (qid,
    news id, paper) with a seeded hash: a held-out part becomes the retrieval sets (query -> document,
    the documents of the held-out part are the corpus), the rest (capped per source) is what the arms
    train on. Then ``pipeline pairs`` and the teacher stage (both sides embedded, consistency scores
    stored; ``--top-k 0`` keeps every pair, ``--top-k 0 2`` also writes the set the ``*_top2`` arms
    read: a pair kept when its partner is in the teacher's top 2).
    Translation pairs (Tatoeba) are left out: the student's vocabulary is trimmed to the Chinese
    sample's characters, so English would be mostly unknown pieces.
``run``
    Each arm x seed trains the main job's untrained student (its recipe: launch/configs/distill.yaml,
    lr 1e-3) for the same number of steps and encoded texts (``--steps``, 128 texts a step: 64 pairs,
    or 128 corpus sentences for the corpus arm, 64 tokens) and keeps the checkpoint with the best STS-B
    validation score (selection on validation data only).
``score``
    The five STS sets (``--max_pairs`` per set, seeded) and the held-out retrieval sets for every
    finished run, and the starting model; ``report`` prints the tables (mean +- std over seeds).

What docs/BENCHMARKS.md reports ran as (one thread a run, two runs at once; the main job's shards in
runs/sample/ from launch/run_sample.sh first)::

    .venv/bin/python benchmarks/pairs_study.py prepare --per-source 2000
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pairs_study.py run --steps 100 \
        --arms distill_pairtexts,distill_pairs --seeds 0,1,2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pairs_study.py run --steps 100 \
        --arms pairs,distill_corpus,distill_pairs_onesource,distill_pairs_w001 --seeds 0
    .venv/bin/python benchmarks/pairs_study.py score && .venv/bin/python benchmarks/pairs_study.py report

Later sessions ran, on the same prepared data (``prepare --per-source 2000 --top-k 0 2``)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pairs_study.py run --steps 100 \
        --arms luse_pairs --seeds 0,1,2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pairs_study.py run --steps 100 \
        --arms distill_pairs_w001_top2,distill_pairtexts_top2 --seeds 0
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pairs_study.py run --steps 100 \
        --arms distill_pairs_w001,distill_pairs_w001_t01,distill_pairs_w0003 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import pairs_convert  # noqa: E402
from _common import hash_share, mean_std, run_logged  # noqa: E402

from pipeline.evaluate.sts import STS_SETS as SETS  # noqa: E402

PY = os.environ.get("PYTHON", str(REPO / ".venv" / "bin" / "python"))
OUT = REPO / "runs" / "study"
MODEL = REPO / "models" / "e5-small"
START = REPO / "runs" / "sample" / "student"  # the main job's untrained student (layers 0,4,8,11, trimmed)
CORPUS_SHARDS = REPO / "runs" / "sample" / "teacher"  # the main job's shards with teacher vectors

# source -> (group field, query field, document field) of its converted records
SOURCES = {
    "news2016zh_cctv": ("news_id", "title", "desc"),
    "baike2018qa_baidu_hot": ("qid", "title", "answer"),
    "baike2018qa_toyhom_medical": ("qid", "title", "answer"),
    "webtext2019zh_kuake_qtr": ("qid", "title", "content"),
    "wiki_zh_csl": ("id", "title", "abstract"),
}


def held_out(group: str, share: float) -> bool:
    return hash_share(group) < share


def prepare(args: argparse.Namespace) -> None:
    raw, heldout = OUT / "raw", OUT / "retrieval"
    if not (raw / "done").exists():
        raw.mkdir(parents=True, exist_ok=True)
        heldout.mkdir(parents=True, exist_ok=True)
        keys = pairs_convert.eval_keys()
        for name, (group_field, query_field, doc_field) in SOURCES.items():
            records = list(pairs_convert.CONVERTERS[name]())
            clean = [r for r in records if not pairs_convert.overlaps(r, keys)]
            test = [r for r in clean if held_out(str(r[group_field]), args.heldout_share)]
            train = [r for r in clean if not held_out(str(r[group_field]), args.heldout_share)]
            train = train[: args.per_source]
            queries = []
            for r in test[: args.queries_per_source]:
                doc = r["text"].split("\n\n", 1)[-1] if doc_field == "abstract" else r[doc_field]
                if r[query_field].strip() and doc.strip():
                    queries.append({"query": r[query_field], "desc": doc})
            pairs_convert.write_jsonl(raw / f"{name}.json", train, compress=False)
            pairs_convert.write_jsonl(heldout / f"{name}.jsonl", queries, compress=False)
            print(
                f"{name}: {len(records):,} records, {len(records) - len(clean):,} overlap an eval set, "
                f"{len(train):,} train, {len(queries):,} retrieval queries"
            )
        (raw / "done").write_text("")
    pairs = OUT / "pairs"
    if not (pairs / "manifest.json").exists():
        run_logged(
            PY,
            "-m",
            "pipeline",
            "pairs",
            *sorted(str(p) for p in raw.glob("*.json")),
            "--out",
            str(pairs),
            "--progress",
            "false",
        )
    for k in args.top_k:
        out = OUT / f"pairs_t{k}"
        if not (out / "manifest.json").exists():
            run_logged(
                PY,
                "-m",
                "pipeline",
                "teacher",
                "--shards",
                str(pairs),
                "--out",
                str(out),
                "--model",
                str(MODEL),
                "--precision",
                "auto",
                "--max-length",
                str(args.max_length),
                "--pair-top-k",
                str(k),
                "--workers",
                "1",
            )


def arm_args(arm: str, seed: int, steps: int) -> list[str]:
    """The training overrides of one arm: the data, the loss, the batch."""
    common = [
        "--config",
        "launch/configs/distill.yaml",
        f"--model.name_or_path={START}",
        f"--train.seed={seed}",
        f"--train.max_steps={steps}",
        "--train.eval_every=50",
        "--checkpoint.every_steps=50",
        "--checkpoint.every_minutes=0",
        "--data.max_length=64",
        "--data.length_bucketing=false",
    ]
    pairs = OUT / "pairs_t0"
    mixed = [f"--data.shards={pairs}", "--data.one_source_per_batch=false"]
    top2 = [
        f"--data.shards={OUT / 'pairs_t2'}",
        "--data.one_source_per_batch=false",
        "--data.pair_max_rank=2",
    ]
    both = "--loss=[{distill: {loss: cosine}}, {pairs: {temperature: 0.05}, weight: 0.1}]"
    arms = {
        # the main job's data, 128 sentences a step: as many encoded texts as a pair arm's 64 pairs
        "distill_corpus": [f"--data.shards={CORPUS_SHARDS}", "--train.global_batch_size=128"],
        # distillation alone on the pair arms' texts, both sides: the control
        "distill_pairtexts": [*mixed, "--loss=[{distill: {loss: cosine}}]"],
        "pairs": [*mixed, "--loss=[{pairs: {temperature: 0.05}}]"],
        "distill_pairs": [*mixed, both],
        "distill_pairs_w001": [*mixed, both.replace("weight: 0.1}", "weight: 0.01}")],
        # the sweep around it: a softer pairs term (tau 0.1) at weight 0.01, and weight 0.003 at tau 0.05
        "distill_pairs_w001_t01": [
            *mixed,
            both.replace("weight: 0.1}", "weight: 0.01}").replace("temperature: 0.05", "temperature: 0.1"),
        ],
        "distill_pairs_w0003": [*mixed, both.replace("weight: 0.1}", "weight: 0.003}")],
        "distill_pairs_onesource": [f"--data.shards={pairs}", "--data.one_source_per_batch=true", both],
        # LUSE's multi-positive loss on the pairs (docs/pairs.md, "LUSE on pairs") beside distillation, at
        # distill_pairs_w001's weight: 0.1 of the pairs term cost 3.6 avg5 (3 seeds) and luse is an InfoNCE
        # of the same scale (log of its candidates), so 0.01 compares the two contrastive terms at the
        # weight the study supports. The recipe's dropout is 0: no dropout views (d = 0, the same 128
        # encoded texts a step); a memory-bank queue (momentum 0: no key encoder's extra forward) of 4
        # steps' anchors; same_text as the pairs term's default.
        "luse_pairs": [
            *mixed,
            "--data.num_dropout_views=0",
            "--loss=[{distill: {loss: cosine}}, {luse: "
            "{temperature: 0.05, queue_size: 256, momentum: 0.0, false_negatives: {same_text: "
            "true}}, weight: 0.01}]",
        ],
        # the teacher's consistency filter (keep a pair when its partner is in the teacher's top 2 of the
        # candidate pool; prepare --top-k 0 2): the w001 arm and its distillation-only control on the
        # filtered pairs, so the filter is judged against the same texts
        "distill_pairtexts_top2": [*top2, "--loss=[{distill: {loss: cosine}}]"],
        "distill_pairs_w001_top2": [*top2, both.replace("weight: 0.1}", "weight: 0.01}")],
    }
    extra = os.environ.get(f"ARM_{arm.upper()}")  # e.g. a sweep arm: a JSON list of overrides
    if arm not in arms and extra is None:
        raise SystemExit(f"unknown arm {arm!r}; one of {', '.join(arms)} or set ARM_{arm.upper()}")
    rest = json.loads(extra) if extra is not None else arms[arm]
    if arm != "distill_corpus":
        rest = [*rest, "--train.global_batch_size=64"]
    return [*common, *rest]


def run(args: argparse.Namespace) -> None:
    for arm in args.arms.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            run_dir = OUT / "runs" / f"{arm}-s{seed}"
            if (run_dir / "model" / "config.json").exists():
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [PY, "launch/pretrain.py", *arm_args(arm, seed, args.steps), f"--run_dir={run_dir}"]
            run_logged(*cmd, log=run_dir / "train.log")


def score(args: argparse.Namespace) -> None:
    retrieval = sorted(str(p) for p in (OUT / "retrieval").glob("*.jsonl"))
    models = {"start": START} | {
        p.name: p / "model"
        for p in sorted((OUT / "runs").glob("*"))
        if (p / "model" / "config.json").exists()
    }
    for name, model in models.items():
        out = OUT / "scores" / name
        if (out / "eval.json").exists():
            continue
        cmd = [
            PY,
            "-m",
            "pipeline",
            "eval",
            str(model),
            "--suite",
            "[sts]",
            "--max_pairs",
            str(args.max_pairs),
            "--out",
            str(out),
            *[f for r in retrieval for f in ("--retrieval", r)],
        ]
        out.parent.mkdir(parents=True, exist_ok=True)
        run_logged(*cmd, log=OUT / "scores" / f"{name}.log")


def report(args: argparse.Namespace) -> None:
    rows: dict[str, list[dict]] = {}
    for path in sorted((OUT / "scores").glob("*/eval.json")):
        arm = path.parent.name.rsplit("-s", 1)[0]
        rows.setdefault(arm, []).append(json.loads(path.read_text()))
    for arm, results in rows.items():
        sts = [[r["sts"]["model"][s] for s in SETS] for r in results]
        avg = [sum(x) / len(x) for x in sts]
        ret = [r.get("retrieval", {}) for r in results]
        rec = [sum(v["recall@10"] for v in x.values()) / max(1, len(x)) for x in ret]
        ndcg = [sum(v["ndcg@10"] for v in x.values()) / max(1, len(x)) for x in ret]
        per_set = " ".join(f"{s} {mean_std([x[i] for x in sts])}" for i, s in enumerate(SETS))
        print(
            f"{arm} (n={len(results)}): avg5 {mean_std(avg)} | {per_set} | recall@10 {mean_std(rec)} "
            f"nDCG@10 {mean_std(ndcg)}"
        )
        for name in sorted(ret[0]):
            print(f"    {name}: recall@10 {mean_std([x[name]['recall@10'] for x in ret])}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--per-source", type=int, default=6000, help="training records per source (cap)")
    p.add_argument("--heldout-share", type=float, default=0.05)
    p.add_argument("--queries-per-source", type=int, default=500)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--top-k", type=int, nargs="*", default=[0])
    p = sub.add_parser("run")
    p.add_argument("--arms", default="distill_corpus,distill_pairtexts,pairs,distill_pairs")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p = sub.add_parser("score")
    p.add_argument("--max_pairs", type=int, default=2000)
    sub.add_parser("report")
    args = parser.parse_args()
    {"prepare": prepare, "run": run, "score": score, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
