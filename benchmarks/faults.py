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
* two "nodes" (two ``accelerate launch`` groups, one process each) in two network namespaces joined by a
  veth pair (tests/netns.py; root), node 1 killed, hung (SIGSTOP) or cut off (its link down) after a
  random step: node 0 must exit by itself within ``train.collective_timeout`` (30 s) + 60 s, its rank
  with exit code 76 and a ``collective timeout:`` line, and both nodes relaunched must
  end bit-identical to an uninterrupted two-node run; the time node 0 took to exit is reported.
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
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import psutil
import pyarrow as pa

from pipeline.data.pairs import read_pairs
from pipeline.errors import InputError
from pipeline.io import atomic_write_json, sha256_file
from pipeline.resources import SAMPLE_CORPUS, sample_sentences
from pipeline.run_layout import CHECKPOINTS_DIR, SAVING_PREFIX, STEP_GLOB, step_dir_name, step_of
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
        tmp_left = any((run_dir / CHECKPOINTS_DIR).glob(SAVING_PREFIX + STEP_GLOB))
        mid_write += tmp_left
        latest = Checkpointer(run_dir).latest()
        ok = latest is not None and not latest.name.startswith(".")
        if ok:
            verify_checkpoint(latest)
            ok = (step_of(latest.name) or 0) >= max(done)  # no finished save lost
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
# debug.yaml's luse term with a momentum encoder (its default has none): the key encoder is checked too
MOMENTUM_LOSS = "--loss=[{luse: {temperature: 0.05, queue_size: 32, momentum: 0.9}}]"
TRAIN_STEPS = 24  # checkpoints every 2 steps; a step of the debug model takes about 0.1 s here


