"""Small tensor helpers shared by the loss tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unit(*shape, seed=0):
    """Random float64 rows of unit length."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


def leaf(x):
    return x.clone().requires_grad_(True)
