"""Auxiliary MLM loss: BERT masking statistics, the loss against a literal cross entropy, config checks,
a debug run that logs both losses and learns, no MLM head in the exported model, exact resume."""

import json
import math

import pytest
import torch
from _train_data import debug_config, debug_luse, full_and_resumed, sample_sentences
from safetensors import safe_open

from pipeline.config import load_config
from pipeline.data.collate import MLMCollator, ViewCollator
from pipeline.data.masking import IGNORE_INDEX, batch_generator, mask_tokens
from pipeline.errors import ConfigError
from pipeline.losses.mlm import compute_loss
from pipeline.model.heads import MLMHead
from pipeline.train.config import PROJECT_ROOT, Config

DEBUG = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"
SPECIAL = [0, 1, 2, 3, 4]  # [PAD] [UNK] [CLS] [SEP] [MASK] in a made-up vocabulary
PAD, CLS, SEP, MASK, VOCAB = 0, 2, 3, 4, 500


def random_batch(rows: int = 4000, length: int = 40, seed: int = 0):
    """[CLS] tokens [SEP] [PAD]...: random lengths, ordinary ids 5..VOCAB-1 (plus some [UNK])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, length), generator=g)
    ids[torch.rand(rows, length, generator=g) < 0.02] = 1  # [UNK] is special: never selected
    lengths = torch.randint(3, length + 1, (rows,), generator=g)
    pos = torch.arange(length).expand(rows, length)
    mask = (pos < lengths[:, None]).long()
    ids[:, 0] = CLS
    ids[torch.arange(rows), lengths - 1] = SEP
    ids[mask == 0] = PAD
    return ids, mask


def test_masking_statistics_follow_bert():
    ids, mask = random_batch()
    before = ids.clone()
    masked, labels = mask_tokens(ids, mask, SPECIAL, MASK, VOCAB, torch.Generator().manual_seed(1))
    assert torch.equal(ids, before)  # pure: the input is untouched
    candidates = (mask == 1) & (ids > 4)
    selected = labels != IGNORE_INDEX
    assert not (selected & ~candidates).any()  # specials and padding never selected
    assert torch.equal(labels[selected], ids[selected])  # labels: the original ids, -100 elsewhere
    assert torch.equal(masked[~selected], ids[~selected])  # unselected positions unchanged
    n = selected.sum().item()
    assert abs(n / candidates.sum().item() - 0.15) < 0.005  # ~60k candidates: 0.005 is > 5 sigma
    to_mask = (masked == MASK) & selected
    unchanged = (masked == ids) & selected
    replaced = selected & ~to_mask & ~unchanged
    assert abs(to_mask.sum().item() / n - 0.8) < 0.015
    # a random replacement can draw the same id (1 in 495): counted as unchanged
    assert abs(replaced.sum().item() / n - 0.1) < 0.01
    assert abs(unchanged.sum().item() / n - 0.1) < 0.01
    assert (masked[replaced] > 4).all()  # random replacements are ordinary tokens
    # another generator seed, another mask; the same seed, the same mask
    again, _ = mask_tokens(ids, mask, SPECIAL, MASK, VOCAB, torch.Generator().manual_seed(1))
    other, _ = mask_tokens(ids, mask, SPECIAL, MASK, VOCAB, torch.Generator().manual_seed(2))
    assert torch.equal(again, masked) and not torch.equal(other, masked)


def test_masking_probability_is_configurable():
    ids, mask = random_batch(1000)
    _, labels = mask_tokens(ids, mask, SPECIAL, MASK, VOCAB, torch.Generator().manual_seed(0), 0.4)
    share = (labels != IGNORE_INDEX).sum().item() / ((mask == 1) & (ids > 4)).sum().item()
    assert abs(share - 0.4) < 0.01


def test_batch_generator_depends_on_seed_and_ids():
    draw = lambda seed, ids: torch.rand(4, generator=batch_generator(seed, ids))  # noqa: E731
    big = 2**64 - 1  # sentence ids are uint64
    assert torch.equal(draw(1, [5, big]), draw(1, [5, big]))
    assert not torch.equal(draw(1, [5, big]), draw(2, [5, big]))
    assert not torch.equal(draw(1, [5, big]), draw(1, [big, 5]))


def test_collator_masks_view_zero_only(tmp_path):
    from pipeline.model import build_char_vocab, make_tokenizer
    from pipeline.model.vocab import write_vocab

    texts = sample_sentences(8)
    write_vocab(build_char_vocab(texts, 1, 1000), tmp_path / "vocab.txt")
    tok = make_tokenizer(tmp_path / "vocab.txt")
    inner = ViewCollator(tok, 32, 1, 1)
    rows = {"id": list(range(1, 9)), "text": texts, "variants": [[t[1:]] for t in texts]}
    out = MLMCollator(inner, tok, seed=3)(rows)
    plain = inner(rows)
    assert torch.equal(out.input_ids, plain.input_ids)  # the contrastive views are not masked
    sel = out.mlm_labels != IGNORE_INDEX
    assert out.mlm_input_ids.shape == (8, plain.input_ids.shape[1])
    assert torch.equal(out.mlm_labels[sel], plain.input_ids[:8][sel])
    assert torch.equal(MLMCollator(inner, tok, seed=3)(rows).mlm_input_ids, out.mlm_input_ids)


def test_loss_equals_literal_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.full((3, 5), IGNORE_INDEX)
    labels[0, 1], labels[1, 4], labels[2, 0], labels[2, 3] = 6, 0, 2, 2
    terms = []
    for i in range(3):
        for j in range(5):
            if labels[i, j] != IGNORE_INDEX:
                z = logits[i, j]
                terms.append(-(z[labels[i, j]].item() - math.log(sum(math.exp(v) for v in z.tolist()))))
    assert compute_loss(logits, labels).item() == pytest.approx(sum(terms) / len(terms), rel=1e-10)
    # nothing selected: 0, not NaN
    assert compute_loss(logits, torch.full((3, 5), IGNORE_INDEX)).item() == 0.0


def test_head_is_tied_to_the_embeddings():
    head = MLMHead(8, 11)
    emb = torch.randn(11, 8, requires_grad=True)
    logits = head(torch.randn(2, 3, 8), emb)
    assert logits.shape == (2, 3, 11)
    logits.sum().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0
    assert {n for n, _ in head.named_parameters()} == {
        "dense.weight",
        "dense.bias",
        "norm.weight",
        "norm.bias",
        "bias",
    }


@pytest.mark.parametrize(
    "over",
    [
        {"loss": [{"luse": {}}, {"mlm": {}, "weight": -0.1}]},
        {"loss": [{"luse": {}}, {"mlm": {"probability": 0.0}}]},
        {"loss": [{"luse": {}}, {"mlm": {}, "weight": 0.1}], "train.gradcache_chunk_size": 8},
        {"loss": [{"cosent": {}}, {"mlm": {}, "weight": 0.1}], "data.supervised_file": "x.tsv"},
        {"objective.mlm_weight": -0.1},  # the deprecated flat section, read into `loss`
        {"objective.mlm_weight": 0.1, "train.gradcache_chunk_size": 8},
        {"objective.mlm_weight": 0.1, "objective.name": "cosent", "data.supervised_file": "x.tsv"},
    ],
)
def test_config_refuses(over):
    with pytest.raises(ConfigError, match="mlm"):
        load_config(Config, DEBUG, over)


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[32]], num_variants=2)  # 32 sentences: two batches an epoch, repeated


MLM = {"mlm": {}, "weight": 0.5}


def debug_cfg(tmp_path, shards, **overrides):
    base = {"train.eval_max_pairs": 16, "loss": [*debug_luse(), MLM]}
    return debug_config(tmp_path, shards, **{**base, **overrides})


def read_metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _tensor_names(folder):
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    return names


@pytest.mark.slow
def test_debug_run_logs_both_losses_learns_and_exports_no_head(tmp_path, shards):
    from pipeline.export import Config as ExportConfig
    from pipeline.export import run as export
    from pipeline.train.run import run

    # random batches, as when the 0.5 margin below was set (bucketed, the loss fell 5.92 -> 5.43 once)
    overrides = {"train.max_steps": 24, "optim.lr": 3e-3, "data.length_bucketing": False}
    cfg = debug_cfg(tmp_path, shards, **overrides)
    assert run(cfg) == 0
    steps = read_metrics(cfg.run_dir)
    assert len(steps) == 24
    for r in steps:
        assert r["loss"] == pytest.approx(r["contrastive_loss"] + 0.5 * r["mlm_loss"], rel=1e-5)
    first = sum(r["mlm_loss"] for r in steps[:4]) / 4
    last = sum(r["mlm_loss"] for r in steps[-4:]) / 4
    assert last < first - 0.5, (first, last)  # 32 sentences seen 12 times: the MLM loss must fall
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg.run_dir / "tensorboard"))
    events.Reload()
    assert {"train/mlm_loss", "train/contrastive_loss"} <= set(events.Tags()["scalars"])
    # the head is trained state in the checkpoint ...
    from pipeline.train.checkpoint import Checkpointer

    latest = Checkpointer(cfg.run_dir).latest()
    saved = torch.load(latest / "state.pt", map_location="cpu", weights_only=True)
    assert set(saved["mlm_head"]) == {"dense.weight", "dense.bias", "norm.weight", "norm.bias", "bias"}
    # ... but neither model/ nor the sentence-transformers export carries it: encoder weights only
    assert {n.split(".")[0] for n in _tensor_names(cfg.run_dir / "model")} == {"embeddings", "encoder"}
    out = tmp_path / "export"
    assert export(ExportConfig(checkpoint=str(cfg.run_dir), out=out)) == 0
    exported = _tensor_names(out)
    # (the export's writer adds BertModel's unused pooler; no MLM head or "cls.predictions" either way)
    assert exported and {n.split(".")[0] for n in exported} <= {"embeddings", "encoder", "pooler"}


@pytest.mark.slow
def test_resume_with_mlm_is_exact(tmp_path, shards):
    """3 steps, stop, resume to 6 == 6 steps uninterrupted, with the MLM head and masks in play."""
    common = {"loss": [*debug_luse(momentum=0.9), MLM], "train.debug_dump": True}

    def make_cfg(run_dir, steps):
        return debug_cfg(tmp_path, shards, **{**common, "run_dir": str(run_dir), "train.max_steps": steps})

    full, resumed = full_and_resumed(tmp_path, make_cfg, stop=3, total=6)
    assert resumed["param_checksum"] == full["param_checksum"]  # includes the MLM head's parameters
    assert resumed["queue_checksum"] == full["queue_checksum"]
    pick = lambda d: [(r["loss"], r["mlm_loss"]) for r in read_metrics(d)]  # noqa: E731
    assert pick(tmp_path / "split")[-3:] == pick(tmp_path / "full")[-3:]


def _tiny_train_module(tmp_path):
    """A 2-layer char BERT with an MLM head, dropout 0, and an MLM batch of 8 sentences (two views)."""
    from pipeline.model import SentenceEncoder, build_char_vocab, build_scratch_backbone, make_tokenizer
    from pipeline.model.heads import TrainModule
    from pipeline.model.vocab import write_vocab

    texts = sample_sentences(8)
    write_vocab(build_char_vocab(texts, 1, 1000), tmp_path / "vocab.txt")
    tok = make_tokenizer(tmp_path / "vocab.txt")
    config = dict(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    backbone = build_scratch_backbone(config, len(tok.get_vocab()), seed=0)
    encoder = SentenceEncoder(backbone, tok, "mean", 32, "")
    torch.manual_seed(0)
    module = TrainModule(encoder, mlm_head=MLMHead(16, backbone.config.vocab_size))
    rows = {"id": list(range(1, 9)), "text": texts, "variants": [[t[1:]] for t in texts]}
    return module, MLMCollator(ViewCollator(tok, 32, 1, 0), tok, seed=3, mask_prob=0.3)(rows)


def test_mlm_head_on_masked_positions_only_gives_the_full_heads_loss_and_gradients(tmp_path):
    """The step's path (Batch.inputs finds the selected positions, the model runs the head on those alone,
    (M, V)) against the head at every position (B, L, V), fp32: the same loss and the same gradient for
    every parameter (the tied embedding table included), and logits only M rows long."""
    module, batch = _tiny_train_module(tmp_path)
    inputs = batch.inputs("cpu")
    selected = batch.mlm_labels != IGNORE_INDEX
    count = int(selected.sum())
    assert 0 < count < selected.numel() // 3  # most positions carry no label: the head skips them
    assert torch.equal(inputs["mlm_positions"], selected.reshape(-1).nonzero().squeeze(1))

    def loss_and_grads(**extra):
        module.zero_grad(set_to_none=True)
        emb, logits = module(**extra, mlm_input_ids=batch.mlm_input_ids)
        loss = compute_loss(logits, batch.mlm_labels) + emb.sum() * 0  # every parameter in the graph
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        return logits, loss.detach(), grads

    full_logits, full, full_grads = loss_and_grads(
        **{k: v for k, v in inputs.items() if k != "mlm_positions"}
    )
    masked_logits, masked, masked_grads = loss_and_grads(**inputs)
    assert full_logits.shape[:2] == batch.mlm_labels.shape and masked_logits.shape[0] == count
    torch.testing.assert_close(masked_logits, full_logits[selected], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked, full, rtol=1e-6, atol=0)
    assert masked_grads.keys() == full_grads.keys() and "mlm_head.dense.weight" in masked_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(masked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert masked_grads["encoder.backbone.embeddings.word_embeddings.weight"].abs().sum() > 0


def test_masked_loss_equals_literal_cross_entropy_and_is_zero_without_selection():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.full((3, 5), IGNORE_INDEX)
    labels[0, 1], labels[1, 4], labels[2, 0], labels[2, 3] = 6, 0, 2, 2
    selected = labels != IGNORE_INDEX
    assert compute_loss(logits[selected], labels).item() == pytest.approx(
        compute_loss(logits, labels).item(), rel=1e-12
    )
    shuffled = logits[selected][[1, 0, 2, 3]]  # the rows must be in the labels' row-major order
    assert compute_loss(shuffled, labels).item() != pytest.approx(
        compute_loss(logits, labels).item(), rel=1e-6
    )
    assert compute_loss(logits[:0].reshape(0, 7), torch.full((3, 5), IGNORE_INDEX)).item() == 0.0


def test_mlm_positions_without_the_masked_originals_are_refused(tmp_path):
    module, batch = _tiny_train_module(tmp_path)
    with pytest.raises(ValueError, match="mlm_positions"):
        module(**batch.inputs("cpu"))
