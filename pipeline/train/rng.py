"""Capture and restore every random number generator a training process draws from.

A resumed run is exact only if each rank continues the same random streams: dropout masks come from
torch's global generator (CPU, and CUDA on GPUs), EDA view choices or shuffles may use ``random`` or
``numpy``. :class:`RNGState` wraps them as one stateful object for the checkpointer's per-rank states.

CUDA keeps one generator per visible device, and a rank draws from its own device's only. When a
requeued job sees a different number of GPUs (another node type, one GPU bound per task instead of
all of them), the state of the device this rank used when it saved is restored onto the device it
uses now, with one log line: the rank's dropout stream goes on exactly. A checkpoint that does not
name its device (older ones) maps state i onto device i for the devices both have.

Everything is stored as plain Python values and tensors, so the file loads with
``torch.load(weights_only=True)``: numpy's key array becomes an int64 tensor, Python's state a list.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from pipeline.errors import PipelineError

__all__ = ["RNGState", "capture_rng_state", "restore_rng_state"]

log = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The state of python's ``random``, numpy's legacy global generator, torch CPU and CUDA."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # One state per visible device, and the one this rank draws from (for a changed GPU count).
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`. A missing CUDA entry (or no CUDA now) leaves CUDA alone."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npy["bit_generator"],
            "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
            "has_gauss": npy["has_gauss"],
            "gauss": npy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        _restore_cuda(list(cuda), state.get("cuda_device"))


def _restore_cuda(saved: list[torch.Tensor], saved_device: int | None) -> None:
    """Restore the per-device CUDA generators, mapping them when the number of devices changed."""
    visible = torch.cuda.device_count()
    if len(saved) == visible:
        torch.cuda.set_rng_state_all(saved)
        return
    if saved_device is None:  # a checkpoint from before the device was recorded: state i -> device i
        n = min(len(saved), visible)
        for i in range(n):
            torch.cuda.set_rng_state(saved[i], i)
        log.warning(
            "checkpoint holds CUDA RNG states for %d devices but %d are visible: restored states 0..%d "
            "onto devices 0..%d; a rank whose device index changed draws a different dropout stream",
            len(saved),
            visible,
            n - 1,
            n - 1,
        )
        return
    if not 0 <= saved_device < len(saved):
        raise PipelineError(
            f"checkpoint's RNG state names CUDA device {saved_device} but holds states for {len(saved)} "
            "devices: the rank state file is damaged; resume from another checkpoint (--resume PATH)"
        )
    current = torch.cuda.current_device()
    torch.cuda.set_rng_state(saved[saved_device], current)
    log.info(
        "checkpoint holds CUDA RNG states for %d devices, %d visible now: this rank's state (saved on "
        "device %d) restored onto device %d, its dropout stream continues exactly",
        len(saved),
        visible,
        saved_device,
        current,
    )


class RNGState:
    """Stateful view of the process-global generators, for ``rank_states={"rng": RNGState()}``."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)
