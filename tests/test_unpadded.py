"""The unpadded (varlen) encoder path (``train.unpadded``, pipeline/model/varlen.py): the same embeddings
and gradients as the padded path in fp32 on batches of mixed lengths, for every pooling; the collator's
flat layout holds exactly the padded batch's real tokens; the users' mistakes are one-line ConfigErrors.

With dropout > 0 the two paths draw their dropout masks over differently shaped tensors ((T, H) against
(B, L, H)), so in training mode their outputs differ sample by sample (same distribution, another
stream); in eval mode they are equal again (tested below)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _train_data import debug_config, debug_luse
from transformers import BertModel  # noqa: F401  (imported before any test: it sets inductor's environ)

from pipeline.data.collate import Batch, TokenLayout, ViewCollator, token_layout, unpad
from pipeline.errors import ConfigError
from pipeline.model import POOLINGS, SentenceEncoder, build_scratch_backbone
from pipeline.model import encoder as encoder_module
from pipeline.model.compile import prepare_encoder
from pipeline.model.heads import TrainModule

TINY = json.loads((Path(__file__).resolve().parents[1] / "launch/configs/model_tiny.json").read_text())
VOCAB = 40
LENGTHS = [5, 12, 2, 9, 12, 3, 7, 1]  # mixed, two at the batch's width, one of a single token


def tiny_encoder(pooling: str, dropout: float = 0.0, seed: int = 0) -> SentenceEncoder:
    config = {**TINY, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    return SentenceEncoder(build_scratch_backbone(config, VOCAB, seed), None, pooling)


def padded_batch(lengths=LENGTHS, width: int | None = None, seed: int = 0) -> Batch:
    """Random ids in (N, L) rows padded on the right with id 0, as the collators pad them."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[r, :n] = 1
    return Batch(input_ids=ids, attention_mask=mask, num_views=2)


def forward_and_grads(encoder: SentenceEncoder, batch: Batch, weights: torch.Tensor):
    encoder.zero_grad(set_to_none=True)
    emb = encoder(**batch.inputs("cpu"))  # (N, H): the loop's call, model(**mb.inputs(device))
    (emb * weights).sum().backward()
    return emb.detach(), {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pooling", POOLINGS)
def test_unpadded_equals_padded_forward_and_gradients(pooling):
    encoder = tiny_encoder(pooling)
    batch = padded_batch()
    weights = torch.randn(len(LENGTHS), encoder.dim, generator=torch.Generator().manual_seed(1))
    emb_padded, grads_padded = forward_and_grads(encoder, batch, weights)
    emb_flat, grads_flat = forward_and_grads(encoder, unpad(batch), weights)
    torch.testing.assert_close(emb_flat, emb_padded, rtol=1e-5, atol=1e-6)
    assert grads_flat.keys() == grads_padded.keys()
    # every weight of the backbone takes part (the pooler is absent; token type 1 is never used)
    unused = {n for n, p in encoder.named_parameters() if n not in grads_flat}
    assert unused == set()
    for name in grads_padded:
        torch.testing.assert_close(grads_flat[name], grads_padded[name], rtol=1e-5, atol=1e-6, msg=name)


def test_unpadded_differs_when_two_sentences_share_a_segment():
    """The check above can fail: with the boundary between sentences 0 and 1 dropped from cu_seqlens
    they attend to each other and their merged embedding is neither's; the others stay as they were."""
    encoder = tiny_encoder("mean")
    flat = unpad(padded_batch())
    cu = flat.cu_seqlens
    merged = dataclasses.replace(
        flat, cu_seqlens=torch.cat([cu[:1], cu[2:]]), max_seqlen=LENGTHS[0] + LENGTHS[1]
    )
    with torch.no_grad():
        separate, joined = encoder(**flat.inputs("cpu")), encoder(**merged.inputs("cpu"))
    torch.testing.assert_close(joined[1:], separate[2:], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(joined[0], separate[0], atol=1e-3)
    assert not torch.allclose(joined[0], separate[1], atol=1e-3)


def test_bucketed_padding_changes_nothing():
    """Padding wider than the longest row (train.pad_to_multiple_of) gives the same embeddings."""
    encoder = tiny_encoder("mean")
    with torch.no_grad():
        narrow = encoder(**padded_batch().inputs("cpu"))
        wide = encoder(**padded_batch(width=16).inputs("cpu"))
    torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-6)


def test_dropout_differs_in_training_and_not_in_eval():
    encoder = tiny_encoder("mean", dropout=0.1)
    batch = padded_batch()
    torch.manual_seed(0)
    padded = encoder(**batch.inputs("cpu")).detach()
    torch.manual_seed(0)
    flat = encoder(**unpad(batch).inputs("cpu")).detach()
    assert not torch.allclose(flat, padded, atol=1e-3)  # other masks: the documented difference
    encoder.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            encoder(**unpad(batch).inputs("cpu")), encoder(**batch.inputs("cpu")), rtol=1e-5, atol=1e-6
        )


