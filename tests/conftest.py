"""Fixtures shared by the tests: a fresh Accelerate state and tiny shards (the debug config: _train_data)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _train_data import make_shards


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps its state in class attributes: a test that trains must not see the last one's."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Callable[..., Path]:
    """``tiny_shards([[40, 24], [32]], num_variants=3)``: augmented shards with those block sizes."""

    def make(block_sizes: list[list[int]], num_variants: int = 4, seed: int = 0) -> Path:
        directory = tmp_path_factory.mktemp("shards")
        make_shards(directory, block_sizes, num_variants, seed)
        return directory

    return make
