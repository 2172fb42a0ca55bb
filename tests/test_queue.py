"""The negative queue (FIFO, wraparound, state) and the momentum encoder (EMA math, state, dropout, the
in-place update against the old out-of-place formula)."""

from collections import deque

import pytest
import torch
from torch import nn

from pipeline.errors import ConfigError
from pipeline.losses.queue import UNKNOWN, MomentumEncoder, NegativeQueue, needs_forward, validate_queue_size


def rows(start: int, count: int, dim: int = 3) -> torch.Tensor:
    """Rows whose first entry is a running id, so the queue's contents are easy to read."""
    ids = torch.arange(start, start + count, dtype=torch.float32)
    return ids[:, None] + torch.zeros(count, dim)


def ids(queue: NegativeQueue) -> list[int]:
    return sorted(int(v) for v in queue.negatives()[:, 0])


# -------------------------------------------------------------------------------------------- queue
def test_queue_fills_then_wraps_like_a_fifo():
    queue = NegativeQueue(size=5, dim=3)
    reference: deque[int] = deque(maxlen=5)
    assert queue.negatives().shape == (0, 3) and queue.fill == 0 and not queue.is_full
    next_id = 0
    for count in [2, 2, 3, 1, 4, 5, 2]:
        queue.enqueue(rows(next_id, count))
        reference.extend(range(next_id, next_id + count))
        next_id += count
        assert ids(queue) == sorted(reference)
        assert queue.fill == len(reference) == int(queue.filled)
        assert int(queue.ptr) == next_id % 5
    assert queue.is_full and queue.fill_fraction == 1.0


def test_queue_batch_larger_than_queue_keeps_the_newest_rows_in_ring_order():
    one_by_one, at_once = NegativeQueue(4, 3), NegativeQueue(4, 3)
    one_by_one.enqueue(rows(0, 1))
    at_once.enqueue(rows(0, 1))
    for i in range(1, 11):
        one_by_one.enqueue(rows(i, 1))
    at_once.enqueue(rows(1, 10))
    assert ids(at_once) == [7, 8, 9, 10]
    torch.testing.assert_close(at_once.keys, one_by_one.keys)  # same slots, not only the same set
    assert int(at_once.ptr) == int(one_by_one.ptr) == 11 % 4


def test_queue_negatives_are_detached_copies():
    queue = NegativeQueue(4, 3)
    keys = rows(0, 2).requires_grad_(True)
    queue.enqueue(keys)
    negatives = queue.negatives()
    assert not negatives.requires_grad
    queue.enqueue(rows(10, 4))  # overwrite: a copy taken earlier must not change
    assert sorted(negatives[:, 0].tolist()) == [0.0, 1.0]


def test_queue_casts_keys_and_rejects_wrong_width():
    queue = NegativeQueue(4, 3)
    queue.enqueue(rows(0, 2).to(torch.bfloat16))
    assert queue.negatives().dtype == torch.float32
    with pytest.raises(ValueError, match=r"\(N, 3\)"):
        queue.enqueue(torch.zeros(2, 5))


def test_queue_state_round_trip_is_exact(tmp_path):
    queue = NegativeQueue(6, 3)
    queue.enqueue(torch.randn(4, 3))
    queue.enqueue(torch.randn(4, 3))
    torch.save(queue.state_dict(), tmp_path / "q.pt")
    restored = NegativeQueue(6, 3)
    restored.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    assert (restored.fill, int(restored.ptr)) == (queue.fill, int(queue.ptr)) == (6, 2)
    torch.testing.assert_close(restored.negatives(), queue.negatives())
    more = torch.randn(3, 3)
    queue.enqueue(more)
    restored.enqueue(more)  # the Python-side pointer was restored too
    torch.testing.assert_close(restored.keys, queue.keys)


def test_queue_state_inside_a_parent_module_and_size_mismatch():
    parent = nn.Module()
    parent.queue = NegativeQueue(4, 3)
    parent.queue.enqueue(rows(0, 3))
    state = parent.state_dict()
    assert set(state) == {"queue.keys", "queue.ids", "queue.text_hashes", "queue.ptr", "queue.filled"}
    other = nn.Module()
    other.queue = NegativeQueue(4, 3)
    other.load_state_dict(state)
    assert other.queue.fill == 3 and ids(other.queue) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="size mismatch"):
        NegativeQueue(8, 3).load_state_dict(parent.queue.state_dict())


def test_queue_moves_with_to():
    queue = NegativeQueue(4, 3).to(torch.float64)
    assert queue.keys.dtype == torch.float64 and queue.ptr.dtype == torch.long


@pytest.mark.parametrize("size,batch", [(0, 64), (64, 64), (256, 64), (4096, 512)])
def test_validate_queue_size_accepts(size, batch):
    validate_queue_size(size, batch)


@pytest.mark.parametrize(
    "size,batch,hint", [(32, 64, "e.g. 64"), (100, 64, "e.g. 64 or 128"), (-1, 8, ">= 0")]
)
def test_validate_queue_size_rejects_with_a_fix(size, batch, hint):
    with pytest.raises(ConfigError, match=hint):
        validate_queue_size(size, batch)


