"""The backward of ``all_gather_with_grad`` reduce-scatters (pipeline/distributed.py): two gloo processes
get the same gradients as the all-reduce it replaced, and the collective it calls returns 1/W of the
bytes (and, as a ring, sends half)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline import distributed

pytestmark = pytest.mark.slow

WORLD, B, H = 2, 3, 5


def reference_backward(grad: torch.Tensor, local_rows: int) -> torch.Tensor:
    """The backward before the change: all-reduce the whole gathered gradient, keep the own rows."""
    grad = grad.contiguous().clone()
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    start = distributed.rank() * local_rows
    return grad[start : start + local_rows]


def loss_of(x: torch.Tensor, rank: int) -> torch.Tensor:
    gathered = distributed.all_gather_with_grad(x)  # (W * B, H)
    weights = torch.arange(gathered.numel(), dtype=x.dtype).reshape(gathered.shape) + rank
    return (gathered.sin() * weights).sum() + (gathered[:B] ** 2).sum() * (rank + 1)  # rank-dependent


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x = torch.randn(WORLD * B, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        x = x[rank * B : (rank + 1) * B].clone().requires_grad_(True)
        sent: list[tuple[str, int, int]] = []  # (collective, bytes returned to this rank, bytes given)
        real_rs, real_ar = dist.reduce_scatter_tensor, dist.all_reduce

        def counting_rs(output, input, *args, **kwargs):
            sent.append(("reduce_scatter", output.numel() * output.element_size(), input.numel() * 8))
            return real_rs(output, input, *args, **kwargs)

        def counting_ar(tensor, *args, **kwargs):
            n = tensor.numel() * tensor.element_size()
            sent.append(("all_reduce", n, n))
            return real_ar(tensor, *args, **kwargs)

        dist.reduce_scatter_tensor, dist.all_reduce = counting_rs, counting_ar
        try:
            loss_of(x, rank).backward()
            new_grad = x.grad.clone()
            new_calls = list(sent)
            sent.clear()
            x.grad = None
            real_backward = distributed._AllGatherWithGrad.backward
            distributed._AllGatherWithGrad.backward = staticmethod(
                lambda ctx, grad: reference_backward(grad, ctx.local_rows)
            )
            try:
                loss_of(x, rank).backward()
            finally:
                distributed._AllGatherWithGrad.backward = real_backward
            old_calls = list(sent)
        finally:
            dist.reduce_scatter_tensor, dist.all_reduce = real_rs, real_ar
        out[rank] = {"new": new_grad, "old": x.grad.clone(), "new_calls": new_calls, "old_calls": old_calls}
    finally:
        dist.destroy_process_group()


def test_reduce_scatter_backward_equals_the_all_reduce_one_and_returns_1_over_w_of_the_bytes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(port, out), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = out[rank]
        assert torch.equal(r["new"], r["old"]), rank  # same sums of the same two float64 terms
        assert [c[0] for c in r["new_calls"]] == ["reduce_scatter"]
        assert [c[0] for c in r["old_calls"]] == ["all_reduce"]
        slice_bytes = B * H * 8
        (_, new_back, new_in), (_, old_back, _) = r["new_calls"][0], r["old_calls"][0]
        assert new_back == slice_bytes and old_back == WORLD * slice_bytes  # 1/W of the bytes returned
        assert new_in == WORLD * slice_bytes  # what a ring sends per rank: (W-1)/W of this, vs twice that


def test_single_process_is_the_identity():
    x = torch.randn(B, H, requires_grad=True)
    assert distributed.all_gather_with_grad(x) is x
