"""Training objectives, one per file, each with ``compute_loss(...)`` separate from encoding.

``OBJECTIVES`` maps a config name to the module; ``module.INPUT`` names what it consumes (also in
``OBJECTIVE_INPUTS``) and ``module.USES_QUEUE`` whether it takes ``queue=`` negatives:

=============  =================  ============================================================
name           INPUT              compute_loss arguments (all embeddings L2-normalised)
=============  =================  ============================================================
luse           views              embeddings (n_views >= 2, B, H), temperature, queue (Q, H), gather
simcse         two_views          embeddings (2, B, H) two dropout encodings, temperature, gather
sup_simcse     triples            anchor, positive, negative: (B, H) each, temperature, gather
cosent         scored_pairs       u, v: (B, H), labels (B,) graded or 0/1 scores, scale, gather
sbert          labeled_pairs      u, v: (B, H), labels (B,) class indices, head (SoftmaxHead)
=============  =================  ============================================================

``views`` and ``two_views`` come from the unsupervised shards; ``triples`` from
:func:`pipeline.data.pairs.read_triples`; ``scored_pairs`` / ``labeled_pairs`` from
:func:`pipeline.data.pairs.read_pairs`. See docs/objectives.md.
"""

from __future__ import annotations

from types import ModuleType

from pipeline.errors import ConfigError
from pipeline.losses import cosent, multi_positive, sbert_softmax, simcse, sup_simcse

OBJECTIVES: dict[str, ModuleType] = {
    "luse": multi_positive,
    "simcse": simcse,
    "sup_simcse": sup_simcse,
    "cosent": cosent,
    "sbert": sbert_softmax,
}

OBJECTIVE_INPUTS: dict[str, str] = {name: module.INPUT for name, module in OBJECTIVES.items()}


def get_objective(name: str) -> ModuleType:
    """The loss module for a config name, or a ConfigError listing the valid names."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(
            f"unknown objective {name!r}; set train.objective to one of {', '.join(OBJECTIVES)}"
        ) from None


__all__ = ["OBJECTIVES", "OBJECTIVE_INPUTS", "get_objective"]
