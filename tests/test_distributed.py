"""The distributed helpers without a process group: one rank, identities, no collectives."""

import torch

from pipeline import distributed


def test_single_process_rank_helpers():
    assert not distributed.is_dist()
    assert distributed.world_size() == 1
    assert distributed.rank() == 0
    assert distributed.is_main_process()
    distributed.barrier()  # must not need a process group


def test_gathers_are_identities_and_keep_or_drop_grad():
    x = torch.randn(3, 4, requires_grad=True)
    gathered = distributed.all_gather_with_grad(x)
    assert gathered is x
    (2 * gathered).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 4), 2.0))
    no_grad = distributed.all_gather_no_grad(x)
    assert not no_grad.requires_grad
    torch.testing.assert_close(no_grad, x.detach())


def test_reductions_return_new_detached_tensors():
    x = torch.tensor([1.0, 3.0], requires_grad=True)
    total = distributed.all_reduce_sum(x)
    mean = distributed.all_reduce_mean(x)
    torch.testing.assert_close(total, x.detach())
    torch.testing.assert_close(mean, x.detach())
    total.add_(1)  # must not write through to the input
    torch.testing.assert_close(x.detach(), torch.tensor([1.0, 3.0]))
    assert not mean.requires_grad
    assert distributed.all_reduce_mean(torch.tensor([3, 4])).dtype == torch.float64


def test_broadcast_object_returns_the_object():
    obj = {"run_dir": "runs/x", "seed": 3}
    assert distributed.broadcast_object(obj) is obj
