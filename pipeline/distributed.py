"""Rank helpers, gathers and reductions, in one place, correct with or without a process group.

Without an initialised ``torch.distributed`` process group (one process, plain ``python`` or a unit
test) every helper behaves as if the world had one rank: gathers and reductions return their input,
``barrier`` does nothing. Losses and the negative queue call these helpers unconditionally, so they
never branch on rank themselves.

Every function below except the rank queries is a *collective*: all ranks must call it, in the same
order, with tensors of the same shape and dtype, or the job hangs. Rank-dependent control flow around
them is the usual cause of a deadlock.
"""

from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_no_grad",
    "all_gather_with_grad",
    "all_reduce_mean",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "broadcast",
    "broadcast_object",
    "collective_device",
    "is_dist",
    "ignore_preemption_signals",
    "is_main_process",
    "rank",
    "shutdown",
    "world_size",
]


# The signals a scheduler sends every process of a job step to ask it to stop (SLURM's --signal, a time
# limit's SIGTERM): the training process handles them (pipeline/train/signals.py), its helpers ignore them.
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


def ignore_preemption_signals(*_: Any) -> None:
    """A DataLoader ``worker_init_fn``: loader workers ignore SIGTERM/SIGUSR1.

    Schedulers signal every process of a job step, workers included. The default action of SIGUSR1
    kills a process, and a dead worker makes the main process fail before it can save.
    """
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def is_dist() -> bool:
    """True when a process group is initialised (and there may be other ranks to talk to)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def is_main_process() -> bool:
    """Rank 0: the only rank that logs, writes checkpoints or prints progress bars."""
    return rank() == 0


def shutdown() -> None:
    """Destroy the process group, if any (every rank, on every way out: a normal end, a preemption exit).

    A process that exits with a gloo group still alive aborts in the group's destructor ("terminate
    called without an active exception", SIGABRT): the job's status becomes 134 instead of the exit code
    the run chose, and a scheduler script that requeues on 75 (launch/slurm/pretrain.sbatch) would see
    a crash. Not a collective a rank can wait in; idempotent.
    """
    if is_dist():
        dist.destroy_process_group()


def collective_device() -> torch.device:
    """Where a tensor for a collective must live: NCCL reduces only CUDA tensors, gloo only CPU ones."""
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait until every rank arrives (collective)."""
    if is_dist():
        dist.barrier()


def _gather_list(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward returns to each rank the gradient of its own slice.

    Rank r's loss depends on every rank's slice, so the gradient of slice s is the sum over ranks of
    d loss_r / d slice_s: backward reduce-scatters (sums) the incoming gradient, each rank receiving only
    the sum of its own rows. DDP then averages parameter gradients over ranks, which makes the result the
    gradient of the *mean* of the per-rank losses.

    Cost, per rank, for a slice of S bytes: the all-reduce of the whole gathered gradient this replaces
    returned W x S bytes (of which S were kept) and, as a ring, sent 2 (W - 1) S; the reduce-scatter
    returns S (1/W) and sends (W - 1) S (half: an all-reduce is a reduce-scatter then an all-gather).
    It sits on the backward's critical path. gloo and NCCL both implement it (torch 2.13).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.local_rows = x.shape[0]
        return torch.cat(_gather_list(x), dim=0)  # (W * B, ...)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_rows(grad.contiguous(), ctx.local_rows)  # collective, in the backward pass


def reduce_scatter_rows(full: torch.Tensor, local_rows: int) -> torch.Tensor:
    """Rows ``[rank * local_rows, (rank + 1) * local_rows)`` of the sum over ranks of ``full`` (W * B, ...)
    (collective): each rank receives only its own slice of the sum."""
    out = full.new_empty((local_rows, *full.shape[1:]))  # (B, ...)
    dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM)
    return out


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` of every rank along dim 0 in rank order, keeping gradients (collective).

    ``x`` must have the same shape on every rank (our loader gives every rank the same batch size).
    Gradients flow back to every rank's slice; see :class:`_AllGatherWithGrad`. Without a process
    group this is the identity.
    """
    if not is_dist() or world_size() == 1:
        return x
    return _AllGatherWithGrad.apply(x)


@torch.no_grad()
def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` of every rank along dim 0 in rank order, detached (collective)."""
    if not is_dist() or world_size() == 1:
        return x.detach()
    return torch.cat(_gather_list(x.detach()), dim=0)


@torch.no_grad()
def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ranks, as a new detached tensor (collective; ``x`` is not modified)."""
    out = x.detach().clone()
    if is_dist() and world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@torch.no_grad()
def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ranks, as a new detached tensor (collective), e.g. a loss for logging."""
    out = all_reduce_sum(x)
    return out / world_size() if out.is_floating_point() else out.double() / world_size()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (collective), e.g. a run directory name."""
    if not is_dist() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank, in place (collective); the identity without other ranks."""
    if is_dist() and world_size() > 1:
        dist.broadcast(x, src=src)
    return x


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (collective), e.g. each rank's error or None."""
    if not is_dist() or world_size() == 1:
        return [obj]
    objs: list[Any] = [None] * world_size()
    dist.all_gather_object(objs, obj)
    return objs