# ---------------------------------------------------------------------------------- momentum encoder
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)  # has buffers (running stats) to be copied, not averaged
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.norm(self.linear(x)))


def test_momentum_update_is_an_ema_of_parameters_and_copies_buffers():
    torch.manual_seed(0)
    online = Tiny()
    momentum = MomentumEncoder(online)
    assert all(not p.requires_grad for p in momentum.parameters())
    start = {n: p.clone() for n, p in momentum.encoder.named_parameters()}
    with torch.no_grad():
        for p in online.parameters():
            p.add_(torch.randn_like(p))
        online.norm.running_mean.fill_(3.0)
        online.norm.num_batches_tracked.fill_(7)
    momentum.update(online, 0.9)
    for name, p in online.named_parameters():
        torch.testing.assert_close(momentum.encoder.get_parameter(name), 0.9 * start[name] + 0.1 * p.detach())
    torch.testing.assert_close(momentum.encoder.norm.running_mean, torch.full((3,), 3.0))
    assert int(momentum.encoder.norm.num_batches_tracked) == 7
    assert all(p.requires_grad for p in online.parameters())  # the online model is untouched


def test_momentum_zero_copies_and_one_freezes():
    torch.manual_seed(0)
    online = Tiny()
    momentum = MomentumEncoder(online)
    frozen = {n: p.clone() for n, p in momentum.encoder.named_parameters()}
    with torch.no_grad():
        for p in online.parameters():
            p.mul_(-2.0).add_(0.123)
    momentum.update(online, 1.0)
    for name, p in momentum.encoder.named_parameters():
        assert torch.equal(p, frozen[name])
    momentum.update(online, 0.0)
    for name, p in online.named_parameters():
        assert torch.equal(momentum.encoder.get_parameter(name), p.detach())
    assert needs_forward(0.999) and not needs_forward(0.0)


