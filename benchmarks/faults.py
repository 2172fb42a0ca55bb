"""Reliability table: faults injected for real on this machine, each row with its counts.

    .venv/bin/python benchmarks/faults.py [--quick] [--workdir DIR] [--rows NAME ...]

Rows (each prints PASS only if every run of it met the claim):

* kill -9 during a checkpoint write: a child process saves checkpoints back to back and is killed at a
  random time; ``Checkpointer.latest()`` must return a complete, verified checkpoint (never the partial
  ``.tmp-step-*``), the newest one whose save finished.
* a bit flip and a truncation of a shard: ``shard_paths(verify=True)`` (what training runs with
  ``data.verify_shards``) must refuse with the shard's file named.
* malformed pair-file lines (bad JSON, bad UTF-8, missing field, wrong-type field, a huge line) mixed
  into good ones, read with ``strict=False``: every bad line counted, a sample ``file:line`` in the log,
  0 good records lost; an empty file is refused with its name.
* preprocess (2 workers) killed with kill -9 of its whole process group at a random point of its work
  (after the imports, which take most of a short run), then rerun: shard names, sizes, sha256 and the
  counts must equal a clean run's.
* a gzip input cut in half: counted as one unreadable file, named in the log, and every sentence of its
  readable lines kept (compared with preprocessing those lines from a plain file).

* augment (2 workers, the corpus in shards of 1,000 sentences) killed the same way, then rerun:
  manifest.json and every shard's sha256 must equal a clean run's.
* a 2-process ``accelerate launch`` (gloo, debug.yaml, tiny shards made by preprocess + augment) killed
  with kill -9 of its process group and every rank at two random steps per run, relaunched each time
  (auto-resume from the newest checkpoint): the final parameters (every rank's checksum and the saved
  model file), momentum queue, data cursor and every logged loss must be bit-identical to an
  uninterrupted run's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from pathlib import Path

import psutil
import pyarrow as pa

from pipeline.data.pairs import read_pairs
from pipeline.errors import InputError
from pipeline.io import atomic_write_json, sha256_file
from pipeline.resources import SAMPLE_CORPUS, sample_sentences
from pipeline.shards import (
    BASE_SCHEMA,
    MANIFEST,
    new_manifest,
    read_manifest,
    sentence_id,
    shard_name,
    shard_paths,
    write_shard,
)
from pipeline.train.checkpoint import Checkpointer, verify_checkpoint

ROWS: list[tuple[str, str, bool]] = []


def row(name: str, counts: str, ok: bool) -> None:
    ROWS.append((name, counts, ok))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {counts}", flush=True)


# ----------------------------------------------------------------------------------- checkpoints
SAVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from pipeline.train.checkpoint import Checkpointer

    class Model:  # what Checkpointer needs of the encoder: save_pretrained
        def __init__(self):
            self.weights = {"w": torch.randn(2_000_000)}  # 8 MB, so that a save takes a while

        def save_pretrained(self, directory):
            Path(directory).mkdir(parents=True)
            save_file(self.weights, Path(directory) / "model.safetensors")

    class State:
        def __init__(self):
            self.t = torch.randn(2_000_000)

        def state_dict(self):
            return {"t": self.t}

        def load_state_dict(self, state):
            self.t = state["t"]

    ckpt = Checkpointer(sys.argv[1], keep_last=2)
    model, state = Model(), State()
    for step in range(1, 10_000):
        ckpt.save(step, model, {"state": state}, {}, {"step": step})
        print(step, flush=True)
    """
)


