"""CPU compute precision, decided from the CPU it runs on.

bf16 autocast pays on a CPU only where its matrix products run in bf16 natively: AMX-BF16 (Intel Xeon
from Sapphire Rapids) or AVX512-BF16 (Cooper Lake, AMD Zen 4 and later). Elsewhere oneDNN emulates bf16
and bf16 is several times slower than fp32: e5-small's forward 4.6x on a 2-core AMD EPYC with AVX2; with
the ISA held to AVX2, the teacher stage 3.8x and the distillation step 24x (docs/BENCHMARKS.md, "CPU
precision"). So one place
decides: ``auto`` is bf16 on a CPU with native bf16 and fp32 on any other, for training
(``train.mixed_precision``), the teacher stage, evaluation and the report; an explicit bf16 on a CPU
without native bf16 still runs, after one warning that names the cost.

``PIPELINE_CPU_BF16=0`` (or ``1``) overrides the check: fp32 (or bf16) for ``auto`` whatever the CPU
says, e.g. to keep a comparison in one precision across machines; the test suite sets 0.

The check is torch's own: the CPU's features as torch's cpuinfo reads them (AMX-BF16, AVX512-BF16), and
whether oneDNN, which runs the bf16 matmuls, may use them (``torch.ops.mkldnn._is_mkldnn_bf16_supported``
and ``ONEDNN_MAX_CPU_ISA``, which caps oneDNN's instruction set: ``ONEDNN_MAX_CPU_ISA=AVX2`` makes a
CPU with AMX behave as one without, and is how the fp32 path is measured on such a machine).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

CpuPrecision = Literal["auto", "fp32", "bf16"]
OVERRIDE = "PIPELINE_CPU_BF16"  # 0 or 1: the answer of the check, given (tests, comparisons across machines)
CPU_PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16")
# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA) that keep its native bf16
# kernels: AVX512_CORE_BF16 and every level above it. A cap below (SSE41 .. AVX512_CORE_VNNI, AVX2_VNNI_2)
# leaves bf16 to emulation.
NATIVE_BF16_CAPS = frozenset(
    {
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX10_1_512",
        "AVX512_CORE_AMX",
        "AVX10_1_512_AMX",
        "AVX512_CORE_AMX_FP16",
        "AVX10_1_512_AMX_FP16",
        "AVX10_2_512",
        "AVX10_2_512_AMX_2",
        "DEFAULT",
        "ALL",
    }
)
# What an emulated bf16 costs, for the warning (docs/BENCHMARKS.md, "CPU precision").
EMULATED_COST = "bf16 is emulated there: about 4x slower than fp32 to encode, 25x to train"


@dataclass(frozen=True)
class CpuBf16:
    """Whether this CPU computes bf16 matmuls natively, and the words that say why."""

    native: bool
    why: str  # e.g. "native bf16 (AMX-BF16)", "no native bf16 (no AMX-BF16 or AVX512-BF16)"


def cpu_features() -> dict[str, bool]:
    """The CPU's bf16 features as torch's cpuinfo reads them (unaffected by ONEDNN_MAX_CPU_ISA)."""
    import torch

    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        found = caps()
        return {"amx_bf16": bool(found.get("amx_bf16")), "avx512_bf16": bool(found.get("avx512_bf16"))}
    return {  # older torch: the two flags it exposes
        "amx_bf16": bool(torch.cpu._is_amx_tile_supported()),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
    }


def onednn_bf16() -> bool:
    """Whether oneDNN will run bf16 kernels at all (False when its ISA is capped below AVX512)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def cpu_bf16(
    env: Mapping[str, str] | None = None,
    features: Callable[[], dict[str, bool]] | None = None,
    onednn: Callable[[], bool] | None = None,
) -> CpuBf16:
    """Whether this CPU has native bf16 matmuls that oneDNN may use (the inputs are parameters, the live
    machine's by default, so that tests answer for a CPU they do not run on)."""
    env = os.environ if env is None else env
    forced = env.get(OVERRIDE, "").strip()
    if forced in ("0", "1"):
        return CpuBf16(
            forced == "1", f"{'native' if forced == '1' else 'no native'} bf16 ({OVERRIDE}={forced})"
        )
    if forced:
        raise ConfigError(
            f"{OVERRIDE}={forced!r}: use 0 (fp32 for auto), 1 (bf16 for auto) or leave it unset"
        )
    found = (features or cpu_features)()
    names = [n for key, n in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if found.get(key)]
    if not names:
        return CpuBf16(False, "no native bf16 (this CPU has neither AMX-BF16 nor AVX512-BF16)")
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = env.get(var, "").strip().upper()
        if cap and cap not in NATIVE_BF16_CAPS:
            return CpuBf16(False, f"no native bf16 ({var}={cap} keeps oneDNN from {names[0]})")
    if not (onednn or onednn_bf16)():
        return CpuBf16(False, f"no native bf16 (oneDNN runs no bf16 here, though the CPU has {names[0]})")
    return CpuBf16(True, f"native bf16 ({', '.join(names)})")


def resolve_cpu_precision(
    setting: str, what: str, probe: Callable[[], CpuBf16] | None = None
) -> tuple[Literal["fp32", "bf16"], str]:
    """``(precision, why)`` on a CPU for ``setting`` = auto | fp32 | bf16, for ``what`` (the option's
    name, for the message): auto is bf16 where the CPU has native bf16 and fp32 elsewhere; an explicit
    bf16 on a CPU without it is kept, with one warning per option and process that names the cost."""
    if setting not in CPU_PRECISIONS:
        raise ConfigError(f"{what} {setting!r}: choose one of {', '.join(CPU_PRECISIONS)}")
    if setting == "fp32":
        return "fp32", f"{what}=fp32"
    found = (probe or cpu_bf16)()
    if setting == "auto":
        return ("bf16" if found.native else "fp32"), f"{what}=auto: {found.why}"
    if not found.native:
        warn_emulated(what, found.why)
    return "bf16", f"{what}=bf16 ({found.why})"


def resolve_precision_for(setting: str, device: str, what: str) -> tuple[Literal["fp32", "bf16"], str]:
    """An inference option's precision (teacher stage, eval, report) on ``device``: the CPU rule above on
    a CPU; on a GPU ``auto`` is fp32 here (the stage's own GPU precision applies) and bf16, CPU autocast,
    is refused."""
    if device.startswith("cpu"):
        return resolve_cpu_precision(setting, what)
    if setting not in CPU_PRECISIONS:
        raise ConfigError(f"{what} {setting!r}: choose one of {', '.join(CPU_PRECISIONS)}")
    if setting == "bf16":
        raise ConfigError(f"{what}=bf16 is CPU autocast; on {device} use auto or fp32")
    return "fp32", f"{what}={setting} on {device}"


@functools.cache
def warn_emulated(what: str, why: str) -> None:
    """The warning for an explicit bf16 on a CPU without native bf16, once per option and process."""
    log.warning(
        '%s=bf16 on a CPU with %s: %s (docs/BENCHMARKS.md, "CPU precision"); auto picks fp32 here',
        what, why, EMULATED_COST,
    )  # fmt: skip


def main() -> None:
    """``python -m pipeline.precision``: one line, ``native WHY`` or ``emulated WHY``, for shell scripts
    that choose from the machine (launch/run_sample.sh's reference evaluations)."""
    import sys

    try:
        found = cpu_bf16()
    except ConfigError as e:
        sys.exit(f"precision: {e}")
    print(f"{'native' if found.native else 'emulated'} {found.why}")


if __name__ == "__main__":
    main()
