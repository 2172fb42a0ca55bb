"""The teacher's consistency filter on real pairs: its cost per pair, its precision against hand judgements.

Steps (each skipped when its output exists in --scratch):

  corpus   ``--per-source`` records of each file that ``benchmarks/pairs_convert.py --out`` writes (every
           n-th record, so the whole file is spread), in the collections' formats
  pairs    ``python -m pipeline pairs`` over them (defaults) -> pair shards
  sample   ``--judge`` pairs drawn with a seeded shuffle -> ``benchmarks/pairs_judged.tsv`` columns
           id, source, kind, anchor, positive, and an empty ``good`` column that a person fills in
           (1 = the positive is a real answer / partner of the anchor, 0 = it is not) BEFORE the filter
           is run; the file is never overwritten
  teacher  ``python -m pipeline teacher --model models/e5-small --pair-top-k K --pair-pool P`` on the
           pair shards, timed (pairs per second, both sides encoded, scored and filtered)
  report   the filter's decisions on the judged pairs (rank <= K among the pool): precision (judged
           good among kept) and recall (kept among judged good), per source too

    .venv/bin/python benchmarks/pairs_filter.py --stage sample           # then judge the TSV by hand
    .venv/bin/python benchmarks/pairs_filter.py --stage report --k 2 --pool 64
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

JUDGED = REPO / "benchmarks" / "pairs_judged.tsv"


def corpus(scratch: Path, per_source: int) -> Path:
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


def teacher(scratch: Path, shards: Path, k: int, pool: int, model: str) -> tuple[Path, float, int]:
    """Run the teacher stage with the filter (once: its timing is kept beside its output)."""
    out = scratch / f"teacher-k{k}-p{pool}"
    timing = scratch / f"teacher-k{k}-p{pool}.seconds"
    if not (out / "manifest.json").is_file():
        started = time.perf_counter()
        command = [
            sys.executable, "-m", "pipeline", "teacher", "--shards", str(shards), "--out", str(out),
            "--model", model, "--pair-top-k", str(k), "--pair-pool", str(pool), "--progress", "false",
            "--batch-size", "64",
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
    lengths = [
        len(tokenizer(prefix + r[side], truncation=True, max_length=512)["input_ids"])
        for r in found
        for side in ("text", "positive")
    ]
    tokens = sum(lengths) / len(found)
    h, f, n = E5_SMALL["hidden"], E5_SMALL["intermediate"], E5_SMALL["layers"]
    per_token = 2 * n * (4 * h * h + 2 * h * f)  # the dense layers, forward
    attention = sum(2 * n * 2 * t * t * h for t in lengths) / len(found)  # QK^T and AV, forward
    flops = per_token * tokens + attention
    print(f"projection inputs: {len(found):,} pairs, {tokens:.1f} tokens a pair (both sides, prefix, "
          f"<= 512), {flops / 1e9:.2f} GFLOP a pair (e5-small forward), MFU {ASSUMED_MFU} assumed, "
          f"{FULL_CORPUS_PAIRS:,} pairs in the full corpus (estimated)")  # fmt: skip
    for gpu, peak in GPU_PEAK_TFLOPS.items():
        rate = peak * 1e12 * ASSUMED_MFU / flops
        hours = FULL_CORPUS_PAIRS / rate / 3600
        print(f"  projected {gpu}: {rate:,.0f} pairs/s per GPU, {hours:.2f} GPU-hours for the full corpus")


def report(shards: Path, taught: Path, k: int) -> None:
    from pipeline.shards import read_manifest, read_shard

    judged = list(csv.DictReader(open(JUDGED, encoding="utf-8"), delimiter="\t"))
    if any(r["good"] not in ("0", "1") for r in judged):
        raise SystemExit(f"{JUDGED}: fill in every good value (0/1) first")
    manifest = read_manifest(taught)
    kept = {
        r["id"]: r for e in manifest["shards"] for b in read_shard(taught / e["name"]) for r in b.to_pylist()
    }
    by_source: dict[str, list[int]] = {}
    tp = fp = fn = tn = 0
    for r in judged:
        good, keep = r["good"] == "1", int(r["id"]) in kept
        tp += good and keep
        fp += (not good) and keep
        fn += good and not keep
        tn += (not good) and not keep
        s = by_source.setdefault(r["source"], [0, 0, 0, 0])
        s[0] += good and keep
        s[1] += (not good) and keep
        s[2] += good and not keep
        s[3] += (not good) and not keep
    print(f"judged {len(judged)} pairs: {tp + fn} good, {fp + tn} bad; filter (k={k}) kept {tp + fp}")
    print(
        f"precision {tp / max(tp + fp, 1):.3f} "
        f"(good among kept; among all judged pairs: {(tp + fn) / len(judged):.3f})"
    )
    print(f"recall {tp / max(tp + fn, 1):.3f} (kept among good); bad pairs dropped {tn}/{fp + tn}")
    for source, (a, b, c, d) in sorted(by_source.items()):
        print(f"  {source}: good kept {a}, bad kept {b}, good dropped {c}, bad dropped {d}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=["sample", "report"], required=True)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/pairs_filter"))
    parser.add_argument("--per-source", type=int, default=500)
    parser.add_argument("--judge", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--model", default=str(REPO / "models" / "e5-small"))
    args = parser.parse_args()
    inputs = corpus(args.scratch, args.per_source)
    shards = pair_shards(args.scratch, inputs)
    if args.stage == "sample":
        sample(shards, args.judge, args.seed)
        return
    taught, seconds, pairs = teacher(args.scratch, shards, args.k, args.pool, args.model)
    print(f"teacher + filter: {pairs:,} pairs in {seconds:.1f} s wall = {pairs / seconds:.1f} pairs/s "
          f"({seconds / pairs * 1000:.1f} ms a pair; model load included)")  # fmt: skip
    report(shards, taught, args.k)
    projection(shards, args.model)


if __name__ == "__main__":
    main()
