"""Bounded hangs: every collective gets ``train.collective_timeout``, and a rank whose collective times
out (or loses its peer) exits with one line and :data:`~pipeline.train.signals.EXIT_CODE_COLLECTIVE_TIMEOUT`.

A stopped, hung or cut-off node does not fail: it goes silent, and the other ranks block in their next
collective. Without a timeout they wait for torch's default (gloo 30 min, NCCL 10 min) and then die with
a C++ traceback that names neither the collective nor the rank. Here:

* :func:`init_process_group` creates the process group itself, with the timeout, before Accelerate
  does (Accelerate and DeepSpeed use a group that exists; Accelerate's own ``InitProcessGroupKwargs``
  drops a timeout equal to its class default, so gloo would keep 30 min), and turns on NCCL's
  asynchronous error handling, so a NCCL collective that times out tears the process down instead of
  hanging (torch's watchdog; its log line names the operation and its sequence number).
* :func:`failure_line` recognises a collective's timeout or lost connection (gloo raises them as
  RuntimeError in the waiting rank), names the collective from the traceback and the step, and asks
  the other ranks through the rendezvous store which of them are still there: the ones that never answer
  are the silent ones.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from pipeline import distributed as dist
from pipeline.train.signals import EXIT_CODE_COLLECTIVE_TIMEOUT

__all__ = ["describe_collective", "failure_kind", "failure_line", "init_process_group", "silent_ranks"]

log = logging.getLogger(__name__)

TIMEOUT_WORDS = ("timed out", "timeout")
LOST_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "communicator was aborted",
    "connection refused",
    "socket closed",
)
# The innermost function of ours in a failed collective's traceback -> what the collective carried.
PURPOSE = {
    "compute_loss": "of embeddings",
    "all_gather_with_grad": "of embeddings",
    "enqueue_keys": "of the queue's new keys",
    "should_stop": "of the preemption flag",
    "due": "of the checkpoint-time decision",
    "log_step": "of the logged loss",
    "evaluate": "of the evaluation score",
    "save": "of the checkpoint save",
    "load": "of the checkpoint load",
    "shard_blocks": "of the shard check",
    "build_tokenizer": "after the tokenizer build",
    "step_verdict": "of the non-finite check",
}
# Every failure passes through these: the collective helpers and the entry points say nothing.
NOT_OURS = ("pipeline/distributed.py", "pipeline/train/run.py", "pipeline/train/hangs.py", "pretrain.py")
STORE_KEY = "pipeline/collective_failure/alive/{rank}"


def init_process_group(backend: str, timeout_s: float, env: dict[str, str] | None = None) -> bool:
    """Create the default process group with ``timeout_s`` when launched with several ranks (env://:
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun, ``accelerate launch`` and
    launch/slurm/pretrain.sbatch set them). Returns whether it did; without those variables (one
    process, an MPI launch) Accelerate creates the group from its ``InitProcessGroupKwargs``."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1") or 1) < 2:
        return False
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # read when the NCCL group is created
    needed = ("RANK", "MASTER_ADDR", "MASTER_PORT")
    if tdist.is_initialized() or any(k not in env for k in needed):
        return False
    timeout = timedelta(seconds=timeout_s)
    tdist.init_process_group(backend, timeout=timeout)
    # Groups created later without a timeout (DeepSpeed clones the world group for its reductions)
    # take torch's default for their backend, not the default group's: make that default ours too.
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    return True


def failure_kind(exc: BaseException) -> str | None:
    """ "timed out" or "lost its peer" when ``exc`` is a collective that could not complete, else None.

    Only with a process group, and only for errors that come from torch.distributed (its error types,
    a traceback through it, or gloo's / NCCL's own message), so that e.g. a DataLoader's "timed out" is
    not taken for one.
    """
    if not isinstance(exc, RuntimeError):
        return None
    # Before the process group exists only the rendezvous can fail this way (a rank never arrived).
    if not dist.is_dist() and not isinstance(exc, getattr(tdist, "DistError", ())):
        return None
    text = str(exc).lower()
    frames = traceback.extract_tb(exc.__traceback__)
    from_dist = (
        isinstance(exc, getattr(tdist, "DistError", ()))
        or any(w in text for w in ("gloo", "nccl", "c10d"))
        or any("torch/distributed/" in f.filename.replace(os.sep, "/") for f in frames)
    )
    if not from_dist:
        return None
    if any(w in text for w in TIMEOUT_WORDS):
        return "timed out"
    if any(w in text for w in LOST_WORDS):
        return "lost its peer"
    return None


