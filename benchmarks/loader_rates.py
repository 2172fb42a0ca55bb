"""The training loader at GPU rates: the real BatchStream with 0/1/2/4/8 workers, pinned or not, with and
without the teacher column, padding pre-tokenised ids vs tokenising on the fly.

Each cell builds the trainer's own pieces (``ViewCollator``, ``ShardSource``, ``BatchStream``, as
``pipeline.data.build.build_stream`` does for sentence shards), iterates one epoch and counts the steady
state: the batches made after every worker made its first one (each batch carries the wall-clock time its
worker made it), over the time from then to the last one's arrival in this process. An epoch starts its
workers afresh, as training does; that start-up is reported apart (``first_batches_s``). ``--repeats``
epochs per cell, in an interleaved order, median reported. Nothing consumes the batches: this is the
rate the loader can deliver to one rank, an upper bound that the step then competes with for the CPUs.
An epoch must hold several batches per worker: lower ``--batch`` for many workers on small shards.

Sequences/s count every encoded text (samples x views); per CPU core divides by min(workers, CPUs)
(0 workers: the main process, 1 core). Pinning needs CUDA: on a machine without it the pinned cells are
recorded as not available.

Shards: the teacher stage's output (text + teacher column) for on the fly, and ``pipeline tokenize``
over it for the stored ids; ``benchmarks/gpu_step.py prepare`` writes both from the bundled corpus.

    .venv/bin/python benchmarks/loader_rates.py --data out/gpu_bench --workers 0 1 2 4 8 \
        --out out/loader_rates.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import get_worker_info

from pipeline.data.collate import ViewCollator
from pipeline.data.stream import BatchStream, ShardSource, index_shards
from pipeline.data.token_ids import shards_have_ids
from pipeline.model.encoder import load_tokenizer as load_model_tokenizer
from pipeline.shards import read_manifest


class Stamped:
    """The collator, its batch in a dict beside the wall-clock time it was made and by which worker: the
    steady-state window starts once every worker has made its first batch (module docstring)."""

    def __init__(self, collate: ViewCollator):
        self.collate, self.columns = collate, collate.columns

    def __call__(self, rows: dict[str, Any]) -> dict[str, Any]:
        info = get_worker_info()
        return {"batch": self.collate(rows), "made_at": time.time(), "worker": info.id if info else 0}


def epoch_rate(
    directory: Path,
    tokenizer: Any,
    prefix: str,
    max_length: int,
    batch: int,
    workers: int,
    pin: bool,
    teacher: bool,
    variants: int = 0,
    window: int = 50,
    seed: int = 0,
) -> dict[str, Any]:
    """One epoch of the real stream over ``directory`` (pre-tokenised if it holds ids of ``tokenizer``):
    samples/s and sequences/s delivered in steady state, i.e. the batches made after every worker made its
    first one, over the time from then to the last one's arrival in this process (batches made earlier
    and waiting in the prefetch queue are not counted: they would inflate the rate)."""
    pretokenized = shards_have_ids(directory, tokenizer, prefix, max_length)
    collate = ViewCollator(tokenizer, max_length, variants, 0, prefix, teacher, 0, pretokenized)
    source = ShardSource(index_shards(directory), collate.columns)
    stream = BatchStream(source, Stamped(collate), batch, 0, 1, seed, workers, 4, window, pin_memory=pin)
    started = time.time()
    made, arrived, sizes, owners = [], [], [], []
    pinned = None
    for b in stream.epoch_batches():
        arrived.append(time.time())
        made.append(b["made_at"])
        owners.append(b["worker"])
        sizes.append(b["batch"].ids.shape[0] * b["batch"].num_views)
        if pinned is None:
            pinned = bool(b["batch"].input_ids.is_pinned())
    first_of = {}
    for t, w in zip(made, owners, strict=True):
        first_of[w] = min(t, first_of.get(w, t))
    steady_from = max(first_of.values())
    steady = [i for i, t in enumerate(made) if t > steady_from]
    if len(steady) < 2:
        raise ValueError(
            f"{directory}: {len(made)} batches of {batch} per epoch leave {len(steady)} made after every one "
            f"of {workers} workers made its first; lower --batch"
        )
    seconds = max(arrived[i] for i in steady) - steady_from
    sequences = sum(sizes[i] for i in steady)
    views = sizes[0] // batch
    return {
        "samples_per_s": sequences / views / seconds,
        "sequences_per_s": sequences / seconds,
        "first_batches_s": steady_from - started,  # start-up: every worker's first batch
        "timed_batches": len(steady),
        "pretokenized": pretokenized,
        "pinned": pinned,
    }


def loader_cells(
    text_shards: Path | None,
    token_shards: Path | None,
    model: Path | str,
    workers: list[int],
    pins: list[bool],
    teachers: list[bool],
    batch: int,
    repeats: int,
    variants: int = 0,
    deadline: float | None = None,
) -> list[dict[str, Any]]:
    """Every cell (input, workers, pin, teacher), ``repeats`` epochs each in an interleaved order; a cell
    that cannot run records its error. ``deadline`` (time.monotonic()): cells not reached are skipped."""
    tokenizer, prefix = load_model_tokenizer(str(model), None)
    inputs = {"tokenise on the fly": text_shards, "pad stored ids": token_shards}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    max_length = read_manifest(token_shards)["tokenizer"]["max_length"] if token_shards else 64
    cells = [
        {"input": name, "workers": w, "pin_memory": p, "teacher": t}
        for name, w, p, t in itertools.product(inputs, workers, pins, teachers)
    ]
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cells))}
    errors: dict[int, str] = {}
    for i, cell in enumerate(cells):
        if cell["pin_memory"] and not torch.cuda.is_available():
            errors[i] = "not available: pinning needs CUDA"
    for _ in range(repeats):
        for i, cell in enumerate(cells):
            if i in errors:
                continue
            if deadline is not None and time.monotonic() > deadline:
                if not runs[i]:
                    errors[i] = "skipped: out of time"
                continue
            w, pin, teacher = cell["workers"], cell["pin_memory"], cell["teacher"]
            try:
                rate = epoch_rate(
                    inputs[cell["input"]], tokenizer, prefix, max_length, batch, w, pin, teacher, variants
                )
            except Exception as exc:  # recorded, the other cells go on
                errors[i] = f"{type(exc).__name__}: {exc}"
                continue
            runs[i].append(rate)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    out = []
    for i, cell in enumerate(cells):
        record: dict[str, Any] = {**cell, "batch": batch, "max_length": max_length, "views": 1 + variants}
        if runs[i]:
            rates = [r["sequences_per_s"] for r in runs[i]]
            cores = max(1, min(cell["workers"], cpus))
            record.update(
                sequences_per_s=statistics.median(rates),
                sequences_per_s_runs=[round(r, 1) for r in rates],
                samples_per_s=statistics.median(r["samples_per_s"] for r in runs[i]),
                cores=cores,
                sequences_per_s_per_core=statistics.median(rates) / cores,
                first_batches_s=statistics.median(r["first_batches_s"] for r in runs[i]),
                timed_batches=runs[i][0]["timed_batches"],
                pretokenized=runs[i][0]["pretokenized"],
                pinned=runs[i][0]["pinned"],
            )
        if i in errors:
            record["error"] = errors[i]
        out.append(record)
    return out


def per_value_rows(source: ShardSource, runs: list[tuple[int, Any]]) -> dict[str, list[Any]]:
    """``ShardSource.rows`` before it gathered per block: one Python step per value (the A/B baseline)."""
    out: dict[str, list[Any]] = {name: [] for name in source.columns}
    for block, rows in runs:
        cols = source._block(block)
        for name in source.columns:
            out[name].extend(cols[name][i] for i in rows)
    return out


def rows_vs_loop(directory: Path, model: Path | str, batch: int, repeats: int) -> dict[str, Any]:
    """Microseconds per batch of ``ShardSource.rows`` vs the per-value loop on the same runs (a batch's
    rows from 1-4 blocks, every block decoded beforehand), interleaved, median of ``repeats`` rounds."""
    import numpy as np

    tokenizer, prefix = load_model_tokenizer(str(model), None)
    max_length = read_manifest(directory)["tokenizer"]["max_length"]
    collate = ViewCollator(tokenizer, max_length, 0, 0, prefix, True, 0, True)
    blocks = index_shards(directory)
    source = ShardSource(blocks, collate.columns, cache_blocks=len(blocks))
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(20):
        chosen = rng.choice(len(blocks), size=min(4, len(blocks)), replace=False)
        share = batch // len(chosen)
        batches.append([(int(b), rng.permutation(blocks[b].rows)[:share]) for b in chosen])
    for b in range(len(blocks)):
        source._block(b)  # decoded once: the comparison is the gather alone
    loop = lambda r: per_value_rows(source, r)  # noqa: E731
    arms = {
        "gather": source.rows,
        "per_value": loop,
        "gather+collate": lambda r: collate(source.rows(r)),
        "per_value+collate": lambda r: collate(loop(r)),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            began = time.perf_counter()
            for runs in batches:
                fn(runs)
            times[name].append((time.perf_counter() - began) / len(batches) * 1e6)
    us = {name: statistics.median(values) for name, values in times.items()}
    return {"batch": batch, "columns": list(collate.columns), "median_us_per_batch": us, "rounds": repeats,
            "speedup_rows": us["per_value"] / us["gather"],
            "speedup_rows_and_collate": us["per_value+collate"] / us["gather+collate"]}  # fmt: skip


def machine() -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpus": cpus,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| input | workers | pinned | teacher | sequences/s (runs) | per core |",
        "|---|---:|---|---|---:|---:|",
    ]
    for c in cells:
        if "sequences_per_s" in c:
            runs = ", ".join(f"{r:,.0f}" for r in c["sequences_per_s_runs"])
            rate = f"{c['sequences_per_s']:,.0f} ({runs})"
            per_core = f"{c['sequences_per_s_per_core']:,.0f}"
        else:
            rate, per_core = c.get("error", "–"), "–"
        lines.append(
            f"| {c['input']} | {c['workers']} | {c['pin_memory']} | {c['teacher']} | {rate} | {per_core} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None, help="a `gpu_step.py prepare` folder")
    p.add_argument("--text_shards", type=Path, default=None, help="teacher-stage shards (text + teacher)")
    p.add_argument("--token_shards", type=Path, default=None, help="`pipeline tokenize` over them")
    p.add_argument("--model", type=Path, default=None, help="the model folder the ids were made with")
    p.add_argument("--batch", type=int, default=256, help="samples per batch (one rank)")
    p.add_argument("--variants", type=int, default=0, help="EDA variants per sample (views 1 + this)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--pin", choices=["both", "on", "off"], default="both")
    p.add_argument("--teacher", choices=["both", "on", "off"], default="both")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: print only)")
    p.add_argument("--rows_vs_loop", action="store_true", help="only time ShardSource.rows vs the old loop")
    args = p.parse_args(argv)
    if args.data is not None:
        args.text_shards = args.text_shards or args.data / "teacher"
        args.token_shards = args.token_shards or args.data / "tok_student"
        args.model = args.model or args.data / "models" / "student"
    if args.model is None or (args.text_shards is None and args.token_shards is None):
        p.error("give --data, or --model with --text_shards and/or --token_shards")
    choice = {"both": [False, True], "on": [True], "off": [False]}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as training: workers tokenise, no pools
    before = machine()
    if args.rows_vs_loop:
        ab = rows_vs_loop(args.token_shards, args.model, args.batch, max(5, args.repeats))
        print(json.dumps({"machine": before, **ab}, indent=2))
        return 0
    cells = loader_cells(
        args.text_shards, args.token_shards, args.model, args.workers, choice[args.pin], choice[args.teacher],
        args.batch, args.repeats, args.variants,
    )  # fmt: skip
    result = {
        "benchmark": "loader_rates",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": before,
        "load_average_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cells": cells,
    }
    print(table(cells))
    print(f"machine: {before['cpus']} CPUs, load average before {before['load_average']}, after "
          f"{result['load_average_after']}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
