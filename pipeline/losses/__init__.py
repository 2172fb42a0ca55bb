"""Training objectives, one per file, each with ``compute_loss(...)`` separate from encoding.

``OBJECTIVES`` is the registry, the one list of objective names: name -> :class:`Objective`
(pipeline/losses/objective.py), the face the trainer calls (``objective.loss(embeddings, inputs)``).

=============  =================  ============================================================
name           input              compute_loss arguments (all embeddings L2-normalised)
=============  =================  ============================================================
luse           views              embeddings (n_views, B, H), temperature, queue (Q, H), gather,
                                  teacher (B, D_t), hard_negatives (m, B, H), project
simcse         two_views          embeddings (2, B, H) two dropout encodings, temperature, gather
sup_simcse     triples            anchor, positive, negative: (B, H) each, temperature, gather
cosent         scored_pairs       u, v: (B, H), labels (B,) graded or 0/1 scores, scale, gather
sbert          labeled_pairs      u, v: (B, H), labels (B,) class indices, head (SoftmaxHead)
=============  =================  ============================================================

``views`` and ``two_views`` come from the unsupervised shards; ``triples`` from
:func:`pipeline.data.pairs.read_triples`; ``scored_pairs`` / ``labeled_pairs`` from
:func:`pipeline.data.pairs.read_pairs`. Distillation terms: :mod:`pipeline.losses.distill`. See
docs/objectives.md.
"""

from __future__ import annotations

from pipeline.errors import ConfigError
from pipeline.losses import cosent, multi_positive, sbert_softmax, simcse, sup_simcse
from pipeline.losses.objective import LossInputs, Objective

OBJECTIVES: dict[str, Objective] = {
    m.OBJECTIVE.name: m.OBJECTIVE for m in (multi_positive, simcse, sup_simcse, cosent, sbert_softmax)
}

OBJECTIVE_INPUTS: dict[str, str] = {name: o.input for name, o in OBJECTIVES.items()}


def get_objective(name: str) -> Objective:
    """The objective for a config name, or a ConfigError listing the valid names."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(
            f"objective.name: unknown objective {name!r}; set it to one of {', '.join(OBJECTIVES)}"
        ) from None


__all__ = ["OBJECTIVES", "OBJECTIVE_INPUTS", "LossInputs", "Objective", "get_objective"]