def training_shards(work: Path) -> Path:
    """Tiny augmented shards made by the real stages from 600 corpus lines (2 variants, as debug.yaml)."""
    out = work / "train-aug"
    if (out / MANIFEST).is_file():  # made by an earlier row
        return out
    corpus = work / "train-corpus.txt"
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:600]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    subprocess.run(preprocess_cmd([corpus], work / "train-pp"), check=True, capture_output=True)
    subprocess.run(augment_cmd(work / "train-pp", out, "--num_variants=2"), check=True, capture_output=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(shards: Path, run_dir: Path, script: Path = REPO / "launch" / "pretrain.py") -> list[str]:
    """``accelerate launch`` of two CPU processes over gloo (launch/accelerate/cpu2.yaml) on debug.yaml."""
    return [
        str(Path(sys.executable).parent / "accelerate"), "launch",
        "--config_file", str(REPO / "launch" / "accelerate" / "cpu2.yaml"),
        "--main_process_port", str(free_port()),
        str(script), "--config", str(REPO / "launch" / "configs" / "debug.yaml"),
        f"--data.shards={shards}", f"--run_dir={run_dir}", f"--train.max_steps={TRAIN_STEPS}",
        "--checkpoint.every_steps=2", MOMENTUM_LOSS, "--train.debug_dump",
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


def reference_training(work: Path, shards: Path) -> dict:
    """The uninterrupted 2-process run every training row compares with (run once per work dir)."""
    ref_dir = work / "train-clean"
    if not (ref_dir / "model").exists():
        shutil.rmtree(ref_dir, ignore_errors=True)
        started = time.perf_counter()
        subprocess.run(launch_cmd(shards, ref_dir), check=True, capture_output=True, env=train_env())
        print(f"      uninterrupted 2-process run: {time.perf_counter() - started:.0f} s")
    return final_state(ref_dir)


def killed_run(
    run_dir: Path, shards: Path, targets: list[int], rng: random.Random
) -> tuple[bool, int, int, bool]:
    """Launch, kill -9 after each target step (every rank and the launcher), relaunch; the last launch runs
    to the end. Returns (every kill landed before the end, relaunches that resumed from the newest
    complete checkpoint, relaunches that had none and started afresh, the run finished)."""
    reached, expected, resumed_right, fresh, landed = 0, None, 0, 0, True
    for k, target in enumerate([*targets, None]):  # target None: the last launch runs to the end
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
            return landed, resumed_right, fresh, not alive and child.returncode == 0
        reached = max(logged_steps(run_dir), default=0)
        if not alive or (run_dir / "model").exists():  # the run had finished: this kill missed
            return False, resumed_right, fresh, False
        latest = Checkpointer(run_dir).latest()
        expected = step_of(latest.name) if latest is not None else None
        print(f"      {run_dir.name}: kill {k + 1} after step {reached} (aimed at {target}), newest "
              f"complete checkpoint: {expected}")  # fmt: skip
    raise AssertionError("unreachable")


def training_kills(work: Path, runs: int, kills: int, rng: random.Random) -> None:
    shards = training_shards(work)
    ref = reference_training(work, shards)
    same, resumed_right, fresh, redone, all_landed = 0, 0, 0, 0, 0
    for run in range(runs):
        # Kills land 1-5 steps after their aim on this loaded machine: aim them in the first two thirds of
        # the run, and redo a run (from scratch, earlier aims) whose kill missed because it had finished.
        horizon = TRAIN_STEPS * 2 // 3
        for attempt in range(4):
            run_dir = work / f"train-killed-{run}"
            shutil.rmtree(run_dir, ignore_errors=True)
            targets = sorted(rng.sample(range(1, horizon), kills))
            landed, right, none_yet, finished = killed_run(run_dir, shards, targets, rng)
            if landed:
                break
            print(f"      {run_dir.name}: a kill landed after the run had finished; redoing the run")
            redone, horizon = redone + 1, max(kills + 1, horizon // 2)
        resumed_right, fresh, all_landed = resumed_right + right, fresh + none_yet, all_landed + landed
        same += landed and finished and same_training(final_state(run_dir), ref)
    row(
        "kill -9 of a 2-process accelerate launch (process group and ranks), auto-resume",
        f"{runs} runs x {kills} kills ({all_landed}/{runs} runs with every kill mid-run; {redone} redone "
        f"because a kill landed after the end), {resumed_right}/{runs * kills} relaunches resumed from the "
        f"newest complete checkpoint ({fresh} had none yet and started afresh), {same}/{runs} with "
        "parameters, model file, queue, cursor and every logged loss bit-identical to an uninterrupted run",
        same == runs and all_landed == runs and resumed_right == runs * kills,
    )


# ----------------------------------------------------------------------------------- non-finite steps
# A training process whose online encoder's embeddings are NaN at the given (epoch, batch) positions, whose
# guard verdict is forced to "skip" at others (the reference for a skipped batch: the same forward and
# backward, nothing applied), and whose loss is x10 at the "spike" ones. Arguments: a JSON spec
# {"argv": [...], "poison": [...], "skip": [...], "spike": [...]}. It prints the positions trained on.
DRIVER = textwrap.dedent(
    """
    import dataclasses, json, math, sys

    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["launch"])
    from pretrain import main
    from pipeline.train import guard
    from pipeline.train.callbacks import Callbacks

    poison, skip, seen, hooked = {tuple(p) for p in spec["poison"]}, {tuple(p) for p in spec["skip"]}, [], []
    spiked = {tuple(p) for p in spec.get("spike", [])}

    class Faults(Callbacks):
        def on_batch(self, t, batch):
            if not hooked:
                hooked.append(t.module.encoder.backbone.embeddings.register_forward_hook(
                    lambda _m, _i, out: out * math.nan if seen[-1] in poison else None))
            seen.append((batch.epoch, batch.batch))

        def on_loss(self, t, batch, out):  # the loss (and its gradient, before clipping) x10 there
            return dataclasses.replace(out, total=out.total * 10) if seen[-1] in spiked else out

        def on_verdict(self, t, check):
            return guard.StepCheck(False, 0.0) if seen[-1] in skip else check

    code = main(spec["argv"], Faults())
    print("trained on:", json.dumps(seen))
    sys.exit(code)
    """
)
GUARD_STEPS = 12


def guard_run(
    shards: Path, run_dir: Path, poison=(), skip=(), *extra: str, spike=()
) -> subprocess.CompletedProcess:
    argv = [
        "--config", str(REPO / "launch" / "configs" / "debug.yaml"), f"--data.shards={shards}",
        f"--run_dir={run_dir}", f"--train.max_steps={GUARD_STEPS}", MOMENTUM_LOSS,
        "--train.debug_dump=true", "--train.eval_max_pairs=32", *extra,
    ]  # fmt: skip
    spec = {"argv": argv, "poison": list(poison), "skip": list(skip), "spike": list(spike)}
    spec["launch"] = str(REPO / "launch")
    return subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(spec)], capture_output=True, text=True, env=train_env(),
        timeout=600,
    )  # fmt: skip


def metric_events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == name]


def debug_dump(run_dir: Path) -> dict:
    dump = json.loads((run_dir / "debug" / "rank0.json").read_text())
    return {k: dump[k] for k in ("step", "samples_seen", "cursor", "param_checksum", "queue_checksum")}


