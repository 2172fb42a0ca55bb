"""bf16 against fp32 on a CPU with native bf16 and on the same CPU held to AVX2, in one run: the teacher
stage, distillation steps and one evaluation of the main job, each as its own command.

A CPU without native bf16 (AVX2 only: AMD before Zen 4, Intel before Cooper Lake, most laptops) is
emulated on one that has it by capping each library's instruction set before the process starts:
``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN, which runs the bf16
matmuls) and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's fp32 GEMM). Under that cap bf16 matmuls are emulated
as on a real AVX2 CPU; the script prints what ``auto`` resolves to under each cap (pipeline/precision.py).

Each cell is one command's wall time (start-up included; the distillation cell also gives the steps' own
rate from the run's log), cells in turn, all in one process tree: run it on a quiet machine.

    .venv/bin/python benchmarks/cpu_precision.py --data runs/sample --model models/e5-small \\
        --sentences 1000 --steps 100 --max_pairs 500 --out out/cpu_precision.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PRETRAIN, ROOT, table

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
ISAS = {"native": {}, "avx2": AVX2}
CORPUS = ROOT / "pipeline" / "resources" / "corpus" / "peoples_daily_199801.txt"
PROBE = (
    "from pipeline.precision import cpu_bf16, resolve_cpu_precision; import torch; "
    "print(torch.backends.cpu.get_cpu_capability(), '|', resolve_cpu_precision('auto', 'auto')[0], '|', "
    "cpu_bf16().why)"
)


def env_for(isa: str, threads: int, work: Path) -> dict[str, str]:
    """A child's environment under ``isa``, with its own inductor cache: kernels compiled under one ATen
    capability fail when loaded under another (seen when one machine switches ATEN_CPU_CAPABILITY)."""
    env = {k: v for k, v in os.environ.items() if k not in AVX2}
    env.update(ISAS[isa], OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{isa}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run(cmd: list[str], env: dict[str, str], log: Path) -> float:
    """Wall seconds of ``cmd``; its output goes to ``log``; a failure stops the script with the log's tail."""
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{tail}")
    return seconds


def small_input(work: Path, sentences: int) -> Path:
    """Preprocess shards of the People's Daily sample's first lines: ``sentences`` or a few more."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    text = work / "corpus.txt"
    keep, count = [], 0
    for line in lines:  # about one sentence per 。; preprocess splits them
        keep.append(line)
        count += max(1, line.count("。"))
        if count >= sentences:
            break
    text.write_text("\n".join(keep) + "\n", encoding="utf-8")
    out = work / "shards"
    cmd = [sys.executable, "-m", "pipeline", "preprocess", str(text), "--out", str(out)]
    run([*cmd, "--progress", "false"], env_for("native", 2, work), work / "preprocess.log")
    return out


def steps_rate(run_dir: Path) -> float | None:
    """Median sentences/s of the run's logged steps (metrics.jsonl), start-up excluded."""
    rates = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "sentences_per_s" in record:
            rates.append(record["sentences_per_s"])
    return statistics.median(rates[1:] or rates) if rates else None


def cells(args: argparse.Namespace, work: Path, shards: Path, isa: str, precision: str) -> dict:
    env, py = env_for(isa, args.threads, work), sys.executable
    tag = f"{isa}-{precision}"
    out: dict = {}
    teacher = [py, "-m", "pipeline", "teacher", "--shards", str(shards), "--out",
               str(work / f"teacher-{tag}"), "--model", args.model, "--precision", precision,
               "--workers", "1", "--progress", "false"]  # fmt: skip
    out["teacher_s"] = run(teacher, env, work / f"teacher-{tag}.log")
    run_dir = work / f"distill-{tag}"
    distill = [py, str(PRETRAIN), "--config", "launch/configs/distill.yaml",
               f"--data.shards={args.data}/teacher", f"--model.name_or_path={args.data}/student",
               f"--data.teacher={args.model}", f"--run_dir={run_dir}", f"--train.max_steps={args.steps}",
               "--train.mixed_precision=" + ("no" if precision == "fp32" else precision),
               "--train.eval_every=0", "--train.final_model=last", "--checkpoint.every_steps=0",
               "--checkpoint.every_minutes=0", "--train.progress=false"]  # fmt: skip
    out["distill_s"] = run(distill, env, work / f"distill-{tag}.log")
    out["distill_sentences_per_s"] = steps_rate(run_dir)
    evaluate = [py, "-m", "pipeline", "eval", f"{args.data}/student", "--suite", "[sts]", "--max_pairs",
                str(args.max_pairs), "--precision", precision, "--progress", "false",
                "--out", str(work / f"eval-{tag}")]  # fmt: skip
    out["eval_s"] = run(evaluate, env, work / f"eval-{tag}.log")
    scores = json.loads((work / f"eval-{tag}" / "eval.json").read_text(encoding="utf-8"))["sts"]["model"]
    out["eval_avg5"] = scores.get("avg5")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a main job's OUT (student/, teacher/)")
    p.add_argument("--model", default="models/e5-small", help="the teacher folder")
    p.add_argument("--sentences", type=int, default=1000, help="sentences the teacher stage encodes")
    p.add_argument("--steps", type=int, default=100, help="distillation steps")
    p.add_argument("--max_pairs", type=int, default=500, help="pairs a set in the evaluation")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each command")
    p.add_argument("--isa", nargs="+", default=list(ISAS), choices=list(ISAS))
    p.add_argument("--precision", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--out", type=Path, help="JSON of every cell")
    args = p.parse_args(argv)
    for need in ("teacher", "student"):
        if not (args.data / need).is_dir():
            p.error(f"--data {args.data} has no {need}/: run launch/run_sample.sh first (OUT={args.data})")
    work = Path(tempfile.mkdtemp(prefix="cpu_precision-"))
    try:
        shards = small_input(work, args.sentences)
        results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "cells": {}, "auto": {}}
        for isa in args.isa:
            probe = [sys.executable, "-c", PROBE]
            said = subprocess.run(probe, env=env_for(isa, 1, work), capture_output=True, text=True, cwd=ROOT,
                                  check=True).stdout.strip()  # fmt: skip
            results["auto"][isa] = said
            print(f"{isa}: ATen {said}", flush=True)
            for precision in args.precision:
                found = cells(args, work, shards, isa, precision)
                results["cells"][f"{isa}/{precision}"] = found
                print(f"{isa}/{precision}: {found}", flush=True)
        rows = []
        for key, c in results["cells"].items():
            rate = c["distill_sentences_per_s"]
            cell = [f"{c['teacher_s']:.1f}", f"{c['distill_s']:.1f}", f"{rate:.1f}" if rate else "–"]
            rows.append([key, *cell, f"{c['eval_s']:.1f}", f"{c['eval_avg5']:.2f}"])
        header = ["ISA / precision", f"teacher, {args.sentences} sentences (s)", f"{args.steps} steps (s)",
                  "steps' sentences/s", f"eval, {args.max_pairs} pairs a set (s)", "eval avg5"]  # fmt: skip
        print(table(header, rows))
        for isa, said in results["auto"].items():
            print(f"- {isa}: ATen capability, auto's choice, why: {said}")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
