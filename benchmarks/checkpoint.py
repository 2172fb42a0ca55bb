"""Checkpoint size, save/verify/load time, and the time a preemption costs (signal -> training again).

    .venv/bin/python benchmarks/checkpoint.py                      # default model config, 3 repeats
    .venv/bin/python benchmarks/checkpoint.py --skip-preemption    # only size and save/load times
    .venv/bin/python benchmarks/checkpoint.py --config launch/configs/debug.yaml --nproc 1

Part 1 builds the model of ``--config`` (its ``model.scratch_config``; vocabulary from the bundled
corpus), an AdamW state after one step, the momentum encoder and the negative queue of that config,
and times ``Checkpointer.save`` (fsync included), ``latest()`` (sha256 of every file) and ``load``.

Part 2 starts the real trainer with torchrun on small generated shards, sends SIGUSR1 to every rank
at step 3, and times: signal -> all processes exited with a checkpoint, then restart of the same
command -> first step after the resumed one logged. Under SLURM the requeue adds its own delay
(cred_expire + scheduling, ~7-10 s with launch/slurm/local_cluster.sh's settings).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # _train_data: tiny augmented shards made from the bundled corpus


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench_save_load(config_path: Path, repeats: int, workdir: Path) -> None:
    import torch

    from pipeline.config import load_config, to_dict
    from pipeline.model import (
        SentenceEncoder,
        build_char_vocab,
        build_scratch_backbone,
        make_tokenizer,
        write_vocab,
    )
    from pipeline.model.vocab import SCRATCH_SMALL, read_model_config
    from pipeline.resources import SAMPLE_CORPUS
    from pipeline.train.checkpoint import Checkpointer
    from pipeline.train.config import Config, resolve_path
    from pipeline.train.rng import RNGState

    cfg = load_config(Config, config_path, {"data.shards": str(workdir)})
    queue_size = cfg.terms().needs.queue_size
    scratch = resolve_path(cfg.model.scratch_config) if cfg.model.scratch_config else SCRATCH_SMALL
    model_config = read_model_config(scratch)
    texts = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()
    write_vocab(
        build_char_vocab(texts, cfg.model.vocab_min_count, cfg.model.vocab_max_size), workdir / "vocab.txt"
    )
    tokenizer = make_tokenizer(workdir / "vocab.txt")
    encoder = SentenceEncoder(build_scratch_backbone(model_config, tokenizer.vocab_size, 0), tokenizer)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-4)
    encoder(**encoder.tokenize(texts[:8])).sum().backward()
    optimizer.step()  # populate exp_avg / exp_avg_sq: the optimizer state is 2x the weights

    class Held(torch.nn.Module):  # the momentum encoder and the queue, as the trainer holds them
        def __init__(self) -> None:
            super().__init__()
            self.momentum = copy.deepcopy(encoder.backbone)
            self.register_buffer("queue", torch.randn(max(queue_size, 1), encoder.dim))

    states = {"optimizer": optimizer, "held": Held()}
    params = sum(p.numel() for p in encoder.parameters())
    ckpt = Checkpointer(workdir / "run", keep_last=2)
    save_t, verify_t, load_t = [], [], []
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        path = ckpt.save(step, encoder, states, {"rng": RNGState()}, to_dict(cfg))
        t1 = time.perf_counter()
        assert ckpt.latest() == path
        t2 = time.perf_counter()
        ckpt.load(path, encoder, states, {"rng": RNGState()}, verify=False)
        t3 = time.perf_counter()
        save_t.append(t1 - t0)
        verify_t.append(t2 - t1)
        load_t.append(t3 - t2)
    files = json.loads((path / "checkpoint.json").read_text())["files"]
    print(f"model: {config_path.name} ({scratch.name}), {params / 1e6:.2f} M parameters, queue {queue_size}")
    state_mib = (path / "state.pt").stat().st_size / 2**20
    print(
        f"checkpoint size: {dir_size(path) / 2**20:.1f} MiB in {len(files)} files "
        f"(model/ {dir_size(path / 'model') / 2**20:.1f} MiB, state.pt {state_mib:.1f} MiB)"
    )
    for name, values in (("save (fsync)", save_t), ("latest() verify", verify_t), ("load", load_t)):
        print(
            f"{name:>16}: median {statistics.median(values):.3f} s over {len(values)} (min {min(values):.3f})"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]
    return max(steps, default=0)


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def bench_preemption(config_path: Path, nproc: int, sentences: int, workdir: Path) -> None:
    import psutil
    from _train_data import make_shards

    from pipeline.run_layout import CHECKPOINTS_DIR, STEP_GLOB, step_of

    shards = workdir / "shards"
    per_block = max(sentences // 4, 1)
    make_shards(shards, [[per_block, per_block], [per_block, per_block]], num_variants=2)
    run_dir = workdir / "preempt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [
        "--config", str(config_path), f"--data.shards={shards}", f"--run_dir={run_dir}",
        "--data.num_workers=0", "--data.num_variants=2", "--train.max_steps=100000", "--train.eval_every=0",
        "--train.cpu", "--train.log_every=1",  # every step logged: the resumed step is seen at once
    ]  # fmt: skip

    def start() -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), str(REPO / "launch" / "pretrain.py"), *args]  # fmt: skip
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    proc = start()
    wait(lambda: last_step(run_dir) >= 3, 600, "step 3")
    workers = psutil.Process(proc.pid).children(recursive=True)
    t_signal = time.perf_counter()
    for w in workers:  # what srun does with the forwarded USR1 (torchrun itself would die of it)
        w.send_signal(signal.SIGUSR1)
    proc.wait(timeout=600)
    t_exit = time.perf_counter()
    saved = max(filter(None, (step_of(p.name) for p in (run_dir / CHECKPOINTS_DIR).glob(STEP_GLOB))))
    proc = start()
    t_restart = time.perf_counter()
    wait(lambda: last_step(run_dir) > saved, 600, "the first step after the resume")
    t_step = time.perf_counter()
    proc.send_signal(signal.SIGKILL)
    for p in psutil.Process().children(recursive=True):
        p.kill()
    proc.wait()
    print(f"preemption ({nproc} processes, {config_path.name}): checkpoint at step {saved}")
    print(f"  signal -> checkpoint saved and all ranks exited: {t_exit - t_signal:.1f} s")
    print(f"  restart -> first resumed step logged:           {t_step - t_restart:.1f} s")
    print(f"  time lost per preemption (excluding requeue):   {t_step - t_signal:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=REPO / "launch" / "configs" / "luse_scratch.yaml")
    parser.add_argument("--repeats", type=int, default=3, help="saves/loads to time")
    parser.add_argument("--nproc", type=int, default=2, help="training processes in the preemption run")
    parser.add_argument("--sentences", type=int, default=1024, help="sentences in the generated shards")
    parser.add_argument("--skip-preemption", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        bench_save_load(args.config, args.repeats, Path(tmp))
        if not args.skip_preemption:
            bench_preemption(args.config, args.nproc, args.sentences, Path(tmp))


if __name__ == "__main__":
    main()