def nonfinite_batches(work: Path, runs: int, rng: random.Random) -> None:
    """A NaN in one batch at a random step: finished, 1 skip counted at that batch, every final weight
    finite and the model file, queue and cursor bit-identical to a clean run forced to skip that batch."""
    import torch
    from safetensors.torch import load_file

    shards = training_shards(work)
    results = {}
    for precision, name in (("no", "fp32"), ("bf16", "bf16")):
        ok = 0
        for run in range(runs):
            bad = (0, rng.randrange(1, GUARD_STEPS - 1))
            flag = f"--train.mixed_precision={precision}"
            nan_dir, ref_dir = work / f"nan-{name}-{run}", work / f"nan-{name}-{run}-ref"
            for d in (nan_dir, ref_dir):
                shutil.rmtree(d, ignore_errors=True)
            done = guard_run(shards, nan_dir, [bad], [], flag)
            ref = guard_run(shards, ref_dir, [], [bad], flag)
            if done.returncode or ref.returncode:
                print(
                    f"      {nan_dir.name}: exit codes {done.returncode}, {ref.returncode}: "
                    f"{done.stderr[-500:]}"
                )
                continue
            skips = [(e["epoch"], e["batch"]) for e in metric_events(nan_dir, "nonfinite_skip")]
            weights = load_file(nan_dir / "model" / "model.safetensors")
            ref_weights = load_file(ref_dir / "model" / "model.safetensors")
            finite = all(bool(torch.isfinite(w).all()) for w in weights.values())
            same = weights.keys() == ref_weights.keys() and all(
                torch.equal(weights[k], ref_weights[k]) for k in weights
            )
            dump_same = debug_dump(nan_dir) == debug_dump(ref_dir)
            ok += (
                skips == [bad]
                and finite
                and same
                and dump_same
                and debug_dump(nan_dir)["step"] == GUARD_STEPS
            )
            print(f"      {name} run {run}: NaN at epoch 0 batch {bad[1]}: skips logged {skips}, finite "
                  f"{finite}, weights identical to the forced skip {same}, queue/cursor/checksums "
                  f"identical {dump_same}")  # fmt: skip
        results[name] = ok
    row(
        "a NaN in one batch at a random step (bf16 and fp32), guard on",
        f"{runs} runs each, finished with the skip counted at that batch, every weight finite and the model "
        "file, queue and cursor bit-identical to a run that skips the same batch: "
        + ", ".join(f"{name} {ok}/{runs}" for name, ok in results.items()),
        all(ok == runs for ok in results.values()),
    )


