"""The names of a run directory and of its checkpoints: the format the trainer writes
(:mod:`pipeline.train.checkpoint`) and the readers (:mod:`pipeline.evaluate.resolve`: eval, export,
search, the teacher stage) find models in. Like :mod:`pipeline.shards` for shards, it sits below both,
so a reader never imports the trainer.

    RUN_DIR/checkpoints/step-00001000/{checkpoint.json, state.pt, config.yaml, model/, deepspeed/}
    RUN_DIR/checkpoints/{latest, best}    (text files naming a step-* folder)
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
