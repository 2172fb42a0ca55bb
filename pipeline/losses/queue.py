"""The MoCo-style negative queue and the momentum (EMA) encoder that fills it.

Queue (He et al. 2020, "Momentum Contrast"): a FIFO of the last Q keys, used as extra negatives by
:mod:`pipeline.losses.multi_positive`. Keys are gathered from all ranks *before* they are enqueued,
so every rank holds the identical queue (``tests/test_distributed_gloo.py`` checks this).

While the queue fills. It starts empty, not with random vectors as MoCo's does (random unit vectors
are trivially easy negatives that only add a near-constant term to the denominator). For the first
Q / G steps (G keys enqueued per step) the loss sees fewer negatives than it will later: since a
softmax loss grows roughly like log(number of negatives), the loss *rises* while the queue fills
even as the model improves, and the gradient scale shifts with it. Compare loss curves only after
``is_full``; ``fill_fraction`` is logged for that. A trainer that wants a stable objective from
step 0 can hold the queue back until it is full (pass ``queue=None`` to the loss while
``not queue.is_full``) -- a queue warmup.

Q and the global batch. G = keys enqueued per step across all ranks (world size x local batch x
keys per sentence). Q must be >= G (otherwise one step's keys overwrite each other and the queue adds
fewer negatives than the batch already has) and a multiple of G, so the queue always holds exactly
Q / G whole past steps, each written in one contiguous block: :func:`validate_queue_size`.

Momentum encoder. Keys come from an EMA copy of the online encoder, k <- m k + (1 - m) q, updated
after each optimizer step; a high m (0.999) keeps keys from consecutive steps consistent with each
other. ``momentum = 0`` makes the copy equal to the online encoder, i.e. the queue becomes a plain
memory bank of detached online embeddings; the trainer then need not keep a copy or run a second
forward pass at all (:func:`needs_forward`) and enqueues the detached online embeddings instead.
Those keys grow stale as the model moves (the reason MoCo introduced the EMA), so a memory bank
works best with a small learning rate or a queue short compared with the drift.

Sentence ids and text hashes. Beside each key the queue keeps the 64-bit sentence id of the key's
sentence and the hash of its normalised text (:func:`pipeline.data.collate.text_hashes`), so that the
loss can drop a queued key of the anchor's own sentence, or of a duplicate of it, from its negatives
(``false_negatives`` in :mod:`pipeline.losses.false_negatives`). Both are buffers and resume exactly. A
checkpoint of an earlier version has neither: its rows get :data:`UNKNOWN`, which matches no real id or
hash except by a 1-in-2^64 chance.

Dropout in the momentum encoder: on by default (the copy runs in train mode), as MoCo runs its key
encoder in training mode. The online views the keys are compared with are themselves dropout views,
so keys from the same distribution do not stand out as systematically "cleaner" negatives. Pass
``dropout=False`` for eval-mode keys.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pipeline.distributed import all_gather_no_grad
from pipeline.errors import ConfigError

__all__ = ["UNKNOWN", "MomentumEncoder", "NegativeQueue", "needs_forward", "validate_queue_size"]

UNKNOWN = -(2**63)  # the id and text hash of a row restored from a checkpoint that did not store them


def validate_queue_size(queue_size: int, global_batch: int) -> None:
    """Raise ConfigError unless ``queue_size`` is 0 (no queue) or a multiple of ``global_batch``.

    ``global_batch`` is the number of keys enqueued per step across all ranks.
    """
    if global_batch < 1:
        raise ConfigError(f"global batch size must be >= 1, got {global_batch}")
    if queue_size < 0:
        raise ConfigError(f"queue size must be >= 0 (0 disables the queue), got {queue_size}")
    if queue_size == 0:
        return
    if queue_size < global_batch or queue_size % global_batch:
        lower = max(global_batch, queue_size // global_batch * global_batch)
        raise ConfigError(
            f"queue size {queue_size} must be a multiple of the global batch ({global_batch} keys per "
            f"step, all ranks) and at least that large; set the queue size to e.g. {lower} or "
            f"{lower + global_batch}, or 0 to disable the queue"
        )


class NegativeQueue(nn.Module):
    """A FIFO of ``size`` keys of width ``dim``, identical on every rank.

    The keys, their sentence ids and text hashes (int64, one per row), the write pointer and the fill
    count are buffers, so ``.to(device)`` moves them and ``state_dict`` / ``load_state_dict`` restore the
    queue exactly. The pointer and count are also
    mirrored as Python ints so that the training step never reads a device value back to the host.
    """

    keys: torch.Tensor
    ids: torch.Tensor
    text_hashes: torch.Tensor
    ptr: torch.Tensor
    filled: torch.Tensor

    def __init__(self, size: int, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        if size < 1 or dim < 1:
            raise ValueError(f"queue size and dim must be >= 1, got size={size}, dim={dim}")
        self.size = size
        self.dim = dim
        self.register_buffer("keys", torch.zeros(size, dim, dtype=dtype))
        self.register_buffer("ids", torch.full((size,), UNKNOWN, dtype=torch.long))
        self.register_buffer("text_hashes", torch.full((size,), UNKNOWN, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self._ptr = 0
        self._filled = 0
        # One host read per load, never per step.
        self.register_load_state_dict_post_hook(NegativeQueue._sync_counters)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A checkpoint of an earlier version stored keys only: its rows' ids and hashes are unknown.
        for name in ("ids", "text_hashes"):
            state_dict.setdefault(prefix + name, torch.full((self.size,), UNKNOWN, dtype=torch.long))
        super()._load_from_state_dict(state_dict, prefix, *args)

    @staticmethod
    def _sync_counters(module: NegativeQueue, incompatible_keys: Any) -> None:
        module._ptr = int(module.ptr)
        module._filled = int(module.filled)
        if not (0 <= module._ptr < module.size and 0 <= module._filled <= module.size):
            raise ValueError(f"queue state out of range: ptr={module._ptr}, filled={module._filled}")

    @property
    def fill(self) -> int:
        return self._filled

    @property
    def fill_fraction(self) -> float:
        return self._filled / self.size

    @property
    def is_full(self) -> bool:
        return self._filled == self.size

    def negatives(self) -> torch.Tensor:
        """The filled rows, (filled, dim), detached.

        A copy, not a view: the loss saves it for backward, and an enqueue before backward would
        otherwise modify a tensor autograd still needs.
        """
        return self.keys[: self._filled].detach().clone()  # (filled, dim)

    def negative_ids(self) -> torch.Tensor:
        """The sentence ids of the filled rows, (filled,) int64, row for row with :meth:`negatives`."""
        return self.ids[: self._filled].clone()  # (filled,)

    def negative_text_hashes(self) -> torch.Tensor:
        """The normalised-text hashes of the filled rows, (filled,) int64."""
        return self.text_hashes[: self._filled].clone()  # (filled,)

    @torch.no_grad()
    def enqueue(
        self,
        keys: torch.Tensor,
        ids: torch.Tensor | None = None,
        text_hashes: torch.Tensor | None = None,
        apply: torch.Tensor | None = None,
    ) -> None:
        """Append ``keys`` (N, dim), already gathered from all ranks, dropping the oldest rows; with them
        their sentence ids and text hashes (N,) int64 (left out: :data:`UNKNOWN`).

        If N exceeds the queue size only the newest ``size`` rows are kept, exactly as if the rows
        had been written one by one. ``apply``: a () bool device tensor; where it is False the rows keep
        what they held (the non-finite guard's verdict, decided on the device without a host sync), but
        the pointer moves on all the same, since the host cannot know.
        """
        if keys.dim() != 2 or keys.shape[1] != self.dim:
            raise ValueError(f"keys must be (N, {self.dim}), got {tuple(keys.shape)}")
        count = keys.shape[0]
        if count == 0:
            return
        keys = keys.detach().to(device=self.keys.device, dtype=self.keys.dtype)
        tags = [self._tags(t, count) for t in (ids, text_hashes)]  # (N,) each
        start = self._ptr
        if count > self.size:
            start = (self._ptr + count - self.size) % self.size
            keys = keys[-self.size :]  # (size, dim)
            tags = [t[-self.size :] for t in tags]
        rows = (start + torch.arange(keys.shape[0], device=self.keys.device)) % self.size  # (N,)
        if apply is not None:
            keys = torch.where(apply, keys, self.keys[rows])
            tags = [torch.where(apply, t, old[rows]) for t, old in zip(tags, (self.ids, self.text_hashes))]
        self.keys[rows] = keys
        self.ids[rows], self.text_hashes[rows] = tags
        self._ptr = (self._ptr + count) % self.size
        self._filled = min(self.size, self._filled + count)
        self.ptr.fill_(self._ptr)
        self.filled.fill_(self._filled)

    def _tags(self, values: torch.Tensor | None, count: int) -> torch.Tensor:
        if values is None:
            return torch.full((count,), UNKNOWN, dtype=torch.long, device=self.ids.device)
        if values.shape != (count,):
            raise ValueError(f"ids and text hashes must be ({count},), got {tuple(values.shape)}")
        return values.to(device=self.ids.device, dtype=torch.long)

    @torch.no_grad()
    def enqueue_gathered(
        self,
        local_keys: torch.Tensor,
        ids: torch.Tensor | None = None,
        text_hashes: torch.Tensor | None = None,
        apply: torch.Tensor | None = None,
    ) -> None:
        """Gather ``local_keys`` (B, dim), and their ids and text hashes (B,) when given, from all ranks in
        rank order, then enqueue; ``apply`` as in :meth:`enqueue`. One collective: the keys' bytes and
        the int64 tags' bytes travel packed in one (B, bytes) uint8 tensor and are unpacked bit for bit."""
        tags = [None if t is None else t.to(local_keys.device, torch.long) for t in (ids, text_hashes)]
        parts = [local_keys.detach(), *(t for t in tags if t is not None)]
        if len(parts) == 1:
            self.enqueue(all_gather_no_grad(local_keys), None, None, apply)
            return
        rows = [p.contiguous().view(torch.uint8).reshape(p.shape[0], -1) for p in parts]  # (B, bytes_i)
        gathered = all_gather_no_grad(torch.cat(rows, dim=1))  # (W * B, sum bytes_i): a collective
        out, start = [], 0
        for p, r in zip(parts, rows):
            width = r.shape[1]
            packed = gathered[:, start : start + width].contiguous()  # (W * B, bytes_i)
            out.append(packed.view(p.dtype).reshape(-1, *p.shape[1:]))
            start += width
        keys, given = out[0], iter(out[1:])
        self.enqueue(keys, *(None if t is None else next(given) for t in tags), apply)

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.dim}"


