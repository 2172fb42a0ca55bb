"""The matryoshka term over two real gloo processes equals one process over the concatenated batch, in
value (mean over ranks) and in gradient (per-rank gradients / world size, as DDP averages them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _gloo import spawn_ranks
from _terms import evaluate

from pipeline.losses import build_loss

pytestmark = pytest.mark.slow

WORLD, B, H = 2, 3, 8

# case -> the run's loss list; the matryoshka term's value is compared
CASES = {
    "luse_queue": [
        {"luse": {"temperature": 0.1, "queue_size": 5}},
        {"matryoshka": {"dims": [6, 3], "weights": [1.0, 0.5]}},
    ],
    "distill": [{"distill": {}}, {"matryoshka": {"dims": [8, 4, 2], "temperature": 0.1}}],
    "kl_queue": [
        {"kl": {"teacher_temperature": 0.05, "student_temperature": 0.1}},
        {"matryoshka": {"dims": [4], "of": ["kl"]}},
    ],
    "cosent": [{"cosent": {}}, {"matryoshka": {"dims": [5, 2]}}],
}


def global_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)

    return {
        "views": unit(3, WORLD * B, H),
        "teacher": unit(WORLD * B, H),  # equal widths: the full-width distill term needs no projection
        "queue": unit(5, H),
        "teacher_queue": unit(5, H),
        "labels": torch.tensor([0.0, 3.0, 1.0, 5.0, 3.0, 2.0], dtype=torch.float64),
    }


def step_inputs(case: str, x: dict[str, torch.Tensor], views: torch.Tensor, gather: bool) -> dict:
    if case == "cosent":
        return dict(views=views[:2], labels=x["labels"], gather=gather)
    queued = case.endswith("_queue")
    return dict(
        views=views if case == "luse_queue" else views[:1],
        teacher=x["teacher"],
        queue=x["queue"] if queued else None,
        teacher_queue=x["teacher_queue"] if case == "kl_queue" else None,
        gather=gather,
    )


def _body(rank: int) -> dict:
    everything = global_inputs()
    local = {
        "views": everything["views"][:, rank * B : (rank + 1) * B],
        "teacher": everything["teacher"][rank * B : (rank + 1) * B],
        "labels": everything["labels"][rank * B : (rank + 1) * B],
        "queue": everything["queue"],
        "teacher_queue": everything["teacher_queue"],
    }
    out = {}
    for case, entries in CASES.items():
        views = local["views"].clone().requires_grad_(True)
        value = evaluate(build_loss(entries), **step_inputs(case, local, views, True))["matryoshka"]
        value.backward()
        out[case] = (value.detach(), views.grad / WORLD)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(tmp_path_factory, "gloo_matryoshka", _body, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_matryoshka_over_two_ranks_equals_one_process(ranks, case):
    x = global_inputs()
    views = x["views"].clone().requires_grad_(True)
    value = evaluate(build_loss(CASES[case]), **step_inputs(case, x, views, False))["matryoshka"]
    value.backward()
    torch.testing.assert_close(torch.stack([r[case][0] for r in ranks]).mean(), value.detach())
    torch.testing.assert_close(torch.cat([r[case][1] for r in ranks], dim=1), views.grad)
    assert views.grad.abs().max() > 0
