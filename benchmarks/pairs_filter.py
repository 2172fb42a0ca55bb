"""The teacher's consistency filter on real pairs: its cost per pair, its precision against hand judgements.

Steps (each skipped when its output exists in --scratch):

  corpus   ``--per-source`` records of each file that ``benchmarks/pairs_convert.py --out`` writes (every
           n-th record, so the whole file is spread), in the collections' formats
  pairs    ``python -m pipeline pairs`` over them (defaults) -> pair shards
  sample   ``--judge`` pairs drawn with a seeded shuffle -> ``benchmarks/pairs_judged.tsv`` columns
           id, source, kind, anchor, positive, and an empty ``good`` column that a person fills in
           (1 = the positive is a real answer / partner of the anchor, 0 = it is not) BEFORE the filter
           is run; the file is never overwritten
  subset   the judged pairs and a seeded sample of the others, ``--subset`` per source, as one pair
           shard (the CPU time this shared machine allows)
  teacher  ``python -m pipeline teacher --model models/e5-small --pair-top-k 0 --pair-pool P
           --max-length 128`` on the subset: every pair scored (``pair_rank``), timed
  report   the filter's decision on the judged pairs for each k of ``--k`` (rank <= k): precision
           (judged good among kept) and recall (kept among judged good), per source too; then a FLOP
           projection to the full corpus (``benchmarks/pairs_filter_gpu.py`` measures it on a GPU)

    .venv/bin/python benchmarks/pairs_filter.py --stage sample           # then judge the TSV by hand
    .venv/bin/python benchmarks/pairs_filter.py --stage report --k 1,2,3,5 --pool 64
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402

from pipeline.stages.pairs.passes import PAIR_SCHEMA  # noqa: E402

JUDGED = REPO / "benchmarks" / "pairs_judged.tsv"  # --judged chooses another


def corpus(scratch: Path, per_source: int, inputs: Path | None = None) -> Path:
    if inputs is not None:  # a corpus given as is (e.g. one converted file)
        return inputs
    converted = scratch / "converted"
    if not converted.is_dir():
        subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "pairs_convert.py"), "--out", str(converted)],
            check=True,
        )
    out = scratch / f"corpus-{per_source}"
    if not out.is_dir():
        out.mkdir(parents=True)
        for path in sorted(converted.glob("*.json")):
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            step = max(1, len(lines) // per_source)
            (out / path.name).write_text("".join(lines[::step][:per_source]), encoding="utf-8")
    return out


def pair_shards(scratch: Path, inputs: Path) -> Path:
    out = scratch / "pairs"
    if not (out / "manifest.json").is_file():
        command = [
            sys.executable,
            "-m",
            "pipeline",
            "pairs",
            str(inputs),
            "--out",
            str(out),
            "--progress",
            "false",
        ]
        subprocess.run(command, check=True, cwd=REPO)
    return out


def rows(shards: Path) -> list[dict]:
    from pipeline.shards import read_manifest, read_shard

    manifest = read_manifest(shards)
    return [r for e in manifest["shards"] for b in read_shard(shards / e["name"]) for r in b.to_pylist()]


def subset(scratch: Path, shards: Path, per_source: int, seed: int) -> Path:
    """The judged pairs and a seeded sample of the others, at most ``per_source`` per source, in their
    shard order, as one pair shard (CPU time on this shared machine allows a few hundred per source)."""
    from pipeline.shards import new_manifest, read_manifest, write_manifest, write_shard

    out = scratch / f"pairs-subset-{per_source}"
    if (out / "manifest.json").is_file():
        return out
    judged = {int(r["id"]) for r in csv.DictReader(open(JUDGED, encoding="utf-8"), delimiter="\t")}
    found = rows(shards)
    chosen: set[int] = set(judged)
    by_source: dict[str, list[int]] = {}
    for r in found:
        by_source.setdefault(r["source"], []).append(r["id"])
    for ids in by_source.values():
        others = [i for i in ids if i not in judged]
        random.Random(seed).shuffle(others)
        chosen.update(others[: max(0, per_source - sum(i in judged for i in ids))])
    table = pa.Table.from_pylist([r for r in found if r["id"] in chosen], schema=PAIR_SCHEMA)
    out.mkdir(parents=True)
    blocks = [table.slice(i, 1000) for i in range(0, table.num_rows, 1000)]
    entry = write_shard(out / "shard-000000.tar", blocks, 0)
    config = {**read_manifest(shards)["config"], "subset_per_source": per_source, "subset_seed": seed}
    write_manifest(out, new_manifest("pairs", config, [entry], counts={"kept": table.num_rows}))
    return out


def sample(shards: Path, n: int, seed: int) -> None:
    if JUDGED.exists():
        print(f"{JUDGED} exists: not overwritten")
        return
    chosen = rows(shards)
    random.Random(seed).shuffle(chosen)
    with open(JUDGED, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(["id", "source", "kind", "anchor", "positive", "good"])
        for r in chosen[:n]:
            w.writerow([r["id"], r["source"], r["kind"], r["text"], r["positive"], ""])
    print(f"wrote {n} pairs to {JUDGED}: fill in the good column (1/0) before running the filter")


def teacher(
    scratch: Path, shards: Path, k: int, pool: int, model: str, max_length: int
) -> tuple[Path, float, int]:
    """Run the teacher stage with the filter (once: its timing is kept beside its output)."""
    out = scratch / f"teacher-{shards.name}-k{k}-p{pool}-t{max_length}"
    timing = out.with_suffix(".seconds")
    if not (out / "manifest.json").is_file():
        started = time.perf_counter()
        command = [
            sys.executable, "-m", "pipeline", "teacher", "--shards", str(shards), "--out", str(out),
            "--model", model, "--pair-top-k", str(k), "--pair-pool", str(pool), "--progress", "false",
            "--batch-size", "64", "--max-length", str(max_length),
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=REPO)
        timing.write_text(str(time.perf_counter() - started))
    seconds = float(timing.read_text()) if timing.is_file() else float("nan")
    counts = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["counts"]
    return out, seconds, counts["positives_encoded"]


# A projection, not a measurement: e5-small's forward FLOPs over the measured token counts, at an
# assumed share of a GPU's dense bf16/fp16 peak (NVIDIA datasheets), for the full corpus's pair count.
E5_SMALL = {"layers": 12, "hidden": 384, "intermediate": 1536}
GPU_PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0}
ASSUMED_MFU = 0.35  # the share of peak benchmarks/projection.py assumes for training; inference with padding
FULL_CORPUS_PAIRS = (
    15_000_000  # see docs/pairs.md: webtext 4.1M + baike ~2.2M + news ~2.8M + wiki 1.0M + zh-en 5.2M
)


def projection(shards: Path, model: str) -> None:
    from transformers import AutoTokenizer

    found = rows(shards)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prefix = "query: "  # e5's prefix as the teacher stage applies it (encoder.json)
    full = [len(tokenizer(prefix + r[side])["input_ids"]) for r in found for side in ("text", "positive")]
    h, f, n = E5_SMALL["hidden"], E5_SMALL["intermediate"], E5_SMALL["layers"]
    per_token = 2 * n * (4 * h * h + 2 * h * f)  # the dense layers, forward
    for limit in (128, 512):
        lengths = [min(t, limit) for t in full]
        tokens = sum(lengths) / len(found)
        attention = sum(2 * n * 2 * t * t * h for t in lengths) / len(found)  # QK^T and AV, forward
        flops = per_token * tokens + attention
        print(f"projection inputs (max_length {limit}): {len(found):,} pairs, {tokens:.1f} tokens a pair "
              f"(both sides, with the prefix), {flops / 1e9:.3f} GFLOP a pair (e5-small forward), MFU "
              f"{ASSUMED_MFU} assumed, {FULL_CORPUS_PAIRS:,} pairs in the full corpus (est.)")  # fmt: skip
        for gpu, peak in GPU_PEAK_TFLOPS.items():
            rate = peak * 1e12 * ASSUMED_MFU / flops
            hours = FULL_CORPUS_PAIRS / rate / 3600
            print(
                f"  projected {gpu}: {rate:,.0f} pairs/s per GPU, {hours:.2f} GPU-hours for the full corpus"
            )


def report(taught: Path, ks: list[int]) -> None:
    """Precision and recall of the filter's decision (rank <= k) against the hand judgements."""
    from pipeline.shards import read_manifest, read_shard

    judged = list(csv.DictReader(open(JUDGED, encoding="utf-8"), delimiter="\t"))
    if any(r["good"] not in ("0", "1") for r in judged):
        raise SystemExit(f"{JUDGED}: fill in every good value (0/1) first")
    manifest = read_manifest(taught)
    ranks = {
        r["id"]: (r["pair_rank"], r["pair_pool"], r["pair_cosine"])
        for e in manifest["shards"]
        for b in read_shard(taught / e["name"])
        for r in b.select(["id", "pair_rank", "pair_pool", "pair_cosine"]).to_pylist()
    }
    good = sum(r["good"] == "1" for r in judged)
    print(f"judged {len(judged)} pairs by hand: {good} good, {len(judged) - good} bad")
    for r in judged:
        if r["good"] == "0":
            rank, pool, cosine = ranks[int(r["id"])]
            print(f"  bad pair {r['source']}: rank {rank} of {pool}, cosine {cosine:.3f}: {r['anchor'][:30]}")
    for k in ks:
        tp = fp = fn = tn = 0
        by_source: dict[str, list[int]] = {}
        for r in judged:
            is_good, keep = r["good"] == "1", ranks[int(r["id"])][0] <= k
            cell = (0 if keep else 2) + (
                0 if is_good else 1
            )  # good kept, bad kept, good dropped, bad dropped
            tp, fp, fn, tn = tp + (cell == 0), fp + (cell == 1), fn + (cell == 2), tn + (cell == 3)
            by_source.setdefault(r["source"], [0, 0, 0, 0])[cell] += 1
        all_kept = sum(rank <= k for rank, _, _ in ranks.values())
        print(f"k={k}: kept {tp + fp} of {len(judged)} judged ({all_kept:,} of {len(ranks):,} pairs in all); "
              f"precision {tp / max(tp + fp, 1):.3f}, recall {tp / max(tp + fn, 1):.3f}, "
              f"bad pairs dropped {tn} of {fp + tn}")  # fmt: skip
        for source, cells in sorted(by_source.items()):
            print(f"    {source}: good kept {cells[0]}, bad kept {cells[1]}, good dropped {cells[2]}, "
                  f"bad dropped {cells[3]}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=["sample", "report"], required=True)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/pairs_filter"))
    parser.add_argument("--per-source", type=int, default=500)
    parser.add_argument("--judge", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", default="1,2,3,5", help="the filter's k values to report")
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--subset", type=int, default=150, help="pairs per source the teacher encodes")
    parser.add_argument("--max-length", type=int, default=128, help="the teacher's token limit per side")
    parser.add_argument("--model", default=str(REPO / "models" / "e5-small"))
    parser.add_argument("--inputs", type=Path, help="use these collection-format files as the corpus")
    parser.add_argument("--judged", type=Path, default=JUDGED, help="the hand-judged TSV")
    args = parser.parse_args()
    globals()["JUDGED"] = args.judged
    inputs = corpus(args.scratch, args.per_source, args.inputs)
    shards = pair_shards(args.scratch, inputs)
    if args.stage == "sample":
        sample(shards, args.judge, args.seed)
        return
    small = subset(args.scratch, shards, args.subset, args.seed)
    taught, seconds, pairs = teacher(args.scratch, small, 0, args.pool, args.model, args.max_length)
    print(f"teacher (e5-small, fp32 CPU, max_length {args.max_length}) + scores: {pairs:,} pairs in "
          f"{seconds:.1f} s wall = {pairs / seconds:.2f} pairs/s ({seconds / pairs * 1000:.0f} ms a pair; "
          "model load included)")  # fmt: skip
    report(taught, [int(k) for k in args.k.split(",")])
    projection(small, args.model)


if __name__ == "__main__":
    main()
