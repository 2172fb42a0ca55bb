"""The training entry points leave through ``exit_process``: the run's exit code, the exit handlers, the
non-daemon threads and the standard streams as at a normal exit, but no interpreter teardown (under
which native threads aborted a finished run now and then: pipeline/train/run.py says why)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path

    from pipeline.cli import exit_process

    out = Path(sys.argv[1])

    def late_writer():  # a non-daemon thread still working when the script ends
        time.sleep(0.5)
        (out / "thread.txt").write_text("done")

    threading.Thread(target=late_writer).start()
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    sys.stdout.write("unflushed line")  # no newline, no flush: only the exit's flush delivers it
    exit_process(int(sys.argv[2]))
    """
)


def test_exit_process_keeps_code_handlers_threads_and_output(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "75"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=120,
    )
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout == "unflushed line"
    assert (tmp_path / "thread.txt").read_text() == "done"
    assert (tmp_path / "atexit.txt").read_text() == "ran"


ENTRY = textwrap.dedent(
    """
    import os, runpy, sys

    import pipeline.cli

    def recorded(code):
        print(f"exit_process({code})", flush=True)
        os._exit(code)

    pipeline.cli.exit_process = recorded
    if sys.argv[1] == "module":
        sys.argv = ["pipeline", "train", "--help"]
        runpy.run_module("pipeline", run_name="__main__")
    else:
        path = sys.argv[1]
        sys.argv = [path, "--help"]
        runpy.run_path(path, run_name="__main__")
    print("returned without exit_process")
    """
)


def test_entry_points_leave_through_exit_process(tmp_path):
    """`python -m pipeline train` and launch/pretrain.py end in exit_process (a plain sys.exit would
    bring the teardown back)."""
    script = tmp_path / "entry.py"
    script.write_text(ENTRY)
    for entry in ("module", str(PROJECT_ROOT / "launch" / "pretrain.py")):
        proc = subprocess.run(
            [sys.executable, str(script), entry],
            capture_output=True,
            text=True,
            cwd=PROJECT_ROOT,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "--loss" in proc.stdout  # the help ran
        assert proc.stdout.rstrip().endswith("exit_process(0)"), proc.stdout[-300:]
