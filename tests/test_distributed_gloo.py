"""Two real gloo processes against one process: gathered and queued losses, DDP gradients, the queue.

One module-scoped spawn runs every distributed check (process start-up dominates the cost) and saves
what each rank saw; the tests below compare it with a plain single-process computation over the
concatenated batch. Per-rank gradients are divided by the world size, which is what DDP's gradient
averaging does, so they must equal the gradient of the single-process loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _gloo import spawn_ranks

from pipeline import distributed
from pipeline.losses import cosent, kl, multi_positive, pairwise_bce, simcse, sup_simcse
from pipeline.losses.false_negatives import Guide
from pipeline.losses.queue import NegativeQueue

pytestmark = pytest.mark.slow

WORLD = 2
B = 3  # local batch
H = 8
N_VIEWS = 3
TAU = 0.1


def global_inputs() -> dict[str, torch.Tensor]:
    """The global batch, identical in every process (fixed seed); rank r takes rows [r*B, (r+1)*B)."""
    g = torch.Generator().manual_seed(1234)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)

    return {
        "views": unit(N_VIEWS, WORLD * B, H),
        "queue": unit(5, H),
        "anchor": unit(WORLD * B, H),
        "positive": unit(WORLD * B, H),
        "negative": unit(WORLD * B, H),
        "u": torch.randn(WORLD * B, H, generator=g, dtype=torch.float64),
        "v": torch.randn(WORLD * B, H, generator=g, dtype=torch.float64),
        "labels": torch.tensor([0.0, 3.0, 1.0, 5.0, 3.0, 2.0], dtype=torch.float64),
        "features": torch.randn(N_VIEWS, WORLD * B, 6, generator=g),
        "teacher": unit(WORLD * B, 5),  # a wider teacher (D_t = 5 != H) for the KL term
        "teacher_same": unit(WORLD * B, H),  # an equal-width teacher for the teacher positive
        "teacher_queue": unit(5, 5),
        "hard": unit(2, WORLD * B, H),  # m = 2 hard negatives per sentence
        # sentence ids: 1 and 2 on both ranks (false negatives across ranks); 3, 9 and 1 also queued
        "ids": torch.tensor([1, 2, 3, 2, 9, 1]),
        "queue_ids": torch.tensor([3, 5, 9, 7, 1]),
    }


def guide(x: dict[str, torch.Tensor], margin: float | None = None) -> Guide:
    """Mask by sentence id (and with a margin by the teacher_same vectors) for the false-negative cases."""
    teacher = x["teacher_same"] if margin is not None else None
    return Guide(x["ids"][:, None], x["queue_ids"][:, None], teacher=teacher, teacher_margin=margin)


def queue_keys(step: int, rank: int) -> torch.Tensor:
    """Distinct keys per (step, rank): row values encode where they came from."""
    base = 100 * step + 10 * rank
    return torch.arange(base, base + 2 * H, dtype=torch.float32).reshape(2, H)


def queue_ids(step: int, rank: int) -> torch.Tensor:
    """The sentence ids of queue_keys(step, rank)."""
    return torch.tensor([100 * step + 10 * rank, 100 * step + 10 * rank + 1])


def tiny_encoder() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, H))


# Loss name -> (function of the global inputs with gather on/off, names of the per-sample inputs).
CASES = {
    "luse": (lambda x, gather: multi_positive.compute_loss(x["views"], TAU, gather=gather), ["views"]),
    "luse_queue": (
        lambda x, gather: multi_positive.compute_loss(x["views"], TAU, queue=x["queue"], gather=gather),
        ["views"],
    ),
    "simcse": (lambda x, gather: simcse.compute_loss(x["views"][:2], TAU, gather=gather), ["views"]),
    "luse_bce": (lambda x, gather: pairwise_bce.compute_loss(x["views"], gather=gather), ["views"]),
    "sup_simcse": (
        lambda x, gather: sup_simcse.compute_loss(
            x["anchor"], x["positive"], x["negative"], TAU, gather=gather
        ),
        ["anchor", "positive", "negative"],
    ),
    "cosent": (lambda x, gather: cosent.compute_loss(x["u"], x["v"], x["labels"], gather=gather), ["u", "v"]),
    "kl_queue": (
        lambda x, gather: kl.kl_loss(
            x["views"][0], x["teacher"], 0.07, TAU, x["queue"], x["teacher_queue"], gather=gather
        ),
        ["views"],
    ),
    "luse_teacher_hard": (
        lambda x, gather: multi_positive.compute_loss(
            x["views"],
            TAU,
            queue=x["queue"],
            gather=gather,
            teacher=x["teacher_same"],
            hard_negatives=x["hard"],
        ),
        ["views", "hard"],
    ),
    "luse_false_negatives": (
        lambda x, gather: multi_positive.compute_loss(
            x["views"], TAU, queue=x["queue"], gather=gather, teacher=x["teacher_same"], guide=guide(x, 1.0)
        ),
        ["views"],
    ),
    "luse_bce_false_negatives": (
        lambda x, gather: pairwise_bce.compute_loss(x["views"], gather=gather, guide=guide(x, 1.0)),
        ["views"],
    ),
}


def local_slice(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a per-sample input (dim 1 for view stacks, dim 0 otherwise)."""
    if name in ("views", "features", "hard"):
        return tensor[:, rank * B : (rank + 1) * B]
    if name in ("queue", "teacher_queue", "queue_ids"):
        return tensor  # identical on every rank
    return tensor[rank * B : (rank + 1) * B]


