"""Student surgery on tiny models built here: a WordPiece BertModel and a Unigram (XLM-R-like) one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny_models import xlmr_fast_tokenizer

from pipeline.cli import main
from pipeline.errors import ConfigError, InputError
from pipeline.model import SentenceEncoder
from pipeline.stages.student import Config, make_student, resolve_layers, token_strings

CORPUS = ["我们今天去北京", "天气很好，我们去公园", "北京的天气怎么样？", "hello world 123", "今天的天气"]
# Seen scripts, characters not in the corpus: their single-character pieces must survive the trim.
COVERED = ["今天我们去公园", "北京天气很好", "world hello", "天很好"]
CJK_NOT_IN_CORPUS = "猫"  # a CJK piece of the source vocabulary, never in the corpus
UNSEEN_SCRIPT = "жук"  # Cyrillic: pieces exist in the source, the script never occurs in the corpus
JUNK = [
    "我去",
    "东京",
    "大阪",
    "▁东京",
    "xyz",
    "▁xyz",
    "ку",
    "ж",
    "у",
    "к",
    "▁ж",
    "▁жук",
    "猫",
    "▁猫",
    "α",
    "β",
]


def _bert_config(vocab_size: int, pad: int) -> object:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=pad,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def _save(folder: Path, tokenizer: object, pad: int) -> Path:
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel(_bert_config(len(tokenizer), pad), add_pooling_layer=False)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "encoder.json").write_text(json.dumps({"pooling": "mean", "max_length": 32, "prefix": "q: "}))
    return folder


@pytest.fixture(scope="module")
def wordpiece_model(tmp_path_factory) -> Path:
    from pipeline.model import make_tokenizer

    folder = tmp_path_factory.mktemp("wp")
    chars = sorted({c for t in CORPUS + COVERED for c in t if not c.isspace()} | set("猫жук:q*"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "北京", "天气", "##llo", "he", "wor", "##ld"]
    vocab += chars + [f"##{c}" for c in chars if c.isascii()] + ["##ж", "##у", "##к", "东京", "大阪", "xyz"]
    vocab = list(dict.fromkeys(vocab))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = make_tokenizer(folder / "vocab.txt")
    (folder / "vocab.txt").unlink()
    return _save(folder, tokenizer, pad=0)


@pytest.fixture(scope="module")
def unigram_model(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    folder = tmp_path_factory.mktemp("uni")
    chars = sorted({c for t in CORPUS + COVERED for c in t if not c.isspace()} | set(":q*"))
    pieces = ["▁", "北京", "天气", "▁北京", "我们", "▁hello", "▁world", "▁wor", "ld", "今天", "▁q"]
    pieces += chars + [f"▁{c}" for c in chars] + JUNK
    pieces = list(dict.fromkeys(pieces))
    # scores: longer pieces likelier, so segmentations are not ties
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(p, -10.0 + 2.0 * len(p.strip("▁")) - 0.01 * i) for i, p in enumerate(pieces)]
    vocab += [("<mask>", 0.0)]
    backend = Tokenizer(Unigram(vocab, unk_id=3, byte_fallback=False))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer = xlmr_fast_tokenizer(backend)
    return _save(folder, tokenizer, pad=1)


def _student(source: Path, out: Path, corpus: Path | None = None, **kw) -> dict:
    texts = [corpus] if corpus else []
    return make_student(Config(model=str(source), out=out, texts=texts, trim_vocab=corpus is not None, **kw))


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    return path


def _layer_weights(model: torch.nn.Module, i: int) -> dict[str, torch.Tensor]:
    return model.encoder.layer[i].state_dict()


def test_resolve_layers() -> None:
    assert resolve_layers(12, keep_layers=3) == [0, 1, 2]
    assert resolve_layers(12, layers=[0, 4, 8, 11]) == [0, 4, 8, 11]
    with pytest.raises(ConfigError, match="out of range"):
        resolve_layers(4, layers=[0, 4])
    with pytest.raises(ConfigError, match="1..4"):
        resolve_layers(4, keep_layers=5)
    with pytest.raises(ConfigError, match="increasing"):
        resolve_layers(4, layers=[2, 1])


def test_keep_layers_copies_the_chosen_source_layers(wordpiece_model: Path, tmp_path: Path) -> None:
    from transformers import BertModel

    summary = _student(wordpiece_model, tmp_path / "s", layers=[1, 3])
    source = BertModel.from_pretrained(wordpiece_model, add_pooling_layer=False)
    student = SentenceEncoder.from_pretrained(tmp_path / "s")
    assert student.backbone.config.num_hidden_layers == 2 and len(student.backbone.encoder.layer) == 2
    for new, old in ((0, 1), (1, 3)):
        got, want = _layer_weights(student.backbone, new), _layer_weights(source, old)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(
        _layer_weights(student.backbone, 0)["output.dense.weight"],
        _layer_weights(source, 0)["output.dense.weight"],
    )
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    meta = json.loads((tmp_path / "s" / "encoder.json").read_text())
    assert config["student_surgery"]["layers"] == [1, 3] == meta["surgery"]["layers"]
    assert meta["pooling"] == "mean" and meta["prefix"] == "q: "  # carried through
    assert summary["parameters_after"] < summary["parameters_before"]


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_trim_keeps_covered_tokenisation_and_embeddings(kind: str, request, tmp_path: Path) -> None:
    source_dir = request.getfixturevalue(f"{kind}_model")
    summary = _student(source_dir, tmp_path / "s", _corpus(tmp_path), keep_layers=3)
    source = SentenceEncoder.from_pretrained(source_dir)
    student = SentenceEncoder.from_pretrained(tmp_path / "s")
    assert summary["vocab"]["pieces_kept"] == len(student.tokenizer) < len(source.tokenizer)
    assert student.backbone.get_input_embeddings().weight.shape[0] == len(student.tokenizer)
    assert student.backbone.config.vocab_size == len(student.tokenizer)
    pad = student.tokenizer.pad_token_id
    assert student.backbone.config.pad_token_id == pad == (1 if kind == "unigram" else 0)

    covered = CORPUS + COVERED + [CJK_NOT_IN_CORPUS + "天气"]
    texts = [student.prefix + t for t in covered]
    assert token_strings(student.tokenizer, texts) == token_strings(source.tokenizer, texts)
    # same text, same pieces: the student equals the source cut to its first 3 layers
    source_cut = SentenceEncoder.from_pretrained(source_dir)
    source_cut.backbone.encoder.layer = source_cut.backbone.encoder.layer[:3]
    np.testing.assert_allclose(student.encode(covered), source_cut.encode(covered), atol=1e-5)
    assert not np.allclose(source.encode(covered), source_cut.encode(covered), atol=1e-3)

    # a Cyrillic word: the source has pieces for it; no Cyrillic in the corpus, so the student maps to unk
    before = source.tokenizer(UNSEEN_SCRIPT, add_special_tokens=False)["input_ids"]
    after = student.tokenizer(UNSEEN_SCRIPT, add_special_tokens=False)["input_ids"]
    assert source.tokenizer.unk_token_id not in before
    assert student.tokenizer.unk_token_id in after
    vocab = student.tokenizer.get_vocab()
    assert CJK_NOT_IN_CORPUS in vocab and "*" in vocab  # single characters of blocks the corpus shows
    assert "α" not in vocab and "ж" not in vocab  # Greek and Cyrillic blocks: never in the corpus
    assert "东京" not in student.tokenizer.get_vocab()  # a multi-character piece the corpus never used


def test_rerun_is_a_no_op_and_a_different_folder_is_not_overwritten(
    unigram_model: Path, tmp_path: Path
) -> None:
    corpus = _corpus(tmp_path)
    _student(unigram_model, tmp_path / "s", corpus, keep_layers=2)
    mtime = (tmp_path / "s" / "model.safetensors").stat().st_mtime_ns
    assert _student(unigram_model, tmp_path / "s", corpus, keep_layers=2).get("unchanged")
    assert (tmp_path / "s" / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(InputError, match="--overwrite"):
        _student(unigram_model, tmp_path / "s", corpus, keep_layers=3)
    _student(unigram_model, tmp_path / "s", corpus, keep_layers=3, overwrite=True)
    assert SentenceEncoder.from_pretrained(tmp_path / "s").backbone.config.num_hidden_layers == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial dirs left


def test_bad_arguments_are_one_line_errors(unigram_model: Path, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    corpus = _corpus(tmp_path)
    cases = [
        (
            [str(unigram_model), "--out", str(tmp_path / "a"), "--layers", "0,4", "--texts", str(corpus)],
            "range",
        ),
        ([str(unigram_model), "--out", str(tmp_path / "b"), "--texts", str(empty)], "corpus is empty"),
        ([str(tmp_path / "nope"), "--out", str(tmp_path / "c"), "--texts", str(corpus)], "does not exist"),
        ([str(unigram_model), "--out", str(tmp_path / "d")], "needs a corpus"),
        (
            [str(unigram_model), "--out", str(tmp_path / "e"), "--keep_layers", "9", "--texts", str(corpus)],
            "1..4",
        ),
    ]
    for argv, message in cases:
        assert main(["student", *argv]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and message in errors[0], errors
    assert not any(p.is_dir() for p in tmp_path.iterdir())


def test_cli_prints_a_summary(wordpiece_model: Path, tmp_path: Path, capsys) -> None:
    corpus = _corpus(tmp_path)
    argv = [
        "student",
        str(wordpiece_model),
        "--out",
        str(tmp_path / "s"),
        "--layers",
        "0,2",
        "--texts",
        str(corpus),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layers kept       [0, 2] of 4" in out and "pieces kept" in out and "same pieces" in out


def test_model_dropout_is_a_training_setting_the_saved_model_keeps_its_own(
    wordpiece_model: Path, tmp_path: Path
) -> None:
    """model.dropout acts on every dropout module (two train-mode passes differ) but is not written into
    the model: a checkpoint or export keeps the folder's own dropout (0.0 here) in config.json."""
    import json

    from _train_data import debug_config
    from torch import nn

    from pipeline.train.build import build_encoder

    folder_config = json.loads((wordpiece_model / "config.json").read_text())
    assert folder_config["hidden_dropout_prob"] == 0.0
    cfg = debug_config(
        tmp_path,
        tmp_path / "no-shards",
        **{"model.name_or_path": str(wordpiece_model), "model.dropout": 0.3},
    )
    encoder = build_encoder(cfg)
    ps = {m.p for m in encoder.backbone.modules() if isinstance(m, nn.Dropout)}
    assert ps == {0.3}
    batch = encoder.tokenize(CORPUS[:4])
    encoder.train()
    torch.manual_seed(0)
    assert not torch.equal(encoder(**batch), encoder(**batch))  # dropout is on while training
    encoder.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (saved["hidden_dropout_prob"], saved["attention_probs_dropout_prob"]) == (
        folder_config["hidden_dropout_prob"],
        folder_config["attention_probs_dropout_prob"],
    )