def test_train_module_keeps_the_loop_contract():
    """TrainModule(**mb.inputs(device)) in both layouts, and the same state_dict keys as HF's BertModel."""
    module = TrainModule(tiny_encoder("cls"))
    batch = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(
            module(**unpad(batch).inputs("cpu")), module(**batch.inputs("cpu")), rtol=1e-5, atol=1e-6
        )
    from transformers import BertConfig

    reference = BertModel(BertConfig(**{**TINY, "vocab_size": VOCAB}), add_pooling_layer=False)
    assert set(module.encoder.backbone.state_dict()) == set(reference.state_dict())


# ------------------------------------------------------------------------------------------ the collator
def test_unpad_holds_the_padded_batch_real_tokens():
    batch = padded_batch()
    flat = unpad(batch)
    assert flat.attention_mask is None and flat.max_seqlen == max(LENGTHS)
    assert flat.cu_seqlens.dtype == torch.int32
    assert flat.cu_seqlens.tolist() == [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    assert flat.num_rows == batch.num_rows and flat.num_sentences == batch.num_sentences
    for r, n in enumerate(LENGTHS):
        start = int(flat.cu_seqlens[r])
        assert flat.input_ids[start : start + n].tolist() == batch.input_ids[r, :n].tolist()
        assert flat.position_ids[start : start + n].tolist() == list(range(n))
    inputs = flat.inputs("cpu")
    assert set(inputs) == {"input_ids", "position_ids", "cu_seqlens", "max_seqlen"}
    assert isinstance(inputs["max_seqlen"], int)


def test_split_of_a_flat_batch_is_the_flat_split():
    """Micro-batches (train.grad_accum_steps) of a flat batch equal the flattened padded micro-batches."""
    batch = padded_batch()
    for flat_part, padded_part in zip(unpad(batch).split(2), batch.split(2)):
        expected = unpad(padded_part)
        for name in ("input_ids", "position_ids", "cu_seqlens"):
            assert getattr(flat_part, name).tolist() == getattr(expected, name).tolist(), name
        assert flat_part.max_seqlen == expected.max_seqlen and flat_part.attention_mask is None


def _view_rows(lengths):
    import numpy as np

    return {
        "id": list(range(len(lengths))),
        "input_ids": [np.arange(2, 2 + n, dtype=np.int64) for n in lengths],
        "variant_input_ids": [[np.arange(3, 3 + max(1, n - 1), dtype=np.int64)] for n in lengths],
    }


def test_view_collator_flat_output_matches_its_padded_output():
    tokenizer = SimpleNamespace(pad_token_id=0)
    collate = ViewCollator(tokenizer, 32, num_variants=1, num_dropout_views=1, pretokenized=True)
    rows = _view_rows([4, 9, 2, 6])
    padded = collate(rows)
    flat = TokenLayout(collate, 0, 32, unpadded=True)(rows)
    assert flat.num_views == padded.num_views == 3 and flat.ids.tolist() == padded.ids.tolist()
    for name in ("input_ids", "position_ids", "cu_seqlens"):
        assert getattr(flat, name).tolist() == getattr(unpad(padded), name).tolist()
    bucketed = TokenLayout(collate, 0, 32, pad_to_multiple_of=8)(rows)
    assert bucketed.input_ids.shape == (12, 16)  # longest 9 -> 16
    assert bucketed.input_ids[:, :9].tolist() == padded.input_ids.tolist()
    assert bucketed.attention_mask[:, 9:].sum() == 0
    off = SimpleNamespace(unpadded=False, pad_to_multiple_of=0)
    assert token_layout(collate, 0, 32, off) is collate


# ------------------------------------------------------------------------------------------ user errors
def test_unpadded_refuses_other_architectures():
    from transformers import RobertaConfig, RobertaModel

    roberta = RobertaModel(RobertaConfig(**{**TINY, "vocab_size": VOCAB}), add_pooling_layer=False)
    with pytest.raises(ConfigError, match=r"train\.unpadded supports bert models, not 'roberta'"):
        prepare_encoder(SentenceEncoder(roberta, None, "cls"), train(unpadded=True))
    prepare_encoder(SentenceEncoder(roberta, None, "cls"), train(unpadded=False))  # padded: fine


def train(**fields):
    return SimpleNamespace(**{"unpadded": False, "pad_to_multiple_of": 0, "compile": "off", **fields})


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"train.unpadded": True, "train.pad_to_multiple_of": 8}, "train.pad_to_multiple_of"),
        ({"train.unpadded": True, "train.gradcache_chunk_size": 4}, "train.gradcache_chunk_size"),
        ({"train.unpadded": True, "loss": debug_luse(momentum=0.9)}, "train.unpadded"),
        ({"train.pad_to_multiple_of": -1}, "train.pad_to_multiple_of"),
        ({"train.compile": "reduce_overhead"}, "train.compile"),
    ],
)
def test_config_errors_name_the_field(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as info:
        debug_config(tmp_path, tmp_path, **overrides)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24], [32]], num_variants=3)


