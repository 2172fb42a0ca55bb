"""launch/run_sample.sh with MODEL in a folder of any name: the distillation is told which teacher the
shards were encoded with (the config's ``data.teacher: e5-small`` matches only a folder of that name,
and the run stopped with a config error after the data stages). The stages are a stub (PYTHON is a shim
that records each command); the match itself is pipeline.vectors.matches, as training checks it."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from pipeline.vectors import matches

REPO = Path(__file__).resolve().parents[1]


def test_training_names_the_teacher_folder(tmp_path):
    log = tmp_path / "commands.log"
    shim = tmp_path / "python"
    shim.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {log}\n')
    shim.chmod(0o755)
    model = tmp_path / "teachers" / "my-e5"  # not named e5-small
    env = {**os.environ, "PYTHON": str(shim), "OUT": str(tmp_path / "out"), "MODEL": str(model)}
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "run_sample.sh"), "--train.max_steps=3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    commands = log.read_text().splitlines()
    train = next((c for c in commands if "launch/pretrain.py" in c), None)
    assert train is not None, (proc.returncode, proc.stderr[-2000:], commands)
    teacher_stage = next(c for c in commands if c.startswith("-m pipeline teacher"))
    assert f"--model {model}" in teacher_stage  # what the shards' manifest records as the teacher's name
    args = shlex.split(train)
    assert f"--data.teacher={model}" in args
    assert args.index(f"--data.teacher={model}") < args.index("--train.max_steps=3")  # a user's flag wins
    recorded = {"name": str(model), "path": str(model), "hash": "e1acc353134e" + "0" * 52, "dim": 384}
    assert matches(recorded, str(model))
    assert not matches(recorded, "e5-small")  # the config's name alone: the error this run used to stop on
