"""The one reader of the ``objective:`` section of earlier versions (deprecated): it becomes ``loss``.

Before the loss was a list of weighted terms (pipeline/losses/terms.py) the training config had one
flat section::

    objective: {name: luse, temperature: 0.05, queue_size: 256, momentum: 0.995, distill_weight: 0.5}

which reads as ``loss: [{luse: {temperature: 0.05, queue_size: 256, momentum: 0.995}}, {distill: {},
weight: 0.5}]``. A YAML file or ``--objective.*`` overrides (:class:`LegacyObjective`, the section's
schema, types checked at load) are converted once, when the training config loads
(:func:`convert_objective`, one warning line showing the new form); a saved ``config.yaml`` or a
checkpoint's config of an earlier version goes through :func:`split_objective` first, so a run of an
earlier version resumes and its model card names what it trained. Nothing else reads the section and
nothing writes it: a resolved config records ``loss`` only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.losses.terms import LossTerm

SECTION = "objective"
log = logging.getLogger(__name__)


@dataclass
class LegacyObjective:
    """The flat ``objective:`` section of earlier versions (deprecated; unset fields are empty)."""

    name: str | None = option(None, "Deprecated: the main loss term (luse, simcse, ...); write `loss`.")
    temperature: float | None = option(None, "Deprecated: loss term luse/simcse/sup_simcse temperature.")
    queue_size: int | None = option(None, "Deprecated: loss term luse queue_size.")
    momentum: float | None = option(None, "Deprecated: loss term luse momentum.")
    cosent_scale: float | None = option(None, "Deprecated: loss term cosent scale.")
    num_labels: int | None = option(None, "Deprecated: loss term sbert num_labels.")
    mlm_weight: float | None = option(None, "Deprecated: the weight of loss term mlm (0 = no such term).")
    mlm_probability: float | None = option(None, "Deprecated: loss term mlm probability.")
    contrastive_weight: float | None = option(None, "Deprecated: the weight of the main loss term.")
    distill_weight: float | None = option(None, "Deprecated: the weight of loss term distill.")
    distill_loss: str | None = option(None, "Deprecated: loss term distill loss.")
    teacher_dim: int | None = option(None, "Deprecated: data.teacher_dim.")
    kl_weight: float | None = option(None, "Deprecated: the weight of loss term kl.")
    kl_teacher_temperature: float | None = option(None, "Deprecated: loss term kl teacher_temperature.")
    kl_student_temperature: float | None = option(None, "Deprecated: loss term kl student_temperature.")
    teacher_positive: bool | None = option(None, "Deprecated: loss term luse teacher_positive.")

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


# field of the old section -> (term slot, field of the term's config)
TERM_FIELDS = {
    "temperature": ("main", "temperature"),
    "queue_size": ("main", "queue_size"),
    "momentum": ("main", "momentum"),
    "teacher_positive": ("main", "teacher_positive"),
    "cosent_scale": ("main", "scale"),
    "num_labels": ("main", "num_labels"),
    "distill_loss": ("distill", "loss"),
    "kl_teacher_temperature": ("kl", "teacher_temperature"),
    "kl_student_temperature": ("kl", "student_temperature"),
    "mlm_probability": ("mlm", "probability"),
}
WEIGHTS = {"contrastive_weight": "main", "distill_weight": "distill", "kl_weight": "kl", "mlm_weight": "mlm"}
STRICT = ("queue_size", "momentum", "teacher_positive")  # change the run: never dropped silently
ORDER = ("main", "distill", "kl", "mlm")  # the order the old objective summed its parts in


def split_objective(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A saved config mapping without its ``objective:`` section, and the fields that section set
    (a config.yaml of this version's predecessors carried the section, unset fields as nulls)."""
    rest = {k: v for k, v in config.items() if k != SECTION}
    return rest, {k: v for k, v in (config.get(SECTION) or {}).items() if v is not None}


