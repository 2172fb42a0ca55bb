"""The mission's size, rehearsed: every stage at up to 110M sentences on this machine (prints figures).

    python benchmarks/scale.py --sizes 1M,10M,110M --work /scratch/scale          # every part
    python benchmarks/scale.py --sizes 1M --parts train --work /tmp/scale           # one part, quick
    python benchmarks/scale.py --work /scratch/scale --table                        # the table so far

Parts (``--parts``, comma-separated; each size runs them in this order and cleans up after itself):

* ``preprocess``: a synthetic corpus in the five nlp_chinese_corpus JSON-lines formats (the generator
  of benchmarks/preprocess.py: the bundled People's Daily sample, so real sentence lengths, copied
  with a per-copy token; one paragraph in ten stays verbatim in every copy, i.e. exact duplicates,
  and every other sentence is a near duplicate of its twin in each other copy), then
  ``python -m pipeline preprocess --workers 2`` with the shard sizes docs/preprocess.md suggests at
  scale: wall time, sentences/s, peak RSS (largest single process), bytes per sentence, files.
* ``stages``: augment, tokenize and the teacher stage on a sample of that output (``--sample-rows``;
  the teacher on ``--teacher-rows`` with models/e5-small when it is there): rates and bytes per row,
  and the full-size time *projected* from them (labelled so).
* ``train``: shards with the training columns written directly (the data path is what is measured):
  text with the sample corpus's length distribution, 4 variants (one character deleted each), token ids
  of a character tokenizer with [CLS]/[SEP] (uint16), and up to ``--teacher-max`` rows also a teacher
  column of e5-small's width (384 fp16, random unit vectors); ids are random 64-bit numbers. Then
  ``accelerate launch`` of launch/pretrain.py with 2 gloo processes, 2 loader workers each, LUSE with
  a queue, length bucketing: launch -> first step; kill -9 of the whole job mid-epoch after a
  checkpoint; relaunch -> first step after the resume; peak RSS per rank and per loader worker.
* ``array``: preprocess as a 2-task SLURM array on the local test cluster
  (``bash launch/slurm/local_cluster.sh start`` first).

Every measurement is appended to WORK/results.jsonl, so parts run at different times make one table:
each cost against N with its growth exponent (the slope of log cost over log N between the smallest
and largest N), and the start-up read projected to a cluster's network file system.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import table as markdown_table  # noqa: E402
from preprocess import PeakRSS, make_corpus  # noqa: E402  (the shared corpus generator)

from pipeline.run_layout import CHECKPOINTS_DIR, STEP_GLOB, step_of  # noqa: E402
from pipeline.run_layout import MANIFEST as CHECKPOINT_MANIFEST  # noqa: E402
from pipeline.shards import (  # noqa: E402
    iter_blocks,
    new_manifest,
    read_manifest,
    shard_name,
    write_manifest,
    write_shard,
)

PREPROCESS_OPTIONS = ["--sentences_per_shard=100000", "--rows_per_block=4000"]  # docs/preprocess.md at scale
ROWS_PER_SHARD, ROWS_PER_BLOCK = 100_000, 4000
NUM_VARIANTS, MAX_LENGTH, TEACHER_DIM = 4, 64, 384
POOL = [chr(c) for c in range(0x4E00, 0x4E00 + 3500)]  # 3,500 CJK characters, 3 UTF-8 bytes each
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CLS, SEP = 2, 3


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6}.get(text[-1], 1)
    return int(float(text.rstrip("KM")) * scale)


def label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else f"{n / 1e3:g}k"


class Results:
    """WORK/results.jsonl: one line per figure, ``part``, ``n``, ``metric``, ``value``, ``unit``."""

    def __init__(self, path: Path):
        self.path = path

    def add(self, part: str, n: int, metric: str, value: float, unit: str, note: str = "") -> None:
        record = {
            "part": part,
            "n": n,
            "metric": metric,
            "value": value,
            "unit": unit,
            "note": note,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load": os.getloadavg()[0],
        }
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        extra = f"  ({note})" if note else ""
        print(f"  {part:<10} N={label(n):>6}  {metric:<44} {value:>14,.3f} {unit}{extra}", flush=True)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line]


def dir_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ------------------------------------------------------------------------------------------ preprocess
def part_preprocess(n: int, work: Path, results: Results, keep: bool) -> Path:
    corpus, out = work / f"raw-{label(n)}", work / f"pre-{label(n)}"
    shutil.rmtree(corpus, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    made = make_corpus(corpus, n)
    raw_bytes, raw_files = dir_bytes(corpus)
    results.add(
        "preprocess",
        n,
        "corpus generated (not the pipeline)",
        time.perf_counter() - started,
        "s",
        f"~{made:,} sentences, {raw_files} files, {raw_bytes / 1e9:.2f} GB",
    )
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        "preprocess",
        str(corpus),
        f"--out={out}",
        "--workers=2",
        *PREPROCESS_OPTIONS,
    ]
    cpu_before, started = children_cpu(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rss = PeakRSS(proc.pid, interval=0.5)
    _, err = proc.communicate()
    wall, peak = time.perf_counter() - started, rss.stop()
    if proc.returncode != 0:
        raise SystemExit(f"preprocess failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")
    cpu = children_cpu() - cpu_before
    manifest = read_manifest(out)
    counts = manifest["counts"]
    split, kept = counts["sentences_split"], counts["kept"]
    out_bytes, out_files = dir_bytes(out)
    results.add("preprocess", n, "wall, 2 workers", wall, "s", f"{split:,} split, {kept:,} kept")
    results.add("preprocess", n, "sentences/s (split sentences / wall)", split / wall, "1/s")
    results.add("preprocess", n, "CPU seconds", cpu, "s")
    results.add("preprocess", n, "peak RSS, largest process", peak / 2**20, "MiB")
    results.add("preprocess", n, "output bytes per kept sentence", out_bytes / kept, "B")
    results.add("preprocess", n, "files written", out_files, "files")
    shutil.rmtree(corpus, ignore_errors=True)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ stages
def sample_shards(source: Path, out: Path, rows: int) -> int:
    """The first ``rows`` rows of a shard set as a shard set of its own."""
    blocks, taken = [], 0
    for entry in read_manifest(source)["shards"]:
        for _, table in iter_blocks(source / entry["name"]):
            blocks.append(table.slice(0, rows - taken))
            taken += blocks[-1].num_rows
            if taken >= rows:
                break
        if taken >= rows:
            break
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    entry = write_shard(out / shard_name(0), blocks, 0)
    write_manifest(out, new_manifest("preprocess", {}, [entry], counts={}))
    return taken


def timed_stage(args: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed: {proc.stderr.strip().splitlines()[-3:]}")
    return time.perf_counter() - started


def part_stages(n: int, work: Path, results: Results, pre: Path, sample_rows: int, teacher_rows: int) -> None:
    sample, aug, tok = work / "sample", work / "sample-aug", work / "sample-tok"
    rows = sample_shards(pre, sample, sample_rows)
    for d in (aug, tok):
        shutil.rmtree(d, ignore_errors=True)
    seconds = timed_stage(
        ["augment", f"--shards={sample}", f"--out={aug}", "--workers=1", "--progress=false"]
    )
    rate = rows / seconds
    results.add("stages", n, "augment rows/s, 1 worker (incl. start-up)", rate, "1/s", f"{rows:,}-row sample")
    results.add("stages", n, "augment bytes per row", read_manifest(aug)["totals"]["bytes"] / rows, "B")
    results.add("stages", n, "augment wall at N, 2 workers (projected)", n / rate / 2 / 3600, "h")
    model = REPO / "models" / "e5-small"
    tokenizer = model if model.is_dir() else tiny_model(work)
    seconds = timed_stage(
        [
            "tokenize",
            f"--shards={aug}",
            f"--out={tok}",
            f"--model={tokenizer}",
            f"--max_length={MAX_LENGTH}",
            "--workers=1",
        ]
    )
    rate = rows / seconds
    results.add("stages", n, "tokenize rows/s (text + 4 variants)", rate, "1/s", tokenizer.name)
    results.add("stages", n, "tokenize bytes per row", read_manifest(tok)["totals"]["bytes"] / rows, "B")
    results.add("stages", n, "tokenize wall at N, 2 workers (projected)", n / rate / 2 / 3600, "h")
    if model.is_dir() and teacher_rows:
        small, taught = work / "sample-small", work / "sample-teacher"
        shutil.rmtree(taught, ignore_errors=True)
        few = sample_shards(aug, small, teacher_rows)
        seconds = timed_stage(
            [
                "teacher",
                f"--shards={small}",
                f"--out={taught}",
                f"--model={model}",
                "--precision=auto",
                "--progress=false",
            ]
        )
        rate = few / seconds
        results.add(
            "stages", n, "teacher rows/s, e5-small bf16, CPU (incl. load)", rate, "1/s", f"{few} rows"
        )
        results.add(
            "stages",
            n,
            "teacher bytes per row (text only, no variants)",
            read_manifest(taught)["totals"]["bytes"] / few,
            "B",
        )
        results.add("stages", n, "teacher wall at N on 1 CPU node (projected)", n / rate / 3600, "h")
        shutil.rmtree(small, ignore_errors=True)
        shutil.rmtree(taught, ignore_errors=True)
    for d in (sample, aug, tok):
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------ training shards
def tiny_model(work: Path) -> Path:
    """A 2-layer BERT with a character vocabulary over POOL: model loading stays out of the figures."""
    folder = work / "tiny-model"
    if (folder / "config.json").is_file():
        return folder
    from transformers import BertConfig, BertModel

    from pipeline.model.vocab import make_tokenizer, write_vocab

    folder.mkdir(parents=True, exist_ok=True)
    write_vocab(SPECIALS + POOL, folder / "vocab.txt")
    make_tokenizer(folder / "vocab.txt").save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(SPECIALS) + len(POOL),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=MAX_LENGTH,
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    return folder


def _strings(codes: np.ndarray, lengths: np.ndarray, utf8: np.ndarray) -> pa.Array:
    """Character codes (indexes into POOL), split by ``lengths``, as an Arrow string array, no Python loop."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths * 3, out=offsets[1:])
    data = utf8[codes].reshape(-1)
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(data))


