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


NATIVE = "native native bf16 (AMX-BF16)"  # what `python -m pipeline.precision` prints on such a CPU
EMULATED = "emulated no native bf16 (this CPU has neither AMX-BF16 nor AVX512-BF16)"


def _stub_run(
    tmp_path, cores: int, bf16: str = NATIVE, check_exit: int = 0, **env: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """run_sample.sh with every stage a stub, ``nproc`` answering ``cores`` and the CPU check ``bf16`` (and
    exiting ``check_exit``): the commands it ran."""
    log, bin_dir = tmp_path / "commands.log", tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = tmp_path / "python"
    shim.write_text(
        f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {log}\n'
        f'if [ "$2" = pipeline.precision ]; then echo "{bf16}"; exit {check_exit}; fi\n'
        'echo "working on $4" >&2\n'
    )
    (bin_dir / "nproc").write_text(f"#!/usr/bin/env bash\necho {cores}\n")
    for f in (shim, bin_dir / "nproc"):
        f.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(shim),
            "OUT": str(tmp_path / "out"), "MODEL": str(tmp_path / "e5-small"), **env}  # fmt: skip
    log.unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(REPO / "launch" / "run_sample.sh")], env=full, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    return proc, log.read_text().splitlines() if log.is_file() else []


def _evals(commands: list[str]) -> dict[str, str]:
    """The evaluation commands by what they evaluate (teacher, untrained, trained) and the report's."""
    found = {}
    for c in commands:
        if c.startswith("-m pipeline eval "):
            target = c.split()[3]
            name = "trained" if "train" in target else "untrained"
            found["teacher" if target.endswith("e5-small") else name] = c
        elif c.startswith("-m pipeline report "):
            found["report"] = c
    return found


def test_every_stage_gets_the_machines_precision_and_the_evaluations_share_the_cores(tmp_path):
    proc, commands = _stub_run(tmp_path, cores=4)  # a CPU with native bf16: the references run
    assert proc.returncode == 0, proc.stderr[-2000:]
    evals = _evals(commands)
    assert set(evals) == {"teacher", "untrained", "trained", "report"}
    for name in ("teacher", "untrained", "trained"):  # two lanes side by side, half the cores each
        assert "--precision auto" in evals[name] and "--threads 2" in evals[name], evals[name]
    teacher_stage = next(c for c in commands if c.startswith("-m pipeline teacher"))
    assert "--precision auto" in teacher_stage
    assert "--max_sentences 38400" in teacher_stage  # what the 600 steps of 64 read, the first 6 shards
    assert "--sentences_per_shard 6400" in next(c for c in commands if c.startswith("-m pipeline preprocess"))
    train = next(c for c in commands if "launch/pretrain.py" in c)
    assert "--train.mixed_precision=auto" in train
    # each lane's lines (stderr too: the progress) carry its piece's name
    assert f"[teacher] working on {tmp_path / 'e5-small'}" in proc.stdout.splitlines()
    assert f"[untrained] working on {tmp_path / 'out' / 'student'}" in proc.stdout.splitlines()

    # the teacher's scores cached (once per MODEL folder): the untrained student takes the other lane
    (tmp_path / "e5-small" / "eval").mkdir(parents=True)
    (tmp_path / "e5-small" / "eval" / "eval.json").write_text("{}")
    _, commands = _stub_run(tmp_path, cores=4)
    evals = _evals(commands)
    assert set(evals) == {"untrained", "trained", "report"} and "--threads 2" in evals["untrained"]
    # both cached: one lane, every core
    (tmp_path / "out" / "student_eval").mkdir(parents=True)
    (tmp_path / "out" / "student_eval" / "eval.json").write_text("{}")
    _, commands = _stub_run(tmp_path, cores=4)
    assert set(_evals(commands)) == {"trained", "report"} and "--threads 4" in _evals(commands)["trained"]


