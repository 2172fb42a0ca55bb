"""Checks that need a CUDA GPU (``@pytest.mark.gpu``: skipped, saying why, where torch sees none).

None of these has run in the session that wrote them (no GPU there): docs/BENCHMARKS.md ("GPU: a
projection") lists them as unverified. On a GPU host: ``.venv/bin/python -m pytest -q -s tests/test_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_data import debug_config, debug_luse, full_and_resumed, run_and_dump

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24], [32]], num_variants=3)


@pytest.fixture
def one_rank_nccl(monkeypatch):
    """torchrun's variables for a world of one, so the trainer creates an NCCL process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def gpu_cfg(tmp_path, shards, name, **overrides):
    base = {
        "train.device": "cuda",
        "train.cpu": False,
        "train.mixed_precision": "bf16",
        "optim.fused": True,
        "loss": debug_luse(momentum=0.9),
        "train.max_steps": 6,
        "train.log_every": 3,
        "train.debug_dump": True,
        "train.eval_max_pairs": 16,
        "run_dir": str(tmp_path / name),
    }
    return debug_config(tmp_path, shards, **{**base, **overrides})


def test_a_bf16_training_step_with_nccl(tmp_path, shards, one_rank_nccl):
    seen = {}

    def on_batch(t, batch):
        seen["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        seen["device"] = str(t.accelerator.device)
        seen["precision"] = t.cfg.train.mixed_precision
        momentum = t.loss.states().get("momentum_encoder")  # the luse term's own
        seen["momentum_autocast"] = momentum.autocast if momentum is not None else None

    from accelerate.state import AcceleratorState

    from pipeline.train.run import run

    cfg = gpu_cfg(tmp_path, shards, "bf16")
    AcceleratorState._reset_state(True)
    assert run(cfg, on_batch) == 0
    dump = json.loads((cfg.run_dir / "debug" / "rank0.json").read_text())
    assert dump["step"] == 6
    assert seen == {
        "backend": "nccl",
        "device": "cuda:0",
        "precision": "bf16",
        "momentum_autocast": torch.bfloat16,
    }
    from safetensors.torch import load_file

    weights = load_file(cfg.run_dir / "model" / "model.safetensors")
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.float32}
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_deterministic_resume_is_bit_exact_on_the_gpu(tmp_path, shards, one_rank_nccl):
    from pipeline.train.config import TrainConfig

    if "deterministic" not in {f.name for f in dataclasses.fields(TrainConfig)}:
        pytest.skip("train.deterministic does not exist in this version")

    def make(run_dir, steps):
        return gpu_cfg(
            tmp_path,
            shards,
            run_dir.name,
            **{
                "train.deterministic": True,
                "train.max_steps": steps,
                "checkpoint.every_steps": 2,
                "optim.schedule": "constant",
                "run_dir": str(run_dir),
            },  # fmt: skip
        )

    full, resumed = full_and_resumed(tmp_path, make, stop=3, total=6)
    for key in ("param_checksum", "queue_checksum", "cursor", "step", "samples_seen"):
        assert resumed[key] == full[key], key
    again = run_and_dump(make(tmp_path / "again", 6))
    assert again["param_checksum"] == full["param_checksum"]  # and a rerun gives the same weights


def test_faiss_gpu_and_the_chunked_search_agree_with_the_cpu():
    from pipeline.search.backend import ChunkedExactSearch, build_index, faiss_module, gpu_available

    pytest.importorskip("faiss", reason="faiss is not installed (EXTRA=gpu installs faiss-gpu)")
    rng = np.random.default_rng(0)
    corpus = rng.standard_normal((20_000, 384)).astype(np.float32)
    corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
    queries = corpus[:500] + 0.05 * rng.standard_normal((500, 384)).astype(np.float32)
    cpu = faiss_module().IndexFlatIP(384)
    cpu.add(corpus)
    ref_scores, ref_rows = cpu.search(queries, 10)

    chunked = ChunkedExactSearch(corpus, "cuda", corpus_chunk=4096, query_block=256)
    scores, rows = chunked.search(queries, 10)
    assert (rows[:, 0] == ref_rows[:, 0]).all()  # each query's own row, far ahead of the rest
    assert np.abs(scores - ref_scores).max() < 5e-3  # float16 products
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, ref_rows)]) > 0.95

    if not gpu_available():
        pytest.skip("faiss sees no GPU (a CPU faiss build): the faiss-gpu part is not checked")
    index, where = build_index("flat", 384, {}, None, [corpus], use_gpu=True)
    assert where == "gpu"
    _, gpu_rows = index.search(queries, 10)
    assert (gpu_rows[:, 0] == ref_rows[:, 0]).all()


def _timeout_worker(rank: int, port: int, out: dict) -> None:
    from pipeline.train.hangs import failure_kind, init_process_group

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.cuda.set_device(rank)
    init_process_group("nccl", 10.0)
    x = torch.ones(1, device="cuda")
    torch.distributed.all_reduce(x)  # both ranks: the group works
    torch.cuda.synchronize()
    if rank == 1:
        import time

        time.sleep(60)  # silent past the 10 s timeout
        return
    try:
        torch.distributed.all_reduce(x)
        torch.cuda.synchronize()
        out[rank] = "completed"
    except Exception as exc:  # NCCL's watchdog aborts the communicator
        out[rank] = failure_kind(exc) or repr(exc)


def test_the_collective_timeout_reaches_nccl():
    """Two ranks on two GPUs, the second silent: the first's collective ends at our 10 s timeout."""
    if torch.cuda.device_count() < 2:
        # A world of one needs no group of ours (init_process_group returns False) and NCCL takes one
        # rank per GPU: on one GPU (the H200 this ran on) this is skipped, and unverified on NCCL.
        pytest.skip("an NCCL group of two ranks needs 2 GPUs (one rank per GPU)")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_timeout_worker, args=(port, out), nprocs=2, join=False)
    import time

    deadline = time.monotonic() + 120
    while 0 not in out and time.monotonic() < deadline:
        time.sleep(1)
    assert out.get(0) == "timed out"


def test_throughput_figure(tmp_path):
    """Prints a throughput figure (not asserted): the student at 64 tokens, a few steps."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_throughput.py"), "--models", "student",
         "--lengths", "64", "--steps", "10", "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, cwd=REPO, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    print("\n" + "\n".join(json.dumps(r) for r in rows))
    assert rows and all(r["sequences_per_s"] > 0 for r in rows)
