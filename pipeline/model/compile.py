"""The encoder made ready for the training step: ``train.unpadded`` checked, ``train.compile`` applied.

Compilation is in place (``nn.Module.compile``): the module keeps its class and its state_dict keys (no
``_orig_mod.`` prefix), so checkpoints, export and resume do not change with compile on or off.

Shapes: a padded run pads each batch to its longest sentence (or to a bucket,
``train.pad_to_multiple_of``); an unpadded one changes its token count every batch. Dynamo compiles the
first shape static and, at the second, one graph dynamic in that dimension (automatic dynamic shapes),
so a run compiles a few graphs, not one per length; ``RECOMPILE_LIMIT`` bounds the rest (past it the
frame runs eagerly, it does not fail) and every recompile is logged with its reason.

Compiled kernels are cached on disk (inductor's cache) per CPU instruction set: a kernel built for one
set crashes the process that loads it under another (a home or /tmp shared by nodes of different CPU
generations, or a run with ``ATEN_CPU_CAPABILITY`` capped), so each set gets its own folder.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from torch import nn

from pipeline.errors import ConfigError
from pipeline.model.varlen import check_unpadded

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
RECOMPILE_LIMIT = 8  # graphs per compiled frame: train/eval mode x a few shapes, with room to spare

log = logging.getLogger(__name__)


def kernel_cache_dir() -> str:
    """Inductor's cache folder for this machine's instruction sets: ``TORCHINDUCTOR_CACHE_DIR`` when the
    user set it, else inductor's default folder with a subfolder named for ATen's CPU capability and the
    vector ISA inductor compiles for (``avx2-avx2``, ``avx512-avx512_avx512_vnni_amx_tile``), which both
    follow ``ATEN_CPU_CAPABILITY``. Set in the environment, so compile workers inherit it.

    Inductor writes its default folder into ``TORCHINDUCTOR_CACHE_DIR`` the first time anything in the
    process asks for a cache (an ``aot_eager`` trace does), so that value counts as unset."""
    import torch
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return given
    isa = f"{torch.backends.cpu.get_cpu_capability()}-{pick_vec_isa() or 'novec'}".lower()
    folder = os.path.join(default_cache_dir(), re.sub(r"[^a-z0-9_.-]+", "_", isa))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def compile_encoder(module: nn.Module, mode: str, backend: str = "inductor") -> nn.Module:
    """``module`` compiled in place with torch.compile ``mode`` (``off``: untouched); returns it.
    ``backend``: inductor for training; the tests also trace with ``aot_eager`` (no C++ build)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile {mode!r} is not a mode; choose one of {', '.join(COMPILE_MODES)}")
    if mode == "off":
        return module
    import torch._dynamo

    if backend == "inductor":
        log.info("compile: kernels cached in %s", kernel_cache_dir())
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._logging.set_logs(recompiles=True)  # each recompile, with the guard that failed, in the log
    module.compile(mode=None if mode == "default" or backend != "inductor" else mode, backend=backend)
    log.info("compile: the encoder with torch.compile mode %s (at most %d graphs)", mode, RECOMPILE_LIMIT)
    return module


def compile_counts() -> dict[str, int]:
    """Graphs dynamo compiled in this process so far and its graph breaks: a run that recompiles per
    batch shows graphs growing with the steps (for logs, benchmarks and tests)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def prepare_encoder(encoder: Any, train: Any, device: Any = None) -> None:
    """As ``train`` (the TrainConfig) asks, before anything copies the encoder (a momentum encoder
    inherits what is set here): a ConfigError if ``train.unpadded`` names an architecture the unpadded
    forward does not reproduce; the prepared attention mask (no host sync per forward:
    :attr:`SentenceEncoder.static_mask`) with static shapes (``pad_to_multiple_of``), ``compile``, or on
    a CUDA ``device``. ``train.compile`` itself is :func:`compile_encoder`, after the copies.

    On CUDA the mask transformers builds costs one host sync per forward (``padding_mask.all()``;
    counted on an H200, docs/BENCHMARKS.md "GPU: the real step"), so a GPU run always gets the
    prepared one; a CPU run keeps transformers' own unless asked (the default CPU step is unchanged)."""
    if train.unpadded:
        check_unpadded(encoder.backbone)
    cuda = getattr(device, "type", device) == "cuda"
    if train.pad_to_multiple_of or train.compile != "off" or cuda:
        encoder.static_mask = True
