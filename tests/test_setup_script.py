"""launch/setup.sh: the pip commands it would run for each TORCH_CUDA / TORCH_INDEX_URL / EXTRA (its
DRY_RUN=1 mode, which installs nothing), and one-line refusals of bad values.

The PyTorch wheel index cannot be reached from this machine: what is tested is the arguments given to
pip, not that the index serves them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "setup.sh"


def setup_sh(**env: str) -> subprocess.CompletedProcess:
    unset = ("TORCH_CUDA", "TORCH_INDEX_URL", "EXTRA", "CONSTRAINTS")
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        ["bash", str(SCRIPT)], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )


def pip_installs(out: str) -> list[list[str]]:
    """The argument lists of each printed `pip install`, without the common options."""
    cmds = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]
    installs = [c[c.index("install") + 1 :] for c in cmds if "pip" in c and "install" in c]
    return [[a for a in c if a not in ("--quiet", "--disable-pip-version-check")] for c in installs]


def test_default_keeps_the_pinned_torch():
    proc = setup_sh(DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    torch_cmd, deepspeed_cmd, project_cmd = pip_installs(proc.stdout)
    lock = ["-c", "launch/constraints.txt"]
    assert torch_cmd == [*lock, "torch==2.13.0"]
    assert deepspeed_cmd == [*lock, "--no-build-isolation", "deepspeed>=0.17"]
    assert project_cmd == [*lock, "-e", ".[cpu,test]"]
    assert proc.stdout.rstrip().endswith("dry run: nothing installed")


@pytest.mark.parametrize("cuda", ["cu126", "cu128", "cu129", "cu130", "cpu"])
def test_torch_cuda_selects_the_pytorch_index_and_pins_the_build(cuda):
    proc = setup_sh(DRY_RUN="1", TORCH_CUDA=cuda, EXTRA="gpu")
    assert proc.returncode == 0, proc.stderr
    torch_cmd, _, project_cmd = pip_installs(proc.stdout)
    # the local label pins the build: no other torch 2.13.0 (a local CPU wheel, PyPI's CUDA 13) matches
    assert torch_cmd == ["--index-url", f"https://download.pytorch.org/whl/{cuda}", f"torch==2.13.0+{cuda}"]
    assert project_cmd == ["-c", "launch/constraints.txt", "-e", ".[gpu,test]"]
    assert "without TORCH_CUDA" not in proc.stderr


def test_torch_index_url_overrides_the_index():
    proc = setup_sh(DRY_RUN="1", TORCH_CUDA="cu128", TORCH_INDEX_URL="https://mirror.example/whl/cu128")
    assert pip_installs(proc.stdout)[0] == [
        "--index-url",
        "https://mirror.example/whl/cu128",
        "torch==2.13.0+cu128",
    ]
    alone = setup_sh(DRY_RUN="1", TORCH_INDEX_URL="https://mirror.example/simple")
    assert pip_installs(alone.stdout)[0] == ["--index-url", "https://mirror.example/simple", "torch==2.13.0"]


def test_gpu_extra_without_torch_cuda_says_which_torch():
    proc = setup_sh(DRY_RUN="1", EXTRA="gpu")
    assert proc.returncode == 0 and "EXTRA=gpu without TORCH_CUDA" in proc.stderr


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TORCH_CUDA": "cu12.8"}, "TORCH_CUDA=cu12.8: use cu126, cu128, cu129, cu130 or cpu"),
        ({"TORCH_CUDA": "12.8"}, "TORCH_CUDA=12.8: use"),
        ({"EXTRA": "cuda"}, "EXTRA=cuda: use EXTRA=cpu or EXTRA=gpu"),
        ({"DRY_RUN": "yes"}, "DRY_RUN=yes: use DRY_RUN=1"),
    ],
)
def test_a_bad_value_fails_with_one_line_before_installing(env, says):
    proc = setup_sh(**{"DRY_RUN": "1", **env})
    assert proc.returncode == 2
    assert proc.stdout == ""  # nothing ran, not even in the dry run
    assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


def test_gpu_extra_is_meta_s_faiss_gpu_wheel():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == ["faiss-gpu>=1.14.3"]  # numpy>=1.25, CUDA 12.6+, sm_70-sm_90 (pyproject note)
    assert extras["cpu"][0].startswith("faiss-cpu")


def test_constraints_can_be_turned_off_and_a_missing_file_is_refused():
    unpinned = setup_sh(DRY_RUN="1", CONSTRAINTS="")
    assert unpinned.returncode == 0, unpinned.stderr
    assert all("-c" not in cmd for cmd in pip_installs(unpinned.stdout))
    missing = setup_sh(DRY_RUN="1", CONSTRAINTS="launch/no-such-lock.txt")
    assert missing.returncode == 2 and "CONSTRAINTS=launch/no-such-lock.txt: no such file" in missing.stderr


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_lock_pins_every_dependency_exactly_and_torch_without_a_build_label():
    """Every package pyproject.toml names for the CPU install (dependencies, cpu and test extras) has
    one exact version in launch/constraints.txt; torch's has no +cpu label, so +cuXXX builds satisfy it."""
    import tomllib

    lock = {}
    for line in (REPO / "launch" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and "+" not in version, f"not an exact, label-free pin: {line}"
            assert _name(name) not in lock, f"pinned twice: {name}"
            lock[_name(name)] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["cpu"]
    wanted += project["optional-dependencies"]["test"]
    missing = sorted({_name(r) for r in wanted} - set(lock))
    assert not missing, f"not in launch/constraints.txt: {missing} (regenerate it: see its header)"
    assert lock["torch"] == "2.13.0"
    assert not [n for n in lock if n.startswith("nvidia-")]
