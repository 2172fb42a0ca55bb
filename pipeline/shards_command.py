"""``python -m pipeline shards index DIR``: give shard sets written before version 0.2 their block indexes.

Training plans its epochs from the per-shard block indexes (``pipeline/shards.py``); a shard set without
them is refused at start with this command in the message. It reads every block once and rewrites the
manifest; shards that already have an index are left alone, so a rerun after an interruption finishes
the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.shards import add_indexes, read_manifest


@dataclass
class Config:
    action: Literal["index"] = option("index", "ACTION: index (write the missing block indexes).")
    directory: Path | None = option(None, "DIRECTORY: a shard set (a folder with manifest.json).")

    def __post_init__(self) -> None:
        if self.directory is None:
            raise ConfigError("name the shard set: `python -m pipeline shards index DIRECTORY`")


def run(cfg: Config) -> int:
    start = time.perf_counter()
    total = len(read_manifest(cfg.directory)["shards"])
    added = add_indexes(cfg.directory)
    print(f"{cfg.directory}: wrote {added} block index(es), {total - added} already there "
          f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    return 0
