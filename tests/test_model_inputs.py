"""Text prefixes and sentence-transformers folders as model inputs (e5-style models).

Everything runs on a tiny XLM-R-style model built here: a Unigram tokenizer with <s>=0, <pad>=1,
</s>=2, <unk>=3 and no token_type_ids, and a 2-layer XLMRobertaModel whose padding id is 1.
"""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from _tiny_models import xlmr_fast_tokenizer
from _train_data import make_shards, sample_sentences

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.errors import ConfigError, InputError
from pipeline.model import SentenceEncoder

PREFIX = "query: "


def build_xlmr_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    backend = Tokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=4000, special_tokens=specials, unk_token="<unk>")
    backend.train_from_iterator(texts + [PREFIX * 3, "hello world 123"], trainer)
    tokenizer = xlmr_fast_tokenizer(backend, model_input_names=["input_ids", "attention_mask"])
    assert [tokenizer.convert_tokens_to_ids(t) for t in specials[:4]] == [0, 1, 2, 3]
    return tokenizer


def build_xlmr_backbone(vocab_size: int, seed: int = 0):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(seed)
    config = XLMRobertaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=80,  # positions start after the padding id: max_length + 2 needed
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return XLMRobertaModel(config, add_pooling_layer=False).eval()


@pytest.fixture(scope="module")
def xlmr_parts():
    texts = sample_sentences(600)
    tokenizer = build_xlmr_tokenizer(texts)
    return tokenizer, build_xlmr_backbone(len(tokenizer))


