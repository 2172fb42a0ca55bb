"""`python -m pipeline ... --help | head`: a reader that stops reading ends the command quietly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [["--help"], ["tokenize", "--help"]])
def test_a_closed_stdout_ends_the_command_without_a_traceback(argv):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write meets a broken pipe
    try:
        command = [sys.executable, "-m", "pipeline", *argv]
        done = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, cwd=REPO, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 1
    assert done.stderr == b""  # no traceback, no "Exception ignored" at exit


def test_help_to_an_open_pipe_is_whole():
    command = [sys.executable, "-m", "pipeline", "tokenize", "--help"]
    done = subprocess.run(command, capture_output=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and b"--max_length" in done.stdout and done.stderr == b""
