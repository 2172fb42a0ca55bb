"""Fixtures shared by the tests: process-wide state restored after every test, and tiny shards.

A test may change process-wide state on purpose (Accelerate writes ``ACCELERATE_USE_DEEPSPEED`` and
friends into ``os.environ``; the teacher stage sets torch's thread count). ``restore_process_state``
puts every such thing back after each test, so a test passes or fails the same alone or after any
other, and lists the tests that changed something in the session summary.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _train_data import make_shards

_changed: list[str] = []

# One intra-op thread in the test process, and by default in the processes the tests start. The tests'
# tensors are tiny, so a second thread buys nothing; on a loaded machine (CI beside another run) OpenMP
# waiting at every op for a descheduled second thread made a 32-wide MLP's training step 40 times slower
# (35-48 ms against 0.9-1.1 ms with one thread, load average 8 on 2 cores), and the suite with it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# precision "auto" answers as on a CPU without native bf16 (fp32) in this process and the ones it starts, so
# that no test's outcome depends on the CPU it runs on; tests/test_precision.py answers both ways itself.
os.environ.setdefault("PIPELINE_CPU_BF16", "0")


def _process_state() -> dict[str, object]:
    return {
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},  # pytest's own
        "cwd": os.getcwd(),
        "torch threads": torch.get_num_threads(),
        "torch default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "grad enabled": torch.is_grad_enabled(),
    }


def _restore(saved: dict[str, object]) -> None:
    environ = saved["environ"]
    for key in set(os.environ) - set(environ) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[key]
    os.environ.update(environ)
    os.chdir(saved["cwd"])
    torch.set_num_threads(saved["torch threads"])
    torch.set_default_dtype(saved["torch default dtype"])
    torch.use_deterministic_algorithms(saved["deterministic algorithms"])
    torch.set_grad_enabled(saved["grad enabled"])


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests skip, saying why, where torch sees no CUDA GPU."""
    if torch.cuda.is_available():
        return
    reason = f"gpu: torch {torch.__version__} sees no CUDA GPU (CPU build, or no driver/device)"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def _reset_deepspeed_groups() -> None:
    """DeepSpeed caches process groups in module globals (``_WORLD_GROUP``, a clone of the world group):
    after the group is destroyed, the next DeepSpeed engine in this process would broadcast over the
    dead clone ("Group ... is not registered"). Put them back to their import-time values."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if name in ("mpu", "mesh_device") or (
            name.startswith("_") and ("GROUP" in name or name.startswith("_MPU_"))
        ):
            if isinstance(value, dict):
                setattr(groups, name, {})
            elif not isinstance(value, str):
                setattr(groups, name, None)


@pytest.fixture(autouse=True)
def restore_process_state(request):
    """Accelerate keeps its state in class attributes and os.environ: reset both after each test."""
    saved = _process_state()
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        _changed.append(f"{request.node.nodeid}: left a process group (destroyed after it)")
    _reset_deepspeed_groups()
    now = _process_state()
    changed = [name for name in saved if now[name] != saved[name]]
    if changed:
        if "environ" in changed:
            keys = sorted(
                k
                for k in set(saved["environ"]) | set(now["environ"])
                if saved["environ"].get(k) != now["environ"].get(k)
            )
            changed[changed.index("environ")] = "environ (" + ", ".join(keys) + ")"
        _changed.append(f"{request.node.nodeid}: {'; '.join(changed)}")
        _restore(saved)


def pytest_sessionfinish(session):
    """Under pytest-xdist (launch/test.sh) a worker hands its list to the controller, which prints it."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["changed_state"] = list(_changed)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent where pytest-xdist is not installed
def pytest_testnodedown(node, error):  # the controller, once per finished xdist worker
    _changed.extend(getattr(node, "workeroutput", {}).get("changed_state", []))


def pytest_terminal_summary(terminalreporter):
    if _changed:
        terminalreporter.section("process-wide state changed by a test (restored after it)")
        for line in _changed:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Callable[..., Path]:
    """``tiny_shards([[40, 24], [32]], num_variants=3)``: augmented shards with those block sizes."""

    def make(block_sizes: list[list[int]], num_variants: int = 4, seed: int = 0) -> Path:
        directory = tmp_path_factory.mktemp("shards")
        make_shards(directory, block_sizes, num_variants, seed)
        return directory

    return make
