"""The bring-your-own example (docs/bring_your_own.md): the main job's export trained further on a user's
FlagEmbedding file, scored on held-out pairs of its source and on the five STS sets, before and after.

The source: KUAKE-QTR (``../shared/data/pairs/KUAKE-QTR_train.json``, CBLUE; no licence stated, so it is
read from there and nothing of it is copied into the project): medical search queries with page titles
graded 0-3. Stages (each skipped when its output exists, so a rerun continues):

``prepare``
    Drops every row with a text of a split of the five scored sets (``--eval_dir``), splits the queries
    with a seeded hash into training and held-out ones (``--heldout-share``), and writes
    ``OUT/train.jsonl`` in FlagEmbedding's format, one line per training query: ``pos`` its titles graded
    >= 2, ``neg`` those graded <= 1 (the source's own hard negatives), less any held-out title;
    ``OUT/heldout.tsv`` is ``query<TAB>title``, each held-out query with its first title graded 3 (the
    retrieval set: each held-out query against every held-out query's title). Then ``python -m pipeline
    pairs --format flag`` (its ``--exclude_eval`` on the same folder) -> ``OUT/shards``.
``run``
    Each seed trains ``--model`` (the main job's export) with launch/configs/byo_pairs.yaml on the
    shards: the pairs term, in-batch negatives plus ``--negatives`` listed ones, ``--steps`` steps.
``score``
    ``pipeline eval`` of the start model and every run: the five STS sets (every pair; the bundled
    copies, the same files as ``--eval_dir``'s) and recall@10 / nDCG@10 on ``heldout.tsv``; ``report``
    prints the table (mean +- std over seeds).

    .venv/bin/python benchmarks/byo_pairs.py prepare
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/byo_pairs.py run --seeds 0,1,2
    .venv/bin/python benchmarks/byo_pairs.py score && .venv/bin/python benchmarks/byo_pairs.py report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import hash_share, mean_std, run_logged  # noqa: E402

from pipeline.evaluate.sts import STS_SETS as SETS  # noqa: E402

PY = os.environ.get("PYTHON", str(REPO / ".venv" / "bin" / "python"))
# ../shared/data beside the project (not in it), or beside the folder of its worktrees
SHARED = next((p / "shared" / "data" for p in (REPO.parent, REPO.parent.parent) if (p / "shared").is_dir()),
              REPO.parent / "shared" / "data")  # fmt: skip
SOURCE = SHARED / "pairs" / "KUAKE-QTR_train.json"
EVAL_DIR = SHARED / "eval"  # what is scored: every split of the five sets


def held_out(query: str, share: float, seed: int) -> bool:
    return hash_share(f"{seed}\x1f{query}") < share


def prepare(args: argparse.Namespace) -> None:
    from pipeline.data.eval_overlap import eval_index
    from pipeline.normalize import normalize_text

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "heldout.tsv").exists():
        scored = eval_index(args.eval_dir)
        rows = json.loads(args.source.read_text(encoding="utf-8"))
        titles: dict[str, list[tuple[str, int]]] = defaultdict(list)
        overlap = 0
        for r in rows:
            query, title = r["query"].strip(), r["title"].strip()
            if normalize_text(query) in scored or normalize_text(title) in scored:
                overlap += 1
                continue
            if query and title:
                titles[query].append((title, int(r["label"])))
        heldout = []  # (query, its first title graded 3): one gold title a held-out query
        for query, graded in titles.items():
            gold = [t for t, g in graded if g == 3 and "\t" not in t]
            if held_out(query, args.heldout_share, args.seed) and gold:
                heldout.append((query, gold[0]))
        unseen = {normalize_text(t) for _, t in heldout}  # no held-out title in the training file
        train, left_out = [], 0
        for query, graded in titles.items():
            if held_out(query, args.heldout_share, args.seed):
                continue
            kept = [(t, g) for t, g in graded if normalize_text(t) not in unseen]
            left_out += len(graded) - len(kept)
            pos = [t for t, g in kept if g >= 2]
            neg = [t for t, g in kept if g <= 1]
            if pos:
                train.append({"query": query, "pos": pos, "neg": neg})
        with (out / "train.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in train)
        (out / "heldout.tsv").write_text("".join(f"{q}\t{t}\n" for q, t in heldout), encoding="utf-8")
        with_neg = sum(1 for r in train if r["neg"])
        print(f"{args.source.name}: {len(rows):,} rows, {overlap} share a text with a scored set (left out); "
              f"{len(train):,} training queries ({with_neg:,} with negatives, "
              f"{sum(len(r['pos']) for r in train):,} positives; {left_out} titles left out as held-out "
              f"ones), {len(heldout):,} held-out queries")  # fmt: skip
    if not (out / "shards" / "manifest.json").exists():
        run_logged(PY, "-m", "pipeline", "pairs", "--format", "flag", str(out / "train.jsonl"), "--out",
           str(out / "shards"), "--eval_dir", str(args.eval_dir), "--progress", "false")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    for seed in (int(s) for s in args.seeds.split(",")):
        run_dir = args.out / "runs" / f"s{seed}"
        if (run_dir / "model" / "config.json").exists():
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [PY, "launch/pretrain.py", "--config", "launch/configs/byo_pairs.yaml",
               f"--data.shards={args.out / 'shards'}", f"--model.name_or_path={args.model}",
               f"--data.num_hard_negatives={args.negatives}", f"--train.max_steps={args.steps}",
               f"--train.seed={seed}", "--train.eval_every=0", f"--run_dir={run_dir}"]  # fmt: skip
        run_logged(*cmd, log=run_dir / "train.log")


def score(args: argparse.Namespace) -> None:
    models = {"start": args.model} | {
        p.name: p / "model"
        for p in sorted((args.out / "runs").glob("*"))
        if (p / "model" / "config.json").exists()
    }
    for name, model in models.items():
        out = args.out / "scores" / name
        if (out / "eval.json").exists():
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [PY, "-m", "pipeline", "eval", str(model), "--suite", "[sts]", "--retrieval",
               str(args.out / "heldout.tsv"), "--progress", "false", "--out", str(out)]  # fmt: skip
        if args.max_pairs:
            cmd += ["--max_pairs", str(args.max_pairs)]
        run_logged(*cmd, log=args.out / "scores" / f"{name}.log")


def report(args: argparse.Namespace) -> None:
    rows: dict[str, list[dict]] = {}
    for path in sorted((args.out / "scores").glob("*/eval.json"), key=lambda p: p.parent.name != "start"):
        arm = "start" if path.parent.name == "start" else "trained"
        rows.setdefault(arm, []).append(json.loads(path.read_text()))
    print("| model | runs | recall@10 | nDCG@10 | avg5 | " + " | ".join(SETS) + " |")
    print("| --- | --- | --- | --- | --- |" + " --- |" * len(SETS))
    for arm, results in rows.items():
        sts = [[r["sts"]["model"][s] for s in SETS] for r in results]
        avg = [sum(x) / len(x) for x in sts]
        ret = [next(iter(r["retrieval"].values())) for r in results]
        cells = [
            mean_std([x["recall@10"] for x in ret]),
            mean_std([x["ndcg@10"] for x in ret]),
            mean_std(avg),
        ]
        cells += [mean_std([x[i] for x in sts]) for i in range(len(SETS))]
        print(f"| {arm} | {len(results)} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "byo", help="where everything goes")
    parser.add_argument("--model", default=str(REPO / "runs" / "sample" / "model"), help="the start model")
    parser.add_argument("--eval_dir", type=Path, default=EVAL_DIR, help="the scored sets (every split)")
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--source", type=Path, default=SOURCE)
    p.add_argument("--heldout-share", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0, help="of the held-out split")
    p = sub.add_parser("run")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--negatives", type=int, default=3, help="listed hard negatives a pair (data.num_hard_negatives)"
    )
    p = sub.add_parser("score")
    p.add_argument("--max_pairs", type=int, default=0, help="STS pairs per set (0: every pair)")
    sub.add_parser("report")
    args = parser.parse_args()
    {"prepare": prepare, "run": run, "score": score, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
