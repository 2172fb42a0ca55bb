"""What the non-finite guard costs per training step, and what the finiteness check at a save costs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/guard_cost.py [--config launch/configs/luse_scratch.yaml]

The guard (pipeline/train/guard.py) adds to every step: a gradient norm (reused from clipping when
``optim.grad_clip`` is on), two ``isfinite``, and one device-to-host copy of two numbers (an all-reduce
of them with more than one process). The same trainer alternates blocks of steps with the guard on and
off (``guard.max_nonfinite_steps`` 5 / 0), so that load drifts on a shared machine hit both alike; the
medians of the per-block step times are compared. Then ``first_nonfinite`` over everything a checkpoint
holds (weights, AdamW moments, momentum encoder, queue) is timed. On CPU a host sync costs nothing in
itself (CPU kernels run synchronously); on a GPU it waits for the step's queued kernels before the
optimizer runs -- not measurable here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # _train_data: tiny augmented shards made from the bundled corpus


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=REPO / "launch" / "configs" / "luse_scratch.yaml")
    parser.add_argument("--blocks", type=int, default=10, help="blocks of steps per setting, interleaved")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    args = parser.parse_args()

    import torch
    from _train_data import make_shards

    from pipeline.config import load_config
    from pipeline.train import loop
    from pipeline.train.build import build
    from pipeline.train.config import Config
    from pipeline.train.guard import first_nonfinite, grad_norm, step_verdict

    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        make_shards(shards, [[256] * 4] * 2, num_variants=4)
        overrides = {"data.shards": str(shards), "run_dir": str(Path(tmp) / "run"), "data.num_workers": 0}
        t = build(load_config(Config, args.config, overrides))
        t.checkpointer = None
        params = sum(p.numel() for p in t.module.parameters())
        print(
            f"config {args.config.name}: {params / 1e6:.2f} M parameters, "
            f"batch {t.cfg.train.global_batch_size}"
        )
        batches = iter(t.stream)
        for _ in range(3):  # warm-up
            loop.train_step(t, next(batches))
        times: dict[bool, list[float]] = {True: [], False: []}
        for block in range(2 * args.blocks):
            on = block % 2 == 0
            t.cfg.guard.max_nonfinite_steps = 5 if on else 0
            started = time.perf_counter()
            for _ in range(args.steps):
                out = loop.train_step(t, next(batches))
                assert ("check" in out) == on
            times[on].append((time.perf_counter() - started) / args.steps)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"step time, median of {args.blocks} blocks of {args.steps} steps: guard on {on * 1e3:.1f} ms "
            f"(blocks {min(times[True]) * 1e3:.1f}-{max(times[True]) * 1e3:.1f}), off {off * 1e3:.1f} ms "
            f"(blocks {min(times[False]) * 1e3:.1f}-{max(times[False]) * 1e3:.1f}); difference "
            f"{(on - off) * 1e3:+.1f} ms ({(on / off - 1) * 100:+.1f}%)"
        )
        # the guard's own work, alone: the norm (as when clipping is off), isfinite, the copy to the host
        norm_times, verdict_times = [], []
        out = loop.train_step(t, next(batches))
        for param in t.model.parameters():  # the step zeroed the gradients: stand-ins of the same shapes
            param.grad = torch.randn_like(param)
        for _ in range(args.blocks):
            started = time.perf_counter()
            norm = grad_norm(t.model.parameters())
            norm_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            step_verdict(out["loss"], norm)
            verdict_times.append(time.perf_counter() - started)
        print(
            f"the guard's work alone: gradient norm {statistics.median(norm_times) * 1e3:.2f} ms (only when "
            f"optim.grad_clip is 0; clipping computes it anyway), verdict (isfinite + host copy) "
            f"{statistics.median(verdict_times) * 1e6:.0f} us; median of {args.blocks}"
        )
        states = {"model": t.encoder.state_dict(), **{k: v.state_dict() for k, v in t.states().items()}}
        tensors = sum(x.numel() for x in loop_tensors(states))
        checks = []
        for _ in range(5):
            started = time.perf_counter()
            assert first_nonfinite(states) is None
            checks.append(time.perf_counter() - started)
        print(
            f"finiteness check at a save: {tensors / 1e6:.1f} M numbers in "
            f"{statistics.median(checks) * 1e3:.1f} ms (median of 5)"
        )
        t.close()
    return 0


def loop_tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from loop_tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from loop_tensors(v)


if __name__ == "__main__":
    sys.exit(main())
