"""A script that leaves a batch stream open exits: its loader workers are stopped at interpreter exit.

The workers ignore SIGTERM (preemption signals are the main process's), and multiprocessing's own exit
handler stops daemonic children with SIGTERM and then waits for them; before the fix a user script that
built a trainer, read batches and returned waited for ever at exit.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    sys.path.insert(0, {tests!r})
    from _train_data import debug_config, make_shards

    from pipeline.train.build import build

    tmp = Path({tmp!r})
    make_shards(tmp / "shards", [[40, 24], [32]], 3)
    cfg = debug_config(tmp, tmp / "shards", **{{"data.num_workers": 1, "train.max_steps": 6}})
    trainer = build(cfg)
    batches = iter(trainer.stream)
    next(batches)
    next(batches)
    if {close}:
        trainer.close()
    print("returning", flush=True)
    """
)


@pytest.mark.parametrize("close", [False, True], ids=["trainer-left-open", "trainer-closed"])
def test_a_script_with_an_open_stream_exits(tmp_path, close):
    script = SCRIPT.format(tests=str(REPO / "tests"), tmp=str(tmp_path), close=close)
    # A hang is what this checks: the bound is far above the few seconds a run takes.
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("returning")
