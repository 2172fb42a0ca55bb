"""Pair extraction speed and memory: ``python -m pipeline pairs`` over the converted real pair files.

The benchmark corpus is ../shared/data/pairs/ converted into the collections' formats by
``benchmarks/pairs_convert.py`` (news2016zh from CCTV news, baike2018qa from Baidu hot searches and
medical QA, webtext2019zh from KUAKE-QTR, translation2019zh from Tatoeba, wiki_zh from CSL: 113k
records), repeated ``--repeat`` times (copies of the files: the same records, so exact dedup removes
the copies, while pass 1, where the per-record work is, reads every one). For each size it runs the
stage as a user does (one ``--phase all`` process, ``--workers W``) under ``/usr/bin/time`` and prints
records/s per worker (wall, whole run), the split pass alone (records per second of pass-1 CPU, one
worker, in-process, after one untimed warm-up unit; the median of ``--runs``), the whole run's CPU
seconds (user + system of the process) and the peak RSS.

    .venv/bin/python benchmarks/pairs_extract.py --repeat 1,3 --workers 1 --runs 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def corpus(scratch: Path, repeat: int) -> Path:
    base = scratch / "converted"
    if not base.is_dir():
        subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "pairs_convert.py"), "--out", str(base)], check=True
        )
    out = scratch / f"corpus-x{repeat}"
    if not out.is_dir():
        out.mkdir()
        for r in range(repeat):
            for path in sorted(base.glob("*.json")):
                shutil.copy(path, out / f"{path.stem}-{r}.json")
    return out


def split_rate(inputs: Path, runs: int) -> tuple[int, float, dict[str, float]]:
    """Pass 1 alone over every unit, in this process: (records, CPU seconds, records/s per source),
    each the median of ``runs`` passes. One untimed unit first: the imports (pyarrow brings pandas)
    and the regex and table builds a worker process does once, whatever its share of the corpus."""
    from pipeline.stages.corpus.readers import expand_inputs, plan_units
    from pipeline.stages.pairs import passes
    from pipeline.stages.pairs.extract import PairRules

    units, _ = plan_units(expand_inputs([inputs]), "auto", 4 << 20, 4 << 20)
    params = passes.PairParams(PairRules(), 4 << 20, 8, 0, False)
    work = Path(tempfile.mkdtemp())
    (work / "split").mkdir()
    passes.split_unit(work, 0, units[0], params, lambda n: None)  # warm-up, not timed
    by_source: dict[str, int] = {}
    seconds: dict[str, list[float]] = {}
    for run in range(runs):
        spent_by_source: dict[str, float] = {}
        for i, unit in enumerate(units):
            started = time.process_time()
            result = passes.split_unit(work, i, unit, params, lambda n: None)
            spent = time.process_time() - started
            if run == 0:
                by_source[unit.format] = by_source.get(unit.format, 0) + result["counts"]["records"]
            spent_by_source[unit.format] = spent_by_source.get(unit.format, 0.0) + spent
        for source, spent in spent_by_source.items():
            seconds.setdefault(source, []).append(spent)
        seconds.setdefault("", []).append(sum(spent_by_source.values()))
    shutil.rmtree(work)
    median = {s: statistics.median(v) for s, v in seconds.items()}
    records = sum(by_source.values())
    return records, median[""], {s: by_source[s] / median[s] for s in sorted(by_source)}


def whole_run(inputs: Path, out: Path, workers: int) -> dict:
    command = [
        "/usr/bin/time", "-f", "%e %M %U %S", sys.executable, "-m", "pipeline", "pairs", str(inputs),
        "--out", str(out), "--workers", str(workers), "--progress", "false", "--overwrite",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    wall, rss, user, system = proc.stderr.strip().splitlines()[-1].split()
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    return {
        "wall_s": float(wall),
        "cpu_s": float(user) + float(system),
        "peak_rss_mib": int(rss) / 1024,
        "counts": manifest["counts"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", default="1,3", help="corpus sizes, as copies of the converted files")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3, help="split-pass timings per source (median)")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "pairs_bench")
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    for repeat in [int(r) for r in args.repeat.split(",")]:
        inputs = corpus(args.scratch, repeat)
        result = whole_run(inputs, args.scratch / f"out-x{repeat}", args.workers)
        records = result["counts"]["records"]
        print(
            f"x{repeat}: {records:,} records -> {result['counts']['kept']:,} pairs; "
            f"whole run {result['wall_s']:.1f} s wall, "
            f"{records / result['wall_s'] / args.workers:,.0f} records/s per worker "
            f"({args.workers} worker(s)); {result['cpu_s']:.2f} CPU s = "
            f"{records / result['cpu_s']:,.0f} records per CPU-second; "
            f"peak RSS {result['peak_rss_mib']:.0f} MiB"
        )
        if repeat == 1:
            n, seconds, per_source = split_rate(inputs, args.runs)
            rates = ", ".join(f"{s} {r:,.0f}" for s, r in per_source.items())
            print(
                f"   split pass alone (median of {args.runs}): {n:,} records in {seconds:.2f} CPU s = "
                f"{n / seconds:,.0f} records/s ({rates})"
            )


if __name__ == "__main__":
    main()
