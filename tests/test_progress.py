"""Long work shows progress: tqdm on a terminal, one plain line per interval in a log file."""

from __future__ import annotations

import io
import json

from pipeline import progress
from pipeline.cli import main
from pipeline.resources import SAMPLE_CORPUS


class Log(io.StringIO):
    def isatty(self) -> bool:
        return False


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_each_report_is_a_whole_line(monkeypatch):
    monkeypatch.setenv("PIPELINE_PROGRESS_SECONDS", "0")
    out = Log()
    with progress.bar(desc="teacher", total=40, unit="sent", file=out) as bar:
        for _ in range(4):
            bar.update(10)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) >= 2
    assert all(line.startswith("teacher:") for line in lines)
    assert "40/40" in lines[-1] and len(lines) == len(set(lines))  # the final state once


def test_in_a_log_reports_are_spaced_by_the_interval(monkeypatch):
    monkeypatch.setenv("PIPELINE_PROGRESS_SECONDS", "3600")
    out = Log()
    with progress.bar(desc="split", total=1000, file=out) as bar:
        for _ in range(1000):
            bar.update(1)
    assert len(out.getvalue().splitlines()) == 2  # the start and the end, nothing in between


def test_on_a_terminal_it_is_plain_tqdm():
    out = Terminal()
    with progress.bar(desc="train", total=3, file=out) as bar:
        bar.update(3)
    assert "\r" in out.getvalue()


def test_preprocess_takes_progress_and_keeps_it_out_of_the_manifest(tmp_path, capsys):
    assert main(["preprocess", str(SAMPLE_CORPUS), f"--out={tmp_path / 'a'}", "--progress=false"]) == 0
    assert "split" not in capsys.readouterr().err  # no bar
    assert main(["preprocess", str(SAMPLE_CORPUS), f"--out={tmp_path / 'b'}"]) == 0
    assert "split:" in capsys.readouterr().err
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab"]
    assert manifests[0]["config"] == manifests[1]["config"] and "progress" not in manifests[0]["config"]
