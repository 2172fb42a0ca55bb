"""The step the GPU wants (issue 41, items 2 and 3): no host sync inside the encoder's forward and
backward (transformers' included), a bounded set of shapes over a run, and ``train.compile``: compiled
loss and gradients equal to eager ones in fp32, with a bounded number of graphs across lengths.

Host syncs are counted on CPU by patching the Tensor methods that read a value on the host (a CUDA
device would block on each): ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``/``int()``/
``float()``/``__index__`` of a tensor and ``nonzero`` (whose output shape needs the data)."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_unpadded import LENGTHS, padded_batch, tiny_encoder
from transformers import BertModel  # noqa: F401  (imported before any test: it sets inductor's environ)

from pipeline.data.collate import Batch, TokenLayout, ViewCollator, bucket_width, unpad
from pipeline.model.compile import compile_counts, compile_encoder, prepare_encoder
from pipeline.model.heads import TrainModule

SYNCS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def syncs(monkeypatch):
    """A Counter of host reads of tensors, by method, while ``syncs.active``."""
    counts = Counter()
    state = SimpleNamespace(active=False, counts=counts)
    for name in SYNCS:
        method = getattr(torch.Tensor, name)

        def counting(tensor, *args, _name=name, _method=method, **kwargs):
            if state.active:
                counts[_name] += 1
            return _method(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    original_nonzero = torch.nonzero

    def nonzero(*args, **kwargs):
        if state.active:
            counts["torch.nonzero"] += 1
        return original_nonzero(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", nonzero)
    return state


def step_syncs(module: TrainModule, batch: Batch, syncs) -> Counter:
    """Host reads during one forward and backward of ``batch`` (its inputs moved first, as the loop does)."""
    inputs = batch.inputs("cpu")
    syncs.counts.clear()
    syncs.active = True
    try:
        module(**inputs).square().sum().backward()
    finally:
        syncs.active = False
    return Counter(syncs.counts)


def static_module(pooling: str) -> TrainModule:
    """The encoder as the trainer prepares it for ``train.pad_to_multiple_of`` (its prepared mask)."""
    encoder = tiny_encoder(pooling)
    prepare_encoder(encoder, SimpleNamespace(unpadded=False, pad_to_multiple_of=8, compile="off"))
    return TrainModule(encoder)


def test_a_cuda_device_gets_the_prepared_mask():
    """On a GPU transformers' own mask costs a host sync per forward (counted on an H200), so the trainer
    prepares the mask whenever its device is CUDA; on CPU only static shapes or compile ask for it."""
    plain = SimpleNamespace(unpadded=False, pad_to_multiple_of=0, compile="off")
    for device, expected in ((torch.device("cpu"), False), ("cpu", False), (None, False),
                             (torch.device("cuda", 0), True), ("cuda", True)):  # fmt: skip
        encoder = tiny_encoder("mean")
        prepare_encoder(encoder, plain, device)
        assert encoder.static_mask is expected, device


def test_the_counter_sees_transformers_sync(syncs):
    """The count can fail: the default padded step hands transformers the 2-D mask, and its mask code
    reads ``padding_mask.all()`` (one ``bool()``) every forward."""
    module = TrainModule(tiny_encoder("mean"))
    assert not module.encoder.static_mask
    assert step_syncs(module, padded_batch(), syncs) == Counter({"__bool__": 1})


@pytest.mark.parametrize("pooling", ["cls", "mean", "first_last_avg"])
def test_no_host_sync_in_the_step(syncs, pooling):
    module = static_module(pooling)
    assert module.encoder.static_mask
    bucketed = TokenLayout(lambda rows: padded_batch(), 0, 32, pad_to_multiple_of=8)(None)  # width 16
    assert step_syncs(module, bucketed, syncs) == Counter()
    assert step_syncs(TrainModule(tiny_encoder(pooling)), unpad(padded_batch()), syncs) == Counter()


def test_the_prepared_mask_changes_nothing():
    """The same embeddings and gradients with transformers' own mask and the prepared one (sdpa and
    eager attention), for the encoder and the mlm head's forward."""
    for implementation in ("sdpa", "eager"):
        plain, static = TrainModule(tiny_encoder("mean")), static_module("mean")
        for m in (plain, static):
            m.encoder.backbone.set_attn_implementation(implementation)
        batch = padded_batch(width=16)
        weights = torch.randn(len(LENGTHS), 32, generator=torch.Generator().manual_seed(2))
        results = []
        for m in (plain, static):
            emb = m(**batch.inputs("cpu"))
            (emb * weights).sum().backward()
            results.append((emb.detach(), [p.grad for p in m.parameters()]))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6, msg=implementation)
        for a, b in zip(results[1][1], results[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=implementation)


# ------------------------------------------------------------------------------------------ shapes
def test_bucket_widths():
    assert [bucket_width(n, 8, 48) for n in (1, 8, 9, 40, 41, 48)] == [8, 8, 16, 40, 48, 48]
    assert bucket_width(45, 16, 40) == 45  # longer than max_length (an id column): itself
    assert bucket_width(33, 16, 40) == 40  # the last bucket stops at max_length


def test_shapes_over_a_run_are_bounded():
    """60 batches of random lengths: one shape per longest sentence padded, ceil(48 / 8) bucketed, and
    unpadded a fixed row count (only the token count moves)."""
    rng = random.Random(0)
    collate = ViewCollator(SimpleNamespace(pad_token_id=0), 48, num_variants=1, num_dropout_views=0,
                           pretokenized=True)  # fmt: skip
    padded, bucketed, flat_rows = set(), set(), set()
    for _ in range(60):
        lengths = [rng.randint(3, 48) for _ in range(8)]
        rows = {
            "id": list(range(8)),
            "input_ids": [np.arange(n, dtype=np.int64) + 1 for n in lengths],
            "variant_input_ids": [[np.arange(max(2, n - 2), dtype=np.int64) + 1] for n in lengths],
        }
        padded.add(tuple(collate(rows).input_ids.shape))
        bucketed.add(tuple(TokenLayout(collate, 0, 48, pad_to_multiple_of=8)(rows).input_ids.shape))
        flat = TokenLayout(collate, 0, 48, unpadded=True)(rows)
        flat_rows.add(tuple(flat.cu_seqlens.shape))
    assert len(padded) > 6  # without buckets: many shapes
    assert bucketed <= {(16, w) for w in (8, 16, 24, 32, 40, 48)} and len(bucketed) >= 2
    assert flat_rows == {(17,)}


# ------------------------------------------------------------------------------------------ compile
@pytest.fixture
def dynamo():
    """A fresh dynamo, its recompile limit and log settings put back after the test."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # config.patch puts the value back (monkeypatch's undo can delete, which hides a config entry)
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        yield
    torch._dynamo.reset()
    torch._logging.set_logs()


def contrastive_loss(module: TrainModule, batch: Batch) -> torch.Tensor:
    emb = module(**batch.inputs("cpu"))  # (2B, H): two views
    b = emb.shape[0] // 2
    return F.cross_entropy(emb[:b] @ emb[b:].T / 0.05, torch.arange(b))


def loss_and_grads(module: TrainModule, batch: Batch):
    module.zero_grad(set_to_none=True)
    loss = contrastive_loss(module, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def assert_compiled_equals_eager(batches, backend, pooling="mean"):
    eager = TrainModule(tiny_encoder(pooling))
    compiled = TrainModule(tiny_encoder(pooling))
    compile_encoder(compiled.encoder, "default", backend=backend)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # no _orig_mod. prefix
    for batch in batches:
        loss_e, grads_e = loss_and_grads(eager, batch)
        loss_c, grads_c = loss_and_grads(compiled, batch)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)


def mixed_batches(widths):
    """Batches of 8 rows (4 sentences x 2 views) with the longest row ``width`` each."""
    return [padded_batch([w, *LENGTHS[1:7], max(1, w - 3)][:8], seed=w) for w in widths]


def test_compiled_equals_eager_and_graphs_are_bounded(dynamo):
    """Traced with aot_eager (dynamo and AOT autograd, no C++ build): five lengths padded and five
    unpadded, each path equal to eager, in at most two graphs per layout (the first length static, then
    one dynamic), not one per length."""
    widths = [12, 14, 17, 20, 23]
    assert_compiled_equals_eager(mixed_batches(widths), "aot_eager")
    padded_graphs = compile_counts()["graphs"]
    assert 1 <= padded_graphs <= 2
    assert_compiled_equals_eager([unpad(b) for b in mixed_batches(widths)], "aot_eager")
    assert compile_counts()["graphs"] - padded_graphs <= 2
    assert compile_counts()["graph_breaks"] == 0


def test_compile_mode_is_checked():
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.compile 'fast' is not a mode"):
        compile_encoder(torch.nn.Linear(2, 2), "fast")
    module = torch.nn.Linear(2, 2)
    assert compile_encoder(module, "off") is module and module._compiled_call_impl is None


@pytest.mark.slow
def test_inductor_compiled_equals_eager(dynamo):
    """The real backend (inductor; builds C++ with gcc: tens of seconds on a loaded 2-core machine)."""
    assert_compiled_equals_eager(mixed_batches([12]), "inductor")


def test_the_step_layouts_benchmark_runs(tmp_path, capsys, monkeypatch):
    """benchmarks/step_layouts.py at a tiny size (the figures come from docs/BENCHMARKS.md's command)."""
    import runpy
    import sys
    from pathlib import Path

    from _tiny_models import build_char_encoder

    from pipeline.resources import sample_sentences

    model = build_char_encoder(tmp_path / "model", sample_sentences(400), 32, 64, 64)
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_layouts.py"
    argv = [str(script), "--model", str(model), "--layers", "0,1", "--steps", "1", "--warmup", "1",
            "--vocab", "100", "--threads", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "tokens per real token" in out and "unpadded" in out and "1.00x eager padded" in out


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24], [32]], num_variants=3)


@pytest.mark.slow
def test_compiled_unpadded_training_resumes_exactly(tmp_path, shards, dynamo):
    """The trainer with train.compile (inductor) on the unpadded layout: 2 steps, stop, resume to 4
    ends on the uninterrupted run's weights (CPU runs are exact). Loaded 2-core machine: 305 s with a
    cold inductor cache for this and the bucketed layout together (which passed too), 10 s warm."""
    from _train_data import debug_config, full_and_resumed

    def make_cfg(run_dir, steps):
        return debug_config(tmp_path, shards, **{
            "train.compile": "default", "train.unpadded": True, "train.max_steps": steps,
            "train.debug_dump": True, "train.eval_max_pairs": 8, "run_dir": str(run_dir),
        })  # fmt: skip

    full, resumed = full_and_resumed(tmp_path, make_cfg, stop=2, total=4)
    assert resumed["param_checksum"] == full["param_checksum"]