def _body(rank: int) -> dict:
    out: dict[str, object] = {
        "rank": distributed.rank(),
        "world": distributed.world_size(),
        "main": distributed.is_main_process(),
    }
    everything = global_inputs()

    # gathers and reductions
    x = torch.full((2, 3), float(rank + 1))
    out["gather_no_grad"] = distributed.all_gather_no_grad(x)
    out["reduce_sum"] = distributed.all_reduce_sum(torch.tensor([rank + 1.0]))
    out["reduce_mean"] = distributed.all_reduce_mean(torch.tensor([rank + 1.0]))
    out["broadcast"] = distributed.broadcast_object({"run": "abc"} if rank == 0 else None)
    leaf = torch.full((2,), float(rank + 1), requires_grad=True)
    gathered = distributed.all_gather_with_grad(leaf)
    out["gather_with_grad"] = gathered.detach()
    # loss_r = sum_i (i+1) * (r+1) * gathered_i: d(sum_r loss_r)/d leaf_r = sum_r (r+1) * weight
    weights = torch.arange(1.0, 1.0 + gathered.numel())
    ((rank + 1) * (weights * gathered).sum()).backward()
    out["gather_grad"] = leaf.grad
    distributed.barrier()

    # every loss: per-rank value and the local-input gradients
    for case, (fn, sample_inputs) in CASES.items():
        local = {k: local_slice(k, v, rank).clone() for k, v in everything.items()}
        for k in sample_inputs:
            local[k].requires_grad_(True)
        loss = fn(local, True)
        loss.backward()
        out[f"{case}/loss"] = loss.detach()
        out[f"{case}/grads"] = {k: local[k].grad / WORLD for k in sample_inputs}

    # a real DDP model under the gathered, queued loss
    model = torch.nn.parallel.DistributedDataParallel(tiny_encoder())
    features = local_slice("features", everything["features"], rank)
    embeddings = F.normalize(model(features), dim=-1)  # (n, B, H)
    loss = multi_positive.compute_loss(embeddings, TAU, queue=everything["queue"].float())
    loss.backward()
    out["ddp/loss"] = loss.detach()
    out["ddp/grads"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}

    # the queue: identical on every rank after gathered enqueues, wrapping around
    queue = NegativeQueue(size=6, dim=H)
    for step in range(4):
        queue.enqueue_gathered(queue_keys(step, rank), queue_ids(step, rank), -queue_ids(step, rank))
    out["queue"] = queue.state_dict()

    # the packed enqueue gather (keys, ids and hashes as bytes, one collective) against one gather each
    packed, separate = NegativeQueue(size=8, dim=H), NegativeQueue(size=8, dim=H)
    keys, ids = edge_keys(rank), queue_ids(0, rank) * (-1) ** rank
    hashes = torch.tensor([2**63 - 1 if rank == 0 else -(2**63), rank])  # (2,) int64, one per key
    packed.enqueue_gathered(keys, ids, hashes)
    gathered = [distributed.all_gather_no_grad(t) for t in (keys, ids, hashes)]  # three collectives
    separate.enqueue(*gathered)
    out["packed"], out["separate"] = packed.state_dict(), separate.state_dict()
    return out


