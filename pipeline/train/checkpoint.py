"""Atomic, verified checkpoints that let a killed run continue exactly where it stopped.

Layout (``docs/fault_tolerance.md`` has the full story)::

    RUN/checkpoints/
      step-00001000/
        model/            the unwrapped encoder: SentenceEncoder.save_pretrained (safetensors)
        state.pt          {name: obj.state_dict()} of the shared states (optimizer, scheduler, queue, ...)
        rank-0.pt ...     {name: obj.state_dict()} of each rank's own states (RNG streams)
        deepspeed/        the engine's checkpoint, under DeepSpeed only (ZeRO shards the optimizer)
        config.yaml       the resolved run config
        checkpoint.json   written last: step, samples seen, world size, sha256 + size of every file
      latest              text file naming the newest checkpoint directory
      best                text file naming the best one (kept regardless of keep_last)

A save writes everything into ``.tmp-step-XXXXXXXX``, fsyncs it, writes ``checkpoint.json`` and only
then renames the directory to its final name, so a kill at any moment leaves either no new
checkpoint or a complete one. :meth:`Checkpointer.latest` re-verifies the checksums, so a checkpoint
damaged later (a truncated copy, a flipped byte) is skipped with a warning and the previous one used.

Everything is loaded safely: weights with safetensors, pickled state with ``weights_only=True``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from pipeline import __version__, distributed
from pipeline.errors import ConfigError, InputError
from pipeline.io import (
    DiskFullError,
    atomic_write_bytes,
    check_free_space,
    file_problem,
    format_size,
    fsync_dir,
    fsync_file,
    is_disk_full,
    needed_phrase,
    sha256_file,
    walk_files,
)
from pipeline.run_layout import (
    BEST,
    CHECKPOINT_FORMAT,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    DEEPSPEED_DIR,
    DEEPSPEED_TAG,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MODEL_DIR,
    SAVING_PREFIX,
    STATE_FILE,
    STEP_GLOB,
    step_dir_name,
    step_of,
)
from pipeline.train.guard import NonFiniteError, first_nonfinite

__all__ = [
    "CHECKPOINT_FORMAT",
    "Checkpointer",
    "CheckpointError",
    "Stateful",
    "check_compatible",
    "config_differences",
]

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


class CheckpointError(InputError):
    """A checkpoint is missing, incomplete, corrupt, or cannot be loaded into this run."""


def rank_file_name(rank: int) -> str:
    return f"rank-{rank}.pt"


# ------------------------------------------------------------------------------ config compatibility
# Keys whose change does not alter the sequence of parameter updates: where and how often we log,
# evaluate and save, loader parallelism (the data order is a function of the seed, not of workers), the
# guard (it changes a run only where a fault would have ended or derailed it),
# and how long to train (extending max_steps/max_samples/epochs is the usual reason to resume) -- but the run
# length is harmless only under a constant learning rate: linear and cosine decay to zero at the last
# step, so a new horizon changes every learning rate from the resume point on (HORIZON_KEYS).
HORIZON_KEYS: tuple[str, ...] = ("train.max_steps", "train.max_samples", "train.epochs")
HARMLESS_KEYS: tuple[str, ...] = (
    "run_dir",
    "resume",
    "checkpoint.",
    "guard.",
    "data.num_workers",
    "data.prefetch_factor",
    "data.verify_shards",
    "train.log_every",
    "train.eval_every",
    "train.eval_every_minutes",
    "train.eval_max_pairs",
    "train.final_model",
    "train.debug_dump",
    "train.progress",
    "train.max_steps",
    "train.max_samples",
    "train.epochs",
    "train.cpu",
    "train.device",
    "train.collective_timeout",
    "train.tf32",  # GPU float32 rounding, not the recipe
    "train.deterministic",  # GPU kernel choice (bit-exactness), not the recipe
)


# Fields added after checkpoints were written, with the value that does what the run did before them: a
# saved config without the key reads as that value (a run of the earlier version resumes).
ADDED_FIELDS: dict[str, Any] = {
    "data.supervised_teacher": None,
    "data.holdout_rows": 0,
    "train.select_on": "sts_b",
    "train.max_samples": 0,
}


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def _harmless(key: str) -> bool:
    return any(key == h or (h.endswith(".") and key.startswith(h)) for h in HARMLESS_KEYS)


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(altering, harmless)`` differences between two resolved configs, as ``key: old -> new`` lines."""
    old, new = _flatten(saved), _flatten(current)
    constant_lr = old.get("optim.schedule") == new.get("optim.schedule") == "constant"
    altering, harmless = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, ADDED_FIELDS.get(key, "<absent>")), new.get(key, "<absent>")
        if a == b:
            continue
        line = f"{key}: {a!r} -> {b!r}"
        if key in HORIZON_KEYS and not constant_lr:
            altering.append(f"{line} (the {new.get('optim.schedule')} schedule decays to 0 at the last step)")
        else:
            (harmless if _harmless(key) else altering).append(line)
    return altering, harmless


