"""The pairs term across two real gloo processes: cross-device negatives and group / text masking across
ranks give the single-process loss over the concatenated batch (mean over ranks) and its gradients (per
rank, divided by the world size as DDP averages)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _gloo import spawn_ranks

from pipeline.losses.pairs import compute_loss

pytestmark = pytest.mark.slow
WORLD, B, H, TAU = 2, 3, 8, 0.1


def global_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    unit = lambda: F.normalize(torch.randn(WORLD * B, H, generator=g, dtype=torch.float64), dim=-1)  # noqa: E731
    return {
        "anchor": unit(),
        "positive": unit(),
        "groups": torch.tensor([1, 2, 3, 2, 5, 6]),  # group 2 on both ranks: masked across devices
        "anchor_hashes": torch.tensor([10, 11, 12, 13, 14, 15]),
        "positive_hashes": torch.tensor([20, 21, 22, 23, 20, 25]),  # pair 4's positive = pair 0's text
    }


CASES = {
    "symmetric": dict(symmetric=True),
    "one_direction": dict(symmetric=False),
}


def run_case(x: dict[str, torch.Tensor], gather: bool, counts: dict | None = None, **options) -> torch.Tensor:
    return compute_loss(x["anchor"], x["positive"], TAU, gather=gather, groups=x["groups"],
                        anchor_hashes=x["anchor_hashes"], positive_hashes=x["positive_hashes"],
                        counts=counts, **options)  # fmt: skip


def _body(rank: int) -> dict:
    out = {}
    for case, options in CASES.items():
        local = {k: v[rank * B : (rank + 1) * B].clone() for k, v in global_inputs().items()}
        for k in ("anchor", "positive"):
            local[k].requires_grad_(True)
        counts: dict = {}
        loss = run_case(local, True, counts, **options)
        loss.backward()
        out[case] = {"loss": loss.detach(), "count": counts["false_negatives"],
                     "grads": {k: local[k].grad / WORLD for k in ("anchor", "positive")}}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(tmp_path_factory, "pairs_gloo", _body, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_gathered_pairs_loss_equals_single_process(ranks, case):
    full = {k: v.clone() for k, v in global_inputs().items()}
    for k in ("anchor", "positive"):
        full[k].requires_grad_(True)
    counts: dict = {}
    loss = run_case(full, False, counts, **CASES[case])
    loss.backward()
    torch.testing.assert_close(torch.stack([r[case]["loss"] for r in ranks]).mean(), loss.detach())
    assert sum(r[case]["count"] for r in ranks) == counts["false_negatives"] > 0
    for k in ("anchor", "positive"):
        torch.testing.assert_close(torch.cat([r[case]["grads"][k] for r in ranks]), full[k].grad)