def edge_keys(rank: int) -> torch.Tensor:
    """(2, H) float32 keys with -0.0, a subnormal, inf and NaN among them, different on each rank."""
    keys = queue_keys(0, rank).clone()
    keys[0, :4] = torch.tensor([-0.0, 1e-40, float("inf"), float("nan")])
    return keys


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(tmp_path_factory, "gloo", _body, WORLD)


def test_rank_helpers(ranks):
    assert [(r["rank"], r["world"], r["main"]) for r in ranks] == [(0, 2, True), (1, 2, False)]


def test_gathers_and_reductions(ranks):
    expected = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
    for r in ranks:
        torch.testing.assert_close(r["gather_no_grad"], expected)
        torch.testing.assert_close(r["gather_with_grad"], torch.tensor([1.0, 1.0, 2.0, 2.0]))
        torch.testing.assert_close(r["reduce_sum"], torch.tensor([3.0]))
        torch.testing.assert_close(r["reduce_mean"], torch.tensor([1.5]))
        assert r["broadcast"] == {"run": "abc"}
    # sum over ranks of (r + 1) * weight = 3 * weight, each rank keeps its own slice of weights
    torch.testing.assert_close(ranks[0]["gather_grad"], torch.tensor([3.0, 6.0]))
    torch.testing.assert_close(ranks[1]["gather_grad"], torch.tensor([9.0, 12.0]))


@pytest.mark.parametrize("case", list(CASES))
def test_gathered_loss_equals_single_process(ranks, case):
    fn, sample_inputs = CASES[case]
    full = {k: v.clone() for k, v in global_inputs().items()}
    for k in sample_inputs:
        full[k].requires_grad_(True)
    loss = fn(full, False)
    loss.backward()
    mean_over_ranks = torch.stack([r[f"{case}/loss"] for r in ranks]).mean()
    torch.testing.assert_close(mean_over_ranks, loss.detach())
    for k in sample_inputs:
        per_rank = [r[f"{case}/grads"][k] for r in ranks]
        dim = 1 if k in ("views", "hard") else 0
        torch.testing.assert_close(torch.cat(per_rank, dim=dim), full[k].grad)


def test_ddp_gradients_equal_single_process(ranks):
    model = tiny_encoder()
    features = global_inputs()["features"]
    queue = global_inputs()["queue"].float()
    loss = multi_positive.compute_loss(F.normalize(model(features), dim=-1), TAU, queue=queue, gather=False)
    loss.backward()
    torch.testing.assert_close(torch.stack([r["ddp/loss"] for r in ranks]).mean(), loss.detach())
    for name, param in model.named_parameters():
        for r in ranks:  # DDP leaves the same averaged gradient on every rank
            torch.testing.assert_close(r["ddp/grads"][name], param.grad, rtol=1e-5, atol=1e-6)


def test_queue_identical_across_ranks_and_equal_to_single_process(ranks):
    for key in ("keys", "ids", "text_hashes", "ptr", "filled"):
        torch.testing.assert_close(ranks[0]["queue"][key], ranks[1]["queue"][key])
    single = NegativeQueue(size=6, dim=H)
    for step in range(4):
        ids = torch.cat([queue_ids(step, r) for r in range(WORLD)])
        single.enqueue(torch.cat([queue_keys(step, r) for r in range(WORLD)]), ids, -ids)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ranks[0]["queue"][key], value)
    assert int(ranks[0]["queue"]["filled"]) == 6 and int(ranks[0]["queue"]["ptr"]) == (4 * 4) % 6
    assert sorted(ranks[0]["queue"]["ids"].tolist()) == [210, 211, 300, 301, 310, 311]


def test_packed_enqueue_gather_equals_one_gather_per_tensor_bit_for_bit(ranks):
    """One all_gather of the packed bytes fills the queue with the very bits three gathers give (keys
    with -0.0, subnormals, inf and NaN; extreme int64 ids and hashes), identically on both ranks."""
    for r in ranks:
        assert r["packed"].keys() == r["separate"].keys()
        for key, value in r["packed"].items():
            other = r["separate"][key]
            if value.is_floating_point():
                value, other = value.view(torch.int32), other.view(torch.int32)
            assert torch.equal(value, other), key
        assert torch.equal(
            r["packed"]["keys"].view(torch.int32), ranks[0]["packed"]["keys"].view(torch.int32)
        )
    assert int(ranks[0]["packed"]["filled"]) == WORLD * 2
    assert ranks[0]["packed"]["text_hashes"][[0, 2]].tolist() == [2**63 - 1, -(2**63)]