def check_compatible(saved_config: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Refuse to resume when the config changed in a way that alters the run.

    Model, data, objective, optimisation, batch and seed changes are refused with every difference
    listed; logging/evaluation/checkpoint intervals, paths, loader workers and -- under a constant
    learning rate -- a longer (or shorter) run are allowed and logged.
    """
    altering, harmless = config_differences(saved_config, config)
    if harmless:
        log.info("resuming with harmless config changes: %s", "; ".join(harmless))
    if altering:
        raise ConfigError(
            f"cannot resume: the config differs from the checkpoint's in {len(altering)} setting(s) that "
            f"change the run: {'; '.join(altering)}. Revert these settings to resume, or start a new run "
            "with a different --run_dir (or --resume=never to overwrite from scratch)"
        )


# ------------------------------------------------------------------------------------------- files
def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_model(model: Any, directory: Path) -> None:
    """``model.save_pretrained(directory)`` with every floating-point weight written in float32.

    Under DeepSpeed bf16/fp16 the engine keeps the module itself in half precision (its float32 master
    weights live in the ZeRO optimizer state, saved under ``deepspeed/``): the safetensors and
    config.json of ``model/`` and of the final model would otherwise be half precision. The module is
    not touched (ZeRO's flat buffers alias its parameters); a float32 copy of the state dict is written.
    """
    backbone = getattr(model, "backbone", None)
    weights = backbone.state_dict() if backbone is not None else {}
    if all(not w.is_floating_point() or w.dtype == torch.float32 for w in weights.values()):
        model.save_pretrained(directory)
        return
    upcast = {k: w.detach().float() if w.is_floating_point() else w for k, w in weights.items()}
    save = backbone.save_pretrained
    backbone.save_pretrained = lambda *args, **kwargs: save(*args, **{**kwargs, "state_dict": upcast})
    try:
        model.save_pretrained(directory)
    finally:
        del backbone.save_pretrained  # the instance attribute; the class's method shows through again
    config = Path(directory) / "config.json"
    if config.is_file():  # transformers names the module's dtype there, not the weights'
        data = json.loads(config.read_text(encoding="utf-8"))
        for key in ("dtype", "torch_dtype"):
            if key in data:
                data[key] = "float32"
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _state_dicts(states: Mapping[str, Stateful]) -> dict[str, Any]:
    return {name: obj.state_dict() for name, obj in states.items()}


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the files of checkpoint ``path``, as they are on the disk."""
    return sum(f.stat().st_size for f in walk_files(path))


def _read_pointer(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; raises :class:`CheckpointError` naming the problem."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (an unfinished save)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid JSON ({exc})") from None
    if manifest.get("format") != CHECKPOINT_FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a {CHECKPOINT_FORMAT} manifest")
    for rel, entry in manifest["files"].items():
        problem = file_problem(path / rel, entry["bytes"], entry["sha256"])
        if problem:
            raise CheckpointError(f"checkpoint {path}: file {rel} {problem}")
    return manifest


# ------------------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Saves and restores the training state under ``run_dir/checkpoints``.

    ``save`` and ``load`` are collectives (every rank calls them); so is ``latest`` when a process
    group is initialised (rank 0 verifies, the answer is broadcast). The run directory must be on a
    filesystem that every rank sees (a shared filesystem across nodes).

    ``engine``: under DeepSpeed, the engine (``accelerator.prepare``'s model) whose own checkpoint is
    saved next to ours, because ZeRO partitions the optimizer state over ranks. Leave the optimizer
    out of ``states`` then.
    """

    def __init__(self, run_dir: str | Path, keep_last: int = 3, keep_best: bool = True, engine: Any = None):
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINTS_DIR
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.engine = engine

    # -------------------------------------------------------------------------------------- listing
    def checkpoints(self) -> list[Path]:
        """Checkpoint directories by step, oldest first (complete or not; unfinished temps excluded)."""
        if not self.dir.is_dir():
            return []
        steps = {p: step_of(p.name) for p in self.dir.iterdir() if p.is_dir()}
        return sorted((p for p, step in steps.items() if step is not None), key=steps.__getitem__)

    def best(self) -> Path | None:
        name = _read_pointer(self.dir / BEST)
        return self.dir / name if name and (self.dir / name).is_dir() else None

    def latest(self, verify: bool = True) -> Path | None:
        """The newest valid checkpoint, or None. Corrupt or unfinished ones are skipped with a warning.

        Collective under a process group: rank 0 reads and verifies (sha256 of every file), the
        answer is broadcast so that every rank resumes from the same checkpoint.
        """
        found = self._find_latest(verify) if distributed.is_main_process() else None
        found = distributed.broadcast_object(str(found) if found else None)
        return Path(found) if found else None

    def _find_latest(self, verify: bool) -> Path | None:
        for path in reversed(self.checkpoints()):
            try:
                if verify:
                    verify_checkpoint(path)
                elif not (path / MANIFEST).is_file():
                    raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (an unfinished save)")
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s; trying the previous one", path.name, exc)
                continue
            return path
        return None

    # ----------------------------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        model: Any,
        states: Mapping[str, Stateful],
        rank_states: Mapping[str, Stateful],
        config: Mapping[str, Any],
        metrics: Mapping[str, Any] | None = None,
        is_best: bool = False,
        samples_seen: int | None = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically (collective: every rank calls it) and return its path.

        ``model`` is the unwrapped SentenceEncoder (``accelerator.unwrap_model``). ``samples_seen``
        defaults to ``metrics["samples_seen"]`` when present.
        """
        started = time.perf_counter()
        rank, world = distributed.rank(), distributed.world_size()
        final = self.dir / step_dir_name(step)
        tmp = self.dir / f"{SAVING_PREFIX}{final.name}"
        shared, problem = None, None
        if distributed.is_main_process():
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(SAVING_PREFIX + STEP_GLOB):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            shared = _state_dicts(states)
            problem = self._refusal(final.name, model, shared)
            if problem is None:
                tmp.mkdir()
        problem = distributed.broadcast_object(problem)  # every rank refuses, or none (and a barrier)
        if problem is not None:
            kind, message = problem
            raise (NonFiniteError if kind == "nonfinite" else DiskFullError)(message)

        failure, deepspeed_info = None, None
        synced: list[Path] = []  # files this rank wrote and fsynced itself
        try:
            _torch_save(_state_dicts(rank_states), tmp / rank_file_name(rank))
            synced.append(tmp / rank_file_name(rank))
            if self.engine is not None:
                deepspeed_info, engine_files = self._save_engine(tmp)
                synced += engine_files
            if distributed.is_main_process():
                save_model(model, tmp / MODEL_DIR)  # fsynced in _finish with the directories
                _torch_save(shared, tmp / STATE_FILE)
                text = yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True)
                atomic_write_bytes(tmp / CONFIG_FILE, text.encode("utf-8"))
                synced += [tmp / STATE_FILE, tmp / CONFIG_FILE]
        except Exception as exc:  # safetensors reports ENOSPC in its own error type
            if not isinstance(exc, DiskFullError) and not is_disk_full(exc):
                raise
            failure = f"rank {rank}: {exc}"
        # every rank's files are in tmp and flushed by their writer, or every rank knows one failed
        reports = distributed.all_gather_object((failure, [str(p) for p in synced]))
        failure = next((f for f, _ in reports if f is not None), None)
        flushed = {Path(p) for _, files in reports for p in files}

        if distributed.is_main_process() and failure is None:
            metrics = dict(metrics or {})
            if samples_seen is None and "samples_seen" in metrics:
                samples_seen = int(metrics["samples_seen"])
            try:
                self._finish(
                    tmp,
                    final,
                    step,
                    world,
                    samples_seen,
                    metrics,
                    list(states),
                    list(rank_states),
                    deepspeed_info,
                    flushed,
                )
                if is_best and self.keep_best:
                    atomic_write_bytes(self.dir / BEST, f"{final.name}\n".encode())
                self._prune(keep=final)
                log.info("saved checkpoint %s in %.1f s", final, time.perf_counter() - started)
            except Exception as exc:  # safetensors reports ENOSPC in its own error type
                if not isinstance(exc, DiskFullError) and not is_disk_full(exc):
                    raise
                failure = str(exc)
        if distributed.is_main_process() and failure is not None:
            written = sum(f.stat().st_size for f in walk_files(tmp)) if tmp.is_dir() else 0
            shutil.rmtree(tmp, ignore_errors=True)
            failure = self._disk_full_message(final.name, failure, written)
        # nobody proceeds (or exits) before the checkpoint is visible, or before the partial one is gone
        failure = distributed.broadcast_object(failure)
        if failure is not None:
            raise DiskFullError(failure)
        return final

    def _refusal(self, name: str, model: Any, shared: Mapping[str, Any]) -> tuple[str, str] | None:
        """Why checkpoint ``name`` must not be written (rank 0): a NaN/inf in the weights or the states,
        or less free space than the newest checkpoint takes. None: go ahead."""
        weights = model.state_dict() if hasattr(model, "state_dict") else {}
        bad = first_nonfinite({"model": weights, **shared})  # a host sync; a save is rare
        if bad is not None:
            newest = self._find_latest(verify=False)
            return "nonfinite", (
                f"refusing to write checkpoint {name} in {self.dir}: {bad} is not finite (NaN or inf); "
                f"the newest good checkpoint, {newest.name if newest else 'none'}, is kept. Resume from it "
                "with a lower optim.lr or other data (see docs/fault_tolerance.md, non-finite steps)"
            )
        needed = self.newest_size()
        try:
            check_free_space(self.dir, needed, f"checkpoint {name}")
        except DiskFullError as exc:
            return "disk", f"{exc}; the previous checkpoints are intact"
        return None

    def newest_size(self) -> int:
        """Bytes of the newest complete checkpoint (0 if none): the expected size of the next one."""
        newest = self._find_latest(verify=False)
        return checkpoint_bytes(newest) if newest else 0

    def _disk_full_message(self, name: str, error: str, written: int) -> str:
        # The sizes measured here, not the free-space check's estimate (newest_size), which a run may
        # set aside (benchmarks/faults.py saves without one): the message says what is on the disk.
        newest = self._find_latest(verify=False)
        size = checkpoint_bytes(newest) if newest else 0
        previous = f"{newest.name} takes {format_size(size)}" if newest else "none before"
        needed = needed_phrase(self.newest_size(), written)  # the estimate; without one, "more than"
        return (
            f"disk full in {self.dir} while writing checkpoint {name} ({needed}: "
            f"{format_size(written)} were written, {previous}; {error}). The partial checkpoint was removed "
            "and the previous ones are intact: free space and rerun the same command to resume"
        )

    def _save_engine(self, tmp: Path) -> tuple[dict[str, Any], list[Path]]:
        """The DeepSpeed engine's own checkpoint (collective); every rank writes its ZeRO partition.

        Each rank fsyncs only the files it wrote, recorded at the engine's ``checkpoint_engine.save``
        (W fsyncs per save, not W x W on a shared filesystem); whatever it wrote another way (DeepSpeed
        copies its zero_to_fp32.py script on rank 0) is flushed by rank 0 in :meth:`_finish`.
        """
        target = tmp / DEEPSPEED_DIR
        written: list[Path] = []
        writer = getattr(self.engine, "checkpoint_engine", None)
        if writer is not None:
            save = writer.save

            def recording_save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
                written.append(Path(path))
                return save(state_dict, path, *args, **kwargs)

            writer.save = recording_save
        try:
            self.engine.save_checkpoint(str(target), tag=DEEPSPEED_TAG, save_latest=False)
        finally:
            if writer is not None:
                writer.save = save
        for path in written:  # each rank flushes what it wrote (shared filesystems)
            fsync_file(path)
        info = {
            "zero_stage": int(self.engine.zero_optimization_stage()),
            "dp_world_size": _dp_size(self.engine),
        }
        return info, written

    def _finish(
        self,
        tmp: Path,
        final: Path,
        step: int,
        world: int,
        samples_seen: int | None,
        metrics: dict[str, Any],
        state_names: list[str],
        rank_state_names: list[str],
        deepspeed_info: dict[str, Any] | None,
        flushed: set[Path] = frozenset(),
    ) -> None:
        # Rank 0 flushes the files no rank flushed as it wrote them (its model folder, anything a library
        # wrote by itself) and every directory; each rank's own files were fsynced by that rank.
        for path in walk_files(tmp):
            if path not in flushed:
                fsync_file(path)
        for dirpath, _, _ in os.walk(tmp):
            fsync_dir(dirpath)
        files = {
            path.relative_to(tmp).as_posix(): {"sha256": sha256_file(path), "bytes": path.stat().st_size}
            for path in walk_files(tmp)
        }
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "format_version": FORMAT_VERSION,
            "tool_version": __version__,
            "step": step,
            "samples_seen": samples_seen,
            "world_size": world,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "states": state_names,
            "rank_states": rank_state_names,
            "deepspeed": deepspeed_info,
            "metrics": metrics,
            "files": files,
        }
        # The manifest is the commit record: written last, so its presence means every file is there.
        atomic_write_bytes(tmp / MANIFEST, (json.dumps(manifest, indent=2, default=str) + "\n").encode())
        fsync_dir(tmp)
        old = None
        if final.exists():  # the same step saved again (e.g. preempted right after a periodic save)
            old = final.with_name(f".old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        atomic_write_bytes(self.dir / LATEST, f"{final.name}\n".encode())
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        """Delete all but the newest ``keep_last`` checkpoints, the best one and the one just written."""
        all_ckpts = self.checkpoints()
        protected = set(all_ckpts[-self.keep_last :]) | {keep}
        best = self.best() if self.keep_best else None
        if best is not None:
            protected.add(best)
        for path in all_ckpts:
            if path not in protected:
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed old checkpoint %s", path.name)

    # ----------------------------------------------------------------------------------------- load
    check_compatible = staticmethod(check_compatible)  # so callers holding a Checkpointer need no import

    @staticmethod
    def saved_config(path: str | Path) -> dict[str, Any]:
        """The resolved config stored in checkpoint ``path`` (for :func:`check_compatible`)."""
        file = Path(path) / CONFIG_FILE
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}")
        return yaml.safe_load(file.read_text(encoding="utf-8")) or {}

    def load(
        self,
        path: str | Path,
        model: Any,
        states: Mapping[str, Stateful],
        rank_states: Mapping[str, Stateful],
        verify: bool = True,
    ) -> dict[str, Any]:
        """Restore checkpoint ``path`` into ``model`` and the states (collective); returns its manifest.

        The returned dict is the manifest plus ``"exact"``: False when the world size changed, in which
        case the per-rank states (RNG streams) are not restored — each rank keeps the streams it was
        seeded with. Everything in ``states`` (including the world-size-free data cursor) is restored.
        """
        path = Path(path)
        if verify:
            error = None
            if distributed.is_main_process():
                try:
                    verify_checkpoint(path)
                except CheckpointError as exc:
                    error = str(exc)
            error = distributed.broadcast_object(error)
            if error:
                raise CheckpointError(error)
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        world = distributed.world_size()
        saved_world = int(manifest["world_size"])
        self._check_engine(path, manifest)

        _load_weights(model, path / MODEL_DIR)
        saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        missing = [name for name in states if name not in saved]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no state for {', '.join(missing)} "
                f"(it holds {', '.join(saved) or 'none'}); "
                "it was written by a run with different components: start a new run_dir"
            )
        for name, obj in states.items():
            obj.load_state_dict(saved[name])
        unused = sorted(set(saved) - set(states))
        if unused:
            log.warning("checkpoint %s holds states this run does not use: %s", path.name, ", ".join(unused))

        exact = saved_world == world
        rank_file = path / rank_file_name(distributed.rank())
        if exact and rank_states:
            if not rank_file.is_file():
                raise CheckpointError(f"checkpoint {path} lacks {rank_file.name} for this rank")
            saved_rank = torch.load(rank_file, map_location="cpu", weights_only=True)
            for name, obj in rank_states.items():
                if name not in saved_rank:
                    raise CheckpointError(f"checkpoint {path}: {rank_file.name} has no state {name!r}")
                obj.load_state_dict(saved_rank[name])
        elif not exact and distributed.is_main_process():
            log.warning(
                "checkpoint %s was written by %d processes and is resumed by %d: the data position carries "
                "over exactly (no sample repeated or skipped), but per-rank random streams (dropout, "
                "augmentation choices) start afresh, so the run is not bit-identical to an uninterrupted one",
                path.name,
                saved_world,
                world,
            )
        if self.engine is not None:
            self.engine.load_checkpoint(
                str(path / DEEPSPEED_DIR),
                tag=DEEPSPEED_TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
        distributed.barrier()
        log.info("resumed from %s (step %s)", path, manifest["step"])
        return {**manifest, "path": str(path), "exact": exact}

    def _check_engine(self, path: Path, manifest: dict[str, Any]) -> None:
        info = manifest.get("deepspeed")
        if self.engine is None:
            if info:
                raise CheckpointError(
                    f"checkpoint {path} was written under DeepSpeed (ZeRO-{info['zero_stage']}): "
                    "its optimizer state lives in deepspeed/; resume with the same --train.deepspeed_config"
                )
            return
        if not info:
            raise CheckpointError(
                f"checkpoint {path} was written without DeepSpeed; resume without --train.deepspeed_config "
                "or start a new run_dir"
            )
        dp = _dp_size(self.engine)
        if info["zero_stage"] > 0 and info["dp_world_size"] != dp:
            raise CheckpointError(
                f"checkpoint {path} holds ZeRO-{info['zero_stage']} optimizer shards for "
                f"{info['dp_world_size']} data-parallel ranks but this run has {dp}, and ZeRO shards "
                f"cannot be re-split on load. Resume with {info['dp_world_size']} processes, or start a new "
                f"run_dir from the weights (--model.name_or_path={path / MODEL_DIR}; optimizer state and "
                "queue start afresh). DeepSpeed's ds_to_universal converter can re-shard the optimizer "
                "state, but this trainer does not load universal checkpoints (see docs/fault_tolerance.md)"
            )


def _dp_size(engine: Any) -> int:
    size = getattr(engine, "dp_world_size", None)
    return int(size) if size is not None else distributed.world_size()


def _load_weights(model: Any, model_dir: Path) -> None:
    """Safetensors weights from ``model_dir`` into ``model.backbone``, every key matching."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # a large model saved in several shards
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = [model_dir / "model.safetensors"]
    if not all(f.is_file() for f in files):
        raise CheckpointError(f"checkpoint model folder {model_dir} has no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    backbone = model.backbone
    expected = set(backbone.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {model_dir} do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; "
            "the checkpoint is from a different architecture (check model.* in the config)"
        )
    backbone.load_state_dict(weights, strict=True)
