"""GradCache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup").

A contrastive loss couples every sequence of the batch, so it cannot be split into micro-batches the
way gradient accumulation splits a classification loss: accumulation gives each micro-batch only its
own negatives. GradCache keeps the full negative set with the memory of one chunk:

1. encode the batch chunk by chunk *without* a graph, keeping only the (N, H) embeddings;
2. compute the loss over all embeddings and backpropagate it to the embeddings only (cheap);
3. re-encode each chunk *with* a graph and backpropagate the cached embedding gradient through it.

Step 3 must reproduce step 1's forward exactly, dropout masks included, so the RNG state before each
chunk is recorded in step 1 and replayed in step 3. The cost is a second forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pipeline.losses.terms import LossOut


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def chunked_forward_backward(
    model: nn.Module,
    backward: Callable[[torch.Tensor], None],
    inputs: dict[str, torch.Tensor],
    size: int,
    loss_fn: Callable[[torch.Tensor], LossOut],
) -> tuple[LossOut, torch.Tensor]:
    """Loss and gradients of one batch encoded in chunks of ``size`` rows (train.gradcache_chunk_size).

    ``model`` is what ``accelerator.prepare`` returned (under DDP its ``no_sync`` skips the all-reduce
    of every chunk but the last); ``backward`` is ``accelerator.backward`` (fp16 loss scaling).
    ``loss_fn`` maps the encoded rows (N, H) to the loss (a :class:`~pipeline.losses.terms.LossOut`), e.g.
    ``lambda rows: term_loss(t, rows, batch)``; every row of the batch (views and hard negatives alike) is
    cached. Returns the detached loss and the detached (N, H) rows. Gradients end
    up in the model's parameters exactly as one full-batch forward/backward would put them (same
    dropout masks).
    """
    device = inputs["input_ids"].device
    total = inputs["input_ids"].shape[0]
    chunks = [slice(i, min(i + size, total)) for i in range(0, total, size)]
    states, outs = [], []
    with torch.no_grad():
        for c in chunks:
            states.append(_rng_state(device))
            outs.append(model(input_ids=inputs["input_ids"][c], attention_mask=inputs["attention_mask"][c]))
    after = _rng_state(device)
    cached = torch.cat(outs).detach().requires_grad_()  # (N, H), a leaf: its .grad is the cache
    loss = loss_fn(cached)
    backward(loss.total)  # loss -> embeddings only (plus any collective inside the loss), fp16-scaled
    for i, c in enumerate(chunks):
        _set_rng_state(states[i], device)
        # all-reduce gradients once, after the last chunk (DDP), not after every chunk
        last = i == len(chunks) - 1
        sync = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            out = model(
                input_ids=inputs["input_ids"][c], attention_mask=inputs["attention_mask"][c]
            )  # (n_c, H)
            out.backward(cached.grad[c].to(out.dtype))
    _set_rng_state(after, device)
    return loss.detach(), cached.detach()
