"""The names of a run directory and of its checkpoints: the format the trainer writes
(:mod:`pipeline.train.checkpoint`) and the readers (:mod:`pipeline.evaluate.resolve`: eval, export,
search, the teacher stage) find models in. Like :mod:`pipeline.shards` for shards, it sits below both,
so a reader never imports the trainer.

    RUN_DIR/checkpoints/step-00001000/{checkpoint.json, state.pt, config.yaml, model/, deepspeed/}
    RUN_DIR/checkpoints/{latest, best}    (text files naming a step-* folder)
    RUN_DIR/checkpoints/.tmp-step-00001000/    (a save under way; a killed one's is removed by the next)

A checkpoint folder's name is made by :func:`step_dir_name` and read by :func:`step_of`, nowhere else.
"""

from __future__ import annotations

import re

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_FORMAT = "sentence-encoder-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
STATE_FILE = "state.pt"
CONFIG_FILE = "config.yaml"
MODEL_DIR = "model"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "engine"
LATEST = "latest"
BEST = "best"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
STEP_GLOB = "step-*"
SAVING_PREFIX = ".tmp-"  # + the step folder's name: a checkpoint being written


def step_dir_name(step: int) -> str:
    """The folder of the checkpoint taken after ``step`` steps: ``step-00001000``."""
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step-00001000`` -> 1000); None for any other name."""
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None