def describe_collective(exc: BaseException) -> str:
    """``"all_gather of embeddings (pipeline/losses/x.py:87 compute_loss)"``, from the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)

    def path(f: traceback.FrameSummary) -> str:
        return f.filename.replace(os.sep, "/")

    c10d = [f for f in frames if path(f).endswith("torch/distributed/distributed_c10d.py")]
    ours = [f for f in frames if _is_ours(path(f))]
    if c10d:
        op = c10d[0].name  # the outermost: broadcast_object_list, not the broadcast inside it
    elif any(path(f).endswith("torch/autograd/__init__.py") or f.name == "backward" for f in frames):
        op = "gradient all_reduce of the backward pass"
    else:
        op = "collective"
    purpose = next((PURPOSE[f.name] for f in reversed(ours) if f.name in PURPOSE), "")
    where = ""
    if ours:
        f = ours[-1]
        p = path(f)
        shown = "pipeline/" + p.split("/pipeline/", 1)[-1] if "/pipeline/" in p else os.path.basename(p)
        where = f" ({shown}:{f.lineno} {f.name})"
    return f"{op} {purpose}".strip() + where


def _is_ours(path: str) -> bool:
    """A frame of the run's own code: the pipeline's (but not its collective helpers or the entry
    points, which every failure passes through), or a script's; not torch's, a library's or Python's."""
    if path.endswith(NOT_OURS) or path.startswith("<"):
        return False
    return "/pipeline/" in path or ("site-packages" not in path and "/lib/python" not in path)


def silent_ranks(grace_s: float) -> str:
    """Which ranks do not answer through the rendezvous store within ``grace_s`` (every survivor of a
    failed collective asks at about the same moment): ``"rank 1"``, ``"ranks 1, 3"`` or a sentence
    when the store itself does not answer (its host, rank 0, is the silent one)."""
    host = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if not dist.is_dist():
        world = os.environ.get("WORLD_SIZE", "?")
        return f"the ranks that did not join the rendezvous at {host} (WORLD_SIZE={world})"
    world, me = dist.world_size(), dist.rank()
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()  # private; a missing API is reported below
            store.set(STORE_KEY.format(rank=me), "1")
            deadline = time.monotonic() + grace_s
            while True:
                alive = [r for r in range(world) if store.check([STORE_KEY.format(rank=r)])]
                if len(alive) == world or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            result["alive"] = alive
        except Exception as exc:  # the store's host is gone or unreachable
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"

    # In a thread: a store whose host is stopped accepts the request and never answers (no timeout).
    thread = threading.Thread(target=ask, name="silent-ranks", daemon=True)
    thread.start()
    thread.join(grace_s + 5.0)
    if "alive" in result:
        silent = [r for r in range(world) if r not in result["alive"]]
        if not silent:
            return "every rank answered afterwards (one was slow, not silent)"
        ranks = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
        return f"{ranks} (no answer within {grace_s:g} s)"
    why = result.get("error", f"no answer within {grace_s + 5:g} s")
    return f"rank 0 or its node, which hosts the rendezvous store at {host} ({why})"


def failure_line(
    exc: BaseException, where: str, timeout_s: float, grace_s: float | None = None
) -> str | None:
    """The one line a rank prints when ``exc`` is a failed collective (else None): which collective,
    at which point of the run (``where``: "at step 25"), how it failed, which ranks are silent."""
    kind = failure_kind(exc)
    if kind is None:
        return None
    grace = min(5.0, max(1.0, timeout_s / 2)) if grace_s is None else grace_s
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = reason.split("] ", 1)[-1][:200]  # gloo prefixes its source file and line
    how = f"did not complete within {timeout_s:g} s" if kind == "timed out" else "lost its peer"
    silent = silent_ranks(grace)
    rank = dist.rank() if dist.is_dist() else os.environ.get("RANK", "?")
    return (
        f"collective timeout: {describe_collective(exc)} {where} {how} on rank {rank} ({reason}); "
        f"silent: {silent}. Exiting with status {EXIT_CODE_COLLECTIVE_TIMEOUT} (requeue to resume from "
        "the newest checkpoint); check the silent rank's node and log (hung, stopped, out of memory, cut "
        "off), and raise train.collective_timeout if a rank legitimately works alone that long"
    )


def exit_now(line: str, closers: list[Any]) -> None:
    """Print ``line`` and leave at once with the collective-timeout status, without the usual teardown:
    destroying a process group whose peer is stopped may block, and so may joining loader workers."""
    print(line, file=sys.stderr, flush=True)
    for close in closers:
        try:
            close()
        except Exception:  # best effort: the line is out, the status is what matters now
            pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE_COLLECTIVE_TIMEOUT)
