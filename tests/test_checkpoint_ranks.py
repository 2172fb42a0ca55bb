"""Checkpoints across ranks: each rank fsyncs only the files it wrote (two gloo processes, a DeepSpeed-
like engine writing one ZeRO shard per rank), and weights kept in half precision are written in float32."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_checkpoint import CONFIG, Setup, tiny_encoder

from pipeline.train.checkpoint import Checkpointer, save_model

WORLD = 2


class ShardWritingEngine:
    """What the checkpointer uses of a DeepSpeed engine: a ``checkpoint_engine.save`` through which every
    rank writes its ZeRO shard, and rank 0 the module states (as DeepSpeed's engine does)."""

    class Writer:
        def save(self, state_dict, path: str) -> None:
            torch.save(state_dict, path)

    def __init__(self) -> None:
        self.checkpoint_engine = self.Writer()
        self.dp_world_size = WORLD

    def zero_optimization_stage(self) -> int:
        return 2

    def save_checkpoint(self, directory: str, tag: str, save_latest: bool = True) -> None:
        folder = Path(directory, tag)
        folder.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()
        self.checkpoint_engine.save(
            {"shard": torch.full((3,), float(rank))}, str(folder / f"zero_pp_rank_{rank}.pt")
        )
        if rank == 0:
            self.checkpoint_engine.save(
                {"module": torch.zeros(2)}, str(folder / "mp_rank_00_model_states.pt")
            )
            (folder / "zero_to_fp32.py").write_text("# copied by DeepSpeed\n")  # not through the writer


def _worker(rank: int, port: int, run_dir: str, tmp: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    synced: list[str] = []
    real = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    try:
        (Path(tmp) / f"model{rank}").mkdir()
        s = Setup(Path(tmp) / f"model{rank}")
        os.fsync = counting_fsync
        try:
            path = Checkpointer(run_dir, engine=ShardWritingEngine()).save(
                1, s.model, s.states, s.rank_states, CONFIG
            )
        finally:
            os.fsync = real
        out[rank] = {"synced": synced, "path": str(path)}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_rank_fsyncs_only_the_files_it_wrote(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, str(tmp_path / "run"), str(tmp_path), out), nprocs=WORLD, join=True)
    final = Path(out[0]["path"])
    tmp = final.with_name(f".tmp-{final.name}")

    def files(rank: int) -> list[str]:  # paths inside the checkpoint; an atomic write's temporary by its name
        inside = [Path(p).relative_to(tmp) for p in out[rank]["synced"] if p.startswith(str(tmp) + "/")]
        return [(p.parent / re.sub(r"^\.(.*)\.tmp-\d+-[0-9a-f]+$", r"\1", p.name)).as_posix() for p in inside]

    ours = files(1)
    assert sorted(ours) == ["deepspeed/engine/zero_pp_rank_1.pt", "rank-1.pt"]  # its own two, nothing else
    everything = sorted(json.loads((final / "checkpoint.json").read_text())["files"])
    file_syncs = [p for p in files(0) + ours if (final / p).is_file() and p != "checkpoint.json"]
    assert sorted(file_syncs) == everything  # every file flushed exactly once, by one rank
    assert "deepspeed/engine/zero_to_fp32.py" in files(0)  # written outside the recorder: rank 0 flushes it


def test_half_precision_weights_are_saved_in_float32(tmp_path):
    from safetensors.torch import load_file

    model = tiny_encoder(tmp_path)
    model.backbone.to(torch.bfloat16)  # what DeepSpeed bf16 does to the module
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    save_model(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert {v.dtype for v in saved.values() if v.is_floating_point()} == {torch.float32}
    assert all(torch.equal(saved[k], before[k].float()) for k in saved)  # bf16 -> fp32 is exact
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    assert all(
        v.dtype == torch.bfloat16 for v in model.backbone.state_dict().values() if v.is_floating_point()
    )
    assert "save_pretrained" not in vars(model.backbone)  # the temporary override is gone

    (tmp_path / "ckpt").mkdir()
    s = Setup(tmp_path / "ckpt")
    s.model.backbone.to(torch.bfloat16)
    path = Checkpointer(tmp_path / "run").save(1, s.model, s.states, s.rank_states, CONFIG)
    weights = load_file(path / "model" / "model.safetensors")
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}
