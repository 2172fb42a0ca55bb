"""Calibrated similarity: the isotonic map, its metrics, the file export --calibrate writes, and the
similarity command that reads it."""

import json

import numpy as np
import pytest
from test_eval_fixtures import build_tiny_encoder

from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.evaluate import calibration as cal


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Cosines with a known P(positive | cosine) = (cosine - 0.5) / 0.5 on [0.5, 1]."""
    rng = np.random.default_rng(seed)
    cosines = rng.uniform(0.5, 1.0, n)
    return cosines, rng.uniform(size=n) < (cosines - 0.5) / 0.5


def test_isotonic_fit_is_monotone_and_calibrated_on_held_out_pairs():
    cosines, positive = synthetic(4000, 0)
    calibration = cal.fit_isotonic(cosines, positive)
    assert (np.diff(calibration.cosine) >= 0).all() and (np.diff(calibration.probability) >= 0).all()
    grid = np.linspace(0.4, 1.1, 200)
    assert (np.diff(calibration(grid)) >= 0).all()  # monotone also between and beyond the knots
    assert calibration(np.array([0.0]))[0] == calibration.probability[0]  # clipped, not extrapolated
    held_cos, held_pos = synthetic(4000, 1)
    figures = cal.summary(calibration, held_cos, held_pos)
    assert figures["ece"] < 0.03
    assert figures["brier"] < figures["brier_base_rate"] - 0.05  # it knows more than the base rate
    # the raw cosine used as a probability is badly calibrated here: the metric can tell
    assert cal.expected_calibration_error(held_cos, held_pos) > 0.2


def test_metrics_on_hand_computed_cases():
    assert cal.brier(np.array([1.0, 0.0, 0.5]), np.array([1, 0, 1])) == pytest.approx(0.25 / 3)
    # two bins: {0.1, 0.1} with no positive (error 0.1), {0.9, 0.7} with both positive (0.1 and 0.3 -> 0.2)
    p, y = np.array([0.1, 0.1, 0.9, 0.7]), np.array([0, 0, 1, 1])
    assert cal.expected_calibration_error(p, y, bins=2) == pytest.approx((2 * 0.1 + 2 * 0.2) / 4)
    assert cal.expected_calibration_error(np.array([1.0]), np.array([1])) == 0.0  # p = 1 has a bin
    positive, rule = cal.positive_labels(np.array([0, 1, 1, 0]), None)
    assert positive.tolist() == [False, True, True, False] and rule == "label >= 1"
    positive, rule = cal.positive_labels(np.array([0.0, 3.8, 4.0, 5.0]), None)
    assert positive.tolist() == [False, False, True, True] and rule == "label >= 4"
    fit, held = cal.split_indices(10, 0.2, seed=3)
    assert len(held) == 2 and sorted([*fit, *held]) == list(range(10))


def test_threshold_table_precision_and_recall():
    calibration = cal.Calibration(np.array([0.0, 0.5, 0.8, 1.0]), np.array([0.0, 0.2, 0.6, 1.0]))
    cosines = np.array([0.1, 0.6, 0.85, 0.95, 0.99])
    positive = np.array([0, 1, 0, 1, 1])
    rows = {r["probability"]: r for r in cal.threshold_table(calibration, cosines, positive, (0.5, 0.95))}
    # P >= 0.5 <=> cosine >= 0.5 + 0.3 / 0.4 * 0.3 = 0.725: 0.85, 0.95, 0.99 -> 2 of 3 right, 2 of 3 found
    assert rows[0.5]["predicted_positive"] == 3
    assert rows[0.5]["precision"] == pytest.approx(2 / 3, abs=1e-4) and rows[0.5]["recall"] == pytest.approx(
        2 / 3, abs=1e-4
    )
    assert rows[0.5]["cosine"] == pytest.approx(0.725)  # where the curve reaches 0.5
    assert calibration(np.array([rows[0.5]["cosine"]]))[0] == pytest.approx(0.5)
    # P >= 0.95 <=> cosine >= 0.8 + 0.35 / 0.4 * 0.2 = 0.975: only 0.99, a positive
    assert rows[0.95]["cosine"] == pytest.approx(0.975)
    assert (rows[0.95]["predicted_positive"], rows[0.95]["precision"], rows[0.95]["recall"]) == (
        1,
        1.0,
        0.3333,
    )


def test_calibration_file_round_trip_and_refusals(tmp_path):
    cosines, positive = synthetic(500, 2)
    calibration = cal.fit_isotonic(cosines, positive)
    calibration.info = {"fitted_on": {"file": "x.tsv"}}
    path = tmp_path / cal.CALIBRATION_FILE
    calibration.save(path)
    back = cal.Calibration.load(path)
    assert back.info["fitted_on"] == {"file": "x.tsv"} and back.method == "isotonic"
    grid = np.linspace(0.4, 1.0, 50)
    assert np.abs(back(grid) - calibration(grid)).max() < 1e-12

    data = json.loads(path.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**data, "probability": data["probability"][::-1]}))
    with pytest.raises(InputError, match="non-decreasing"):
        cal.Calibration.load(bad)
    bad.write_text(json.dumps({**data, "format": "other"}))
    with pytest.raises(InputError, match="not a similarity calibration file"):
        cal.Calibration.load(bad)
    bad.write_text("{")
    with pytest.raises(InputError, match="not readable JSON"):
        cal.Calibration.load(bad)
    with pytest.raises(InputError, match="both kinds"):
        cal.fit_isotonic(cosines, np.zeros(len(cosines)))


@pytest.fixture(scope="module")
def calibrated_export(tmp_path_factory):
    """A tiny model exported with --calibrate on 300 bundled STS-B train pairs (20% held out)."""
    from pipeline.resources import EVAL_DIR

    root = tmp_path_factory.mktemp("calibrated")
    model = build_tiny_encoder(root / "model", "mean", seed=2, max_length=32)
    pairs = root / "train_pairs.tsv"
    pairs.write_text(
        "".join((EVAL_DIR / "STS-B.train.tsv").read_text(encoding="utf-8").splitlines(True)[:300]),
        encoding="utf-8",
    )
    out = root / "st"
    argv = ["export", str(model), "--out", str(out), "--calibrate", "--calibration-pairs", str(pairs)]
    assert main(argv) == 0
    return out


def test_export_writes_the_calibration_file_and_card_section(calibrated_export):
    calibration = cal.Calibration.load(calibrated_export / cal.CALIBRATION_FILE)
    info = calibration.info
    assert (
        info["fitted_on"]["file"] == "train_pairs.tsv" and info["fitted_on"]["positive_rule"] == "label >= 4"
    )
    assert info["fitted_on"]["pairs"] == 240 and info["held_out"]["pairs"] == 60
    assert "left out of the fit" in info["held_out"]["file"]
    assert 0 <= info["held_out"]["ece"] <= 1 and 0 <= info["held_out"]["brier"] <= 1
    assert [r["probability"] for r in info["thresholds"]] == list(cal.THRESHOLDS)
    assert "does not" in info["transfer"]
    card = (calibrated_export / "README.md").read_text(encoding="utf-8")
    assert "## Calibrated similarity" in card and "| P >= | cosine >= | precision | recall |" in card
    assert f"expected calibration error {info['held_out']['ece']:.4f}" in card


def test_export_refuses_to_calibrate_on_a_scored_set(tmp_path, capsys):
    from pipeline.resources import EVAL_DIR

    model = build_tiny_encoder(tmp_path / "model", "cls", seed=1)
    argv = ["export", str(model), "--out", str(tmp_path / "st"), "--calibrate"]
    assert main([*argv, "--calibration-pairs", str(EVAL_DIR / "LCQMC.dev.tsv")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "scored evaluation set" in errors[0]
    assert not (tmp_path / "st").exists()


def test_similarity_command_prints_cosine_and_probability(calibrated_export, tmp_path, capsys):
    from pipeline.model import SentenceEncoder

    capsys.readouterr()
    assert main(["similarity", str(calibrated_export), "花呗怎么还款", "花呗如何还钱"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    cosine, p_same, s1, s2 = out[0].split("\t")
    vectors = SentenceEncoder.from_pretrained(calibrated_export).encode(["花呗怎么还款", "花呗如何还钱"])
    assert float(cosine) == pytest.approx(float(vectors[0] @ vectors[1]), abs=1e-4)
    calibration = cal.Calibration.load(calibrated_export / cal.CALIBRATION_FILE)
    assert float(p_same) == pytest.approx(calibration(np.array([float(cosine)]))[0], abs=1e-3)
    assert (s1, s2) == ("花呗怎么还款", "花呗如何还钱")

    labelled = tmp_path / "pairs.tsv"
    labelled.write_text(
        "一只猫\t一只狗\t0\n花呗怎么还款\t花呗如何还钱\t1\n今天天气\t今天天气\t1\n", encoding="utf-8"
    )
    assert main(["similarity", str(calibrated_export), "--pairs", str(labelled)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 3 and lines[1] == out[0]
    assert float(lines[2].split("\t")[0]) == pytest.approx(1.0, abs=1e-4)  # identical sentences
    assert "3 labelled pairs" in captured.err and "ECE" in captured.err


@pytest.mark.parametrize(
    "content, message",
    [("一只猫\t一只狗\t0\n只有一列\n", "pairs.tsv:2"), ("一只猫\t一只狗\tmaybe\n", "pairs.tsv:1")],
)
def test_similarity_bad_pairs_file_is_one_line_naming_file_and_line(
    calibrated_export, tmp_path, capsys, content, message
):
    path = tmp_path / "pairs.tsv"
    path.write_text(content, encoding="utf-8")
    capsys.readouterr()
    assert main(["similarity", str(calibrated_export), "--pairs", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_similarity_without_calibration_prints_cosine_and_says_so(tmp_path, capsys):
    model = build_tiny_encoder(tmp_path / "model", "cls", seed=1)
    capsys.readouterr()
    assert main(["similarity", str(model), "一只猫", "一只狗"]) == 0
    captured = capsys.readouterr()
    cosine, p_same, *_ = captured.out.strip().split("\t")
    assert -1 <= float(cosine) <= 1 and p_same == "-"
    assert "no similarity_calibration.json" in captured.err
    assert main(["similarity", str(model), "只有一句"]) == 2
    assert "exactly two sentences" in capsys.readouterr().err