def checkpoint_kills(work: Path, runs: int, rng: random.Random) -> None:
    picked_ok, mid_write = 0, 0
    for run in range(runs):
        run_dir = work / f"ckpt-{run}"
        child = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(run_dir)], stdout=subprocess.PIPE, text=True
        )
        done = [int(child.stdout.readline())]  # the first save finished: there is something to keep
        time.sleep(rng.uniform(0.05, 1.5))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        done += [int(x) for x in out.split()]
        tmp_left = any((run_dir / "checkpoints").glob(".tmp-step-*"))
        mid_write += tmp_left
        latest = Checkpointer(run_dir).latest()
        ok = latest is not None and not latest.name.startswith(".")
        if ok:
            verify_checkpoint(latest)
            ok = int(latest.name.split("-")[1]) >= max(done)  # no finished save lost
        picked_ok += ok
    row(
        "kill -9 during checkpoint writes",
        f"{runs} kills ({mid_write} left a partial .tmp-step-*), {picked_ok}/{runs} resumed from the newest "
        "complete, verified checkpoint",
        picked_ok == runs,
    )


# ----------------------------------------------------------------------------------- shards
def write_tiny_shards(directory: Path, sentences: list[str], per_shard: int) -> None:
    directory.mkdir(parents=True)
    entries = []
    for s in range(0, len(sentences), per_shard):
        rows = sentences[s : s + per_shard]
        table = pa.table(
            {"id": [sentence_id(t) for t in rows], "text": rows, "source": ["plain"] * len(rows)},
            schema=BASE_SCHEMA,
        )
        entries.append(write_shard(directory / shard_name(len(entries)), [table], len(entries)))
    atomic_write_json(directory / "manifest.json", new_manifest("preprocess", {}, entries, counts={}))


