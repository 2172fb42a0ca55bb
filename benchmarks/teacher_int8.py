"""The teacher stage in int8 against fp32 on a CPU without native bf16, where the main job picks int8.

Runs ``pipeline teacher`` on the first ``--sentences`` of a main job's augmented shards (its
``--max_sentences``), with ``--precision fp32`` and ``--precision int8`` in turn, ``--repeats`` pairs,
whole-command wall time (start-up and the model load included), and compares the two outputs' vectors:
the cosine of each int8 row to its fp32 row (pipeline/model/int8.py).

By default each command runs held to AVX2 (benchmarks/cpu_precision.py's caps, with
``FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` for FBGEMM, which runs the int8 products): a CPU without native bf16
emulated on one that has it. ``--isa native`` runs on the CPU as it is.

    .venv/bin/python benchmarks/teacher_int8.py --shards runs/sample/augmented --model models/e5-small \\
        --sentences 12800 --workers 2 --repeats 2 --out out/teacher_int8.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import table
from cpu_precision import env_for, run

from pipeline.shards import read_manifest, read_shard
from pipeline.vectors import teacher_matrix


def vectors(out: Path) -> tuple[list[str], np.ndarray]:
    """(ids, teacher rows) of a teacher output, in manifest order."""
    ids, rows = [], []
    for entry in read_manifest(out)["shards"]:
        for block in read_shard(out / entry["name"]):
            ids += block.column("id").to_pylist()
            rows.append(teacher_matrix(block.column("teacher")))
    return ids, np.concatenate(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=Path, required=True, help="a main job's augmented shards")
    p.add_argument("--model", default="models/e5-small", help="the teacher folder")
    p.add_argument("--sentences", type=int, default=12800, help="the teacher stage's --max_sentences")
    p.add_argument("--workers", type=int, default=2, help="the stage's worker processes (one thread each)")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs, fp32 then int8")
    p.add_argument("--isa", choices=["avx2", "native"], default="avx2")
    p.add_argument("--out", type=Path, help="JSON of every run")
    args = p.parse_args(argv)
    if not (args.shards / "manifest.json").is_file():
        p.error(f"--shards {args.shards} has no manifest.json: give a main job's augmented shards")
    work = Path(tempfile.mkdtemp(prefix="teacher_int8-"))
    try:
        env = env_for(args.isa, 1, work)
        env.pop("OMP_NUM_THREADS")  # the stage gives each worker its share of the cores
        if args.isa == "avx2":
            env["FBGEMM_ENABLE_INSTRUCTIONS"] = "AVX2"
        seconds: dict[str, list[float]] = {"fp32": [], "int8": []}
        for repeat in range(args.repeats):
            for precision in seconds:
                out = work / f"{precision}-{repeat}"
                cmd = [sys.executable, "-m", "pipeline", "teacher", "--shards", str(args.shards), "--out",
                       str(out), "--model", args.model, "--precision", precision, "--workers",
                       str(args.workers), "--max_sentences", str(args.sentences),
                       "--progress", "false"]  # fmt: skip
                seconds[precision].append(run(cmd, env, work / f"{precision}-{repeat}.log"))
                print(f"{precision} run {repeat + 1}: {seconds[precision][-1]:.1f} s", flush=True)
        ids32, fp32 = vectors(work / "fp32-0")
        ids8, int8 = vectors(work / "int8-0")
        if ids32 != ids8:
            sys.exit("the two outputs hold different sentences")
        cosine = (fp32 * int8).sum(axis=1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(int8, axis=1)
        ratios = [a / b for a, b in zip(seconds["fp32"], seconds["int8"], strict=True)]
        result = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "sentences": len(ids32),
            "seconds": seconds,
            "fp32_over_int8": ratios,
            "cosine": {"mean": float(cosine.mean()), "p1": float(np.percentile(cosine, 1)),
                       "min": float(cosine.min())},  # fmt: skip
        }
        rows = [[precision, f"{statistics.median(s):.1f}", " / ".join(f"{x:.1f}" for x in s),
                 f"{len(ids32) / statistics.median(s):.1f}"] for precision, s in seconds.items()]  # fmt: skip
        print(table(["precision", "median s", "runs (s)", "sentences/s"], rows))
        pairs = ", ".join(f"{r:.2f}x" for r in ratios)
        print(f"fp32 / int8 per pair: {pairs}; median {statistics.median(ratios):.2f}x")
        c = result["cosine"]
        print(f"int8 rows' cosine to fp32 over {len(ids32)} sentences: mean {c['mean']:.4f}, 1st percentile "
              f"{c['p1']:.4f}, min {c['min']:.4f}")  # fmt: skip
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
