"""The terms of the training loss, one formula per file, each with ``compute_loss(...)`` separate from
encoding and its small config dataclass beside it (pipeline/losses/terms.py: how terms compose).

``TERMS`` is the registry, the one list of terms: name -> its :class:`~pipeline.losses.terms.LossTerm`
class. A new term is a new file (one class) and one line in the tuple below.

===========  ============  =========================================================================
term         reads         compute_loss arguments (all embeddings L2-normalised)
===========  ============  =========================================================================
luse         views         embeddings (n_views, B, H), temperature, queue (Q, H), gather,
                           teacher (B, D_t), hard_negatives (m, B, H), project
simcse       views         embeddings (2, B, H) two dropout encodings, temperature, gather
sup_simcse   pairs         anchor, positive, negative: (B, H) each, temperature, gather
cosent       pairs+labels  u, v: (B, H), labels (B,) graded or 0/1 scores, scale, gather
sbert        pairs+labels  u, v: (B, H), labels (B,) class indices, head (SoftmaxHead)
luse_bce     views         embeddings (n_views, B, H), gather (LUSE's pairwise BCE)
distill      teacher       student (B, D_t) (projected originals), teacher (B, D_t), cosine or mse
kl           teacher       student (B, H), teacher (B, D_t), temperatures, queue + teacher queue
mlm          MLM logits    logits (B, L, V), labels (B, L) (-100 where not masked)
matryoshka   its terms'    the run's terms (``of``) on re-normalised prefixes (dims, weights)
pairs        views         anchor, positive: (B, H) each, temperature, groups, hashes, listed hard
                           negatives (m, B, H) with their mask
===========  ============  =========================================================================

luse, luse_bce and simcse read the unsupervised shards, pairs (and luse) pair shards; sup_simcse reads
:func:`pipeline.data.pairs.read_triples`, cosent and sbert :func:`pipeline.data.pairs.read_pairs`. See
docs/objectives.md.
"""

from __future__ import annotations

from typing import Any

from pipeline.losses.cosent import CoSENT
from pipeline.losses.distill import Distill
from pipeline.losses.kl import KL
from pipeline.losses.legacy import convert_objective, split_objective
from pipeline.losses.matryoshka import Matryoshka
from pipeline.losses.mlm import MLM
from pipeline.losses.multi_positive import Luse
from pipeline.losses.pairs import Pairs
from pipeline.losses.pairwise_bce import PairwiseBCE
from pipeline.losses.sbert_softmax import SbertSoftmax
from pipeline.losses.simcse import SimCSE
from pipeline.losses.sup_simcse import SupSimCSE
from pipeline.losses.terms import Loss, LossTerm, Needs, Rows, WeightedTerm, parse_terms

TERMS: dict[str, type[LossTerm]] = {
    t.name: t
    for t in (
        Luse,
        SimCSE,
        SupSimCSE,
        CoSENT,
        SbertSoftmax,
        PairwiseBCE,
        Distill,
        KL,
        MLM,
        Matryoshka,
        Pairs,
    )
}
DEFAULT_LOSS: list[dict[str, Any]] = [{"luse": {}, "weight": 1.0}]  # a run's loss when its config sets none


def build_loss(entries: list[dict]) -> Loss:
    """The config's ``loss`` list as a :class:`Loss` (a ConfigError names any bad entry). A training
    config parses its list once (:meth:`pipeline.train.config.Config.terms`)."""
    return Loss(parse_terms(entries, TERMS))


def trained_loss(config: dict[str, Any]) -> dict[str, Any]:
    """What a run's saved config (``config.yaml``) trained, for its model card.

    ``loss``: the terms as one line (``distill (loss: cosine)``, ``luse (...) + 0.1 x mlm (...)``);
    ``terms``: their names; ``objective``, ``temperature``: the main term's (None without one); ``rows``,
    ``cite`` and ``prefix_dims``: what the terms say of themselves (:meth:`LossTerm.describe`): card rows
    (a queue's size, a momentum), citation keys, the widths a matryoshka term trained (None: none);
    ``queue_size``, ``momentum``: a term's negative queue and momentum (None without one).
    A config of an earlier version (an ``objective:`` section) is read as training
    read it (:mod:`pipeline.losses.legacy`).
    """
    config, legacy = split_objective(config)
    entries = config.get("loss") or DEFAULT_LOSS
    if legacy:
        entries, _ = convert_objective(entries, legacy, TERMS, warn=False)
    terms = [(next(k for k in e if k != "weight"), e) for e in entries]
    parts = []
    for name, e in terms:
        fields = ", ".join(f"{k}: {v}" for k, v in (e[name] or {}).items())
        weight = float(e.get("weight", 1.0))
        parts.append(("" if weight == 1.0 else f"{weight:g} x ") + name + (f" ({fields})" if fields else ""))
    main = next(((n, e[n] or {}) for n, e in terms if n in TERMS and TERMS[n].data is not None), (None, {}))
    said = [TERMS[n].describe(e[n] or {}) for n, e in terms if n in TERMS]
    dims = [d["prefix_dims"] for d in said if d.get("prefix_dims")]
    facts = {k: v for d in said for k, v in d.items() if k in ("queue_size", "momentum")}
    return {
        "loss": " + ".join(parts),
        "terms": [n for n, _ in terms],
        "objective": main[0],
        "temperature": main[1].get("temperature"),
        "rows": [row for d in said for row in d.get("rows", [])],
        "cite": [key for d in said for key in d.get("cite", [])],
        "prefix_dims": dims[0] if dims else None,
        "queue_size": facts.get("queue_size"),  # a term's negative queue (None: none)
        "momentum": facts.get("momentum"),  # its momentum encoder's momentum
    }


__all__ = ["TERMS", "Loss", "LossTerm", "Needs", "Rows", "WeightedTerm", "build_loss", "trained_loss"]
