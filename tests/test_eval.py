import json
import math
import shutil

import numpy as np
import pytest
from scipy import sparse
from test_eval_fixtures import build_fake_run, tiny_model  # noqa: F401 (fixture)

from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.evaluate import resolve
from pipeline.evaluate.alignment import alignment, uniformity
from pipeline.evaluate.probe import LabelledTexts, linear_probe, read_labelled_tsv
from pipeline.evaluate.sts import (
    PairSet,
    load_sts_sets,
    pair_cosine,
    read_pair_file,
    score_pairs,
    spearman100,
)
from pipeline.evaluate.tfidf import CharTfidf, corpus_lines


def test_read_pair_file_tsv_and_jsonl(tmp_path):
    tsv = tmp_path / "p.tsv"
    tsv.write_text("今天天气好\t天气不错\t1\n\n我饿了\t股市大跌\t0\n", encoding="utf-8")
    pairs = read_pair_file(tsv)
    assert pairs.name == "p" and pairs.sentence2 == ["天气不错", "股市大跌"]
    assert pairs.labels.tolist() == [1.0, 0.0]
    jsonl = tmp_path / "q.jsonl"
    rows = [{"sentence1": "a", "sentence2": "b", "label": 4.5}, {"text1": "c", "text2": "d", "score": 1}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    assert read_pair_file(jsonl).labels.tolist() == [4.5, 1.0]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("bad.tsv", "a\tb\t1\na\tb\n", r"bad.tsv:2: expected 3 tab-separated columns"),
        ("bad.tsv", "a\tb\t1\na\tb\tyes\n", r"bad.tsv:2: label 'yes' is not a number"),
        (
            "bad.jsonl",
            '{"sentence1": "a", "sentence2": "b", "label": 1}\n{"sentence1": "a"}\n',
            r"bad.jsonl:2: missing",
        ),
        ("one.tsv", "a\tb\t1\nc\td\t1\n", "every label is 1.0"),
    ],
)
def test_read_pair_file_names_the_bad_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        read_pair_file(path)


def test_bundled_sets_and_positive_masks():
    sets = {s.name: s for s in load_sts_sets()}
    assert [len(sets[n]) for n in ("ATEC", "BQ", "LCQMC", "PAWSX", "STS-B")] == [
        20000,
        10000,
        8802,
        2000,
        1361,
    ]
    stsb = sets["STS-B"]
    assert stsb.positive_mask().sum() == int((stsb.labels >= 4).sum()) == 336
    assert sets["BQ"].positive_mask().sum() == int(sets["BQ"].labels.sum())
    sub = stsb.subsample(100, seed=3)
    assert len(sub) == 100 and sub.labels.tolist() == stsb.subsample(100, seed=3).labels.tolist()


def test_cosine_dense_and_sparse_agree_and_spearman():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(50, 8)), rng.normal(size=(50, 8))
    dense = pair_cosine(a, b)
    assert np.allclose(dense, pair_cosine(sparse.csr_matrix(a), sparse.csr_matrix(b)))
    assert np.allclose(dense, [x @ y / np.linalg.norm(x) / np.linalg.norm(y) for x, y in zip(a, b)])
    assert spearman100(np.arange(10.0), np.arange(10.0) ** 3) == pytest.approx(100.0)
    assert spearman100(np.ones(10), np.arange(10.0)) == 0.0


def test_alignment_and_uniformity_match_brute_force():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 16))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    assert alignment(x, x) == 0.0
    assert alignment(x[:10], -x[:10]) == pytest.approx(4.0)  # antipodal unit vectors: ||2x||^2
    sq = ((x[:, None] - x[None]) ** 2).sum(-1)
    off_diagonal = ~np.eye(40, dtype=bool)
    exact = math.log(np.exp(-2 * sq[off_diagonal]).mean())
    assert uniformity(x, num_pairs=400_000, seed=0) == pytest.approx(exact, abs=0.01)
    collapsed = np.tile(x[:1], (40, 1))
    assert uniformity(collapsed, num_pairs=1000) == pytest.approx(0.0, abs=1e-9)


def test_tfidf_floor_on_stsb_matches_the_reference():
    stsb = load_sts_sets(["STS-B"])[0]
    score, _ = score_pairs(CharTfidf(corpus_lines() + stsb.sentences()), stsb)
    assert score == pytest.approx(66.58, abs=0.5)  # the data provider's figure for its recipe


