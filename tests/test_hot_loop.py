"""Hot-loop options of the trainer: bf16 autocast on CPU, frozen word embeddings, fused AdamW."""

from __future__ import annotations

import pytest
import torch
from _train_data import debug_config, debug_luse

from pipeline.train import loop
from pipeline.train.build import build


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24]], num_variants=2)


def one_step(tmp_path, shards, **overrides):
    t = build(debug_config(tmp_path, shards, **{"loss": debug_luse(momentum=0.9), **overrides}))
    batch = next(iter(t.stream))
    out = loop.train_step(t, batch)
    return t, batch, out


def linear_output_dtypes(module: torch.nn.Module, run) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
        for m in module.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("precision, expected", [("bf16", torch.bfloat16), ("no", torch.float32)])
def test_mixed_precision_bf16_really_autocasts_on_cpu(tmp_path, shards, precision, expected):
    t, batch, out = one_step(tmp_path, shards, **{"train.mixed_precision": precision})
    inputs = {k: getattr(batch, k) for k in ("input_ids", "attention_mask")}
    assert linear_output_dtypes(t.module, lambda: t.model(**inputs)) == {expected}
    momentum = t.loss.states()["momentum_encoder"]  # the luse term's own
    assert linear_output_dtypes(momentum, lambda: momentum.encode(**inputs)) == {expected}
    assert t.model(**inputs).dtype == torch.float32  # the loss and the queue see fp32 rows
    assert torch.isfinite(out["loss"]) and all(p.dtype == torch.float32 for p in t.module.parameters())


def test_frozen_embeddings_get_no_gradient_and_no_optimizer_state(tmp_path, shards):
    cfg = debug_config(tmp_path, shards, **{"model.freeze_embeddings": True})
    t = build(cfg)
    words = t.module.encoder.backbone.get_input_embeddings().weight
    before = words.detach().clone()
    layer = next(p for n, p in t.module.named_parameters() if "encoder.layer.0" in n and p.ndim == 2)
    layer_before = layer.detach().clone()
    batches = iter(t.stream)
    for _ in range(2):
        loop.train_step(t, next(batches))
    assert torch.equal(words, before) and words.grad is None
    assert not torch.equal(layer, layer_before)  # the rest trains
    optimized = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert id(words) not in optimized and id(layer) in optimized


def test_fused_adamw_matches_the_loop_implementation(tmp_path, shards):
    plain, _, _ = one_step(tmp_path / "plain", shards)
    fused, _, _ = one_step(tmp_path / "fused", shards, **{"optim.fused": True})
    assert fused.optimizer.defaults.get("fused") is True and not plain.optimizer.defaults.get("fused")
    for (name, a), b in zip(plain.module.named_parameters(), fused.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