def needs_forward(momentum: float) -> bool:
    """Whether keys need a momentum-encoder forward pass; with momentum 0 they are the online
    encoder's detached outputs (a plain memory bank) and no copy of the encoder is needed."""
    return momentum > 0


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside DDP-style wrappers (``.module``), so parameter names match our copy."""
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


class MomentumEncoder(nn.Module):
    """An EMA copy of the online encoder that encodes queue keys without gradient.

    ``state_dict`` holds the copy's parameters and buffers (under ``encoder.``), so it survives a
    checkpoint. Parameters of the online model must be full tensors on every rank (DDP, ZeRO-1/2);
    ZeRO-3 partitions parameters and is not supported with momentum > 0.
    """

    def __init__(self, online: nn.Module, dropout: bool = True, autocast: torch.dtype | None = None):
        super().__init__()
        self.encoder = copy.deepcopy(_unwrap(online))
        self.encoder.requires_grad_(False)
        self.dropout = dropout
        self.encoder.train(dropout)
        # On CUDA, Accelerate autocasts the prepared online model's forward but not this copy: the
        # trainer sets the same dtype here (on CPU bf16 build.autocast_bf16_on_cpu wraps both).
        self.autocast = autocast

    def train(self, mode: bool = True) -> MomentumEncoder:
        # The copy's mode is fixed by ``dropout``, whatever the trainer does with model.train().
        super().train(mode)
        self.encoder.train(self.dropout)
        return self

    @torch.no_grad()
    def update(self, online: nn.Module, momentum: float, apply: torch.Tensor | None = None) -> None:
        """k <- momentum * k + (1 - momentum) * q for every parameter; buffers are copied.

        ``apply``: a () bool device tensor; where False the copy stays as it was (the non-finite guard's
        verdict on the device, without a host sync).
        """
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        online = _unwrap(online)
        ours = dict(self.encoder.named_parameters())
        theirs = dict(online.named_parameters())
        if ours.keys() != theirs.keys():
            missing = sorted(set(ours) ^ set(theirs))[:3]
            raise ValueError(f"online model does not match the momentum copy (e.g. {missing})")
        names = list(ours)
        targets = [ours[n] for n in names]
        sources = [theirs[n].detach().to(ours[n].dtype) for n in names]  # a copy only where dtypes differ
        # lerp(k, q, 1 - m) = k + (1 - m)(q - k) = m k + (1 - m) q, in place, one multi-tensor op.
        if apply is None:
            torch._foreach_lerp_(targets, sources, 1.0 - momentum)
        else:
            _lerp_where_applied(targets, sources, 1.0 - momentum, apply)
        buffers = dict(self.encoder.named_buffers())
        if buffers:  # one multi-tensor copy
            their_buffers = dict(online.named_buffers())
            torch._foreach_copy_(list(buffers.values()), [their_buffers[name] for name in buffers])

    @torch.no_grad()
    def encode(self, **batch: torch.Tensor) -> torch.Tensor:
        """Keys for a tokenised batch: the copy's output, (B, H), no gradient (float32 under autocast)."""
        if self.autocast is None:
            return self.encoder(**batch)
        device = next(self.encoder.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast):
            return self.encoder(**batch).float()