def nonfinite_stop(work: Path, runs: int, rng: random.Random) -> None:
    """NaN from a random batch on: exit code 70 after K skips in a row, one line naming the newest
    checkpoint, which verifies; with the NaN gone the same command resumes from it to the end."""
    from pipeline.train.guard import EXIT_CODE_NONFINITE

    shards, k, ok, resumed = training_shards(work), 3, 0, 0
    for run in range(runs):
        start = rng.randrange(2, GUARD_STEPS - 3)
        poison = [(e, b) for e in range(2) for b in range(100) if (e, b) >= (0, start)]
        run_dir = work / f"nan-stop-{run}"
        shutil.rmtree(run_dir, ignore_errors=True)
        args = ("--checkpoint.every_steps=2", f"--guard.max_nonfinite_steps={k}")
        done = guard_run(shards, run_dir, poison, [], *args)
        errors = [x[x.index("error:") :] for x in done.stderr.splitlines() if "error:" in x]
        newest = step_dir_name(start // 2 * 2)
        names = [p.name for p in Checkpointer(run_dir).checkpoints()]
        intact = (
            names[-1:] == [newest]
            and verify_checkpoint(run_dir / "checkpoints" / newest)["step"] == start // 2 * 2
        )
        clean = (
            done.returncode == EXIT_CODE_NONFINITE and len(errors) == 1 and f"{k} consecutive" in errors[0]
            and newest in errors[0] and intact
        )  # fmt: skip
        ok += clean
        again = guard_run(shards, run_dir, [], [], *args)
        resumed += (
            again.returncode == 0 and f"resumed from {run_dir / 'checkpoints' / newest}" in again.stderr
        )
        print(
            f"      run {run}: NaN from batch {start}: exit {done.returncode}, "
            f"{errors[0] if errors else 'no error line'}"
        )
    row(
        f"{k} consecutive non-finite steps (guard.max_nonfinite_steps={k})",
        f"{ok}/{runs} runs stopped with exit code {EXIT_CODE_NONFINITE}, one error line naming the newest "
        f"checkpoint, that checkpoint intact (verified) and nothing saved after it; {resumed}/{runs} resumed "
        "from it to the end once the NaN source was gone",
        ok == runs and resumed == runs,
    )


def loss_spikes(work: Path, runs: int, rng: random.Random) -> None:
    """The loss x10 on 3 consecutive batches at a random position, guard.spike_factor 3 (2 steps in a row
    above 3 x the median of 8): rolled back to the newest checkpoint before the spike, the data skipped to
    2 batches past the detection, the rest of the spiked batches never trained on, the run finished; a
    rerun from the checkpoint it rolled back to (as after a kill right after the rollback) repeats the
    decision and ends with the same parameters."""
    shards, ok, repeated = training_shards(work), 0, 0
    flags = (
        "--checkpoint.every_steps=4", "--guard.spike_factor=3", "--guard.spike_steps=2",
        "--guard.spike_history=8", "--guard.spike_skip_batches=2", "--train.max_steps=20",
        "--checkpoint.keep_last=10",  # the rerun below starts from the checkpoint rolled back to
    )  # fmt: skip
    for run in range(runs):
        start = rng.randrange(10, 14)  # after the median's history is full and a checkpoint exists
        spike = [(0, b) for b in range(start, start + 3)]
        run_dir, again = work / f"spike-{run}", work / f"spike-{run}-rerun"
        for d in (run_dir, again):
            shutil.rmtree(d, ignore_errors=True)
        done = guard_run(shards, run_dir, [], [], *flags, spike=spike)
        ran = done.returncode == 0
        trained = [tuple(p) for p in json.loads(done.stdout.split("trained on:")[-1])] if ran else []
        rollbacks = metric_events(run_dir, "spike_rollback") if ran else []
        # detection at the 2nd spiked step; the checkpoint before the spike's 1st step; then 2 batches on
        expected_from = step_dir_name(start // 4 * 4)
        good = (
            len(rollbacks) == 1 and rollbacks[0]["resumed_from"] == expected_from
            and rollbacks[0]["skipped_to"] == [0, start + 2 + 2] and (0, start + 2) not in trained
            and debug_dump(run_dir)["step"] == 20
        )  # fmt: skip
        ok += good
        # the same run stopped right after the rollback (before any new checkpoint), rerun: same decision
        shutil.copytree(run_dir / "checkpoints" / expected_from, again / "checkpoints" / expected_from)
        shutil.copytree(run_dir / "tokenizer", again / "tokenizer")
        rerun = guard_run(shards, again, [], [], *flags, spike=spike)
        repeated += (
            rerun.returncode == 0 and metric_events(again, "spike_rollback")[:1] == rollbacks[:1]
            and debug_dump(again) == debug_dump(run_dir)
        )  # fmt: skip
        print(f"      run {run}: loss x10 at batches {start}-{start + 2}: {rollbacks}")
    row(
        "a loss spike (x10 on 3 consecutive batches at a random step), guard.spike_factor=3",
        f"{ok}/{runs} runs rolled back to the newest checkpoint before the spike, skipped the data to 2 "
        "batches past the detection (the spike's last batch never trained on) and finished; "
        f"{repeated}/{runs} reruns from that checkpoint repeated the decision and ended bit-identical",
        ok == repeated == runs,
    )


# ----------------------------------------------------------------------------------- full disk
def mount_tmpfs(point: Path, size: int) -> None:
    point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], check=True)


def unmount(point: Path) -> None:
    subprocess.run(["umount", "-l", str(point)], check=False)


def fill_disk(point: Path, leave: int) -> Path:
    """Grow a filler file until about ``leave`` bytes are free on the file system of ``point``; in
    chunks, as the run writes meanwhile (a disk that fills up completely here is fine too)."""
    filler = point / "filler"
    with open(filler, "ab", buffering=0) as f:  # unbuffered: a failed write leaves nothing to flush
        while (room := shutil.disk_usage(point).free - leave) > 0:
            try:
                f.write(b"\0" * min(room, 1 << 20))
            except OSError:
                break
    return filler


def error_lines(text: str) -> list[str]:
    return [
        x[x.index("error:") :] for x in text.splitlines() if "error:" in x
    ]  # tqdm may precede it on a line


NO_ESTIMATE = """
import sys

sys.path.insert(0, "{launch}")
from pretrain import main

from pipeline.train.checkpoint import Checkpointer

Checkpointer.newest_size = lambda self: 0
sys.exit(main(sys.argv[1:]))
"""


