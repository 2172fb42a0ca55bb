"""The teacher's consistency filter over pair shards (the output of ``python -m pipeline pairs``).

For every pair the teacher has embedded both sides; the pair's *pool* is its partner plus the other
positives of the same source in a window of its shard: each source's rows, in shard order, are cut
into consecutive windows of ``pool`` rows (a shorter last window joins the one before it, so every
pool holds at least ``pool`` rows when the shard has that many of the source). A positive of the same
group (another answer to the same question, the desc beside the lead) is no competitor and is left
out. The partner's *rank* is 1 + the number of competitors the anchor is closer to (cosine) than to
its partner; the pair is kept when ``rank <= k`` (e5's CCPairs and nomic keep top-2; ``k = 0`` keeps
every pair and only stores the scores). The pool is a pure function of the shard's rows, so the
result does not depend on workers, tasks or restarts.

Stored per kept pair (shards/README.md): ``pair_rank`` (uint32), ``pair_cosine`` (float32, anchor to
partner) and ``pair_pool`` (uint32, the candidates it was ranked among, itself included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairScores:
    rank: np.ndarray  # (N,) uint32, 1 = the partner is the anchor's nearest candidate
    cosine: np.ndarray  # (N,) float32
    pool: np.ndarray  # (N,) uint32

    def keep(self, k: int) -> np.ndarray:
        return np.ones(len(self.rank), dtype=bool) if k <= 0 else self.rank <= k


def windows(rows: np.ndarray, pool: int) -> list[np.ndarray]:
    """Consecutive windows of ``pool`` rows; a shorter last one joins the window before it."""
    cuts = list(range(0, len(rows), pool))
    if len(cuts) > 1 and len(rows) - cuts[-1] < pool:
        cuts.pop()
    return np.split(rows, cuts[1:]) if len(rows) else []


def pair_scores(
    anchors: np.ndarray, positives: np.ndarray, sources: Sequence[str], groups: np.ndarray, pool: int
) -> PairScores:
    """Rank of each pair's partner among its pool (module docstring); vectors L2-normalised, (N, D)."""
    n = len(anchors)
    rank = np.ones(n, dtype=np.uint32)
    cosine = np.einsum("nd,nd->n", anchors, positives).astype(np.float32)
    size = np.ones(n, dtype=np.uint32)
    source_codes = np.unique(np.asarray(sources, dtype=object), return_inverse=True)[1]
    for code in np.unique(source_codes):
        for window in windows(np.flatnonzero(source_codes == code), pool):
            sims = anchors[window] @ positives[window].T  # (w, w): anchor i against positive j
            own = np.diagonal(sims)[:, None]
            g = groups[window]
            competitor = g[:, None] != g[None, :]
            rank[window] = 1 + ((sims > own) & competitor).sum(axis=1)
            size[window] = 1 + competitor.sum(axis=1)
    return PairScores(rank, cosine, size)
