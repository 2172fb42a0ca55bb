"""The one numeric rule the losses share: similarities are computed in at least float32."""

from __future__ import annotations

import torch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 if it is half precision, else unchanged (float64 stays float64).

    At temperature 0.05 logits span [-20, 20]; bf16 keeps ~3 significant digits, too few to tell
    close negatives apart in the softmax.
    """
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
