"""Memory of preprocess's dedup bookkeeping (prints figures): the per-unit partition maps of a split
work directory held as (old, before this version) a dict of lists of tuples or (new) ``run._Pieces``.
Both grow with units x partitions, and both counts grow with the corpus.

    python -m pipeline preprocess RAW --out OUT --phase split --chunk_bytes=200000 --num_partitions=3000
    python benchmarks/dedup_bookkeeping.py old OUT/.work; python benchmarks/dedup_bookkeeping.py new OUT/.work
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

from pipeline.stages.preprocess import passes, run

mode, work = sys.argv[1], Path(sys.argv[2])
units = len(list((work / "split").glob("*.json")))
base = psutil.Process().memory_info().rss
split = [passes.split_paths(work, u) for u in range(units)]
if mode == "old":
    metas = [passes.read_json(j) for _, j in split]
    pieces = {}
    for u, meta in enumerate(metas):
        arrow = str(split[u][0])
        for part, batch_indices in meta["batches"].items():
            pieces.setdefault(int(part), []).append((arrow, batch_indices, meta["source"]))
    entries = sum(len(v) for v in pieces.values())
else:
    pieces, sources = run._Pieces(), []
    for u, (_, j) in enumerate(split):
        meta = passes.read_json(j)
        sources.append(meta["source"])
        pieces.add(u, meta["batches"])
    pieces.freeze()
    entries = len(pieces.keys)
peak = psutil.Process().memory_info().rss
print(f"{mode}: {units} units, {entries:,} (unit, partition) entries, RSS +{(peak - base) / 2**20:.0f} MiB")