def disk_full_checkpoints(work: Path, runs: int, rng: random.Random) -> None:
    """A 2-process run on a 64 MiB tmpfs whose disk is filled (and kept full) at a random step: the next
    checkpoint save fails on every rank with one error line, the processes exit (no hang), the previous
    checkpoint verifies, and once the filler is deleted the same command resumes to the parameters,
    queue, cursor and logged losses of an uninterrupted run."""
    shards = training_shards(work)
    ref = reference_training(work, shards)
    # Odd runs: the trainer with no size estimate (as for a run's first checkpoint), so that the save
    # starts and meets ENOSPC mid-write on some rank, and the ranks must agree on the failure.
    no_estimate = work / "pretrain_no_estimate.py"
    no_estimate.write_text(NO_ESTIMATE.format(launch=REPO / "launch"), encoding="utf-8")
    clear, no_hang, intact, same, kinds, exit_codes, waits = 0, 0, 0, 0, [], set(), []
    for run in range(runs):
        mount = work / f"disk-ckpt-{run}"
        mount_tmpfs(mount, 64 << 20)
        try:
            run_dir = mount / "run"
            target = rng.randrange(3, TRAIN_STEPS - 6)
            log_file = work / f"disk-ckpt-{run}.log"
            with open(log_file, "w") as log_out:
                script = no_estimate if run % 2 else REPO / "launch" / "pretrain.py"
                child = subprocess.Popen(
                    launch_cmd(shards, run_dir, script), start_new_session=True, env=train_env(),
                    stdout=log_out, stderr=subprocess.STDOUT,
                )  # fmt: skip
                while child.poll() is None and max(logged_steps(run_dir), default=0) < target:
                    time.sleep(0.05)
                newest = Checkpointer(run_dir).checkpoints()[-1]
                size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
                leave = max(16 << 10, size // 4)
                filler = fill_disk(mount, leave)
                filled_at = time.monotonic()
                # Kept full, as by another job writing to the same disk: the run's own pruning of an old
                # checkpoint (keep_last) would otherwise free room for the next one.
                while child.poll() is None and time.monotonic() - filled_at < 180:
                    fill_disk(mount, leave)
                    time.sleep(0.05)
                if child.poll() is None:
                    kill_everything(child)
            waits.append(time.monotonic() - filled_at)
            no_hang += child.returncode is not None and waits[-1] < 180
            exit_codes.add(child.returncode)
            errors = [e for e in error_lines(log_file.read_text()) if str(run_dir / "checkpoints") in e]
            kinds += (
                ["before the write" if "not enough disk space" in errors[0] else "while writing"]
                if errors
                else []
            )
            clear += len(errors) == 2 and "needed" in errors[0]  # one line from each rank
            latest = Checkpointer(run_dir).latest()
            leftovers = list((run_dir / "checkpoints").glob(".tmp-*"))
            intact += latest is not None and verify_checkpoint(latest) is not None and not leftovers
            print(f"      run {run}: disk filled after step {target}, exit {child.returncode} "
                  f"{waits[-1]:.1f} s later; newest checkpoint {latest.name if latest else None}; "
                  f"{errors[0] if errors else 'no error line'}")  # fmt: skip
            filler.unlink()
            done = subprocess.run(
                launch_cmd(shards, run_dir), capture_output=True, text=True, env=train_env()
            )
            same += done.returncode == 0 and same_training(final_state(run_dir), ref)
        finally:
            unmount(mount)
    row(
        "disk full at a checkpoint write (2-process accelerate launch, tmpfs run directory)",
        f"{runs} runs: {clear}/{runs} with one error line per rank naming the checkpoint directory and the "
        f"space needed ({kinds.count('before the write')} refused by the free-space check, "
        f"{kinds.count('while writing')} by ENOSPC mid-write: every other run saves without a size "
        f"estimate), {no_hang}/{runs} exited without hanging (max {max(waits):.1f} s after the fill; "
        f"launcher exit codes {sorted(exit_codes)}), {intact}/{runs} "
        f"with the previous checkpoint intact, {same}/{runs} resumed after freeing space to a state "
        "bit-identical to an uninterrupted run",
        clear == no_hang == intact == same == runs,
    )


def teacher_input(work: Path) -> Path:
    """Preprocessed shards of 500 sentences from the corpus's first 12,000 lines (a teacher run ~10 s)."""
    out = work / "tea-input"
    if not (out / MANIFEST).is_file():
        corpus = work / "tea-corpus.txt"
        lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:12_000]
        corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
        subprocess.run(preprocess_cmd([corpus], out, per_shard=500), check=True, capture_output=True)
    return out


