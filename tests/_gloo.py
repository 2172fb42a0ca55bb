"""Spawn real gloo processes, run a body in each, and collect what every rank saw.

``spawn_ranks(tmp_path_factory, "name", body)`` starts ``world`` processes joined by a gloo process group
over a file store (no port to race for with whatever else runs on the machine), calls ``body(rank)`` in
each, saves its dict and returns the dicts in rank order. ``body`` must be a module-level function of the
test module (the spawned processes import it by name). Process start-up dominates the cost, so a test
module spawns once (a module-scoped fixture) and its tests compare the saved results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, body: Callable[[int], dict], store: str, out_dir: str, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.save(body(rank), f"{out_dir}/rank{rank}.pt")
        # Leave together: a rank tearing down gloo while its peer still talks to it can abort the peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_ranks(tmp_path_factory, name: str, body: Callable[[int], dict], world: int = 2) -> list[dict]:
    out_dir = tmp_path_factory.mktemp(name)
    mp.spawn(_run, args=(body, str(out_dir / "store"), str(out_dir), world), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]