def test_momentum_update_unwraps_ddp_style_wrappers_and_rejects_other_models():
    online = Tiny()
    momentum = MomentumEncoder(online)
    wrapper = nn.Module()
    wrapper.module = online  # what DDP / accelerate wrappers look like
    momentum.update(wrapper, 0.5)
    with pytest.raises(ValueError, match="does not match"):
        momentum.update(nn.Linear(4, 3), 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        momentum.update(online, 1.5)


def test_momentum_encode_has_no_grad_and_dropout_follows_the_flag():
    torch.manual_seed(0)
    online = Tiny()
    x = torch.randn(16, 4)
    with_dropout = MomentumEncoder(online)
    with_dropout.eval()  # the trainer's train()/eval() calls must not change the key encoder's mode
    a, b = with_dropout.encode(x=x), with_dropout.encode(x=x)
    assert not a.requires_grad and not torch.equal(a, b)
    without = MomentumEncoder(online, dropout=False).train()
    c, d = without.encode(x=x), without.encode(x=x)
    assert torch.equal(c, d)
    torch.testing.assert_close(c, online.eval()(x))


def test_momentum_state_round_trip(tmp_path):
    torch.manual_seed(0)
    online = Tiny()
    momentum = MomentumEncoder(online)
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    momentum.update(online, 0.7)
    torch.save(momentum.state_dict(), tmp_path / "m.pt")
    restored = MomentumEncoder(Tiny())
    restored.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    for (name, p), (_, q) in zip(momentum.state_dict().items(), restored.state_dict().items()):
        assert torch.equal(p, q), name


def test_momentum_encoder_wraps_a_sentence_encoder(tmp_path):
    from pipeline.model import (
        SentenceEncoder,
        build_char_vocab,
        build_scratch_backbone,
        make_tokenizer,
        write_vocab,
    )

    texts = ["今天天气很好", "我们去公园散步", "天气预报说明天下雨"]
    write_vocab(build_char_vocab(texts, min_count=1), tmp_path / "vocab.txt")
    tokenizer = make_tokenizer(tmp_path / "vocab.txt")
    config = {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 32,
    }
    backbone = build_scratch_backbone(config, tokenizer.vocab_size, seed=0)
    online = SentenceEncoder(backbone, tokenizer, pooling="mean", max_length=16)
    momentum = MomentumEncoder(online, dropout=False)
    batch = online.tokenize(texts)
    keys = momentum.encode(**batch)
    assert keys.shape == (3, 16) and not keys.requires_grad
    torch.testing.assert_close(keys.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(keys, online.eval()(**batch))


def test_queue_keeps_ids_and_text_hashes_row_for_row_and_resumes_them_exactly(tmp_path):
    queue = NegativeQueue(4, 3)
    queue.enqueue(rows(0, 3), torch.tensor([10, 11, 12]), torch.tensor([-5, -6, -7]))
    queue.enqueue(rows(3, 3), torch.tensor([13, 14, 2**63 - 1]))  # no hashes given: unknown
    # the oldest two rows were overwritten: keys 2..5 with their ids, in the keys' order
    order = queue.negatives()[:, 0].long()
    assert dict(zip(order.tolist(), queue.negative_ids().tolist())) == {2: 12, 3: 13, 4: 14, 5: 2**63 - 1}
    hashes = dict(zip(order.tolist(), queue.negative_text_hashes().tolist()))
    assert hashes == {2: -7, 3: UNKNOWN, 4: UNKNOWN, 5: UNKNOWN}
    torch.save(queue.state_dict(), tmp_path / "q.pt")
    restored = NegativeQueue(4, 3)
    restored.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    for a, b in zip(queue.state_dict().values(), restored.state_dict().values()):
        assert torch.equal(a, b)
    for q in (queue, restored):  # the pointer and the ids continue alike
        q.enqueue(rows(6, 1), torch.tensor([16]), torch.tensor([60]))
    assert torch.equal(queue.ids, restored.ids) and torch.equal(queue.text_hashes, restored.text_hashes)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        queue.enqueue(rows(0, 2), torch.tensor([1, 2, 3]))


def test_queue_from_a_checkpoint_without_ids_marks_its_rows_unknown():
    queue = NegativeQueue(4, 3)
    queue.enqueue(rows(0, 2), torch.tensor([1, 2]))
    old = {k: v for k, v in queue.state_dict().items() if k in ("keys", "ptr", "filled")}
    restored = NegativeQueue(4, 3)
    restored.load_state_dict(old)
    assert restored.negative_ids().tolist() == [UNKNOWN, UNKNOWN] and restored.fill == 2
    torch.testing.assert_close(restored.negatives(), queue.negatives())


def test_the_packed_enqueue_gather_keeps_every_bit():
    """Keys, ids and text hashes travel in one packed all_gather (bytes): -0.0, subnormals and the extreme
    int64 tags arrive as they left."""
    keys = torch.tensor([[-0.0, 1e-40, float("inf")], [3.5, -2.0, 1 / 3]])
    ids = torch.tensor([2**63 - 1, -(2**63)])
    hashes = torch.tensor([-1, 7])
    packed, plain = NegativeQueue(4, 3), NegativeQueue(4, 3)
    packed.enqueue_gathered(keys, ids, hashes)
    plain.enqueue(keys, ids, hashes)
    for a, b in zip(packed.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b)  # fmt: skip
    only_keys = NegativeQueue(4, 3)
    only_keys.enqueue_gathered(keys)
    assert torch.equal(only_keys.keys.view(torch.uint8), plain.keys.view(torch.uint8))


def _old_update(copy: nn.Module, online: nn.Module, momentum: float, apply: torch.Tensor | None) -> None:
    """The momentum update as it was before it ran in place: an out-of-place lerp kept with torch.where."""
    with torch.no_grad():
        ours, theirs = dict(copy.named_parameters()), dict(online.named_parameters())
        targets = list(ours.values())
        sources = [theirs[n].detach().to(p.dtype) for n, p in ours.items()]
        if apply is None:
            torch._foreach_lerp_(targets, sources, 1.0 - momentum)
        else:
            for target, new in zip(targets, torch._foreach_lerp(targets, sources, 1.0 - momentum)):
                target.copy_(torch.where(apply, new, target))
        their_buffers = dict(online.named_buffers())
        for name, buffer in copy.named_buffers():
            buffer.copy_(their_buffers[name])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("deferred", [False, True])
def test_in_place_momentum_update_is_bit_equal_to_the_old_formula(deferred):
    """Several updates (the device verdict applied and refused in turn when deferred) leave every parameter
    and buffer with the bits of the old out-of-place formula, including -0.0 and subnormal entries; a refused
    update changes nothing."""
    torch.manual_seed(0)
    online = Tiny()
    with torch.no_grad():
        online.linear.weight[0, :2] = torch.tensor([-0.0, 1e-40])
    new, old = MomentumEncoder(online), MomentumEncoder(online)
    verdicts = [True, False, True, True, False, False, True] if deferred else [None] * 7
    for step, verdict in enumerate(verdicts):
        with torch.no_grad():  # the optimizer moves the online model only on applied steps
            if verdict is not False:
                for p in online.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            online.norm.running_mean.fill_(float(step))
        apply = None if verdict is None else torch.tensor(verdict)
        before = {n: p.clone() for n, p in new.encoder.named_parameters()}
        new.update(online, 0.9, apply)
        _old_update(old.encoder, online, 0.9, apply)
        for (name, a), (_, b) in zip(new.state_dict().items(), old.state_dict().items()):
            assert torch.equal(a, b), (step, name)
            if verdict is not False:  # applied: the very same bits
                assert torch.equal(_bits(a), _bits(b)), (step, name)
        if verdict is False:
            for name, p in new.encoder.named_parameters():
                assert torch.equal(p, before[name])
    assert not torch.equal(new.encoder.linear.weight, online.linear.weight)  # it averaged, not copied