def test_precision_fp32_reaches_every_stage_and_a_wrong_one_stops_at_once(tmp_path):
    proc, commands = _stub_run(tmp_path, cores=2, PRECISION="fp32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--train.mixed_precision=no" in next(c for c in commands if "launch/pretrain.py" in c)
    assert all("--precision fp32" in c for c in _evals(commands).values())
    proc, commands = _stub_run(tmp_path, cores=2, TEACHER_SENTENCES="all")
    assert proc.returncode == 2 and "TEACHER_SENTENCES=all is not a number" in proc.stderr
    assert commands == []  # refused before anything ran
    proc, commands = _stub_run(tmp_path, cores=2, PRECISION="fp16")
    assert proc.returncode == 2 and "PRECISION=fp16: use auto, fp32 or bf16" in proc.stderr
    assert commands == []


def test_a_bad_cpu_check_stops_the_job_before_any_stage(tmp_path):
    """`python -m pipeline.precision` exits non-zero on a bad PIPELINE_CPU_BF16 (its one line on stderr):
    the job stops there."""
    proc, commands = _stub_run(tmp_path, cores=2, bf16="", check_exit=1)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert [c.split()[1] for c in commands] == ["pipeline.precision"]


def test_references_follow_the_cpu_unless_asked(tmp_path):
    """REFERENCES=auto evaluates the teacher and the untrained student only on a CPU with native bf16; on
    any other it says why it skips them and how to have them; 1 and 0 decide whatever the CPU."""
    proc, commands = _stub_run(tmp_path, cores=2, bf16=EMULATED)
    assert proc.returncode == 0, proc.stderr[-2000:]
    evals = _evals(commands)
    assert set(evals) == {"trained", "report"} and "--threads 2" in evals["trained"]  # one lane, every core
    said = [line for line in proc.stdout.splitlines() if "not evaluated" in line]
    assert len(said) == 1 and "neither AMX-BF16 nor AVX512-BF16" in said[0] and "REFERENCES=1" in said[0]
    proc, commands = _stub_run(tmp_path, cores=2, bf16=EMULATED, REFERENCES="1")
    assert set(_evals(commands)) == {"teacher", "untrained", "trained", "report"}
    assert "not evaluated" not in proc.stdout
    proc, commands = _stub_run(tmp_path, cores=2, REFERENCES="0")  # native bf16, references refused
    assert set(_evals(commands)) == {"trained", "report"} and "not evaluated" not in proc.stdout
    # both cached already: nothing skipped, so nothing said
    for folder in (tmp_path / "e5-small" / "eval", tmp_path / "out" / "student_eval"):
        folder.mkdir(parents=True)
        (folder / "eval.json").write_text("{}")
    proc, commands = _stub_run(tmp_path, cores=2, bf16=EMULATED)
    assert set(_evals(commands)) == {"trained", "report"} and "not evaluated" not in proc.stdout
    proc, commands = _stub_run(tmp_path, cores=2, REFERENCES="yes")
    assert proc.returncode == 2 and "REFERENCES=yes: use auto, 1 or 0" in proc.stderr
    assert commands == []


def test_a_teacher_set_of_other_sentences_is_encoded_again(tmp_path):
    """An older job's teacher set (51,200 sentences) or another TEACHER_SENTENCES: the set and the training
    on it are redone, and said; a set of the sentences asked for is kept."""
    teacher, train = tmp_path / "out" / "teacher", tmp_path / "out" / "train"

    def older(sentences: int) -> None:
        teacher.mkdir(parents=True, exist_ok=True)
        manifest = f'{{"config": {{\n  "max_sentences": {sentences},\n  "x": 1}}}}'
        (teacher / "manifest.json").write_text(manifest)
        (train / "checkpoints").mkdir(parents=True, exist_ok=True)

    older(51200)
    proc, commands = _stub_run(tmp_path, cores=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(c.startswith("-m pipeline teacher") for c in commands)
    assert "holds other sentences than TEACHER_SENTENCES=38400; encoding again" in proc.stderr
    assert not (train / "checkpoints").exists()  # the stubs write nothing: removed, not rebuilt
    older(38400)
    (teacher / "manifest.json").write_text('{"config": {\n  "max_sentences": 38400\n}}')  # the last key
    proc, commands = _stub_run(tmp_path, cores=2)
    assert not any(c.startswith("-m pipeline teacher") for c in commands)
    assert "encoding again" not in proc.stderr
    assert (train / "checkpoints").is_dir()
    proc, commands = _stub_run(tmp_path, cores=2, TEACHER_SENTENCES="0")  # every sentence now
    assert any(c.startswith("-m pipeline teacher") for c in commands) and "encoding again" in proc.stderr
