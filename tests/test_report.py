import json
import logging

import numpy as np
import pytest
from test_eval_fixtures import build_fake_run, tiny_model  # noqa: F401 (fixture)

from pipeline.cli import main
from pipeline.evaluate.plots import label_groups, metric_series, plot_similarity, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_metrics_are_read_tolerantly(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "samples_seen": 64, "loss": 3.0, "lr": 1e-5, "note": "warmup", "ok": True},
        "garbage {",
        [1, 2],
        {"step": 2, "samples_seen": 128, "loss": 2.5, "lr": 2e-5, "batch": {"pos_cos": 0.9}},
        {"step": 2, "eval": {"stsb_valid": 40.5, "probe": {"acc": 70}}},
        {"loss": float("nan")},
    ]
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    with caplog.at_level(logging.WARNING):
        records, bad = read_metrics(path)
    assert (len(records), bad) == (4, 2)
    assert "skipped 2 malformed line(s) (first at line 2)" in caplog.text
    train, evals = metric_series(records)
    assert set(train) == {"loss", "lr", "batch/pos_cos"}  # strings, booleans and NaN are not series
    assert train["loss"] == ([1, 2], [3.0, 2.5])
    assert evals == {"stsb_valid": ([2], [40.5]), "probe/acc": ([2], [70.0])}


def test_label_groups_and_similarity_plot(tmp_path):
    groups = label_groups(np.array([0, 1, 1, 0]))
    assert [t for t, _ in groups] == ["0", "1"] and groups[1][1].tolist() == [False, True, True, False]
    continuous = label_groups(np.linspace(0, 5, 50))
    assert [t for t, _ in continuous] == ["0", "1", "2", "3", "4", "5"]
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    png = plot_similarity(
        {"toy": (0.5 + 0.4 * labels + 0.05 * rng.normal(size=200), labels)}, tmp_path / "s.png"
    )
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_report_writes_plots_and_markdown(tiny_model, tmp_path):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    eval_dir = run / "checkpoints" / "step-00000020" / "eval"
    eval_dir.mkdir()
    result = {"sts": {"sets": ["STS-B"], "pairs": {"STS-B": 1361}, "model": {"STS-B": 12.5}}}
    (eval_dir / "eval.json").write_text(json.dumps(result))
    argv = ["report", str(run), "--max-pairs", "60", "--sets", "STS-B", "--sets", "BQ", "--progress", "false"]
    assert main(argv) == 0
    report = run / "report"
    for name in ("training.png", "eval_curves.png", "similarity.png"):
        data = (report / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
        assert f"]({name})" in (report / "report.md").read_text(encoding="utf-8")
    md = (report / "report.md").read_text(encoding="utf-8")
    assert "1 malformed line(s) skipped" in md
    assert "| model | 12.50 |" in md
    assert "```yaml\ndata:\n  shards: data/augmented" in md


def test_report_without_metrics_or_checkpoints(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert main(["report", str(run), "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text(encoding="utf-8")
    assert "No `metrics.jsonl`" in md and "No similarity plot" in md and "No eval.json yet" in md


def test_report_missing_run_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run directory" in err[0] and "does not exist" in err[0]


def test_trainer_events_become_eval_curves_or_are_left_out():
    records = [
        {"event": "unk_rate", "ATEC.test": 0.12, "BQ.dev": 0.003},  # a start-up report, not a curve
        {"step": 10, "loss": 5.0, "lr": 1e-4},
        {"event": "eval", "step": 10, "sts_b_valid_spearman": 40.0},
        {"step": 20, "loss": 4.0, "lr": 2e-4},
        {"event": "eval", "step": 20, "sts_b_valid_spearman": 45.0},
    ]
    train, evals = metric_series(records)
    assert set(train) == {"loss", "lr"}
    assert evals == {"sts_b_valid_spearman": ([10, 20], [40.0, 45.0])}


def test_report_encodes_in_the_precision_it_is_given(tiny_model, tmp_path, monkeypatch):  # noqa: F811
    from pipeline.model.encoder import SentenceEncoder

    run = build_fake_run(tmp_path / "run", tiny_model)
    seen, encode = [], SentenceEncoder.encode

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("bf16"))
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(SentenceEncoder, "encode", recording)
    for precision, expected in (("fp32", False), ("bf16", True)):
        seen.clear()
        argv = ["report", str(run), "--max-pairs", "20", "--sets", "STS-B", "--progress", "false"]
        assert main([*argv, "--precision", precision, "--out", str(tmp_path / precision)]) == 0
        assert seen and set(seen) == {expected}
        assert (tmp_path / precision / "similarity.png").read_bytes()[:8] == PNG_MAGIC


def test_report_refuses_bf16_off_the_cpu_in_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--precision", "bf16", "--device", "cuda:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision bf16 is CPU autocast" in err[0]


def test_the_similarity_plot_reuses_evals_cosines_of_the_same_weights(
    tiny_model,  # noqa: F811
    tmp_path,
    monkeypatch,
    caplog,
):
    """eval saves each set's per-pair cosines with the weights' sha256; report plots those of the same
    weights and precision without loading the encoder, and encodes again for other weights."""
    from pipeline.evaluate import report, resolve

    run = build_fake_run(tmp_path / "run", tiny_model)
    sets = ["--sets", "[STS-B, PAWSX]"]
    assert (
        main(["eval", str(run), "--suite", "[sts]", *sets, "--progress", "false", "--out", str(run / "eval")])
        == 0
    )
    record = json.loads((run / "eval" / "eval.json").read_text())["cosines"]
    assert record["pairs"] == {"STS-B": 1361, "PAWSX": 2000} and record["max_pairs"] is None
    cfg = report.Config(run_dir=run, sets=["STS-B", "PAWSX"], max_pairs=300, progress=False)
    resolved = resolve.resolve(run, "best")
    encoded = report.similarity_by_set(resolved, cfg, None)
    evaluation = report.find_eval(run, resolved.checkpoint_dir)

    def refuse(*args, **kwargs):
        raise AssertionError("the report loaded the encoder")

    monkeypatch.setattr(resolve, "load_encoder", refuse)
    with caplog.at_level(logging.INFO):
        reused = report.similarity_by_set(resolved, cfg, evaluation)
    assert "nothing to encode" in caplog.text
    for name, (cosines, labels) in encoded.items():
        assert len(reused[name][0]) == 300 and np.array_equal(reused[name][1], labels)
        assert np.allclose(reused[name][0], cosines, atol=1e-5)  # the same pairs, the same cosines
    assert main(["report", str(run), "--sets", "STS-B", "--sets", "PAWSX", "--max-pairs", "300",
                 "--progress", "false"]) == 0  # fmt: skip
    assert (run / "report" / "similarity.png").read_bytes()[:8] == PNG_MAGIC

    other = {**evaluation[1], "cosines": {**record, "weights_sha256": "0" * 64}}  # other weights: encode
    with pytest.raises(AssertionError, match="loaded the encoder"):
        report.similarity_by_set(resolved, cfg, (evaluation[0], other))
    other["cosines"] = {**record, "precision": "bf16"}  # another precision: encode
    with pytest.raises(AssertionError, match="loaded the encoder"):
        report.similarity_by_set(resolved, cfg, (evaluation[0], other))