def convert_objective(
    entries: list[dict[str, Any]],
    given: dict[str, Any],
    registry: dict[str, type[LossTerm]],
    *,
    warn: bool = True,
) -> tuple[list[dict[str, Any]], int | None]:
    """``(loss entries, data.teacher_dim or None)`` after the set fields ``given`` of an ``objective:``
    section, logging one deprecation line with the new form (``warn``); a field that cannot be read
    into ``loss`` is a one-line ConfigError showing what to write instead."""
    given = dict(given)
    teacher_dim = given.pop("teacher_dim", None)
    new = apply_legacy_objective(entries, given, registry)
    if warn:
        log.warning(
            "config: `objective:` is deprecated; read as `loss: %s`%s (docs/objectives.md)",
            yaml.safe_dump(new, default_flow_style=True, width=1000, sort_keys=False).strip(),
            f" and `data.teacher_dim: {teacher_dim}`" if teacher_dim else "",
        )
    return new, teacher_dim


def apply_legacy_objective(
    entries: list[dict[str, Any]], legacy: dict[str, Any], registry: dict[str, type[LossTerm]]
) -> list[dict[str, Any]]:
    """The ``loss`` entries after the set fields of the deprecated ``objective`` section.

    The section patches the list as the old objective would have read: ``name`` picks the main term,
    a ``*_weight`` of 0 removes its term and > 0 sets (or adds) it, the other fields set the field of
    their term and are ignored when the run has no such term (the old section carried every field),
    except a queue, a momentum encoder or a teacher positive without a luse term: a ConfigError.
    """
    slots: dict[str, dict[str, Any]] = {}
    for entry in entries:
        name = next(k for k in entry if k != "weight")
        slot = "main" if registry[name].data is not None else name
        slots[slot] = {"name": name, "fields": dict(entry[name] or {}), "weight": entry.get("weight", 1.0)}
    mains = [n for n, t in registry.items() if t.data is not None]
    if legacy.get("name") is not None:
        if legacy["name"] not in registry or registry[legacy["name"]].data is None:
            raise ConfigError(
                f"objective.name: unknown objective {legacy['name']!r}; write `loss: [{{TERM: {{}}}}]`, "
                f"TERM one of {', '.join(mains)} (docs/objectives.md)"
            )
        old = slots.get("main")
        keep = old["name"] == legacy["name"] if old else False
        slots["main"] = {
            "name": legacy["name"],
            "fields": old["fields"] if keep else {},
            "weight": old["weight"] if old else 1.0,
        }
    for key, slot in WEIGHTS.items():
        weight = legacy.get(key)
        if weight is None:
            continue
        if weight < 0:
            raise ConfigError(
                f"objective.{key} must be >= 0; write the term's `weight` in `loss` (> 0), or leave the "
                "term out (docs/objectives.md)"
            )
        if not weight:
            slots.pop(slot, None)
        elif slot in slots:
            slots[slot]["weight"] = weight
        else:
            name = "luse" if slot == "main" else slot
            slots[slot] = {"name": name, "fields": {}, "weight": weight}
    for key, (slot, field) in TERM_FIELDS.items():
        value = legacy.get(key)
        if value is None:
            continue
        target = slots.get(slot)
        config_class = registry[target["name"]].config_class if target else None
        fields = {f.name for f in dataclasses.fields(config_class)} if config_class else set()
        if field in fields:
            target["fields"][field] = value
        elif key in STRICT and value:
            raise ConfigError(
                f"objective.{key} applies to luse only; add a luse term to `loss` "
                f"(`loss: [{{luse: {{{field}: {value}}}}}]`) or set it to 0 (docs/objectives.md)"
            )
    order = [*ORDER, *(s for s in slots if s not in ORDER)]  # terms the old section had none of (matryoshka)
    return [{slots[s]["name"]: slots[s]["fields"], "weight": slots[s]["weight"]} for s in order if s in slots]