def tiny_teacher(work: Path) -> Path:
    """A random 2-layer, 32-wide char-vocabulary encoder saved as a model folder (the teacher's speed
    and output format are what matter here, not its quality)."""
    from pipeline.model import (
        SentenceEncoder,
        build_char_vocab,
        build_scratch_backbone,
        make_tokenizer,
        write_vocab,
    )

    folder = work / "tiny-teacher"
    if not (folder / "model.safetensors").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        vocab = build_char_vocab(sample_sentences(2000))
        write_vocab(vocab, folder / "vocab.txt")
        config = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 64, "max_position_embeddings": 64}  # fmt: skip
        backbone = build_scratch_backbone(config, len(vocab), 0)
        SentenceEncoder(backbone, make_tokenizer(folder / "vocab.txt"), "mean", 48, "").save_pretrained(
            folder
        )
    return folder


def teacher_cmd(shards: Path, out: Path, model: Path) -> list[str]:
    return [
        sys.executable, "-m", "pipeline", "teacher", f"--shards={shards}", f"--out={out}", f"--model={model}",
        "--workers=2", "--device=cpu", "--progress=false",
    ]  # fmt: skip


def shard_set(out: Path) -> tuple:
    """Every shard's name, size and sha256, and the counts: what a fault must not change."""
    manifest = read_manifest(out)
    shards = [(s["name"], s["bytes"], s["sha256"]) for s in manifest["shards"]]
    return shards, json.dumps(manifest.get("counts"), sort_keys=True)


def stage_commands(work: Path) -> dict[str, tuple[Callable[[Path], list[str]], str]]:
    """stage -> (command writing to an output directory, its work directory's name)."""
    pp_small, teacher = teacher_input(work), tiny_teacher(work)
    return {
        "preprocess": (lambda out: preprocess_cmd([SAMPLE_CORPUS], out, per_shard=1000), ".work"),
        "augment": (lambda out: augment_cmd(pp_small, out), ".augment-work"),
        "teacher": (lambda out: teacher_cmd(pp_small, out, teacher), ".teacher-work"),
    }


