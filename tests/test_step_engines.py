"""One step function per engine (pipeline/train/engines.py): which engine a run takes, when the guard (and
so the spike detector) is off, and what a spike rollback keeps of the train state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.errors import ConfigError
from pipeline.train import accounting, engines
from pipeline.train.build import TrainState


def fake_trainer(deepspeed=False, gradcache=0, accum=1, precision="no", max_nonfinite=5, spike=0.0):
    cfg = SimpleNamespace(
        train=SimpleNamespace(
            deepspeed_config="zero2.json" if deepspeed else None,
            gradcache_chunk_size=gradcache,
            grad_accum_steps=accum,
            mixed_precision=precision,
        ),
        guard=SimpleNamespace(max_nonfinite_steps=max_nonfinite, spike_factor=spike, spike_steps=2,
                              spike_history=4),
    )  # fmt: skip
    kind = "DEEPSPEED" if deepspeed else "NO"
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value=kind))
    return SimpleNamespace(cfg=cfg, accelerator=accelerator, state=TrainState())


@pytest.mark.parametrize(
    "kwargs, engine",
    [
        ({}, engines.plain_backward_and_step),
        ({"accum": 2}, engines.plain_backward_and_step),
        ({"gradcache": 8}, engines.gradcache_backward_and_step),
        ({"deepspeed": True}, engines.deepspeed_backward_and_step),
    ],
)
def test_each_run_takes_one_engine(kwargs, engine):
    assert engines.backward_and_step(fake_trainer(**kwargs)) is engine


@pytest.mark.parametrize(
    "kwargs, why",
    [
        ({"max_nonfinite": 0}, "max_nonfinite_steps is 0"),
        ({"precision": "fp16"}, "GradScaler"),
        ({"deepspeed": True, "accum": 2}, "DeepSpeed"),
    ],
)
def test_a_spike_factor_without_the_guard_is_refused(kwargs, why):
    t = fake_trainer(spike=3.0, **kwargs)
    assert why in engines.guard_off(t) and not engines.guarded(t)
    assert accounting.start_guard(fake_trainer(**kwargs)) is None  # no spike factor: nothing to refuse
    with pytest.raises(ConfigError, match="guard.spike_factor reads the non-finite guard's verdict"):
        accounting.start_guard(t)


def test_the_guard_judges_plain_bf16_and_one_micro_batch_deepspeed():
    for kwargs in ({}, {"precision": "bf16"}, {"deepspeed": True}, {"accum": 4}, {"gradcache": 8}):
        t = fake_trainer(spike=3.0, **kwargs)
        assert engines.guard_off(t) is None and accounting.start_guard(t) is not None


def test_a_rollback_loads_the_position_and_keeps_the_run_history():
    state = TrainState(step=9, samples_seen=90, nonfinite_skipped=2, nonfinite_streak=1)
    state.rollbacks = [{"detected_at_step": 5}]
    saved = TrainState(step=4, samples_seen=40, best_metric=0.5, spike={"history": [1.0]}).state_dict()
    accounting.KeepHistory(state).load_state_dict(saved)
    assert (state.step, state.samples_seen, state.best_metric) == (4, 40, 0.5)
    assert state.spike == {"history": [1.0]}
    assert (state.nonfinite_skipped, state.nonfinite_streak) == (2, 1)
    assert state.rollbacks == [{"detected_at_step": 5}]
    assert set(accounting.RUN_HISTORY) < set(TrainState().state_dict())
