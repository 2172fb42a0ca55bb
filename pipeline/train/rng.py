"""Capture and restore every random number generator a training process draws from.

A resumed run is exact only if each rank continues the same random streams: dropout masks come from
torch's global generator (CPU, and CUDA on GPUs), EDA view choices or shuffles may use ``random`` or
``numpy``. :class:`RNGState` wraps them as one stateful object for the checkpointer's per-rank states.

Everything is stored as plain Python values and tensors, so the file loads with
``torch.load(weights_only=True)``: numpy's key array becomes an int64 tensor, Python's state a list.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNGState", "capture_rng_state", "restore_rng_state"]


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
        # One state per visible device; restoring needs the same number of devices (checked below).
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`. A missing CUDA entry leaves CUDA generators alone."""
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
        if len(cuda) != torch.cuda.device_count():
            raise RuntimeError(
                f"checkpoint holds CUDA RNG states for {len(cuda)} devices but {torch.cuda.device_count()} "
                "are visible; resume with the same CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_rng_state_all(cuda)


class RNGState:
    """Stateful view of the process-global generators, for ``rank_states={"rng": RNGState()}``."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)