def shard_damage(work: Path, rng: random.Random) -> None:
    sentences = sample_sentences(600)
    refused = 0
    for kind in ("bit flip", "truncation"):
        d = work / f"shards-{kind.replace(' ', '-')}"
        write_tiny_shards(d, sentences, 200)
        victim = d / shard_name(1)
        data = bytearray(victim.read_bytes())
        if kind == "bit flip":
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        else:
            data = data[: len(data) // 2]
        victim.write_bytes(bytes(data))
        try:
            shard_paths(d, verify=True)
        except InputError as exc:
            refused += victim.name in str(exc)
            print(f"      {kind}: {exc}")
    row("a bit flip and a truncation of a shard", f"{refused}/2 refused with the shard named", refused == 2)


# ----------------------------------------------------------------------------------- preprocess
def preprocess_cmd(inputs: list[Path], out: Path, per_shard: int = 5000) -> list[str]:
    return [
        sys.executable, "-m", "pipeline", "preprocess", *map(str, inputs), f"--out={out}", "--workers=2",
        "--chunk_bytes=500000", f"--sentences_per_shard={per_shard}",
    ]  # fmt: skip


def output_fingerprint(out: Path) -> tuple:
    """What must not depend on a kill: every shard's name, size and sha256, and the counts."""
    manifest = read_manifest(out)
    shards = [(s["name"], s["bytes"], s["sha256"]) for s in manifest["shards"]]
    return shards, json.dumps(manifest["counts"], sort_keys=True)


def timed_clean_run(cmd: list[str], out: Path, work_name: str) -> float:
    """Run ``cmd`` to the end; return the seconds from its work directory's creation to its exit."""
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work_started = None
    while child.poll() is None:
        if work_started is None and (out / work_name).is_dir():
            work_started = time.monotonic()
        time.sleep(0.02)
    if child.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {child.returncode}")
    return time.monotonic() - (work_started or time.monotonic())


def kill_during_work(
    cmd: list[str],
    out: Path,
    work_name: str,
    work_seconds: float,
    rng: random.Random,
    window: tuple[float, float] = (0.1, 0.8),
) -> tuple[bool, int]:
    """Start ``cmd`` in its own process group (kill -9 then reaches its worker processes too, as a node
    failure would), wait for its work directory, kill the group at a random point (``window``, a share
    of the work's length in a clean run; imports excluded: they take most of a short run). On a shared
    machine a run can finish before its kill: then it starts again in an empty ``out`` with half the
    delay, up to 4 times.
    Returns (whether a kill landed before the end, how many runs finished first)."""
    shrink = 1.0
    for missed in range(4):
        child = subprocess.Popen(
            cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        while child.poll() is None and not (out / work_name).is_dir():
            time.sleep(0.02)
        delay = rng.uniform(*window) * work_seconds * shrink
        time.sleep(delay)
        landed = child.poll() is None
        if landed:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        print(
            f"      {out.name}: killed {delay:.1f} s into its work" + ("" if landed else " (it had finished)")
        )
        if landed:
            return True, missed
        shutil.rmtree(out)
        shrink /= 2
    return False, 4


def preprocess_kills(work: Path, runs: int, rng: random.Random) -> None:
    clean = work / "pp-clean"
    work_seconds = timed_clean_run(preprocess_cmd([SAMPLE_CORPUS], clean), clean, ".work")
    print(f"      clean preprocess: {work_seconds:.1f} s of work after its imports")
    expected, same, landed, partial, redone = output_fingerprint(clean), 0, 0, 0, 0
    for run in range(runs):
        out = work / f"pp-killed-{run}"
        hit, missed = kill_during_work(preprocess_cmd([SAMPLE_CORPUS], out), out, ".work", work_seconds, rng)
        landed, redone = landed + hit, redone + missed
        partial += (out / ".work").is_dir()  # the kill left work files for the rerun to pick up
        subprocess.run(preprocess_cmd([SAMPLE_CORPUS], out), check=True, capture_output=True)
        same += output_fingerprint(out) == expected
    row(
        "preprocess (2 workers) killed with kill -9 of its process group, rerun",
        f"{runs} runs ({landed} kills before the end, {partial} with work files left; {redone} runs finished "
        f"before their kill and were redone), {same}/{runs} with shards (sha256) and counts identical to a "
        "clean run",
        same == runs and landed == runs,
    )


def truncated_gzip(work: Path) -> None:
    """A gzip cut in half: preprocess keeps every sentence it could decompress and counts the file."""
    lines = [line for line in SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()][:4000]
    data = gzip.compress(("\n".join(lines) + "\n").encode("utf-8"))
    cut = work / "cut.txt.gz"
    cut.write_bytes(data[: len(data) // 2])
    readable = zlib.decompressobj(wbits=31).decompress(data[: len(data) // 2]).decode("utf-8", "ignore")
    complete = [line for line in readable.split("\n")[:-1] if line.strip()]  # the last line is cut
    whole = work / "readable.txt"
    whole.write_text("\n".join(complete) + "\n", encoding="utf-8")
    result = subprocess.run(preprocess_cmd([cut], work / "pp-cut"), capture_output=True, text=True)
    subprocess.run(preprocess_cmd([whole], work / "pp-readable"), check=True, capture_output=True)
    got = read_manifest(work / "pp-cut")["counts"] if result.returncode == 0 else {}
    ref = read_manifest(work / "pp-readable")["counts"]
    named = str(cut) in result.stderr
    ok = bool(got) and got["dropped"].get("unreadable") == 1 and got["kept"] >= ref["kept"] and named
    print(f"      truncated gzip: kept {got.get('kept')} (the readable part alone: {ref['kept']}), "
          f"file named in the log: {named}")  # fmt: skip
    row(
        "truncated gzip input to preprocess",
        f"counted as 1 unreadable file, {got.get('kept')} sentences kept vs {ref['kept']} from its readable "
        "lines alone (0 good records lost)",
        ok,
    )


# ----------------------------------------------------------------------------------- augment
def augment_cmd(shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pipeline", "augment", f"--shards={shards}", f"--out={out}", "--workers=2",
        "--progress=false", *extra,
    ]  # fmt: skip


def stage_output(out: Path) -> tuple:
    """The manifest's sha256 and every shard's name, size and sha256 (what a kill must not change)."""
    shards = [(s["name"], s["bytes"], s["sha256"]) for s in read_manifest(out)["shards"]]
    return sha256_file(out / MANIFEST), shards


def augment_kills(work: Path, runs: int, rng: random.Random) -> None:
    pp = work / "aug-input"  # the corpus in shards of 1,000 sentences: a kill finds some finished
    subprocess.run(preprocess_cmd([SAMPLE_CORPUS], pp, per_shard=1000), check=True, capture_output=True)
    clean = work / "aug-clean"
    work_seconds = timed_clean_run(augment_cmd(pp, clean), clean, ".augment-work")
    print(f"      clean augment: {work_seconds:.1f} s of work after its imports")
    expected, same, landed, partial, redone = stage_output(clean), 0, 0, 0, 0
    for run in range(runs):
        out = work / f"aug-killed-{run}"
        # the workers' start (jieba) takes about the first third of the work: kill among the shards
        hit, missed = kill_during_work(
            augment_cmd(pp, out), out, ".augment-work", work_seconds, rng, (0.35, 0.9)
        )
        landed, redone = landed + hit, redone + missed
        done = len(list((out / ".augment-work").glob("shard-*.json")))
        partial += done
        print(f"      augment run {run}: killed with {done} shard(s) recorded done")
        subprocess.run(augment_cmd(pp, out), check=True, capture_output=True)
        same += stage_output(out) == expected
    row(
        "augment (2 workers) killed with kill -9 of its process group, rerun",
        f"{runs} runs ({landed} kills before the end, {partial} finished shards kept over all kills; "
        f"{redone} runs finished before their kill and were redone), "
        f"{same}/{runs} with manifest and shards (sha256) identical to a clean run",
        same == runs and landed == runs,
    )


# ----------------------------------------------------------------------------------- training
REPO = Path(__file__).resolve().parents[1]
TRAIN_STEPS = 24  # checkpoints every 2 steps; a step of the debug model takes about 0.1 s here


def training_shards(work: Path) -> Path:
    """Tiny augmented shards made by the real stages from 600 corpus lines (2 variants, as debug.yaml)."""
    corpus = work / "train-corpus.txt"
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:600]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    subprocess.run(preprocess_cmd([corpus], work / "train-pp"), check=True, capture_output=True)
    out = work / "train-aug"
    subprocess.run(augment_cmd(work / "train-pp", out, "--num_variants=2"), check=True, capture_output=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(shards: Path, run_dir: Path) -> list[str]:
    """``accelerate launch`` of two CPU processes over gloo (launch/accelerate/cpu2.yaml) on debug.yaml."""
    return [
        str(Path(sys.executable).parent / "accelerate"), "launch",
        "--config_file", str(REPO / "launch" / "accelerate" / "cpu2.yaml"),
        "--main_process_port", str(free_port()),
        str(REPO / "launch" / "pretrain.py"), "--config", str(REPO / "launch" / "configs" / "debug.yaml"),
        f"--data.shards={shards}", f"--run_dir={run_dir}", f"--train.max_steps={TRAIN_STEPS}",
        "--checkpoint.every_steps=2", "--objective.momentum=0.9", "--train.debug_dump",
    ]  # fmt: skip


def train_env() -> dict[str, str]:
    extra = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
    return {**os.environ, **extra}


def logged_steps(run_dir: Path) -> dict[int, list[float]]:
    """step -> every loss logged for it (a step redone after a resume is logged again)."""
    out: dict[int, list[float]] = {}
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        record = json.loads(line)
        if "loss" in record:
            out.setdefault(record["step"], []).append(record["loss"])
    return out


def kill_everything(child: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group and every descendant: torch's launcher starts each rank in a
    session of its own, so the group alone would leave the ranks running (a node failure would not)."""
    victims = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
    os.killpg(child.pid, signal.SIGKILL)
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=60)
    child.wait(timeout=60)


def final_state(run_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "debug").glob("rank*.json"))]
    tensors = {}
    for path in sorted((run_dir / "model").glob("*.safetensors")):
        tensors.update(load_file(path))
    keep = ("step", "samples_seen", "cursor", "param_checksum", "queue_checksum")
    return {
        "ranks": [{k: r.get(k) for k in keep} for r in ranks],
        "losses": logged_steps(run_dir),
        "model": {k: v.to(torch.float64) for k, v in tensors.items()},
    }


def same_training(got: dict, ref: dict) -> bool:
    import torch

    losses_ok = sorted(got["losses"]) == sorted(ref["losses"]) and all(
        v == ref["losses"][step][0] for step, values in got["losses"].items() for v in values
    )
    model_ok = got["model"].keys() == ref["model"].keys() and all(
        torch.equal(got["model"][k], ref["model"][k]) for k in ref["model"]
    )
    return len(ref["ranks"]) == 2 and got["ranks"] == ref["ranks"] and losses_ok and model_ok


def training_kills(work: Path, runs: int, kills: int, rng: random.Random) -> None:
    shards = training_shards(work)
    ref_dir = work / "train-clean"
    started = time.perf_counter()
    subprocess.run(launch_cmd(shards, ref_dir), check=True, capture_output=True, env=train_env())
    print(f"      uninterrupted 2-process run: {time.perf_counter() - started:.0f} s")
    ref = final_state(ref_dir)
    same, landed, resumed_right, fresh = 0, 0, 0, 0
    for run in range(runs):
        run_dir = work / f"train-killed-{run}"
        targets: list[int | None] = [*sorted(rng.sample(range(1, TRAIN_STEPS - 1), kills)), None]
        reached, expected, finished = 0, None, False
        for k, target in enumerate(targets):  # target None: the last launch runs to the end
            log_file = run_dir.parent / f"{run_dir.name}.launch{k}.log"
            with open(log_file, "w") as log_out:
                child = subprocess.Popen(
                    launch_cmd(shards, run_dir), start_new_session=True, env=train_env(),
                    stdout=log_out, stderr=subprocess.STDOUT,
                )  # fmt: skip
                try:
                    deadline = time.monotonic() + 300
                    kill_after = TRAIN_STEPS + 1 if target is None else max(target, reached + 1)
                    while child.poll() is None and time.monotonic() < deadline:
                        if max(logged_steps(run_dir), default=0) >= kill_after:
                            break
                        time.sleep(0.05)
                    if target is not None:
                        time.sleep(rng.uniform(0.0, 0.3))  # anywhere in a step, a checkpoint write included
                    alive = child.poll() is None
                finally:
                    if target is not None or alive:
                        kill_everything(child)
            if k > 0:  # a relaunch must resume from the newest complete checkpoint (or start afresh if none)
                got = re.search(r"resumed from \S*step-(\d+)", log_file.read_text())
                resumed_right += (int(got.group(1)) if got else None) == expected
                fresh += expected is None
            if target is None:
                finished = not alive and child.returncode == 0
                break
            reached = max(logged_steps(run_dir), default=0)
            landed += alive and not (run_dir / "model").exists()
            latest = Checkpointer(run_dir).latest()
            expected = int(latest.name.split("-")[1]) if latest is not None else None
            print(f"      training run {run}: kill {k + 1} after step {reached} (aimed at {target}), newest "
                  f"complete checkpoint: {expected}")  # fmt: skip
        same += finished and same_training(final_state(run_dir), ref)
    row(
        "kill -9 of a 2-process accelerate launch (process group and ranks), auto-resume",
        f"{runs} runs x {kills} kills ({landed} landed mid-run), {resumed_right}/{runs * kills} relaunches "
        f"resumed from the newest complete checkpoint ({fresh} had none yet and started afresh), "
        f"{same}/{runs} with parameters, model file, queue, cursor and every logged loss bit-identical to an "
        "uninterrupted run",
        same == runs and landed == runs * kills and resumed_right == runs * kills,
    )


# ----------------------------------------------------------------------------------- malformed input
MALFORMED: dict[str, bytes] = {
    "bad JSON": b'{"sentence1": "a", "sentence2": ',
    "bad UTF-8": b'{"sentence1": "\xff\xfe", "sentence2": "b", "label": 1}',
    "missing field": b'{"sentence1": "a", "label": 1}',
    "wrong-type field": b'{"sentence1": "a", "sentence2": 3, "label": 1}',
}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def malformed_inputs(work: Path, huge_bytes: int) -> None:
    good = [
        json.dumps({"sentence1": f"句子{i}", "sentence2": f"另一句{i}", "label": i % 6}, ensure_ascii=False)
        for i in range(50)
    ]
    capture = _Capture()
    logging.getLogger("pipeline.data.pairs").addHandler(capture)
    results = []
    for kind, bad in MALFORMED.items():
        path = work / f"{kind.replace(' ', '_')}.jsonl"
        lines = [g.encode() for g in good]
        lines[25:25] = [bad, bad]  # two bad lines in the middle
        path.write_bytes(b"\n".join(lines) + b"\n")
        capture.messages.clear()
        pairs = read_pairs(path, strict=False)
        logged = " ".join(capture.messages)
        ok = len(pairs) == len(good) and f"{path}:26:" in logged and "skipped 2 bad line(s)" in logged
        results.append((kind, ok))
        print(f"      {kind}: {len(pairs)}/{len(good)} good kept; log: {logged[:160]}")
    # a huge line is a long text, not a bad record: kept, and the lines around it too
    path = work / "huge.jsonl"
    huge = json.dumps({"sentence1": "长" * huge_bytes, "sentence2": "b", "label": 1}, ensure_ascii=False)
    path.write_text("\n".join(good[:25] + [huge] + good[25:]) + "\n", encoding="utf-8")
    pairs = read_pairs(path, strict=False)
    results.append(("huge line", len(pairs) == len(good) + 1))
    print(f"      huge line ({len(huge.encode()) / 2**20:.1f} MiB): {len(pairs)} records")
    empty = work / "empty.jsonl"
    empty.write_bytes(b"")
    try:
        read_pairs(empty, strict=False)
        results.append(("empty file", False))
    except InputError as exc:
        results.append(("empty file", str(empty) in str(exc)))
        print(f"      empty file: {exc}")
    logging.getLogger("pipeline.data.pairs").removeHandler(capture)
    passed = sum(ok for _, ok in results)
    row(
        "malformed pair-file lines, strict=False",
        f"{passed}/{len(results)} kinds ({', '.join(k for k, _ in results)}) counted with file:line, "
        "0 good records lost",
        passed == len(results),
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer runs (2 instead of 3 or 5), a smaller huge line"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the files here (default: a temp dir)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rows",
        nargs="*",
        default=[],
        help="only these rows (checkpoint shards preprocess gzip augment training malformed; default: all)",
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = {
            "checkpoint": lambda: checkpoint_kills(work, 2 if args.quick else 5, rng),
            "shards": lambda: shard_damage(work, rng),
            "preprocess": lambda: preprocess_kills(work, 2 if args.quick else 3, rng),
            "gzip": lambda: truncated_gzip(work),
            "augment": lambda: augment_kills(work, 2 if args.quick else 3, rng),
            "training": lambda: training_kills(work, 2 if args.quick else 5, 2, rng),
            "malformed": lambda: malformed_inputs(work, 1 << 18 if args.quick else 1 << 22),
        }
        unknown = set(args.rows) - set(rows)
        if unknown:
            parser.error(f"--rows: unknown {sorted(unknown)}; choose from {', '.join(rows)}")
        for name, run_row in rows.items():
            if not args.rows or name in args.rows:
                run_row()
    print("\n| fault | counts | result |\n|---|---|---|")
    for name, counts, ok in ROWS:
        print(f"| {name} | {counts} | {'pass' if ok else 'FAIL'} |")
    print(f"\n{len(ROWS)} rows, {sum(ok for *_, ok in ROWS)} passed, {time.perf_counter() - started:.0f} s")
    return 0 if all(ok for *_, ok in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
