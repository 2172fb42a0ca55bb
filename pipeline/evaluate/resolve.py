"""Turn MODEL_OR_CHECKPOINT into a loaded :class:`SentenceEncoder`.

Accepted, in this order (docs/DESIGN.md "Checkpoints"):

* a model folder (has ``encoder.json``) or a sentence-transformers folder (has ``modules.json``, e.g.
  one of our exports): loaded as is, with the folder's pooling/length/prefix rule
  (:mod:`pipeline.model.rules`);
* one of our checkpoints (``step-XXXXXXXX/`` with ``model/``): its ``model/``;
* a run directory (has ``checkpoints/``) or its ``checkpoints/`` folder: the checkpoint named by
  ``checkpoints/latest`` (or ``checkpoints/best``), then its ``model/``;
* a DeepSpeed ZeRO checkpoint folder (a ``latest`` tag file naming a sub-folder with
  ``*model_states.pt``): the partitioned fp32 weights are consolidated with DeepSpeed's
  ``zero_to_fp32`` into the model skeleton (config + tokenizer + ``encoder.json``) found beside it;
* a plain Hugging Face folder (``config.json``, no rule): loaded only with an explicit pooling;
* any other string: a Hugging Face Hub name.

Everything that goes wrong is one :class:`InputError` line naming the path and what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.errors import InputError, PipelineError
from pipeline.model.encoder import ENCODER_FILE, SentenceEncoder
from pipeline.model.rules import is_sentence_transformers_folder
from pipeline.run_layout import CHECKPOINTS_DIR, MODEL_DIR
from pipeline.run_layout import MANIFEST as CHECKPOINT_MANIFEST

log = logging.getLogger(__name__)

Which = Literal["latest", "best"]


@dataclass
class Resolved:
    spec: str  # what the user typed
    kind: Literal["model", "checkpoint", "deepspeed", "hub"]
    model_dir: Path | None  # the folder holding config.json + weights (None for a Hub name)
    checkpoint_dir: Path | None = None  # our checkpoint (step-XXXXXXXX/) when there is one
    run_dir: Path | None = None
    skeleton_dir: Path | None = None  # deepspeed: where config, tokenizer and encoder.json come from

    @property
    def name(self) -> str:
        return str(self.model_dir or self.spec)


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything with more parts or a path prefix is a local path.
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec


def _read_pointer(path: Path) -> Path:
    """A ``latest``/``best`` text file names a checkpoint directory (relative to its folder or absolute)."""
    try:
        target = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read checkpoint pointer {path}: {exc}") from None
    if not target:
        raise InputError(f"checkpoint pointer {path} is empty; name a checkpoint directory in it")
    candidate = Path(target)
    if not candidate.is_absolute():
        candidate = path.parent / candidate
    if not candidate.is_dir():
        raise InputError(f"{path} names {target!r}, which is not a directory (deleted or moved checkpoint?)")
    return candidate


def zero_tag_dir(path: Path) -> Path | None:
    """The tag folder of a DeepSpeed checkpoint at ``path`` (``latest`` -> folder with model states)."""
    latest = path / "latest"
    if latest.is_file():
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        tag_dir = path / tag
        if tag and tag_dir.is_dir() and any(tag_dir.glob("*model_states.pt")):
            return tag_dir
    return None


def is_zero_checkpoint(path: Path) -> bool:
    if zero_tag_dir(path) is not None:
        return True
    return any(path.glob("global_step*/*model_states.pt"))


def _checkpoint_model(checkpoint: Path) -> Path:
    model = checkpoint / MODEL_DIR
    if not (model / ENCODER_FILE).is_file():
        raise InputError(
            f"checkpoint {checkpoint} has no {MODEL_DIR}/{ENCODER_FILE}; it is incomplete or not ours"
        )
    return model


def find_skeleton(zero_dir: Path) -> Path | None:
    """A model folder (config + tokenizer + encoder.json) next to a DeepSpeed checkpoint."""
    for candidate in (zero_dir / "model", zero_dir.parent / "model", zero_dir, zero_dir.parent):
        if (candidate / ENCODER_FILE).is_file() and (candidate / "config.json").is_file():
            return candidate
    return None


def resolve(spec: str | Path, which: Which = "latest", skeleton: Path | None = None) -> Resolved:
    """Decide what ``spec`` names, without loading any weights."""
    text = str(spec)
    path = Path(text).expanduser()
    if not path.exists():
        if _looks_like_path(text) or isinstance(spec, Path):
            raise InputError(
                f"{text} does not exist; give a model folder, checkpoint, run directory or Hub name"
            )
        return Resolved(text, "hub", None)
    if not path.is_dir():
        raise InputError(f"{text} is a file; give a model folder, checkpoint, run directory or Hub name")
    if (path / ENCODER_FILE).is_file() or is_sentence_transformers_folder(path):
        return Resolved(text, "model", path)
    # A run directory has a model/ too (the final model); its checkpoints/ pointer decides, so that
    # --checkpoint latest|best is honoured.
    is_run = (path / CHECKPOINTS_DIR).is_dir() and not (path / CHECKPOINT_MANIFEST).is_file()
    if not is_run and ((path / MODEL_DIR).is_dir() or (path / CHECKPOINT_MANIFEST).is_file()):
        run = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else None
        return Resolved(text, "checkpoint", _checkpoint_model(path), checkpoint_dir=path, run_dir=run)
    if is_zero_checkpoint(path):
        found = skeleton or find_skeleton(path)
        if found is None or not (Path(found) / ENCODER_FILE).is_file():
            raise InputError(
                f"DeepSpeed checkpoint {text} has no model skeleton (config.json, tokenizer, "
                f"{ENCODER_FILE}) beside it; pass --skeleton MODEL_DIR "
                "(e.g. the model/ folder of one of the run's checkpoints)"
            )
        return Resolved(text, "deepspeed", path, skeleton_dir=Path(found))
    checkpoints = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else None
    if checkpoints is None and (path / which).is_file() and path.name == CHECKPOINTS_DIR:
        checkpoints = path
    if checkpoints is not None:
        pointer = checkpoints / which
        if not pointer.is_file():
            raise InputError(f"run {text} has no checkpoints/{which}; has it written a checkpoint yet?")
        checkpoint = _read_pointer(pointer)
        return Resolved(
            text,
            "checkpoint",
            _checkpoint_model(checkpoint),
            checkpoint_dir=checkpoint,
            run_dir=checkpoints.parent,
        )
    if (path / "config.json").is_file():  # a plain transformers folder: the pooling must be given
        return Resolved(text, "model", path)
    raise InputError(
        f"{text} is not a model folder ({ENCODER_FILE} or sentence-transformers modules.json), checkpoint "
        "(model/), run directory (checkpoints/) or DeepSpeed checkpoint (latest + global_step*/)"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def load_encoder(
    resolved: Resolved, device: str = "cpu", pooling: str | None = None, prefix: str | None = None
) -> SentenceEncoder:
    """Load the encoder ``resolved`` names; corrupt files become one InputError line.

    ``pooling``/``prefix`` override the folder's rule (a folder or Hub name without a pooling rule
    needs ``pooling``).
    """
    if resolved.kind == "deepspeed":
        encoder = consolidate_zero(resolved.model_dir, resolved.skeleton_dir)
        encoder.pooling = pooling or encoder.pooling
        encoder.prefix = encoder.prefix if prefix is None else prefix
    else:
        target = resolved.model_dir or resolved.spec
        try:
            encoder = SentenceEncoder.from_pretrained(str(target), pooling=pooling, prefix=prefix)
        except PipelineError:
            raise
        except Exception as exc:  # safetensors, JSON and config errors all mean a damaged folder
            raise InputError(f"cannot load model from {target}: {_first_line(exc)}") from None
    return encoder.to(device).eval()


# DeepSpeed pickles its checkpoints and its reader calls torch.load(weights_only=False). Forcing
# weights_only keeps the load safe; these are the non-tensor globals its model/optim files hold.
def _deepspeed_safe_globals() -> list[Any]:
    import importlib

    names = [
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ]
    found = []
    for module, name in names:
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return found


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    import torch

    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def match_state_dict(consolidated: dict[str, Any], target_keys: list[str]) -> dict[str, Any]:
    """Map consolidated keys onto the backbone's keys.

    The engine may have wrapped the backbone (``embeddings.*``), the encoder (``backbone.*``) or a
    training module holding more than one encoder (``encoder.backbone.*``, ``momentum.backbone.*``):
    take the shortest prefix under which every backbone key is present.
    """
    keys = set(consolidated)
    anchor = target_keys[0]
    prefixes = sorted(
        {k[: len(k) - len(anchor)] for k in keys if k.endswith(anchor)},
        key=lambda p: (len(p), p),
    )
    for prefix in prefixes:
        if prefix and not prefix.endswith("."):
            continue
        if all(prefix + k in keys for k in target_keys):
            return {k: consolidated[prefix + k] for k in target_keys}
    missing = [k for k in target_keys if not any(c.endswith(k) for c in keys)][:3]
    raise InputError(
        "the DeepSpeed checkpoint's weights do not fit the skeleton model "
        f"(e.g. no {missing or target_keys[:1]}); is --skeleton the same architecture?"
    )


def consolidate_zero(zero_dir: Path, skeleton_dir: Path) -> SentenceEncoder:
    """Gather ZeRO-partitioned fp32 weights into the encoder described by ``skeleton_dir``."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise InputError("reading a DeepSpeed checkpoint needs deepspeed: pip install deepspeed") from None
    tag = zero_tag_dir(zero_dir)
    try:
        with _weights_only_loads():
            state = get_fp32_state_dict_from_zero_checkpoint(str(zero_dir), tag=tag.name if tag else None)
    except Exception as exc:  # missing shards, truncated pickles, unexpected layouts
        unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        reason = (
            f"it pickles {unsafe.group(1)}, which is not on our safe-load list (add it in resolve.py if you "
            "trust the checkpoint)"
            if unsafe
            else _first_line(exc)
        )
        raise InputError(f"cannot consolidate DeepSpeed checkpoint {zero_dir}: {reason}") from None
    try:
        encoder = SentenceEncoder.from_pretrained(str(skeleton_dir))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"cannot load the skeleton model {skeleton_dir}: {_first_line(exc)}") from None
    target_keys = list(encoder.backbone.state_dict())
    weights = match_state_dict(state, target_keys)
    encoder.backbone.load_state_dict(weights, strict=True)
    log.info("consolidated %d tensors from DeepSpeed checkpoint %s", len(weights), zero_dir)
    return encoder


def weights_digest(resolved: Resolved | None) -> str | None:
    """sha256 of the model's safetensors weights, which say that two evaluations encoded with the same
    model; None where there is no such file (a Hub name, a DeepSpeed checkpoint)."""
    from pipeline.io import sha256_file

    if resolved is None or resolved.model_dir is None or resolved.kind == "deepspeed":
        return None
    weights = Path(resolved.model_dir) / "model.safetensors"
    return sha256_file(weights) if weights.is_file() else None


def describe(resolved: Resolved) -> dict[str, Any]:
    """What was evaluated/exported, for eval.json and the model card."""
    info: dict[str, Any] = {"spec": resolved.spec, "kind": resolved.kind, "model_dir": resolved.name}
    if resolved.checkpoint_dir is not None:
        info["checkpoint_dir"] = str(resolved.checkpoint_dir)
        meta = resolved.checkpoint_dir / CHECKPOINT_MANIFEST
        if meta.is_file():
            with contextlib.suppress(OSError, json.JSONDecodeError):
                data = json.loads(meta.read_text(encoding="utf-8"))
                info.update({k: data[k] for k in ("step", "samples_seen") if k in data})
    return info
