"""``train.deterministic``: the settings under which a GPU run gives the same weights every time.

On CPU, training is already bit-exact run to run and across a resume (tests/test_resume.py); these
settings change nothing in its results. On GPUs the data order and every RNG stream are exact anyway
(pipeline/train/rng.py), but several kernels are not: cuBLAS picks split-K reductions by workspace,
cuDNN autotunes, and the backward of SDPA's flash and memory-efficient attention accumulates with
atomics. With ``deterministic`` on:

- ``torch.use_deterministic_algorithms(True)``: an op with no deterministic CUDA kernel raises
  (it does not silently fall back), naming the op;
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (NVIDIA's documented setting for reproducible cuBLAS), which
  must be in place before the first cuBLAS call of the process;
- ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``;
- attention through SDPA's math backend only: the flash, memory-efficient and cuDNN backends are
  switched off process-wide (the encoder calls ``scaled_dot_product_attention`` through transformers,
  so this covers the encoder, the momentum encoder and evaluation without touching the model code).
  Only where CUDA is available: the same switches also turn off CPU's flash attention kernel, which
  changes CPU results in the last bits (measured), and CPU attention is deterministic without them.
  (On a GPU node forced onto the CPU the math backend is used there too: exact, and slower.)

The cost in speed is not measured here (no GPU in the session that wrote this): the math backend
materialises the (L, L) attention matrix per head, which at 64-128 tokens is small.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["CUBLAS_WORKSPACE", "enable_determinism"]

log = logging.getLogger(__name__)

CUBLAS_WORKSPACE = ":4096:8"
_CUBLAS_VALUES = (":4096:8", ":16:8")  # the two settings NVIDIA documents as deterministic


def enable_determinism(enabled: bool) -> None:
    """Switch the process to deterministic kernels when ``enabled``; do nothing otherwise.

    Call it before CUDA is initialised (first thing in ``build``). A ``CUBLAS_WORKSPACE_CONFIG``
    already set to one of the deterministic values is kept; another value is replaced, with a line.
    """
    if not enabled:
        return
    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if current not in _CUBLAS_VALUES:
        if current is not None:
            log.warning(
                "train.deterministic: CUBLAS_WORKSPACE_CONFIG=%s replaced by %s", current, CUBLAS_WORKSPACE
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        if torch.cuda.is_initialized():
            log.warning(
                "train.deterministic: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set; if a "
                "cuBLAS call came first the workspace setting does not apply: export "
                "CUBLAS_WORKSPACE_CONFIG=%s in the job's environment",
                CUBLAS_WORKSPACE,
            )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    attention = "attention as before (no CUDA: CPU attention is deterministic already)"
    if torch.cuda.is_available():
        # Process-wide, and they reach CPU attention too (its flash kernel), hence only with CUDA.
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
        attention = "attention through SDPA's math backend only"
    log.info(
        "train.deterministic: deterministic algorithms on, CUBLAS_WORKSPACE_CONFIG=%s, cuDNN "
        "deterministic without autotuning, %s",
        os.environ["CUBLAS_WORKSPACE_CONFIG"],
        attention,
    )
