"""launch/run_sample.sh's EXTRA_TEXT and EXTRA_MAX: the extra files reach preprocess (their scored-set
sentences dropped), a changed input set rebuilds the shards and what is built from them, an unchanged one
does not, a student with other layers than the main job's is rebuilt with its training, and a mistake
stops the script before anything runs. The stages other than preprocess are a
stub (PYTHON is a shim that records each command and runs only preprocess, for real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAIN_JOB_KEPT = 68_545  # the bundled corpus's sentences (docs/preprocess.md)
OWN = [f"第{i}个外加的问题：这个功能应该怎么设置才好？" for i in range(5)]
EVAL = ["开初婚未育证明怎么弄？", "一群男人在海滩上踢足球。"]  # LCQMC dev, STS-B test


def _shim(tmp_path: Path) -> Path:
    shim = tmp_path / "python"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$*" >> {tmp_path / "commands.log"}\n'
        'if [ "$1 $2 $3" = "-m pipeline preprocess" ]; then\n'
        f'  exec {sys.executable} "$@" --progress false\n'
        "fi\n"
    )
    shim.chmod(0o755)
    return shim


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHON": str(_shim(tmp_path)),
        "OUT": str(tmp_path / "out"),
        "MODEL": str(tmp_path / "model"),
        **env,
    }
    return subprocess.run(
        ["bash", str(REPO / "launch" / "run_sample.sh")],
        cwd=tmp_path,  # EXTRA_TEXT paths relative to the caller's folder
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _preprocess_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "commands.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.startswith("-m pipeline preprocess")]


def _counts(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "shards" / "manifest.json").read_text())["counts"]


def test_extra_text_reaches_preprocess_and_a_changed_input_set_rebuilds(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(_preprocess_calls(tmp_path)) == 1
    assert _counts(tmp_path)["kept"] == MAIN_JOB_KEPT
    assert _counts(tmp_path)["dropped"]["eval_overlap"] == 0
    record = tmp_path / "out" / "preprocess_inputs.txt"
    assert len(record.read_text().splitlines()) == 2

    # unchanged inputs: nothing is redone, also for a job from before the record
    record.unlink()
    assert _run(tmp_path).returncode == 0
    assert len(_preprocess_calls(tmp_path)) == 1 and record.exists()

    (tmp_path / "questions.txt").write_text("\n".join([*OWN[:2], *EVAL, *OWN[2:]]) + "\n", encoding="utf-8")
    (tmp_path / "out" / "augmented").mkdir()  # built from the old shards: must go with them
    done = _run(tmp_path, EXTRA_TEXT="questions.txt")
    assert done.returncode == 0, done.stderr
    assert "built from other inputs; preprocessing again" in done.stderr
    calls = _preprocess_calls(tmp_path)
    assert len(calls) == 2 and str(tmp_path / "questions.txt") in calls[-1]
    assert not (tmp_path / "out" / "augmented").exists()
    counts = _counts(tmp_path)
    assert counts["kept"] == MAIN_JOB_KEPT + len(OWN)
    assert counts["dropped"]["eval_overlap"] == len(EVAL)

    # the mixture knob: the first 3 lines of each extra file (two own questions, one eval sentence)
    done = _run(tmp_path, EXTRA_TEXT="questions.txt", EXTRA_MAX="3")
    assert done.returncode == 0, done.stderr
    assert len(_preprocess_calls(tmp_path)) == 3
    capped = tmp_path / "out" / "extra_text" / "0-questions.txt"
    assert capped.read_text(encoding="utf-8").splitlines() == [*OWN[:2], EVAL[0]]
    counts = _counts(tmp_path)
    assert (counts["kept"], counts["dropped"]["eval_overlap"]) == (MAIN_JOB_KEPT + 2, 1)
    assert _run(tmp_path, EXTRA_TEXT="questions.txt", EXTRA_MAX="3").returncode == 0
    assert len(_preprocess_calls(tmp_path)) == 3  # the same capped input: nothing redone


def test_mistakes_stop_before_anything_runs(tmp_path):
    done = _run(tmp_path, EXTRA_TEXT="missing.txt")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"run_sample: EXTRA_TEXT names {tmp_path / 'missing.txt'}, which is not a file; "
        "give existing files, space-separated"
    )
    (tmp_path / "q.txt").write_text(OWN[0] + "\n", encoding="utf-8")
    done = _run(tmp_path, EXTRA_TEXT="q.txt", EXTRA_MAX="lots")
    assert done.returncode == 2 and "EXTRA_MAX=lots is not a positive number" in done.stderr
    assert not (tmp_path / "commands.log").exists()


def _student_calls(tmp_path: Path) -> list[str]:
    lines = (tmp_path / "commands.log").read_text().splitlines()
    return [line for line in lines if line.startswith("-m pipeline student")]


def test_a_student_with_other_layers_is_rebuilt_with_its_training(tmp_path):
    student, train = tmp_path / "out" / "student", tmp_path / "out" / "train"
    student.mkdir(parents=True)
    train.mkdir()
    old = {"pooling": "mean", "surgery": {"source": "e5", "layers": [0, 4, 8, 11], "vocab": {}}}
    (student / "encoder.json").write_text(json.dumps(old, indent=2))
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "holds other layers than 0,2,4,6,8,11; building it again" in done.stderr
    assert not train.exists() and not student.exists()  # the shim builds nothing: both are gone
    [call] = _student_calls(tmp_path)
    assert "--layers 0,2,4,6,8,11" in call

    # a student with the main job's layers is kept, and so is its training
    student.mkdir()
    train.mkdir()
    same = {**old, "surgery": {"layers": [0, 2, 4, 6, 8, 11]}}
    (student / "encoder.json").write_text(json.dumps(same, indent=2))
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(_student_calls(tmp_path)) == 1 and train.exists(), done.stderr
