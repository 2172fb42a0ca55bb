"""CPU precision decided from the machine (pipeline/precision.py): ``auto`` is bf16 autocast only on a CPU
with native bf16, for training, the teacher stage, evaluation and the report; a resumed run keeps the
precision it started with; the start-up line says which and why. Each test answers the capability check
both ways (patched), so its verdict does not depend on the CPU it runs on."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml
from _train_data import debug_config, run_and_dump

from pipeline import precision
from pipeline.devices import CudaProbe
from pipeline.errors import ConfigError
from pipeline.evaluate.run import resolve_encode_precision
from pipeline.precision import CpuBf16, cpu_bf16, resolve_cpu_precision
from pipeline.stages.teacher.run import precision_for
from pipeline.train import speed

NATIVE = CpuBf16(True, "native bf16 (AMX-BF16)")
EMULATED = CpuBf16(False, "no native bf16 (this CPU has neither AMX-BF16 nor AVX512-BF16)")
NO_GPU = CudaProbe(torch_version="2", torch_cuda=None, available=False)


def cpu(answer: CpuBf16):
    """Make every caller of pipeline.precision.cpu_bf16 see ``answer``."""
    return lambda *args, **kwargs: answer


@pytest.fixture
def machine(monkeypatch):
    """``machine(NATIVE)`` / ``machine(EMULATED)``: the capability check's answer for this test."""
    precision.warn_emulated.cache_clear()

    def answer(found: CpuBf16) -> None:
        monkeypatch.setattr(precision, "cpu_bf16", cpu(found))

    yield answer
    precision.warn_emulated.cache_clear()


# ------------------------------------------------------------------------------------- the check
AMX = {"amx_bf16": True, "avx512_bf16": True}
AVX2 = {"amx_bf16": False, "avx512_bf16": False}


@pytest.mark.parametrize(
    ("features", "env", "onednn", "native", "said"),
    [
        (AMX, {}, True, True, "native bf16 (AMX-BF16, AVX512-BF16)"),
        ({"amx_bf16": False, "avx512_bf16": True}, {}, True, True, "native bf16 (AVX512-BF16)"),
        (AVX2, {}, True, False, "neither AMX-BF16 nor AVX512-BF16"),
        (AMX, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, False, "ONEDNN_MAX_CPU_ISA=AVX2"),
        (AMX, {"DNNL_MAX_CPU_ISA": "avx512_core_vnni"}, True, False, "DNNL_MAX_CPU_ISA=AVX512_CORE_VNNI"),
        (AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True, True, "native bf16"),
        (AMX, {}, False, False, "oneDNN runs no bf16"),
        (AVX2, {"PIPELINE_CPU_BF16": "1"}, False, True, "native bf16 (PIPELINE_CPU_BF16=1)"),
        (AMX, {"PIPELINE_CPU_BF16": "0"}, True, False, "no native bf16 (PIPELINE_CPU_BF16=0)"),
    ],
)
def test_native_bf16_needs_the_feature_and_onednn_allowed_to_use_it(features, env, onednn, native, said):
    found = cpu_bf16(env, features=lambda: features, onednn=lambda: onednn)
    assert found.native is native and said in found.why


def test_the_live_check_follows_onednns_isa_cap():
    """On this machine, whatever it is: capping oneDNN at AVX2 leaves no native bf16."""
    assert cpu_bf16({"ONEDNN_MAX_CPU_ISA": "AVX2"}).native is False
    with pytest.raises(ConfigError, match="PIPELINE_CPU_BF16='yes': use 0"):
        cpu_bf16({"PIPELINE_CPU_BF16": "yes"})
    live = precision.cpu_features()
    assert set(live) == {"amx_bf16", "avx512_bf16"} and all(isinstance(v, bool) for v in live.values())


# --------------------------------------------------------------------------------- the resolution
@pytest.mark.parametrize(("found", "auto"), [(NATIVE, "bf16"), (EMULATED, "fp32")])
def test_auto_is_bf16_only_with_native_bf16_everywhere_on_cpu(machine, found, auto):
    machine(found)
    assert resolve_cpu_precision("auto", "--precision")[0] == auto
    assert precision_for("cpu", "auto") == auto  # the teacher stage
    assert resolve_encode_precision("auto", "cpu")[0] == auto  # eval and report
    assert speed.resolve_precision("auto", "cpu")[0] == ("bf16" if auto == "bf16" else "no")  # training
    for explicit in ("fp32", "bf16"):  # an explicit choice is kept on either CPU
        assert resolve_cpu_precision(explicit, "--precision")[0] == explicit
        assert precision_for("cpu", explicit) == explicit
    assert speed.resolve_precision("no", "cpu")[0] == "no"


