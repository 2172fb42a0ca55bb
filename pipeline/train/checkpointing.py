"""Checkpointing as one component of a run (:class:`RunCheckpoints`): when to save (every N steps or
minutes, at a new best score, at the last step, on preemption), the save of everything the trainer
declares (``Trainer.states()``, the loss terms' states among them), the final model, and the debug dump.
The files and their atomicity are pipeline/train/checkpoint.py's (:class:`Checkpointer`)."""

from __future__ import annotations

import json
import logging
import shutil

from pipeline import distributed as dist
from pipeline.io import tensor_checksum
from pipeline.train.build import Trainer
from pipeline.train.checkpoint import save_model
from pipeline.train.signals import Cadence

log = logging.getLogger(__name__)


class RunCheckpoints:
    """The run's checkpoints: ``due`` decides, ``save`` writes (a collective: every rank writes its part).
    Without a checkpointer (``t.checkpointer`` None) nothing is saved."""

    def __init__(self, t: Trainer):
        c = t.cfg.checkpoint
        self.t = t
        # The stop flag and the time rule are read at log steps only, where logging syncs with the host
        # anyway: a signal is acted on up to log_every - 1 steps late (SLURM's --signal lead time covers it).
        self.policy = Cadence(c.every_steps, c.every_minutes, check_every=t.cfg.train.log_every)

    @property
    def enabled(self) -> bool:
        return self.t.checkpointer is not None

    def due(self, step: int, is_best: bool) -> bool:
        """Whether step ``step`` is saved: by the policy, at a new best score, or the last step."""
        return self.enabled and (self.policy.due(step) or is_best or step == self.t.total_steps)

    def save(self, is_best: bool = False) -> None:
        """Checkpoint ``t.state.step`` (collective: every rank writes its part)."""
        t = self.t
        t.checkpointer.save(
            t.state.step,
            t.encoder,
            t.states(),
            t.rank_states(),
            t.run_config,
            is_best=is_best,
            metrics={"best_metric": t.state.best_metric},
            samples_seen=t.state.samples_seen,
        )
        self.policy.happened()


def finish(t: Trainer) -> None:
    """The final model in RUN_DIR/model (rank 0), and the debug dump every rank writes if asked.

    With ``train.final_model: best`` the model is the best checkpoint's (by STS-B valid, the initial
    model's step-0 score included: if no step beat it, the initial weights); the last step's weights
    stay in the newest checkpoint. An ``event: final_model`` record in metrics.jsonl says which.
    """
    if t.accelerator.is_main_process:
        target = t.cfg.run_dir / "model"
        best = t.checkpointer.best() if t.cfg.train.final_model == "best" and t.checkpointer else None
        initial = best is not None and t.state.best_step == 0
        on = t.cfg.train.select_on  # what best_metric is: STS-B valid, or its mean with the teacher agreement
        if initial:
            score = t.state.best_metric
            log.warning("no step beat the initial model (%s %.2f); exporting the initial weights", on, score)
        t.metrics.log(
            {
                "event": "final_model",
                "selected": "best" if best is not None else "last",
                "step": t.state.best_step if best is not None else t.state.step,
                "sts_b_valid_spearman": t.state.best_metric if best is not None and on == "sts_b" else None,
                "select_on": on,
                "selection_score": t.state.best_metric if best is not None else None,
                "initial_weights": initial,  # no step beat the step-0 evaluation
            }
        )
        if best is not None:
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(best / "model", tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
            log.info(
                "final model = best checkpoint %s (%s %.2f at step %s), saved to %s",
                best.name, on, t.state.best_metric, t.state.best_step, target,
            )  # fmt: skip
        else:
            if t.cfg.train.final_model == "best":
                log.warning(
                    "train.final_model=best but no best checkpoint exists: saving the last step's weights"
                )
            save_model(t.encoder, target)  # float32, also when DeepSpeed keeps the module in bf16/fp16
            log.info("final model saved to %s", target)
    if t.cfg.train.debug_dump:
        write_debug_dump(t)
    dist.barrier()


def write_debug_dump(t: Trainer) -> None:
    """RUN_DIR/debug/rank{r}.json: checksums the multi-process tests compare across ranks."""
    folder = t.cfg.run_dir / "debug"
    folder.mkdir(parents=True, exist_ok=True)
    params = [p for _, p in sorted(t.module.named_parameters())]
    dump = {
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "distributed_type": t.accelerator.distributed_type.value,
        "step": t.state.step,
        "samples_seen": t.state.samples_seen,
        "cursor": t.stream.state_dict(),
        "param_checksum": tensor_checksum(params),
        "param_sum": float(sum(p.detach().double().sum() for p in params)),
        "queue_checksum": None,
        "queue_fill": None,
        **t.loss.dump(),  # a queue's checksum and fill, from the term that holds it
    }
    (folder / f"rank{dist.rank()}.json").write_text(json.dumps(dump, indent=2) + "\n", encoding="utf-8")