@pytest.fixture(scope="module")
def xlmr_folder(tmp_path_factory, xlmr_parts):
    """An e5-like model folder: encoder.json with mean pooling and the "query: " prefix."""
    tokenizer, backbone = xlmr_parts
    folder = tmp_path_factory.mktemp("xlmr") / "model"
    SentenceEncoder(backbone, tokenizer, "mean", 48, prefix=PREFIX).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory, xlmr_parts):
    """The same weights as a plain transformers folder: no encoder.json, no sentence-transformers files."""
    tokenizer, backbone = xlmr_parts
    folder = tmp_path_factory.mktemp("plain") / "model"
    backbone.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory, xlmr_folder):
    out = tmp_path_factory.mktemp("export") / "st"
    assert main(["export", str(xlmr_folder), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def pair_file(tmp_path_factory):
    rng = random.Random(0)
    texts = sample_sentences(80)
    lines = [f"{texts[i]}\t{texts[rng.randrange(80)]}\t{rng.randrange(6)}\n" for i in range(40)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.tsv"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


# ------------------------------------------------------------------------------ (a) the prefix, once
def test_encoder_json_keeps_the_prefix_and_tokenize_applies_it_once(xlmr_folder, xlmr_parts):
    tokenizer, _ = xlmr_parts
    assert json.loads((xlmr_folder / "encoder.json").read_text())["prefix"] == PREFIX
    encoder = SentenceEncoder.from_pretrained(xlmr_folder)
    assert (encoder.pooling, encoder.max_length, encoder.prefix) == ("mean", 48, PREFIX)
    text = "今天天气很好"
    batch = encoder.tokenize([text, "好"])
    rows = _unpadded(batch["input_ids"], batch["attention_mask"])
    assert rows[0] == _ids(tokenizer, PREFIX + text) != _ids(tokenizer, text)
    assert rows[1] == _ids(tokenizer, PREFIX + "好")
    assert batch["input_ids"][1, -1].item() == 1  # padded with <pad> = 1
    assert "token_type_ids" not in batch
    # an explicit prefix wins over the folder's, including "no prefix"
    assert SentenceEncoder.from_pretrained(xlmr_folder, prefix="").tokenize([text])["input_ids"][
        0
    ].tolist() == (_ids(tokenizer, text))


def test_collators_apply_the_prefix_once(xlmr_parts):
    from pipeline.data.collate import PairCollator, ViewCollator

    tokenizer, _ = xlmr_parts
    texts = sample_sentences(4)
    rows = {"id": [1, 2, 3, 4], "text": texts, "variants": [[t[1:]] for t in texts]}
    out = ViewCollator(tokenizer, 48, num_variants=1, num_dropout_views=1, prefix=PREFIX)(rows)
    got = _unpadded(out.input_ids, out.attention_mask)
    want = [_ids(tokenizer, PREFIX + t) for t in texts + [t[1:] for t in texts] + texts]
    assert got == want and out.num_views == 3
    assert (out.input_ids[out.attention_mask == 0] == 1).all()  # padding is <pad> = 1

    pairs = {"index": [0, 1], "text0": texts[:2], "text1": texts[2:], "label": [1.0, 0.0]}
    out = PairCollator(tokenizer, 48, ["text0", "text1"], torch.float32, prefix=PREFIX)(pairs)
    assert _unpadded(out.input_ids, out.attention_mask) == [_ids(tokenizer, PREFIX + t) for t in texts]


class _RecordingTokenizer:
    """Wraps a tokenizer and records every text it is asked to tokenise."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, texts, **kwargs):
        self.seen.extend(texts)
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_eval_tokenises_every_text_with_the_prefix_once(xlmr_folder, pair_file, tmp_path, monkeypatch):
    from pipeline.data.pairs import read_pairs
    from pipeline.evaluate import resolve

    recorders = []
    original = resolve.load_encoder

    def recording_load_encoder(*args, **kwargs):
        encoder = original(*args, **kwargs)
        encoder.tokenizer = _RecordingTokenizer(encoder.tokenizer)
        recorders.append(encoder.tokenizer)
        return encoder

    monkeypatch.setattr(resolve, "load_encoder", recording_load_encoder)
    argv = ["eval", str(xlmr_folder), "--suite", "sts", "--sets", "[]", "--pairs", f"[{pair_file}]"]
    assert main([*argv, "--out", str(tmp_path / "eval"), "--progress", "false"]) == 0
    seen = recorders[0].seen
    pairs = read_pairs(pair_file)
    assert set(seen) == {PREFIX + t for p in pairs for t in (p.text_a, p.text_b)}
    assert not any(t.startswith(PREFIX * 2) for t in seen)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["model"]["prefix"] == PREFIX


# ------------------------------------------------------------------------------ (b) export round trip
def test_export_writes_the_prompt_and_sentence_transformers_agrees(exported, xlmr_folder):
    from sentence_transformers import SentenceTransformer

    st_config = json.loads((exported / "config_sentence_transformers.json").read_text())
    assert st_config["prompts"] == {"query": PREFIX} and st_config["default_prompt_name"] == "query"
    assert not (exported / "encoder.json").exists()
    texts = sample_sentences(12) + ["hello world 123", "好"]
    ours = SentenceEncoder.from_pretrained(xlmr_folder).encode(texts)
    reloaded = SentenceEncoder.from_pretrained(exported)
    assert (reloaded.pooling, reloaded.max_length, reloaded.prefix) == ("mean", 48, PREFIX)
    theirs = SentenceTransformer(str(exported), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(reloaded.encode(texts), theirs, atol=1e-5)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    # without the prompt the vectors differ: the check above would catch a missing or doubled prefix
    plain = SentenceTransformer(str(exported), device="cpu").encode(texts, prompt="", convert_to_numpy=True)
    assert np.abs(plain - theirs).max() > 1e-3


def test_eval_of_an_export_matches_the_source_and_sentence_transformers(
    exported, xlmr_folder, pair_file, tmp_path
):
    from scipy.stats import spearmanr
    from sentence_transformers import SentenceTransformer

    from pipeline.data.pairs import read_pairs

    scores = {}
    for name, model in (("folder", xlmr_folder), ("export", exported)):
        out = tmp_path / name
        argv = ["eval", str(model), "--suite", "sts", "--sets", "[]", "--pairs", f"[{pair_file}]"]
        assert main([*argv, "--out", str(out), "--progress", "false"]) == 0
        result = json.loads((out / "eval.json").read_text())
        assert result["model"]["kind"] == "model" and result["model"]["pooling"] == "mean"
        scores[name] = result["sts"]["model"]["pairs"]
    pairs = read_pairs(pair_file)
    st = SentenceTransformer(str(exported), device="cpu")
    a = st.encode([p.text_a for p in pairs], convert_to_numpy=True)
    b = st.encode([p.text_b for p in pairs], convert_to_numpy=True)
    reference = spearmanr((a * b).sum(1), [p.label for p in pairs]).correlation * 100
    assert scores["folder"] == pytest.approx(scores["export"], abs=1e-6)
    assert scores["export"] == pytest.approx(reference, abs=1e-4)


def test_export_of_an_export_keeps_pooling_and_prefix(exported, tmp_path):
    again = tmp_path / "again"
    assert main(["export", str(exported), "--out", str(again)]) == 0
    assert json.loads((again / "config_sentence_transformers.json").read_text())["prompts"] == {
        "query": PREFIX
    }
    texts = sample_sentences(5)
    np.testing.assert_allclose(
        SentenceEncoder.from_pretrained(again).encode(texts),
        SentenceEncoder.from_pretrained(exported).encode(texts),
        atol=1e-6,
    )


def test_first_last_avg_round_trips_through_an_export(xlmr_parts, tmp_path):
    tokenizer, backbone = xlmr_parts
    SentenceEncoder(backbone, tokenizer, "first_last_avg", 32).save_pretrained(tmp_path / "m")
    assert main(["export", str(tmp_path / "m"), "--out", str(tmp_path / "st")]) == 0
    reloaded = SentenceEncoder.from_pretrained(tmp_path / "st")
    assert (reloaded.pooling, reloaded.max_length, reloaded.prefix) == ("first_last_avg", 32, "")


# ------------------------------------------------------------------------------ (c) no rule, bad modules
def test_a_folder_without_a_pooling_rule_is_a_clear_error(plain_folder, xlmr_folder, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"no pooling rule.*--model\.pooling"):
        SentenceEncoder.from_pretrained(plain_folder)
    assert SentenceEncoder.from_pretrained(plain_folder, pooling="cls").pooling == "cls"

    argv = ["eval", str(plain_folder), "--suite", "sts", "--sets", "[PAWSX]", "--max-pairs", "20"]
    capsys.readouterr()  # the loads above print progress bars
    assert main([*argv, "--out", str(tmp_path / "e"), "--progress", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no pooling rule" in err[0] and "--pooling" in err[0], err
    assert main([*argv, "--out", str(tmp_path / "e"), "--progress", "false", "--pooling", "mean"]) == 0
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["model"]["pooling"] == "mean"

    from pipeline.train.config import PROJECT_ROOT, Config

    debug = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"
    with pytest.raises(ConfigError, match="--model.pooling"):  # a scratch model has no folder to ask
        load_config(Config, debug, {"data.shards": str(tmp_path), "model.pooling": None})


def test_unsupported_sentence_transformers_modules_are_refused(exported, tmp_path):
    lstm = tmp_path / "lstm"  # (a Dense is supported: tests/test_export_whitening.py)
    shutil.copytree(exported, lstm)
    modules = json.loads((lstm / "modules.json").read_text())
    modules.insert(-1, {"idx": 9, "name": "9", "path": "9_LSTM", "type": "sentence_transformers.models.LSTM"})
    (lstm / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(InputError, match="module LSTM is not supported"):
        SentenceEncoder.from_pretrained(lstm)

    maxpool = tmp_path / "max"
    shutil.copytree(exported, maxpool)
    config_path = next(maxpool.glob("*_Pooling")) / "config.json"
    config = json.loads(config_path.read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    config_path.write_text(json.dumps(config))
    with pytest.raises(InputError, match="pooling max is not supported"):
        SentenceEncoder.from_pretrained(maxpool)


def test_sentence_transformers_6_pooling_mode_key(exported, tmp_path):
    folder = tmp_path / "st6"
    shutil.copytree(exported, folder)
    config_path = next(folder.glob("*_Pooling")) / "config.json"
    config_path.write_text(
        json.dumps({"embedding_dimension": 32, "pooling_mode": "cls", "include_prompt": True})
    )
    assert SentenceEncoder.from_pretrained(folder).pooling == "cls"


# ------------------------------------------------------------------- (d) train, resume, eval, export
@pytest.fixture
def fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def _train_cfg(tmp_path, shards, model, **overrides):
    from pipeline.train.config import PROJECT_ROOT, Config

    base = {
        "data.shards": str(shards),
        "run_dir": str(tmp_path / "run"),
        "model.name_or_path": str(model),
        "model.pooling": None,  # the folder's rule
        "train.eval_max_pairs": 32,
        "checkpoint.every_steps": 2,
    }
    return load_config(Config, PROJECT_ROOT / "launch" / "configs" / "debug.yaml", {**base, **overrides})


def test_train_resume_eval_export_from_an_xlmr_folder(tmp_path, xlmr_folder, fresh_accelerate_state):
    from accelerate.state import AcceleratorState
    from sentence_transformers import SentenceTransformer

    from pipeline.train.build import build
    from pipeline.train.run import run

    shards = tmp_path / "shards"
    make_shards(shards, [[24, 16]], num_variants=3)

    # the loader's batches carry the prefix exactly once, padded with <pad> = 1
    cfg = _train_cfg(tmp_path / "probe", shards, xlmr_folder)
    trainer = build(cfg)
    try:
        assert (trainer.encoder.pooling, trainer.encoder.prefix) == ("mean", PREFIX)
        batch = next(iter(trainer.stream))
        tokenizer = trainer.encoder.tokenizer
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in batch.input_ids]
        assert all(t.startswith(PREFIX) and not t.startswith(PREFIX + "query:") for t in texts), texts[:2]
        assert (batch.input_ids[batch.attention_mask == 0] == 1).all()
    finally:
        trainer.close()
        AcceleratorState._reset_state(True)

    cfg = _train_cfg(tmp_path, shards, xlmr_folder, **{"train.max_steps": 4})
    assert run(cfg) == 0
    AcceleratorState._reset_state(True)
    assert (cfg.run_dir / "checkpoints" / "step-00000004").is_dir()
    cfg = _train_cfg(tmp_path, shards, xlmr_folder, **{"train.max_steps": 6})
    assert run(cfg) == 0
    AcceleratorState._reset_state(True)
    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in metrics if "loss" in r]  # a fresh start instead of a resume: 1..4, 1..6
    assert steps == [1, 2, 3, 4, 5, 6] and all(np.isfinite(r["loss"]) for r in metrics if "loss" in r)

    saved = json.loads((cfg.run_dir / "model" / "encoder.json").read_text())
    assert (saved["pooling"], saved["prefix"], saved["max_length"]) == ("mean", PREFIX, 32)

    out = tmp_path / "eval"
    argv = ["eval", str(cfg.run_dir / "model"), "--suite", "sts", "--sets", "[STS-B]", "--max-pairs", "30"]
    assert main([*argv, "--out", str(out), "--progress", "false"]) == 0
    assert np.isfinite(json.loads((out / "eval.json").read_text())["sts"]["model"]["STS-B"])

    export = tmp_path / "st"
    assert main(["export", str(cfg.run_dir), "--out", str(export)]) == 0
    texts = sample_sentences(6)
    trained = SentenceEncoder.from_pretrained(cfg.run_dir / "checkpoints" / "step-00000006" / "model")
    theirs = SentenceTransformer(str(export), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(trained.encode(texts), theirs, atol=1e-5)
    assert (
        np.abs(trained.encode(texts) - SentenceEncoder.from_pretrained(xlmr_folder).encode(texts)).max()
        > 1e-4
    )


def test_index_and_queries_use_the_prefix(xlmr_folder, plain_folder, tmp_path):
    from pipeline.search.api import SearchIndex

    corpus = sample_sentences(30)
    (tmp_path / "corpus.txt").write_text("\n".join(corpus) + "\n", encoding="utf-8")
    out = tmp_path / "idx"
    assert main(["index", str(xlmr_folder), "--input", str(tmp_path / "corpus.txt"), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["model"]["prefix"], manifest["model"]["pooling"]) == (PREFIX, "mean")
    index = SearchIndex.load(out, device="cpu")
    assert index.encoder.prefix == PREFIX
    hits = index.search([corpus[3]], k=1)[0]
    assert hits[0].text == corpus[3] and hits[0].score == pytest.approx(1.0, abs=1e-5)
    stored = index.vectors(np.array([hits[0].row]))
    np.testing.assert_allclose(
        stored, SentenceEncoder.from_pretrained(xlmr_folder).encode([corpus[3]]), atol=1e-5
    )
    # a query encoder without the prefix would not land on the stored vector
    unprefixed = SentenceEncoder.from_pretrained(xlmr_folder, prefix="").encode([corpus[3]])[0]
    assert float(unprefixed @ stored[0]) < 0.9999
    # a plain folder indexes with an explicit pooling and prefix; queries reuse the recorded ones
    out2 = tmp_path / "idx2"
    argv = ["index", str(plain_folder), "--input", str(tmp_path / "corpus.txt"), "--out", str(out2)]
    assert main([*argv, "--pooling", "mean", "--prefix", PREFIX]) == 0
    index2 = SearchIndex.load(out2, device="cpu")
    assert (index2.encoder.pooling, index2.encoder.prefix) == ("mean", PREFIX)
    np.testing.assert_allclose(index2.vectors(np.arange(30)), index.vectors(np.arange(30)), atol=1e-5)