def test_explicit_bf16_without_native_bf16_runs_after_one_warning_that_names_the_cost(machine, caplog):
    machine(EMULATED)
    with caplog.at_level(logging.WARNING, logger="pipeline.precision"):
        for _ in range(3):
            assert speed.resolve_precision("bf16", "cpu") == (
                "bf16",
                "train.mixed_precision=bf16 (no native bf16 (this CPU has neither AMX-BF16 nor AVX512-BF16))",
            )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "4x slower than fp32 to encode, 25x to train" in warnings[0]
    assert "auto picks fp32 here" in warnings[0]
    caplog.clear()
    machine(NATIVE)
    with caplog.at_level(logging.WARNING, logger="pipeline.precision"):
        assert speed.resolve_precision("bf16", "cpu")[0] == "bf16"
    assert not caplog.records  # native bf16: nothing to warn about


@pytest.mark.parametrize("found", [NATIVE, EMULATED])
def test_on_a_gpu_the_cpu_check_is_not_asked(machine, monkeypatch, found):
    machine(found)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert speed.resolve_precision("auto", "cuda") == ("bf16", "train.mixed_precision=auto: bf16 on this GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert speed.resolve_precision("auto", "cuda")[0] == "no"
    assert speed.resolve_precision("bf16", "cuda")[0] == "bf16"  # as asked (doctor warns of such a GPU)
    assert precision_for("cuda", "auto") == precision_for("cuda:1", "bf16") == "fp16"  # the teacher's weights
    assert resolve_encode_precision("auto", "cuda")[0] == "fp32"
    with pytest.raises(ConfigError, match="--precision=bf16 is CPU autocast; on cuda use auto or fp32"):
        resolve_encode_precision("bf16", "cuda")


def test_a_resumed_run_keeps_the_precision_it_recorded(machine):
    machine(EMULATED)
    assert speed.resolve_precision("auto", "cpu", recorded="bf16") == (
        "bf16",
        "train.mixed_precision=auto: bf16, as the checkpoint this run resumes",
    )
    machine(NATIVE)
    assert speed.resolve_precision("auto", "cpu", recorded="no")[0] == "no"
    assert speed.resolve_precision("no", "cpu", recorded="bf16")[0] == "no"  # an explicit value is the user's


def test_unknown_precisions_are_config_errors():
    with pytest.raises(ConfigError, match=r"--precision 'fp16': choose one of auto, fp32, bf16"):
        resolve_cpu_precision("fp16", "--precision")


# ------------------------------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[32]], num_variants=2)


def start_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("start: "))


def test_a_run_records_what_auto_chose_and_resumes_it_exactly_on_another_cpu(
    tmp_path, shards, machine, caplog
):
    """Started on a CPU with native bf16 (auto: bf16), stopped, resumed on one without: the resumed steps
    stay bf16, and the weights equal an uninterrupted bf16 run's."""

    def cfg(run: str, steps: int):
        over = {"train.max_steps": steps, "train.mixed_precision": "auto", "train.debug_dump": True}
        return debug_config(tmp_path, shards, **{**over, "run_dir": str(tmp_path / run)})

    machine(NATIVE)
    with caplog.at_level(logging.INFO):
        full = run_and_dump(cfg("full", 6))
    assert "precision bf16 (train.mixed_precision=auto: native bf16 (AMX-BF16))" in start_line(caplog)
    run_and_dump(cfg("split", 3))
    config = yaml.safe_load((tmp_path / "split" / "config.yaml").read_text(encoding="utf-8"))
    assert config["train"]["mixed_precision"] == "bf16"  # the resolved value, not "auto"

    machine(EMULATED)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        resumed = run_and_dump(cfg("split", 6))
    assert (
        "precision bf16 (train.mixed_precision=auto: bf16, as the checkpoint this run resumes)"
        in start_line(caplog)
    )
    assert resumed["step"] == 6 and resumed["param_checksum"] == full["param_checksum"]

    caplog.clear()  # a fresh run on that CPU: fp32, and the line says why
    with caplog.at_level(logging.INFO):
        run_and_dump(cfg("fresh", 1))
    assert "precision fp32 (train.mixed_precision=auto: no native bf16 (this CPU has neither" in start_line(
        caplog
    )


@pytest.mark.parametrize(
    ("pin", "said"),
    [
        ("1", "native native bf16 (PIPELINE_CPU_BF16=1)"),
        ("0", "emulated no native bf16 (PIPELINE_CPU_BF16=0)"),
    ],
)
def test_the_shell_line_gives_the_answer_and_why(monkeypatch, capsys, pin, said):
    """``python -m pipeline.precision``: the line launch/run_sample.sh reads to choose its reference
    evaluations; a wrong pin is one line on stderr and exit status 1, not a traceback."""
    monkeypatch.setenv(precision.OVERRIDE, pin)
    precision.main()
    assert capsys.readouterr().out == said + "\n"
    monkeypatch.setenv(precision.OVERRIDE, "yes")
    with pytest.raises(SystemExit) as stop:
        precision.main()
    assert str(stop.value).startswith("precision: PIPELINE_CPU_BF16='yes': use 0")