def test_model_layers_cut_at_build_time(wordpiece_model: Path, tmp_path: Path) -> None:
    from _train_data import debug_config
    from transformers import BertModel

    from pipeline.train.build import build_encoder

    cfg = debug_config(
        tmp_path,
        tmp_path / "no-shards",
        **{"model.name_or_path": str(wordpiece_model), "model.layers": [0, 2]},
    )
    encoder = build_encoder(cfg)
    source = BertModel.from_pretrained(wordpiece_model, add_pooling_layer=False)
    assert encoder.backbone.config.num_hidden_layers == 2
    got, want = _layer_weights(encoder.backbone, 1), _layer_weights(source, 2)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ConfigError, match="model.layers"):
        debug_config(
            tmp_path, tmp_path, **{"model.name_or_path": str(wordpiece_model), "model.layers": [2, 0]}
        )


def test_corpus_reads_text_and_variants_of_shards(tiny_shards, tmp_path: Path) -> None:
    from pipeline.shards import read_shard, shard_paths
    from pipeline.stages.student import corpus_texts

    directory = tiny_shards([[6, 4], [5]], num_variants=2)
    want = []
    for path in shard_paths(directory):
        for table in read_shard(path):
            for text, variants in zip(table.column("text").to_pylist(), table.column("variants").to_pylist()):
                want += [text, *variants]
    texts = corpus_texts([directory], [_corpus(tmp_path)])
    assert sorted(texts) == sorted(want + CORPUS) and len(want) > 15
    assert len(corpus_texts([directory], [], max_sentences=7)) == 7
    with pytest.raises(InputError, match="not a directory"):
        corpus_texts([tmp_path / "nope"], [])