def test_linear_probe_separates_an_easy_signal():
    texts = [f"{'好' if i % 2 else '坏'}{i}" for i in range(200)]
    data = LabelledTexts(texts, np.asarray([i % 2 for i in range(200)]))

    def embed(batch):
        return np.asarray([[1.0, 0.0] if t[0] == "好" else [0.0, 1.0] for t in batch])

    result = linear_probe(embed, data, test_size=0.2, seed=0)
    assert result["accuracy"] == 100.0 and result["macro_f1"] == 100.0
    assert (result["train"], result["test"]) == (160, 40)
    bundled = read_labelled_tsv()
    assert len(bundled.texts) == 17363 and set(bundled.labels.tolist()) == {0, 1}


def test_linear_probe_reads_a_signal_inside_a_narrow_cone():
    # Unit vectors that all point almost the same way (a briefly trained contrastive encoder), the
    # label in a 1e-4 offset along one coordinate: plain C=1 logistic regression on raw vectors
    # predicts the majority class here; the probe must still find the signal.
    rng = np.random.default_rng(0)
    labels = np.asarray([i % 2 for i in range(400)])
    vectors = np.zeros((400, 8))
    vectors[:, 0] = 1.0
    vectors[:, 1] = np.where(labels == 1, 1e-4, -1e-4) + rng.normal(0, 3e-5, 400)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    data = LabelledTexts([str(i) for i in range(400)], labels)
    result = linear_probe(lambda batch: vectors[[int(t) for t in batch]], data, test_size=0.25, seed=0)
    assert result["accuracy"] > 95


def _eval_argv(model, out, *extra):
    return ["eval", str(model), "--max-pairs", "40", "--out", str(out), "--progress", "false", *extra]


def test_eval_cli_writes_json_and_markdown(tiny_model, tmp_path, capsys):  # noqa: F811
    user = tmp_path / "mine.tsv"
    user.write_text("".join(f"句子{i}\t句子{i % 7}\t{i % 3}\n" for i in range(30)), encoding="utf-8")
    argv = _eval_argv(
        tiny_model,
        tmp_path / "out",
        "--whitening",
        "--whitening-sentences",
        "100",
        "--pairs",
        str(user),
        "--uniformity-pairs",
        "2000",
    )
    assert main(argv) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text(encoding="utf-8"))
    sts = result["sts"]
    assert sts["sets"] == ["ATEC", "BQ", "LCQMC", "PAWSX", "STS-B", "mine"]
    assert sts["pairs"]["ATEC"] == 40 and sts["pairs"]["mine"] == 30
    for row in ("model", "model_whitened", "tfidf"):
        assert set(sts[row]) == {*sts["sets"], "avg5"}
        assert all(-100 <= v <= 100 for v in sts[row].values())
        five = [sts[row][n] for n in ("ATEC", "BQ", "LCQMC", "PAWSX", "STS-B")]
        assert sts[row]["avg5"] == pytest.approx(np.mean(five))
    assert sts["model"] != sts["model_whitened"]
    assert result["model"]["pooling"] == "cls" and result["model"]["dim"] == 32
    assert set(result["align"]) == set(sts["sets"])
    assert all(v["uniform"] <= 0 for v in result["align"].values())
    assert 0 <= result["probe"]["accuracy"] <= 100 and result["probe"]["train"] == 32
    md = (tmp_path / "out" / "eval.md").read_text(encoding="utf-8")
    assert "| model + whitening |" in md and "char TF-IDF" in md and "macro F1" in md
    assert "| model |" in capsys.readouterr().out


def test_eval_whitening_on_eval_sentences_differs_from_corpus(tiny_model, tmp_path):  # noqa: F811
    results = {}
    for source in ("corpus", "eval"):
        out = tmp_path / source
        argv = _eval_argv(
            tiny_model,
            out,
            "--suite",
            "sts",
            "--sets",
            "STS-B",
            "--whitening",
            "--whitening-source",
            source,
            "--whitening-sentences",
            "200",
            "--whitening-dim",
            "16",
        )
        assert main(argv) == 0
        results[source] = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    assert results["corpus"]["sts"]["model"] == results["eval"]["sts"]["model"]
    assert results["corpus"]["sts"]["model_whitened"] != results["eval"]["sts"]["model_whitened"]
    assert "avg5" not in results["corpus"]["sts"]["model"]  # a partial mean would mislead
    assert results["eval"]["whitening"]["dim"] == 16


