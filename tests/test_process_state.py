"""The autouse fixture in conftest.py puts process-wide state back after every test (issue 33 item 8).

The two tests run in file order: the first leaks what Accelerate's DeepSpeed plugin leaks, the second
sees none of it.
"""

from __future__ import annotations

import os

import torch

_before: dict[str, object] = {}


def test_a_test_that_leaks_process_state():
    _before["deepspeed"] = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    _before["threads"] = torch.get_num_threads()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "leaked"
    torch.set_num_threads(max(1, _before["threads"] + 1))


def test_the_next_test_sees_none_of_it():
    assert _before, "runs after test_a_test_that_leaks_process_state"
    assert os.environ.get("ACCELERATE_USE_DEEPSPEED") == _before["deepspeed"]
    assert torch.get_num_threads() == _before["threads"]
