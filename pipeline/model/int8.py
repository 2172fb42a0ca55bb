"""Dynamic int8 inference on a CPU, for encoding a corpus with a teacher (``teacher --precision int8``).

No default chooses it: on a CPU without native bf16 it encodes faster than fp32, but a student distilled
from its vectors scored a little lower than from bf16 ones (docs/BENCHMARKS.md, "CPU precision").

torch's dynamic quantisation (``torch.ao.quantization.quantize_dynamic``): each chosen ``nn.Linear`` keeps
int8 weights, one scale per output channel, and quantises its input per batch to 7-bit unsigned codes
(torch's ``reduce_range`` for x86, so that the 16-bit pair sums of FBGEMM's AVX2 kernels cannot saturate);
the products accumulate in int32 and come out in float32. On multilingual-e5-small the vectors computed
with FBGEMM held to AVX2 (``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``) equal those of its AVX-512 kernels bit for
bit (400 sentences), so a teacher set does not depend on the CPU that encoded it.

Every linear layer is quantised except those that narrow their input (``out_features < in_features``):
in a transformer those are the feed-forward blocks' second layers, whose inputs, the activations after
GELU, carry outliers that 8 bits per tensor do not hold: on multilingual-e5-small the vectors' cosine to
fp32 is about 0.9965 with this rule and 0.989 with every layer quantised (docs/BENCHMARKS.md, "CPU
precision", with the speed).

torch 2.13 deprecates this eager-mode API in favour of torchao and says so on every call; the pinned torch
runs it, and :func:`quantize_int8` keeps those notices off the screen.
"""

from __future__ import annotations

import warnings

from torch import nn


def int8_layers(module: nn.Module) -> list[str]:
    """The names of the linear layers :func:`quantize_int8` quantises: all but those that narrow."""
    return [
        name
        for name, layer in module.named_modules()
        if isinstance(layer, nn.Linear) and layer.out_features >= layer.in_features
    ]


def quantize_int8(module: nn.Module) -> tuple[nn.Module, int]:
    """``module`` with the layers of :func:`int8_layers` replaced by dynamic int8 ones (in place, also
    returned), and their number. For inference on a CPU only: the new layers have no gradients."""
    import torch

    names = int8_layers(module)
    if names:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated")
            warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_channel")
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

            spec = {name: per_channel_dynamic_qconfig for name in names}
            module = quantize_dynamic(module, spec, dtype=torch.qint8, inplace=True)
    return module, len(names)