def test_trainer_runs_unpadded_and_bucketed_like_padded(tmp_path, shards, monkeypatch):
    """The real loop (pipeline/train/loop.py untouched) on the debug config without dropout: the
    unpadded and the bucketed runs log the padded run's losses and end on its weights (fp32)."""
    from _train_data import run_and_dump

    def run(name, **overrides):
        cfg = debug_config(tmp_path, shards, **{
            "model.dropout": 0.0, "train.max_steps": 4, "train.debug_dump": True, "train.eval_max_pairs": 8,
            "train.grad_accum_steps": 2, "run_dir": str(tmp_path / name), **overrides,
        })  # fmt: skip
        dump = run_and_dump(cfg)
        lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
        losses = [json.loads(line)["loss"] for line in lines if '"loss"' in line]
        return dump["param_sum"], losses

    flat_forwards = []
    original = encoder_module.unpadded_hidden_states

    def counting(*args, **kwargs):
        flat_forwards.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(encoder_module, "unpadded_hidden_states", counting)
    padded_sum, padded_losses = run("padded")
    assert flat_forwards == []
    assert len(padded_losses) == 4
    for name, overrides in (
        ("unpadded", {"train.unpadded": True}),
        ("bucketed", {"train.pad_to_multiple_of": 8}),
    ):
        params, losses = run(name, **overrides)
        assert losses == pytest.approx(padded_losses, rel=1e-4), name
        assert params == pytest.approx(padded_sum, rel=1e-5), name
    assert len(flat_forwards) == 4 * 2  # the unpadded run: every micro-batch through the flat forward


@pytest.mark.gpu
def test_varlen_flash_attention_matches_the_padded_path_on_a_gpu(monkeypatch):
    """On CUDA in bf16 the unpadded path runs torch's varlen flash attention (counted) and gives the
    padded path's embeddings and gradients within bf16 rounding."""
    from pipeline.model import varlen

    calls = []
    flash = varlen._flash_varlen()
    assert flash is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen"

    def counting():
        def attend(*args, **kwargs):
            calls.append(1)
            return flash(*args, **kwargs)

        return attend

    monkeypatch.setattr(varlen, "_flash_varlen", counting)
    encoder = tiny_encoder("mean").cuda()
    batch = padded_batch()
    weights = torch.randn(len(LENGTHS), encoder.dim, device="cuda")
    results = []
    for layout in (batch, unpad(batch)):
        encoder.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            emb = encoder(**layout.inputs("cuda"))
        (emb.float() * weights).sum().backward()
        results.append((emb.float().detach(), [p.grad.float() for p in encoder.parameters()]))
    assert len(calls) == TINY["num_hidden_layers"]
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-2, atol=2e-2)
    for flat, padded in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(flat, padded, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("seed", range(5))
def test_segments_place_each_token_as_searchsorted_does(seed):
    """Each flat token's sentence (so its slot) equals ``searchsorted(cu_seqlens[1:], token, right=True)``,
    the formula the count of sentence ends replaced; empty sentences (at the start, middle and end) too."""
    from pipeline.model.varlen import Segments

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (12,), generator=g)
    lengths[[0, 5, -1]] = 0  # empty first, middle and last sentences
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    total, width = int(cu[-1]), int(lengths.max())
    seg = Segments.of(cu, width, total)
    tokens = torch.arange(total)
    row = torch.searchsorted(cu[1:].long(), tokens, right=True)
    assert torch.equal(seg.slot, row * width + (tokens - cu.long()[row]))
    assert torch.equal(seg.lengths, lengths) and seg.num_rows == 12
    flat = torch.randn(total, 3)
    assert torch.equal(seg.unpad(seg.pad(flat)), flat)