def _lerp_where_applied(
    targets: list[torch.Tensor], sources: list[torch.Tensor], weight: float, apply: torch.Tensor
) -> None:
    """``targets`` <- lerp(targets, sources, ``weight``) where the () bool device tensor ``apply`` is True,
    unchanged where False: in place, without reading ``apply`` back to the host.

    The weight goes in as a () device tensor, ``weight`` applied and 0 refused: lerp(k, q, 0) = k + 0 (q - k)
    is k for finite q (a refused step left the online weights as they were). Applied, the values are
    bit for bit those of the scalar weight: both kernels compute lerp in float32 from the same float32
    weight (``tests/test_queue.py`` checks it on CPU; not yet on a GPU). Refused, the one difference from
    the out-of-place torch.where(apply, lerp(k, q, w), k) this replaces: an entry holding -0.0 can come
    back +0.0, equal as a value, and the next applied update writes the same bits either way. No
    temporary copy of the encoder; on CUDA a () weight takes torch's per-tensor route (one lerp_ launch
    per parameter, where the where-and-copy took two more). fp16/bf16 copies keep the out-of-place path:
    a weight tensor of their dtype would round 1 - m (the scalar weight is float32).
    """
    exact = [t.dtype in (torch.float32, torch.float64) for t in targets]
    by_dtype: dict[torch.dtype, torch.Tensor] = {}
    for target, ok in zip(targets, exact):
        if ok and target.dtype not in by_dtype:  # () per dtype, on the device: where() makes no host read
            full = torch.full((), weight, dtype=target.dtype, device=apply.device)
            by_dtype[target.dtype] = torch.where(apply, full, torch.zeros_like(full))
    fast = [i for i, ok in enumerate(exact) if ok]
    if fast:
        torch._foreach_lerp_(
            [targets[i] for i in fast], [sources[i] for i in fast], [by_dtype[targets[i].dtype] for i in fast]
        )
    rest = [i for i, ok in enumerate(exact) if not ok]
    if rest:  # fp16/bf16: the lerp out of place (float32 weight), kept where applied
        new = torch._foreach_lerp([targets[i] for i in rest], [sources[i] for i in rest], weight)
        for i, value in zip(rest, new):
            targets[i].copy_(torch.where(apply, value, targets[i]))