def test_seen_char_pieces_keeps_unused_pieces_of_corpus_characters(
    unigram_model: Path, tmp_path: Path
) -> None:
    corpus = _corpus(tmp_path)
    _student(unigram_model, tmp_path / "a", corpus)
    _student(unigram_model, tmp_path / "b", corpus, seen_char_pieces=True)
    plain, wide = (SentenceEncoder.from_pretrained(tmp_path / n).tokenizer for n in "ab")
    assert (
        "我去" not in plain.get_vocab() and "我去" in wide.get_vocab()
    )  # both characters occur, the piece not
    assert "东京" not in wide.get_vocab()  # 东 and 京 never occur in the corpus
    texts = ["q: " + t for t in CORPUS + COVERED]
    assert token_strings(wide, texts) == token_strings(plain, texts)


def test_model_random_init_keeps_architecture_and_draws_fresh_seeded_weights(
    wordpiece_model: Path, tmp_path: Path
) -> None:
    from _train_data import debug_config
    from transformers import BertModel

    from pipeline.train.build import build_encoder

    def build(seed: int):
        overrides = {"model.name_or_path": str(wordpiece_model), "model.random_init": True}
        overrides["train.seed"] = seed
        return build_encoder(debug_config(tmp_path, tmp_path / "no-shards", **overrides)).backbone

    source = BertModel.from_pretrained(wordpiece_model, add_pooling_layer=False)
    fresh, same_seed, other_seed = build(1), build(1), build(2)
    want, got = dict(source.named_parameters()), dict(fresh.named_parameters())
    assert want.keys() == got.keys() and all(want[k].shape == got[k].shape for k in want)
    linear = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(got[linear], want[linear])
    words = "embeddings.word_embeddings.weight"
    assert not torch.equal(got[words], want[words])
    # the architecture's own initialiser: normal(0, initializer_range) weights, unit LayerNorm, zero bias
    assert abs(got[linear].std().item() - source.config.initializer_range) < 0.005
    assert torch.all(got["embeddings.LayerNorm.weight"] == 1)
    assert torch.all(got["encoder.layer.0.attention.self.query.bias"] == 0)
    assert torch.equal(same_seed.get_parameter(linear), got[linear])
    assert not torch.equal(other_seed.get_parameter(linear), got[linear])
    with pytest.raises(ConfigError, match="random_init"):
        debug_config(tmp_path, tmp_path, **{"model.random_init": True, "model.pooling": "mean"})