def _ragged_take(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``flat[starts[i] : starts[i] + lengths[i]]`` for every i."""
    ends = np.cumsum(lengths)
    positions = np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - lengths, lengths)
    return flat[np.repeat(starts, lengths) + positions]


def _ids(codes: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] + the first MAX_LENGTH - 2 characters' ids + [SEP] per row: (flat uint16 ids, row lengths)."""
    kept = np.minimum(lengths, MAX_LENGTH - 2)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    body = _ragged_take(codes, starts, kept).astype(np.int64) + len(SPECIALS)
    out_lengths = kept + 2
    flat = np.empty(int(out_lengths.sum()), dtype=np.uint16)
    ends = np.cumsum(out_lengths)
    heads = ends - out_lengths
    flat[heads] = CLS
    flat[ends - 1] = SEP
    body_at = np.ones(len(flat), dtype=bool)
    body_at[heads] = False
    body_at[ends - 1] = False
    flat[body_at] = body
    return flat, out_lengths


def _list(values: pa.Array, lengths: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def synthetic_block(rng: np.random.Generator, rows: int, length_pool: np.ndarray, teacher: bool) -> pa.Table:
    utf8 = np.frombuffer("".join(POOL).encode("utf-8"), dtype=np.uint8).reshape(-1, 3)
    lengths = rng.choice(length_pool, rows).astype(np.int64)  # (rows,) characters
    codes = rng.integers(0, len(POOL), int(lengths.sum()))
    # variants: NUM_VARIANTS copies of each text, one character deleted from each (row-major order)
    v_src = np.repeat(lengths, NUM_VARIANTS)
    v_starts = np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), NUM_VARIANTS)
    copies = _ragged_take(codes, v_starts, v_src)
    drop = (rng.random(len(v_src)) * v_src).astype(np.int64)  # the deleted position of each copy
    keep = np.ones(len(copies), dtype=bool)
    keep[np.concatenate([[0], np.cumsum(v_src)[:-1]]) + drop] = False
    v_codes, v_lengths = copies[keep], v_src - 1
    ids, id_lengths = _ids(codes, lengths)
    v_ids, v_id_lengths = _ids(v_codes, v_lengths)
    per_row = np.full(rows, NUM_VARIANTS, dtype=np.int64)
    columns = {
        "id": pa.array(rng.integers(0, 2**63, rows, dtype=np.int64).astype(np.uint64)),
        "text": _strings(codes, lengths, utf8),
        "source": pa.array(["wiki_zh"] * rows),
        "variants": _list(_strings(v_codes, v_lengths, utf8), per_row),
        "variant_ops": _list(pa.array(["rd"] * (rows * NUM_VARIANTS)), per_row),
        "input_ids": _list(pa.array(ids), id_lengths),
        "variant_input_ids": _list(_list(pa.array(v_ids), v_id_lengths), per_row),
    }
    if teacher:
        vectors = rng.standard_normal((rows, TEACHER_DIM), dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        flat = pa.array(vectors.astype(np.float16).reshape(-1))
        columns["teacher"] = pa.FixedSizeListArray.from_arrays(flat, TEACHER_DIM)
    return pa.table(columns)


def _write_training_shard(job: tuple[Path, int, int, int, bool, np.ndarray]) -> dict[str, Any]:
    out, shard, rows, seed, teacher, length_pool = job
    rng = np.random.default_rng([seed, shard])
    sizes = [min(ROWS_PER_BLOCK, rows - start) for start in range(0, rows, ROWS_PER_BLOCK)]
    blocks = (synthetic_block(rng, size, length_pool, teacher) for size in sizes)
    return write_shard(out / shard_name(shard), blocks, shard)


def training_shards(out: Path, n: int, teacher: bool, model: Path, workers: int = 2) -> float:
    """N rows of training shards with a manifest like `pipeline tokenize`'s; returns the wall seconds."""
    from transformers import AutoTokenizer

    from pipeline.data.token_ids import tokenizer_hash
    from pipeline.resources import sample_sentences

    lengths = np.array([len(t) for t in sample_sentences(20_000)], dtype=np.int64)
    lengths = lengths[(lengths >= 5) & (lengths <= 256)]  # what preprocess keeps by default
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    counts = [min(ROWS_PER_SHARD, n - start) for start in range(0, n, ROWS_PER_SHARD)]
    jobs = [(out, i, rows, 0, teacher, lengths) for i, rows in enumerate(counts)]
    started = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        entries = list(pool.map(_write_training_shard, jobs))
    tokenizer = AutoTokenizer.from_pretrained(model)
    extra: dict[str, Any] = {
        "tokenizer": {
            "name": str(model),
            "hash": tokenizer_hash(tokenizer, "", MAX_LENGTH),
            "prefix": "",
            "max_length": MAX_LENGTH,
            "pad_token_id": 0,
            "vocab_size": len(tokenizer),
            "dtype": "uint16",
        }
    }
    if teacher:
        extra["teacher"] = {
            "name": "synthetic",
            "dim": TEACHER_DIM,
            "dtype": "float16",
            "hash": "synthetic",
            "kind": "synthetic",
            "pooling": "mean",
            "prefix": "query: ",
            "max_length": 512,
        }
    config = {"num_variants": NUM_VARIANTS, "synthetic": "benchmarks/scale.py"}
    write_manifest(out, new_manifest("tokenize", config, entries, counts={"sentences": n}, **extra))
    return time.perf_counter() - started


# ------------------------------------------------------------------------------------------ training runs
def train_config(work: Path, shards: Path, model: Path, run_dir: Path) -> Path:
    import yaml

    config = {
        "data": {
            "shards": str(shards),
            "num_variants": NUM_VARIANTS,
            "num_dropout_views": 1,
            "max_length": MAX_LENGTH,
            "num_workers": 2,
        },
        "model": {"name_or_path": str(model), "pooling": "cls"},
        "loss": [{"luse": {"temperature": 0.05, "queue_size": 256, "momentum": 0.995}}],
        "optim": {"lr": 1e-4, "warmup_steps": 10},
        "train": {"global_batch_size": 64, "max_steps": 10**7, "log_every": 1, "eval_every": 0, "cpu": True},
        "checkpoint": {"every_steps": 20, "every_minutes": 0},
        "run_dir": str(run_dir),
    }
    path = work / "scale-train.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def rank_or_worker(proc: psutil.Process, tree: list[psutil.Process]) -> str | None:
    """A training rank (a launch/pretrain.py process that is not a loader worker), one of its loader
    workers (a pretrain.py process whose parent is a rank), or neither (the launcher): PeakRSS classes."""

    def is_rank(p: psutil.Process) -> bool:
        cmd = p.cmdline()
        return "pretrain.py" in " ".join(cmd) and "accelerate" not in " ".join(cmd[:2])

    if proc not in tree or not is_rank(proc):
        return None
    parent = next((p for p in tree if p.pid == proc.ppid()), None)
    return "worker" if parent is not None and is_rank(parent) else "rank"


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "step" in record and "loss" in record:
            steps.append(int(record["step"]))
    return steps


def launch(config: Path, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "launch/accelerate/cpu2.yaml"),
        str(REPO / "launch/pretrain.py"),
        "--config",
        str(config),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_for(proc: subprocess.Popen, done: Callable[[], bool], log: Path, timeout: float) -> float:
    started = time.perf_counter()
    while not done():
        if proc.poll() is not None:
            raise SystemExit(f"training exited with {proc.returncode} early; see {log}")
        if time.perf_counter() - started > timeout:
            kill(proc)
            raise SystemExit(f"no progress in {timeout:.0f} s; see {log}")
        time.sleep(0.05)
    return time.perf_counter() - started


def kill(proc: subprocess.Popen) -> None:
    """kill -9 of the whole job, as a node failure would: launcher, ranks and loader workers (torch's
    launcher starts the ranks in sessions of their own, so a signal to its process group misses them)."""
    try:
        members = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        members = []
    for member in members:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    proc.wait()
    psutil.wait_procs(members, timeout=30)


def saved(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (``checkpoint.json`` is written last)."""
    complete = (run_dir / CHECKPOINTS_DIR).glob(f"{STEP_GLOB}/{CHECKPOINT_MANIFEST}")
    done = [step_of(p.parent.name) for p in complete]
    return [s for s in done if s is not None]


def logged_seconds(log: Path, marker: str) -> float | None:
    """The ``in X s`` figure of the first log line containing ``marker``."""
    import re

    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if marker in line and (found := re.search(r"in ([0-9.]+) s", line)):
            return float(found.group(1))
    return None


def part_train(n: int, work: Path, results: Results, teacher_max: int, keep: bool, reuse: bool) -> None:
    model = tiny_model(work)
    shards, run_dir = work / f"train-{label(n)}", work / f"run-{label(n)}"
    teacher = n <= teacher_max
    if reuse and (shards / "manifest.json").is_file() and read_manifest(shards)["totals"]["sentences"] == n:
        seconds = None  # written by an earlier call with --keep: only the runs are measured again
    else:
        seconds = training_shards(shards, n, teacher, model)
    total, files = dir_bytes(shards)
    index_bytes = sum(e["index"]["bytes"] for e in read_manifest(shards)["shards"])
    columns = "text, variants, ids" + (", teacher 384 fp16" if teacher else "")
    results.add("train", n, "shard bytes per row", total / n, "B", columns)
    results.add("train", n, "block index bytes per row", index_bytes / n, "B")
    results.add(
        "train", n, "manifest bytes", (shards / "manifest.json").stat().st_size, "B", f"{files} files"
    )
    if seconds is not None:
        results.add("train", n, "writing the synthetic shards (not the pipeline)", seconds, "s")
    subprocess.run(["sync"], check=False)
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False, stderr=subprocess.DEVNULL)
    shutil.rmtree(run_dir, ignore_errors=True)
    config = train_config(work, shards, model, run_dir)
    log = work / f"train-{label(n)}.log"
    proc = launch(config, log)
    rss = PeakRSS(proc.pid, interval=0.2, kind=rank_or_worker)
    first = wait_for(proc, lambda: bool(steps_logged(run_dir)), log, 600)
    results.add("train", n, "launch -> first step (cold page cache)", first, "s", "2 gloo processes")
    model_s, plan_s = logged_seconds(log, "model: "), logged_seconds(log, "data: ")
    if model_s is not None:
        results.add("train", n, "  of which model built (tiny model)", model_s, "s")
    if plan_s is not None:
        results.add("train", n, "  of which data planned (indexes read)", plan_s, "s")
    wait_for(proc, lambda: max(steps_logged(run_dir), default=0) >= 25 and bool(saved(run_dir)), log, 900)
    kill(proc)
    logged, resume_from = steps_logged(run_dir), max(saved(run_dir))
    relog = work / f"train-{label(n)}-resume.log"
    proc = launch(config, relog)
    resumed = wait_for(proc, lambda: len(steps_logged(run_dir)) > len(logged), relog, 600)
    first_step = steps_logged(run_dir)[len(logged)]
    note = f"killed at step {max(logged)}, resumed from step {resume_from}, first step {first_step}"
    results.add("train", n, "relaunch after kill -9 -> first step", resumed, "s", note)
    plan_s = logged_seconds(relog, "data: ")
    if plan_s is not None:
        results.add("train", n, "  of which data planned on resume", plan_s, "s")
    time.sleep(3)  # a few steps with the loader workers running
    kill(proc)
    rss.stop()
    rank_rss, worker_rss = rss.peaks.get("rank", 0), rss.peaks.get("worker", 0)
    results.add("train", n, "peak RSS per rank", rank_rss / 2**20, "MiB")
    results.add("train", n, "peak RSS per loader worker", worker_rss / 2**20, "MiB")
    shutil.rmtree(run_dir, ignore_errors=True)
    if not keep:
        shutil.rmtree(shards, ignore_errors=True)


# ------------------------------------------------------------------------------------------ SLURM array
def part_array(n: int, work: Path, results: Results) -> None:
    """Preprocess as a 2-task array per phase on the local cluster (launch/slurm/preprocess.sbatch)."""
    if shutil.which("sbatch") is None:
        print("  array: no sbatch here; start the local cluster with launch/slurm/local_cluster.sh start")
        return
    corpus, out = work / f"raw-array-{label(n)}", work / f"pre-array-{label(n)}"
    shutil.rmtree(corpus, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    make_corpus(corpus, n)
    script = str(REPO / "launch/slurm/preprocess.sbatch")
    env = {**os.environ, "PYTHON": sys.executable, "PIPELINE_REPO": str(REPO)}
    started = time.perf_counter()
    for phase, array in (("split", "0-1"), ("dedup", "0-1"), ("shards", "0-1"), ("finalize", "0")):
        proc = subprocess.run(
            [
                "sbatch",
                "--wait",
                f"--array={array}",
                f"--chdir={work}",
                script,
                phase,
                str(out),
                str(corpus),
                *PREPROCESS_OPTIONS,
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            break
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not (out / "manifest.json").is_file():
        print(f"  array: sbatch failed ({proc.returncode}): {proc.stderr.strip()[-300:]}")
        return
    kept = read_manifest(out)["counts"]["kept"]
    results.add("array", n, "preprocess as a 2-task SLURM array, wall", wall, "s", f"{kept:,} kept")
    shutil.rmtree(corpus, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)


# ------------------------------------------------------------------------------------------ table
def report(results: Results, bandwidth: float, rows_per_s: float) -> None:
    rows = results.read()
    if not rows:
        print("no results yet")
        return
    sizes = sorted({r["n"] for r in rows})
    runs: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        runs.setdefault((r["part"], r["metric"]), {}).setdefault(r["n"], []).append(r)
    metrics: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for key, by_n in runs.items():  # repeated figures (``--sizes 1M,110M,1M,110M``): their median
        metrics[key] = {n: {**found[-1], "value": statistics.median(r["value"] for r in found),
                            "repeats": len(found)} for n, found in by_n.items()}  # fmt: skip
    lines = []
    for (part, metric), by_n in metrics.items():
        cells = [_cell(by_n[n]) if n in by_n else "" for n in sizes]
        have = sorted(by_n)
        exponent = ""
        if len(have) >= 2 and by_n[have[0]]["value"] > 0 and by_n[have[-1]]["value"] > 0:
            slope = math.log(by_n[have[-1]]["value"] / by_n[have[0]]["value"]) / math.log(have[-1] / have[0])
            exponent = f"{slope:+.2f}"
        unit = next(iter(by_n.values()))["unit"]
        lines.append([part, metric.strip(), unit, *cells, exponent])
    header = ["part", "cost", "unit", *(label(n) for n in sizes), "growth exponent"]
    print("\n" + markdown_table(header, lines))
    starts = metrics.get(("train", "block index bytes per row"), {})
    manifests = metrics.get(("train", "manifest bytes"), {})
    shard_bytes = metrics.get(("train", "shard bytes per row"), {})
    if starts:
        print(
            f"\nProjected for a cluster whose ranks read shards from a network file system at {bandwidth:g} "
            "MB/s (projections from the measured bytes above):"
        )
        for n in sorted(starts):
            read = starts[n]["value"] * n + manifests.get(n, {"value": 0})["value"]
            print(
                f"  N={label(n):>6}: start-up reads the manifest + every block index, {read / 1e6:8.1f} MB: "
                f"{read / (bandwidth * 1e6):6.2f} s per reading rank"
            )
        for n in sorted(shard_bytes):
            need = shard_bytes[n]["value"] * rows_per_s / 1e6
            print(
                f"  N={label(n):>6}: training at {rows_per_s:,.0f} rows/s reads {need:6.1f} MB/s of shards "
                f"({shard_bytes[n]['note']})"
            )


def _cell(figure: dict[str, Any]) -> str:
    repeats = figure.get("repeats", 1)
    return f"{figure['value']:,.3g}" + (f" (median of {repeats})" if repeats > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1M", help="comma-separated corpus sizes, e.g. 1M,10M,110M")
    parser.add_argument("--parts", default="preprocess,stages,train", help="preprocess,stages,train,array")
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (tens of GB at 110M)")
    parser.add_argument("--sample-rows", type=int, default=20_000, help="rows of the augment/tokenize sample")
    parser.add_argument("--teacher-rows", type=int, default=300, help="rows of the teacher sample (0: skip)")
    parser.add_argument(
        "--teacher-max",
        type=parse_size,
        default=10**7,
        help="largest N whose training shards carry the teacher column (disk)",
    )
    parser.add_argument("--bandwidth", type=float, default=200.0, help="NFS MB/s for the projection")
    parser.add_argument(
        "--rows-per-s",
        type=float,
        default=6560.0,
        help="training rows/s for the read projection (default: 110M rows in a 4.66 h epoch on 8 A100s, "
        "as benchmarks/projection.py projects it)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the shards (default: removed after use)")
    parser.add_argument("--reuse", action="store_true", help="train: reuse shards kept by an earlier --keep")
    parser.add_argument("--results", type=Path, default=None, help="default WORK/results.jsonl")
    parser.add_argument("--table", action="store_true", help="only print the table of WORK/results.jsonl")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = Results(args.results or args.work / "results.jsonl")
    if not args.table:
        parts = args.parts.split(",")
        print(f"{psutil.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; work {args.work}", flush=True)
        for n in [parse_size(s) for s in args.sizes.split(",")]:
            pre = None
            if "preprocess" in parts:
                pre = part_preprocess(n, args.work, results, keep="stages" in parts or args.keep)
            if "stages" in parts:
                pre = pre or args.work / f"pre-{label(n)}"
                part_stages(n, args.work, results, pre, args.sample_rows, args.teacher_rows)
                if not args.keep:
                    shutil.rmtree(pre, ignore_errors=True)
            if "train" in parts:
                part_train(n, args.work, results, args.teacher_max, args.keep, args.reuse)
            if "array" in parts:
                part_array(n, args.work, results)
    report(results, args.bandwidth, args.rows_per_s)


if __name__ == "__main__":
    main()