def disk_full_stages(work: Path, runs: int, rng: random.Random) -> None:
    """Each offline stage writing to a tmpfs of 20-70% of its output's size: exit code 74 with one error
    line naming the output directory, no traceback; after the tmpfs is enlarged (space freed) the same
    command finishes with shards identical to a clean run's."""
    from pipeline.io import EXIT_CODE_DISK_FULL

    counts = []
    for name, (cmd, _) in stage_commands(work).items():
        clean = work / f"{name}-clean-disk"
        if not (clean / MANIFEST).is_file():
            subprocess.run(cmd(clean), check=True, capture_output=True)
        expected = shard_set(clean)
        size = sum(f.stat().st_size for f in clean.rglob("*") if f.is_file())
        clear, same = 0, 0
        for run in range(runs):
            mount = work / f"disk-{name}-{run}"
            share = rng.uniform(0.2, 0.7)
            mount_tmpfs(mount, max(64 << 10, int(size * share) // 4096 * 4096))
            try:
                out = mount / "out"
                done = subprocess.run(cmd(out), capture_output=True, text=True, timeout=600)
                errors = error_lines(done.stderr)
                clear += (
                    done.returncode == EXIT_CODE_DISK_FULL and len(errors) == 1 and str(out) in errors[0]
                    and "Traceback" not in done.stderr
                )  # fmt: skip
                print(f"      {name} run {run}: tmpfs {share:.0%} of the output, exit {done.returncode}: "
                      f"{errors[0] if errors else done.stderr[-300:]}")  # fmt: skip
                subprocess.run(["mount", "-o", "remount,size=1g", str(mount)], check=True)  # space freed
                subprocess.run(cmd(out), check=True, capture_output=True, timeout=600)
                same += shard_set(out) == expected
            finally:
                unmount(mount)
        counts.append((name, clear, same))
    row(
        "disk full during preprocess, augment and teacher (tmpfs of 20-70% of the output), rerun after "
        "freeing space",
        "; ".join(
            f"{name}: {clear}/{runs} exit 74 with one error line naming the output directory, "
            f"{same}/{runs} reruns with shards (sha256) and counts identical to a clean run"
            for name, clear, same in counts
        ),  # fmt: skip
        all(clear == same == runs for _, clear, same in counts),
    )


def teacher_kills(work: Path, runs: int, rng: random.Random) -> None:
    cmd, work_name = stage_commands(work)["teacher"]
    clean = work / "tea-clean"
    work_seconds = timed_clean_run(cmd(clean), clean, work_name)
    print(f"      clean teacher: {work_seconds:.1f} s of work after its imports")
    expected, same, landed, partial, redone = shard_set(clean), 0, 0, 0, 0
    for run in range(runs):
        out = work / f"tea-killed-{run}"
        # the workers load torch and the model in the first part of the work: kill among the shards
        hit, missed = kill_during_work(cmd(out), out, work_name, work_seconds, rng, (0.35, 0.9))
        landed, redone = landed + hit, redone + missed
        done = len(list((out / work_name).glob("*.json")))
        partial += done
        print(f"      teacher run {run}: killed with {done} shard(s) recorded done")
        subprocess.run(cmd(out), check=True, capture_output=True)
        same += shard_set(out) == expected
    row(
        "teacher (2 workers) killed with kill -9 of its process group, rerun",
        f"{runs} runs ({landed} kills before the end, {partial} finished shards kept over all kills; "
        f"{redone} runs finished before their kill and were redone), "
        f"{same}/{runs} with shards (sha256) and counts identical to a clean run",
        same == runs and landed == runs,
    )


# ----------------------------------------------------------------------------------- two nodes, netns
NETNS_FAULTS = ("kill9", "sigstop", "partition")
COLLECTIVE_TIMEOUT = 30  # train.collective_timeout of the netns row; survivors must exit within it + 60 s


def netns_launch_cmd(shards: Path, run_dir: Path, node: int, master: str) -> list[str]:
    """One "node" of two: ``accelerate launch --num_machines 2 --machine_rank NODE`` (one process each),
    the rendezvous at node 0's veth address; else launch_cmd's run (debug.yaml, 24 steps)."""
    return [
        str(Path(sys.executable).parent / "accelerate"), "launch",
        "--config_file", str(REPO / "launch" / "accelerate" / "cpu2.yaml"),
        "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(node),
        "--main_process_ip", master, "--main_process_port", "29500",  # free: nothing else in the namespace
        str(REPO / "launch" / "pretrain.py"), "--config", str(REPO / "launch" / "configs" / "debug.yaml"),
        f"--data.shards={shards}", f"--run_dir={run_dir}", f"--train.max_steps={TRAIN_STEPS}",
        "--checkpoint.every_steps=2", MOMENTUM_LOSS, "--train.debug_dump",
        f"--train.collective_timeout={COLLECTIVE_TIMEOUT}",
    ]  # fmt: skip


def netns_launch(nodes, shards: Path, run_dir: Path, name: str) -> list[subprocess.Popen]:
    from netns import IFNAME

    env = {**train_env(), "GLOO_SOCKET_IFNAME": IFNAME}  # else gloo picks the interface of the hostname
    procs = []
    for node in (0, 1):
        with open(run_dir.parent / f"{run_dir.name}.{name}.node{node}.log", "w") as out:
            cmd = [*nodes.prefix(node), *netns_launch_cmd(shards, run_dir, node, nodes.addresses[0])]
            procs.append(
                subprocess.Popen(cmd, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
            )
    return procs


def netns_faults(work: Path, runs: int, rng: random.Random) -> None:
    """Two "nodes" (tests/netns.py: two network namespaces joined by a veth pair, 10.231.0.1 and .2), one
    ``accelerate launch`` group each. Node 1 killed (SIGKILL of every process in its namespace), hung
    (SIGSTOP of them all) or cut off (its end of the link down) after a random step: node 0's launcher
    must exit by itself within collective_timeout + 60 s, its rank with exit code 76 and a
    ``collective timeout:`` line (at once after a kill: gloo sees the peer's sockets close); then both
    nodes relaunched must end bit-identical to an uninterrupted two-node run."""
    sys.path.insert(0, str(REPO / "tests"))
    from netns import TwoNodes, unavailable

    from pipeline.train.signals import EXIT_CODE_COLLECTIVE_TIMEOUT

    reason = unavailable()
    if reason is not None:
        row("two nodes in network namespaces: a node killed, hung or cut off", f"not run: {reason}", False)
        return
    shards = training_shards(work)
    bound = COLLECTIVE_TIMEOUT + 60
    results: dict[str, dict[str, list]] = {
        f: {"exit": [], "ok": [], "same": [], "how": []} for f in NETNS_FAULTS
    }
    with TwoNodes() as nodes:
        ref_dir = work / "netns-clean"
        shutil.rmtree(ref_dir, ignore_errors=True)
        started = time.perf_counter()
        procs = netns_launch(nodes, shards, ref_dir, "run")
        codes = [p.wait(timeout=600) for p in procs]
        if codes != [0, 0]:
            raise RuntimeError(f"the uninterrupted two-node run failed: exit codes {codes} (logs in {work})")
        print(f"      uninterrupted two-node run: {time.perf_counter() - started:.0f} s")
        ref = final_state(ref_dir)
        for run in range(runs):
            for fault in NETNS_FAULTS:
                run_dir = work / f"netns-{fault}-{run}"
                shutil.rmtree(run_dir, ignore_errors=True)
                target = rng.randrange(3, TRAIN_STEPS * 2 // 3)
                procs = netns_launch(nodes, shards, run_dir, "faulted")
                try:
                    while procs[0].poll() is None and max(logged_steps(run_dir), default=0) < target:
                        time.sleep(0.05)
                    reached = max(logged_steps(run_dir), default=0)
                    if procs[0].poll() is not None:
                        raise RuntimeError(f"{run_dir.name}: node 0 exited with {procs[0].returncode} "
                                           f"before step {target} (logs in {work})")  # fmt: skip
                    faulted_at = time.monotonic()
                    if fault == "partition":
                        nodes.cut(1)
                    else:
                        nodes.signal(1, signal.SIGKILL if fault == "kill9" else signal.SIGSTOP)
                    try:
                        code = procs[0].wait(timeout=bound)
                    except subprocess.TimeoutExpired:
                        code = None
                    took = time.monotonic() - faulted_at
                finally:
                    for node in (0, 1):
                        nodes.signal(node, signal.SIGKILL)
                    for p in procs:
                        p.wait(timeout=60)
                    nodes.mend(1)
                log0 = (run_dir.parent / f"{run_dir.name}.faulted.node0.log").read_text(errors="replace")
                rank_code = re.search(r"exitcode\s*:\s*(-?\d+)", log0)
                rank_code = int(rank_code.group(1)) if rank_code else None
                line = next((x[x.index("collective timeout:") :] for x in log0.splitlines()
                             if "collective timeout:" in x), None)  # fmt: skip
                ok = (
                    code is not None and rank_code == EXIT_CODE_COLLECTIVE_TIMEOUT and line is not None
                    and not (run_dir / "model").exists()
                )  # fmt: skip
                procs = netns_launch(nodes, shards, run_dir, "resumed")
                codes = [p.wait(timeout=600) for p in procs]
                same = codes == [0, 0] and same_training(final_state(run_dir), ref)
                r = results[fault]
                r["exit"].append(took), r["ok"].append(ok), r["same"].append(same)
                r["how"].append(f"launcher {code}, rank {rank_code}")
                print(f"      {fault} run {run}: after step {reached} (aimed at {target}); node 0's launcher "
                      f"exited {code} {took:.1f} s later (its rank: {rank_code}): "
                      f"{(line or 'no timeout line')[:200]}; relaunch identical: {same}")  # fmt: skip
    row(
        "two nodes in network namespaces (accelerate launch groups, gloo over a veth pair), node 1 killed, "
        f"hung or cut off; train.collective_timeout={COLLECTIVE_TIMEOUT}",
        "; ".join(
            f"{fault}: node 0 exited after {statistics.median(r['exit']):.1f} s median "
            f"(max {max(r['exit']):.1f}; {', '.join(sorted(set(r['how'])))}), {sum(r['ok'])}/{runs} within "
            f"{bound} s with the expected exit, {sum(r['same'])}/{runs} relaunches bit-identical"
            for fault, r in results.items()
        ),
        all(all(r["ok"]) and all(r["same"]) for r in results.values()),
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
        help="only these rows (checkpoint shards preprocess gzip augment training malformed nonfinite "
        "nonfinite-stop spike disk-checkpoint disk-stages teacher netns; default: all)",
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
            "nonfinite": lambda: nonfinite_batches(work, 2 if args.quick else 5, rng),
            "nonfinite-stop": lambda: nonfinite_stop(work, 2 if args.quick else 3, rng),
            "spike": lambda: loss_spikes(work, 2 if args.quick else 3, rng),
            "disk-checkpoint": lambda: disk_full_checkpoints(work, 2 if args.quick else 5, rng),
            "disk-stages": lambda: disk_full_stages(work, 2 if args.quick else 3, rng),
            "teacher": lambda: teacher_kills(work, 2 if args.quick else 3, rng),
            "netns": lambda: netns_faults(work, 1 if args.quick else 3, rng),
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
