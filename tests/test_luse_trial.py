"""benchmarks/luse_trial.py: what it reads from the trial's run folders, and its per-task verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _scripts import benchmark_module


def _run(root: Path, name: str, avg5: float, tests: dict[tuple[str, str], float], dev: float) -> None:
    (root / name / "zs").mkdir(parents=True)
    (root / name / "ft").mkdir()
    sts = {"ATEC": 1.0, "BQ": 2.0, "LCQMC": 3.0, "PAWSX": 4.0, "STS-B": 5.0, "avg5": avg5}
    (root / name / "zs" / "eval.json").write_text(json.dumps({"sts": {"model": sts}}))
    tasks: dict = {}
    for (task, regime), score in tests.items():
        entry = tasks.setdefault(task, {"metric": "spearman", "regimes": {}})
        entry["regimes"][regime] = {"test": [score], "dev": [dev]}
    (root / name / "ft" / "finetune.json").write_text(json.dumps({"tasks": tasks}))


def test_the_verdict_needs_a_difference_beyond_the_larger_std(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    # cut: A at 10 ± 0 (two seeds), B at 50 / 54 (std 2.83)
    _run(runs, "cut-s0", 30.0, {("A", "train"): 10.0, ("B", "train"): 50.0}, dev=20.0)
    _run(runs, "cut-s1", 30.0, {("A", "train"): 10.0, ("B", "train"): 54.0}, dev=22.0)
    # luse: A +1 with std 0.71 (better), B +2 within B's spread (level)
    _run(runs, "luse-s0", 31.0, {("A", "train"): 10.5, ("B", "train"): 54.0}, dev=30.0)
    _run(runs, "luse-s1", 33.0, {("A", "train"): 11.5, ("B", "train"): 54.0}, dev=32.0)
    (runs / "luse-s2").mkdir()  # a run still going: no results yet, left out
    (runs / "nofn-s0").mkdir()
    (runs / "nofn-s0" / "identical.txt").write_text("nofn seed 0: bit-identical to luse's\n")
    with benchmark_module("luse_trial") as trial:
        arms = trial.load(runs)
        assert arms["luse"]["seeds"] == [0, 1] and arms["cut"]["seeds"] == [0, 1]
        assert arms["luse"]["zs"]["avg5"] == [31.0, 33.0]
        assert arms["luse"]["dev"]["train"] == [30.0, 32.0]  # one mean over tasks per seed
        assert trial.verdict([10.5, 11.5], [10.0, 10.0]) == ("better", 1.0)
        assert trial.verdict([54.0, 54.0], [50.0, 54.0])[0] == "level"
        assert trial.verdict([1.0, 1.0], [5.0, 5.0]) == ("worse", -4.0)
        assert trial.verdict(None, [1.0]) is None
        monkeypatch.setattr(sys, "argv", ["luse_trial.py", str(runs), "--plot", str(tmp_path / "d.png")])
        assert trial.main() == 0
    out = capsys.readouterr().out
    assert "nofn seed 0: bit-identical" in out and "| nofn |" not in out
    assert "| luse vs cut | TrainBERT | +1.00 better | +2.00 level | 1 / 1 / 0 |" in out
    assert (tmp_path / "d.png").stat().st_size > 0