def test_resolve_checkpoints_and_runs(tiny_model, tmp_path):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    latest = resolve.resolve(run)
    assert latest.kind == "checkpoint" and latest.checkpoint_dir.name == "step-00000020"
    assert resolve.resolve(str(run), which="best").checkpoint_dir.name == "step-00000010"
    assert resolve.resolve(str(run / "checkpoints")).checkpoint_dir.name == "step-00000020"
    ckpt = run / "checkpoints" / "step-00000010"
    assert resolve.resolve(str(ckpt)).model_dir == ckpt / "model"
    assert resolve.describe(resolve.resolve(str(ckpt)))["step"] == 10
    assert resolve.resolve(str(tiny_model)).kind == "model"
    assert resolve.resolve("someone/some-model").kind == "hub"
    # a finished run also holds its final model/: --checkpoint latest|best must still be honoured
    shutil.copytree(tiny_model, run / "model")
    assert resolve.resolve(str(run), which="best").checkpoint_dir.name == "step-00000010"
    assert resolve.resolve(str(run)).checkpoint_dir.name == "step-00000020"
    assert resolve.resolve(str(run / "model")).kind == "model"


def test_eval_default_out_is_inside_the_checkpoint(tiny_model, tmp_path):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    assert (
        main(
            [
                "eval",
                str(run),
                "--max-pairs",
                "20",
                "--suite",
                "sts",
                "--sets",
                "PAWSX",
                "--progress",
                "false",
            ]
        )
        == 0
    )
    assert (run / "checkpoints" / "step-00000020" / "eval" / "eval.json").is_file()


def _corrupt(tiny_model, tmp_path):  # noqa: F811
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 100)
    return broken


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m, t: t / "nowhere", "does not exist"),
        (lambda m, t: _corrupt(m, t), "cannot load model from"),
        (lambda m, t: (t / "empty").mkdir() or t / "empty", "is not a model folder"),
        (lambda m, t: m / "encoder.json", "is a file"),
    ],
)
def test_eval_bad_models_are_one_line(tiny_model, tmp_path, capsys, make, message):  # noqa: F811
    target = make(tiny_model, tmp_path)
    assert main(_eval_argv(target, tmp_path / "out", "--suite", "sts", "--sets", "PAWSX")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_eval_run_without_best_pointer(tiny_model, tmp_path, capsys):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    (run / "checkpoints" / "best").unlink()
    assert main(_eval_argv(run, tmp_path / "out", "--checkpoint", "best", "--suite", "sts")) == 2
    assert "has no checkpoints/best" in capsys.readouterr().err


def test_eval_stale_latest_pointer(tiny_model, tmp_path, capsys):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    (run / "checkpoints" / "latest").write_text("step-00000099\n")
    assert main(_eval_argv(run, tmp_path / "out", "--suite", "sts")) == 2
    assert "names 'step-00000099', which is not a directory" in capsys.readouterr().err


def test_eval_hub_name_offline_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(_eval_argv("no-such-user/no-such-model", tmp_path / "out", "--suite", "sts")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot load model 'no-such-user/no-such-model'" in err[0]


def test_tfidf_only_needs_no_model(tmp_path):
    assert main(["eval", "--suite", "tfidf", "--sets", "PAWSX", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "eval.json").read_text(encoding="utf-8"))
    assert result["model"] is None and result["sts"]["tfidf"]["PAWSX"] == pytest.approx(3.23, abs=0.5)


@pytest.mark.slow
def test_tfidf_avg5_close_to_reference(tmp_path):
    assert main(["eval", "--suite", "tfidf", "--out", str(tmp_path)]) == 0
    tfidf = json.loads((tmp_path / "eval.json").read_text(encoding="utf-8"))["sts"]["tfidf"]
    reference = {"ATEC": 25.70, "BQ": 44.94, "LCQMC": 43.92, "PAWSX": 3.23, "STS-B": 66.58, "avg5": 36.87}
    for name, value in reference.items():
        assert tfidf[name] == pytest.approx(value, abs=1.0), name


def test_pairset_sentences_dedupes():
    p = PairSet("x", ["a", "b", "a"], ["b", "c", "d"], np.asarray([0.0, 1.0, 0.0]))
    assert p.sentences() == ["a", "b", "c", "d"]
