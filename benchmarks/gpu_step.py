"""The real training step as the GPU benchmark.

Two subcommands:

``prepare`` (CPU, here): small real shards from the bundled corpus through the project's own commands
(preprocess, the teacher stage for a real teacher column, tokenize for the student at 64 tokens and
e5-small at 128), the 4-layer student cut (``pipeline student``), and both model folders *without their
weights* (config, tokenizer, pooling rule): a folder of a few tens of MiB to carry to the GPU machine.

``run`` (the GPU machine; ``--smoke`` on CPU): with a global time budget, each measurement in its own
try/except that records its error in the JSON and goes on:

* ``gemm``: cuBLAS bf16 TFLOPS at the encoder's four GEMM shapes (QKV fused 384->1152, attention out
  384->384, FFN up 384->1536, FFN down 1536->384) at tokens = batch x length of every step below;
* ``loader``: the real BatchStream alone with ``--loader_workers`` workers (pinned, teacher column,
  stored ids vs tokenising on the fly) on this machine's CPUs (benchmarks/loader_rates.py);
* ``step``: the trainer built as launch/pretrain.py builds it (``pipeline.train.build.build`` on
  launch/configs/distill.yaml with overrides), fed by its own stream (workers, pinning, teacher column),
  each step ``pipeline.train.loop.train_step(trainer, batch)``: the student at 64 tokens and e5-small at
  128, batches 256/1,024/4,096. Host time waiting for the batch, step time from CUDA events, and inside
  the step CUDA events put by public hooks (module forward hooks, a gradient hook on the encoder's output,
  a post-accumulate-grad hook on the first parameter, optimizer step pre/post hooks): forward, loss,
  backward, the optimizer, the rest. Sequences/s over the timed steps (wall clock, synchronised at both
  ends), MFU against the nominal bf16 dense peak and against the measured GEMM rate;
* ``profile``: CUDA kernels per step and the kernel time by kind (torch.profiler over a few steps);
* ``sync_debug``: ``torch.cuda.set_sync_debug_mode`` over 20 non-logging steps: first "warn" (every host
  sync counted with the Python line that made it), then "error" (passes or names the first sync);
* ``compile`` / ``unpadded``: the same step with ``--train.compile=MODE`` / ``--train.unpadded=true``
  passed as config overrides; a config without the field records "not available";
* ``deepspeed``: the same step under DeepSpeed ZeRO-2 bf16 (launch/deepspeed/zero2.json) in one process,
  beside the plain engine, when deepspeed imports.

Weights: the model folders carry no weights (e5-small's are 470 MB); ``run`` builds each model from its
folder's config.json with random weights (seeded), which times the same architecture and the same
kernels as the real weights. The teacher column is real: the teacher stage's output, by the model given
to ``prepare`` (e5-small by default).

Peak: 989.4 TFLOPS dense bf16 for H100 SXM and H200 (NVIDIA H100 Tensor Core GPU datasheet,
"BF16 Tensor Core 1,979 teraFLOPS with sparsity", i.e. half dense; the H200 datasheet gives the same
figure); H100 PCIe 756 (datasheet, 1,513 with sparsity). Other GPUs: no nominal MFU.

    # here (CPU): about 5-10 min on a quiet 2-core machine, most of it the teacher stage
    .venv/bin/python benchmarks/gpu_step.py prepare --out out/gpu_bench --model models/e5-small
    # the GPU machine (the folder carried): <= 8 min, JSON to $OUT/gpu_step.json
    .venv/bin/python benchmarks/gpu_step.py run --data out/gpu_bench --out "$OUT/gpu_step.json" --budget_s 420
    # CPU smoke (tests/test_gpu_step_smoke.py): tiny model, a few steps
    .venv/bin/python benchmarks/gpu_step.py run --smoke --data DIR --out smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "pipeline" / "resources" / "corpus"
DISTILL = ROOT / "launch" / "configs" / "distill.yaml"
ZERO2 = ROOT / "launch" / "deepspeed" / "zero2.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "onnx", "openvino")
# Dense bf16 tensor-core peaks (TFLOPS) by device-name substring: NVIDIA datasheets (module docstring).
NOMINAL_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4}
PEAK_SOURCE = "NVIDIA H100/H200 datasheets: BF16 tensor core 1,979 TFLOPS with sparsity = 989.4 dense"
# model -> (its folder under DATA/models, its tokenised shards under DATA); the length is the shards'
MODELS = {"student": ("student", "tok_student"), "e5-small": ("e5-small", "tok_e5")}


# ------------------------------------------------------------------------------------------ prepare
def run_cli(*argv: str) -> None:
    """``python -m pipeline ARGV``: the stages' own command lines (in this process: one start-up)."""
    from pipeline.cli import main as pipeline_main

    print("+ python -m pipeline " + " ".join(argv), flush=True)
    code = pipeline_main(list(argv))
    if code:
        raise SystemExit(f"prepare: `python -m pipeline {' '.join(argv)}` exited {code}")


def copy_without_weights(src: Path, dst: Path) -> None:
    """A model folder's config, tokenizer and pooling rule, without its weights."""
    shutil.copytree(
        src, dst, ignore=lambda _, names: [n for n in names if n in WEIGHT_FILES], dirs_exist_ok=True
    )


def prepare(args: argparse.Namespace) -> int:
    out: Path = args.out
    if out.exists() and args.overwrite:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus"
    corpus.mkdir(exist_ok=True)
    inputs = []
    for name, lines in zip(("peoples_daily_199801.txt", "taobao_dialogues.jsonl"), args.lines, strict=True):
        text = (CORPUS / name).read_text(encoding="utf-8").splitlines()[:lines]
        (corpus / name).write_text("\n".join(text) + "\n", encoding="utf-8")
        inputs.append(str(corpus / name))
    model = str(args.model)
    teacher = str(args.teacher_model or args.model)
    student = str(args.student or out / "build" / "student")
    taught = str(out / "teacher")
    quiet = ["--progress", "false"]
    steps: list[tuple[Path, list[str]]] = [
        (out / "shards", ["preprocess", *inputs, "--out", str(out / "shards"), "--rows_per_block", "1000"]),
        (Path(student), ["student", model, "--layers", args.student_layers, "--shards", str(out / "shards"),
                         "--seen_char_pieces", "--out", student]),
        (out / "teacher", ["teacher", "--shards", str(out / "shards"), "--out", str(out / "teacher"),
                           "--model", teacher, "--dtype", "int8", "--precision", args.teacher_precision,
                           *quiet]),
        (out / "tok_student", ["tokenize", "--shards", taught, "--out", str(out / "tok_student"),
                               "--model", student, "--max_length", str(args.lengths[0]), *quiet]),
        (out / "tok_e5", ["tokenize", "--shards", taught, "--out", str(out / "tok_e5"),
                          "--model", model, "--max_length", str(args.lengths[1]), *quiet]),
    ]  # fmt: skip
    for done, argv in steps:
        if (done / "manifest.json").is_file() or (done / "encoder.json").is_file():
            print(f"prepare: {done} exists, kept", flush=True)
            continue
        run_cli(*argv)
    copy_without_weights(Path(student), out / "models" / "student")
    copy_without_weights(Path(model), out / "models" / "e5-small")
    if args.drop_build:
        shutil.rmtree(out / "build", ignore_errors=True)
    sizes = {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        for p in out.iterdir()
        if p.is_dir()
    }
    carried = {k: v for k, v in sizes.items() if k not in ("build", "corpus")}
    print(json.dumps({"prepared": str(out), "MiB": {k: round(v / 2**20, 2) for k, v in sizes.items()},
                      "to_carry_MiB": round(sum(carried.values()) / 2**20, 2)}, indent=2))  # fmt: skip
    return 0


# ------------------------------------------------------------------------------------------ helpers
class Budget:
    """The global time budget: a section asks before it starts whether its estimate still fits. 0 is no
    budget (every section runs, however slow the machine: the smoke test's setting)."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        if not self.seconds:
            return math.inf
        return self.seconds - (time.monotonic() - self.start)

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s


def error_record(exc: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:]]
    return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", "where": where}


def section(
    results: dict[str, Any], key: str, budget: Budget, estimate_s: float, fn: Callable[[], Any]
) -> Any:
    """Run one measurement: its record (or error) under ``results[key]``, never raising."""
    if not budget.allows(estimate_s):
        results[key] = {"skipped": f"budget: {budget.left():.0f} s left, about {estimate_s:.0f} s needed"}
        print(f"[{key}] skipped (budget)", flush=True)
        return None
    started = time.monotonic()
    try:
        value = fn()
        results[key] = value
    except Exception as exc:  # each measurement's failure is recorded; the next one runs
        results[key] = error_record(exc)
        value = None
    if isinstance(results[key], dict):
        results[key]["section_s"] = round(time.monotonic() - started, 2)
    print(f"[{key}] {time.monotonic() - started:.1f} s: {short(results[key])}", flush=True)
    cleanup()
    return value


def short(record: Any) -> str:
    if not isinstance(record, dict):
        return str(record)[:200]
    keys = ("error", "skipped", "sequences_per_s", "mfu_nominal", "kernels_per_step", "passed", "syncs")
    return ", ".join(f"{k}={record[k]}" for k in keys if k in record)[:300] or "ok"


def cleanup() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def nominal_peak(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, tflops in NOMINAL_BF16_TFLOPS.items():
        if key in device_name:
            return tflops
    return None


def shard_length(directory: Path) -> int:
    """The max_length a tokenised shard set was made with (the trainer's data.max_length must match)."""
    from pipeline.shards import read_manifest

    return int(read_manifest(directory)["tokenizer"]["max_length"])


def materialise(folder: Path, work: Path, seed: int = 0) -> Path:
    """A copy of ``folder`` with random weights built from its config.json (the folders carry none)."""
    import torch
    from transformers import AutoConfig, AutoModel

    dst = work / folder.name
    if (dst / "model.safetensors").is_file():
        return dst
    copy_without_weights(folder, dst)
    torch.manual_seed(seed)
    model = AutoModel.from_config(AutoConfig.from_pretrained(folder), add_pooling_layer=False)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


# ------------------------------------------------------------------------------------------ gemm
def gemm_peaks(tokens: list[int], device: str, smoke: bool) -> dict[str, Any]:
    """bf16 (fp32 on CPU) TFLOPS of y = x W^T at the encoder's four forward GEMM shapes, per token count."""
    import torch
    import torch.nn.functional as F

    shapes = {"qkv": (384, 1152), "attention_out": (384, 384), "ffn_up": (384, 1536), "ffn_down": (1536, 384)}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    iters, warm = (3, 1) if smoke else (50, 10)
    out: dict[str, Any] = {"dtype": str(dtype), "iters": iters, "by_tokens": {}}
    for m in tokens:
        row: dict[str, Any] = {}
        total_flops = total_s = 0.0
        for name, (k, n) in shapes.items():
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype)
            for _ in range(warm):
                F.linear(x, w)
            seconds = timed(lambda x=x, w=w: F.linear(x, w), iters, device)
            flops = 2.0 * m * k * n
            row[name] = round(flops / seconds / 1e12, 2)
            total_flops, total_s = total_flops + flops, total_s + seconds
            del x, w
        row["layer_mix"] = round(total_flops / total_s / 1e12, 2)  # the four at once: a layer's GEMM rate
        row["max"] = max(row[name] for name in shapes)
        out["by_tokens"][str(m)] = row
    return out


def timed(fn: Callable[[], Any], iters: int, device: str) -> float:
    """Seconds per call: CUDA events around ``iters`` calls on a GPU, the wall clock on CPU."""
    import torch

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) / iters


# ------------------------------------------------------------------------------------------ the trainer
def trainer_argv(
    data: Path, model_dir: Path, shards: str, max_length: int, batch: int, workers: int, device: str,
    run_dir: Path, extra: list[str],
) -> list[str]:  # fmt: skip
    """The distillation recipe (launch/configs/distill.yaml) pointed at the prepared data, as
    launch/pretrain.py would get it on its command line."""
    return [
        "--config", str(DISTILL),
        f"--data.shards={data / shards}",
        "--data.teacher=null",  # the shards' own teacher (the recipe pins e5-small; smoke data has another)
        "--data.teacher_dim=0",
        f"--data.max_length={max_length}",
        f"--data.num_workers={workers}",
        f"--model.name_or_path={model_dir}",
        f"--train.global_batch_size={batch}",
        "--train.max_steps=1000000",
        f"--train.device={device}",
        "--train.mixed_precision=" + ("bf16" if device == "cuda" else "no"),
        "--train.eval_every=0",
        "--train.progress=false",
        "--checkpoint.every_steps=0",
        "--checkpoint.every_minutes=0",
        f"--run_dir={run_dir}",
        "--resume=never",
        *extra,
    ]  # fmt: skip


def build_trainer(argv: list[str]) -> Any:
    """``launch/pretrain.py``'s build: the config from the command line, then ``build``."""
    from pipeline.cli import build_config
    from pipeline.train.build import build
    from pipeline.train.config import Config

    return build(build_config(Config, argv))


def config_accepts(argv: list[str]) -> str | None:
    """None when the config takes ``argv``'s overrides, else the config's one-line refusal."""
    from pipeline.cli import build_config
    from pipeline.errors import PipelineError
    from pipeline.train.config import Config

    try:
        build_config(Config, argv)
    except (PipelineError, SystemExit, ValueError, TypeError) as exc:
        line = str(exc).splitlines()[0] if str(exc) else ""
        return f"not available: {type(exc).__name__}: {line.split('. Known keys')[0]}"
    return None


def close_trainer(trainer: Any) -> None:
    with contextlib.suppress(Exception):
        trainer.close()
    with contextlib.suppress(Exception):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)  # one Accelerator per build: the next may differ (DeepSpeed)
        GradientState._reset_state()


class SectionClock:
    """CUDA events inside ``train_step`` through public hooks only (the loop's internals are not touched):
    forward (model forward pre/post hooks), loss (forward end to the gradient of the encoder's output),
    backward (to the first parameter's accumulated gradient: the last one backward reaches), optimizer
    (its step pre/post hooks). Events are read once, after the timed steps."""

    def __init__(self, trainer: Any):
        import torch

        self.torch = torch
        self.marks: list[dict[str, Any]] = []
        self.current: dict[str, Any] = {}
        self.handles: list[Any] = []
        model = trainer.model
        self.handles.append(model.register_forward_pre_hook(lambda *_: self.mark("forward_start")))
        self.handles.append(model.register_forward_hook(self.forward_end))
        first = next(p for p in trainer.module.parameters() if p.requires_grad)
        self.handles.append(first.register_post_accumulate_grad_hook(lambda _: self.mark("backward_end")))
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # Accelerate's wrapper
        if hasattr(optimizer, "register_step_pre_hook"):
            self.handles.append(optimizer.register_step_pre_hook(lambda *_: self.mark("optimizer_start")))
            self.handles.append(optimizer.register_step_post_hook(lambda *_: self.mark("optimizer_end")))

    def event(self) -> Any:
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def mark(self, name: str) -> None:
        if self.current is not None and name not in self.current:
            self.current[name] = self.event()

    def forward_end(self, module: Any, inputs: Any, output: Any) -> None:
        self.mark("forward_end")
        rows = output[0] if isinstance(output, tuple) else output
        if getattr(rows, "requires_grad", False):
            rows.register_hook(lambda grad: self.mark("backward_start"))

    def begin(self) -> None:
        self.current = {"step_start": self.event()}

    def end(self) -> None:
        self.current["step_end"] = self.event()
        self.marks.append(self.current)
        self.current = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def medians_ms(self) -> dict[str, float]:
        spans = {
            "to_forward": ("step_start", "forward_start"),
            "forward": ("forward_start", "forward_end"),
            "loss": ("forward_end", "backward_start"),
            "backward": ("backward_start", "backward_end"),
            "clip_and_rest_before_optimizer": ("backward_end", "optimizer_start"),
            "optimizer": ("optimizer_start", "optimizer_end"),
            "after_optimizer": ("optimizer_end", "step_end"),
            "step": ("step_start", "step_end"),
        }
        out = {}
        for name, (a, b) in spans.items():
            values = [m[a].elapsed_time(m[b]) for m in self.marks if a in m and b in m]
            if values:
                out[name] = round(statistics.median(values), 3)
        return out


def batch_lengths(batch: Any) -> tuple[Any, int | None]:
    """(each row's real token count (B,), the padded width) of a padded batch, or of an unpadded one
    (``train.unpadded``: flat tokens and ``cu_seqlens``; width None: nothing is padded)."""
    if batch.attention_mask is not None:
        return batch.attention_mask.sum(dim=1), batch.attention_mask.shape[1]
    return batch.cu_seqlens.diff(), None


def model_flops(trainer: Any, lengths: tuple[Any, int | None]) -> dict[str, float]:
    """Training FLOPs of one step's encoder (forward + backward = 3 x forward): 6 x non-embedding
    parameters x tokens + 12 x layers x hidden x B x T^2 (the attention's two matmuls), on the padded
    batch (what the GEMMs compute) and on the real tokens (what an unpadded step needs). An unpadded
    batch (width None) computes its real tokens only: its "padded" figures are its real ones."""
    backbone = trainer.module.encoder.backbone
    config = backbone.config
    dense = sum(p.numel() for n, p in backbone.named_parameters() if "embeddings" not in n)
    real_lengths, width = lengths
    real_lengths = real_lengths.double()
    rows = int(real_lengths.numel())
    if width is None:
        real = 6.0 * dense * float(real_lengths.sum())
        real += 12.0 * config.num_hidden_layers * config.hidden_size * float((real_lengths**2).sum())
        return {
            "padded": real, "real": real, "rows": rows, "length": float(real_lengths.sum()) / rows,
            "real_tokens": float(real_lengths.sum()), "max_length": trainer.cfg.data.max_length,
        }  # fmt: skip
    length = width
    layers, hidden = config.num_hidden_layers, config.hidden_size
    padded = 6.0 * dense * rows * length + 12.0 * layers * hidden * rows * length**2
    real = 6.0 * dense * float(real_lengths.sum()) + 12.0 * layers * hidden * float((real_lengths**2).sum())
    return {
        "padded": padded, "real": real, "rows": rows, "length": length,
        "real_tokens": float(real_lengths.sum()),
        "max_length": trainer.cfg.data.max_length,
    }  # fmt: skip


def batches(trainer: Any) -> Iterator[Any]:
    """The trainer's own stream, epoch after epoch, as train() iterates it."""
    return iter(trainer.stream)


def step_measure(
    trainer: Any, warmup: int, steps: int, device: str, gemm: dict[str, Any] | None, peak: float | None
) -> dict[str, Any]:
    """``steps`` timed calls of ``loop.train_step`` after ``warmup``: data wait (host), step and its
    sections (CUDA events), sequences/s (wall clock), MFU."""
    import torch

    from pipeline.train.loop import train_step

    cuda = device == "cuda"
    trainer.model.train()
    it = batches(trainer)
    warm_widths = []
    for _ in range(warmup):
        batch = next(it)
        warm_widths.append(batch_lengths(batch)[1])  # which widths the timed steps meet for the first time
        train_step(trainer, batch)
    clock = SectionClock(trainer) if cuda else None
    waits, host_steps, lengths, epoch_starts = [], [], [], 0
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        epoch_starts += trainer.stream.cursor.batches == 1  # a new epoch: its workers started afresh
        if clock:
            clock.begin()
        train_step(trainer, batch)
        if clock:
            clock.end()
        t2 = time.perf_counter()
        waits.append(t1 - t0)
        host_steps.append(t2 - t1)
        lengths.append(batch_lengths(batch))  # read after the timed steps
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - began
    it.close()
    flops = [model_flops(trainer, each) for each in lengths]
    sequences = sum(f["rows"] for f in flops)
    padded_flops, real_flops = sum(f["padded"] for f in flops), sum(f["real"] for f in flops)
    real_tokens = sum(f["real_tokens"] for f in flops)
    padded_tokens = sum(f["rows"] * f["length"] for f in flops)
    record: dict[str, Any] = {
        "steps": steps,
        "warmup": warmup,
        "sequences_per_s": round(sequences / wall, 1),
        "step_ms_wall": round(1e3 * wall / steps, 3),
        "data_wait_ms_median": round(1e3 * statistics.median(waits), 3),
        "data_wait_ms_total": round(1e3 * sum(waits), 1),
        "data_wait_share": round(sum(waits) / wall, 4),
        "host_step_ms_median": round(1e3 * statistics.median(host_steps), 3),
        "host_step_ms_each": [round(1e3 * t, 2) for t in host_steps],  # a median hides one-off costs
        "padded_length_each": [int(f["length"]) for f in flops],
        "warmup_padded_length_each": warm_widths,
        "epoch_starts_in_timed_steps": int(epoch_starts),
        "batches_per_epoch": trainer.stream.batches_per_epoch,
        "loader_workers": trainer.stream.num_workers,
        "pinned": bool(batch.input_ids.is_pinned()) if cuda else False,
        "sequences": sequences,
        "padded_length_median": statistics.median(f["length"] for f in flops),
        "real_over_padded_tokens": round(real_tokens / padded_tokens, 4),
        "tflops_padded": round(padded_flops / wall / 1e12, 6),
        "tflops_real": round(real_flops / wall / 1e12, 6),
    }
    if clock is not None:
        record["sections_ms_median"] = clock.medians_ms()
        spans_ms = [m["step_start"].elapsed_time(m["step_end"]) for m in clock.marks]
        record["sequences_per_s_steps_only"] = round(sequences / (sum(spans_ms) / 1e3), 1)  # no data waits
        record["step_span_ms_each"] = [round(t, 2) for t in spans_ms]
        clock.remove()
    if peak:
        record["mfu_nominal"] = round(padded_flops / wall / 1e12 / peak, 4)
        record["mfu_nominal_real_tokens"] = round(real_flops / wall / 1e12 / peak, 4)
    if gemm and gemm.get("by_tokens"):
        measured = {int(k): v for k, v in gemm["by_tokens"].items()}
        m = statistics.median(f["rows"] * f["length"] for f in flops)  # the GEMMs' M: rows x padded length
        nearest = min(measured, key=lambda k: abs(math.log(k / m)))
        record["mfu_vs_gemm_layer_mix"] = round(
            padded_flops / wall / 1e12 / measured[nearest]["layer_mix"], 4
        )
        record["gemm_tokens"] = {"step_median": m, "measured_nearest": nearest}
    return record


def profile_steps(trainer: Any, steps: int, device: str) -> dict[str, Any]:
    """Kernels per step and kernel time by kind, from torch.profiler over ``steps`` steps (after one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pipeline.train.loop import train_step

    it = batches(trainer)
    train_step(trainer, next(it))
    loaded = [next(it) for _ in range(steps)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for batch in loaded:
            train_step(trainer, batch)
        if device == "cuda":
            torch.cuda.synchronize()
    it.close()
    events = prof.events()
    device_type = torch.autograd.DeviceType.CUDA
    kernels = [e for e in events if e.device_type == device_type]
    by_kind: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in kernels:
        short_name = e.name[:120]
        by_name[short_name] += e.time_range.elapsed_us()
        calls[short_name] += 1
        name = e.name.lower()
        kind = (
            "gemm" if any(s in name for s in ("gemm", "cutlass", "sm90", "xmma", "cublas")) else
            "attention" if any(s in name for s in ("flash", "fmha", "attention", "efficient")) else
            "memcpy/memset" if "memcpy" in name or "memset" in name else
            "elementwise/other"
        )  # fmt: skip
        by_kind[kind] += e.time_range.elapsed_us()
    launches = sum(
        1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    )
    total_us = sum(by_kind.values())
    ops = sum(
        1 for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
    )
    return {
        "steps": steps,
        "kernels_per_step": round(len(kernels) / steps, 1),
        "launch_calls_per_step": round(launches / steps, 1),
        "aten_ops_per_step": round(ops / steps, 1),
        "kernel_ms_per_step": round(total_us / 1e3 / steps, 3),
        "kernel_time_share": {k: round(v / total_us, 4) for k, v in by_kind.most_common()}
        if total_us
        else {},
        "top_kernels": [
            {
                "name": n,
                "ms_per_step": round(us / 1e3 / steps, 3),
                "calls_per_step": round(calls[n] / steps, 1),
            }
            for n, us in by_name.most_common(15)
        ],
    }


def sync_debug(trainer: Any, steps: int, device: str) -> dict[str, Any]:
    """Host syncs in ``steps`` non-logging steps: counted with their lines ("warn"), then "error"."""
    import torch

    from pipeline.train.loop import train_step

    if device != "cuda":
        return {"skipped": "not available: torch.cuda.set_sync_debug_mode needs CUDA"}
    it = batches(trainer)
    train_step(trainer, next(it))  # a first step (lazy state, allocations) outside the count
    loaded = [next(it) for _ in range(2 * steps)]  # the loader outside the count: the step's own syncs
    torch.cuda.synchronize()
    where: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for batch in loaded[:steps]:
                train_step(trainer, batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            where[f"{Path(w.filename).name}:{w.lineno}"] += 1
    record: dict[str, Any] = {
        "steps": steps,
        "syncs": sum(where.values()),
        "sync_lines": dict(where.most_common(12)),
    }
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in loaded[steps:]:
            train_step(trainer, batch)
        record["passed"] = True
    except RuntimeError as exc:
        record["passed"] = False
        record["first_error"] = error_record(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    it.close()
    return record


# ------------------------------------------------------------------------------------------ run
def step_section(
    args: argparse.Namespace, which: str, batch: int, extra: list[str], work: Path, device: str,
    gemm: dict[str, Any] | None, peak: float | None, what: tuple[str, ...] = ("step",),
) -> dict[str, Any]:  # fmt: skip
    folder, shards = MODELS[which]
    length = shard_length(args.data / shards)
    model_dir = materialise(args.data / "models" / folder, work / "models")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{which}-{batch}-", dir=work))
    argv = trainer_argv(args.data, model_dir, shards, length, batch, args.workers, device, run_dir, extra)
    refused = config_accepts(argv) if extra else None
    if refused:
        return {"skipped": refused, "overrides": extra}
    trainer = build_trainer(argv)
    try:
        record: dict[str, Any] = {"model": which, "batch": batch, "max_length": length, "overrides": extra}
        record["weights"] = "random, from the folder's config.json (real weights not carried)"
        if "step" in what:
            record.update(step_measure(trainer, args.warmup, args.steps, device, gemm, peak))
        if "profile" in what:
            record["profile"] = guarded(lambda: profile_steps(trainer, args.profile_steps, device))
        if "sync_debug" in what:
            record["sync_debug"] = guarded(lambda: sync_debug(trainer, args.sync_steps, device))
        if device == "cuda":
            record["max_memory_gib"] = round(__import__("torch").cuda.max_memory_allocated() / 2**30, 2)
            __import__("torch").cuda.reset_peak_memory_stats()
        return record
    finally:
        close_trainer(trainer)
        shutil.rmtree(run_dir, ignore_errors=True)


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # one part of a section failing keeps the rest
        return error_record(exc)


def loader_alone(args: argparse.Namespace, device: str, budget: Budget) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from loader_rates import loader_cells

    folder, shards = MODELS["student"]
    model = args.data / "models" / folder
    pins = [True] if device == "cuda" else [False]
    cells = loader_cells(
        args.data / "teacher", args.data / shards, model, args.loader_workers, pins, [True],
        args.loader_batch, args.loader_repeats, 
        deadline=None if not budget.seconds else time.monotonic() + max(10.0, min(90.0, budget.left() - 60)),
    )  # fmt: skip
    return {"cells": cells}


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from pipeline.cli import setup_logging

    setup_logging()
    budget = Budget(args.budget_s)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.smoke and not args.allow_cpu:
        print("gpu_step: no CUDA device; use --smoke (or --allow_cpu) on CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if device == "cuda" else None
    peak = nominal_peak(name)
    results: dict[str, Any] = {
        "benchmark": "gpu_step",
        "command": " ".join(sys.argv),
        "device": name or "cpu",
        "nominal_bf16_tflops": peak,
        "nominal_source": PEAK_SOURCE if peak else None,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "sections": {},
    }
    sections = results["sections"]
    out: Path = args.out

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - budget.start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(out)  # rewritten after every section: a run cut short keeps what it measured

    work = Path(tempfile.mkdtemp(prefix="gpu_step-"))
    try:
        if args.deepspeed_only:  # the child of deepspeed_child
            section(
                sections,
                "deepspeed_zero2",
                budget,
                0,
                lambda: deepspeed_section(args, work, device, None, peak),
            )
            return 0
        lengths = {m: shard_length(args.data / MODELS[m][1]) for m in args.models}
        # the steps pad each batch to its longest sentence (bucketed): ~30 tokens on the bundled corpus,
        # whatever max_length caps; the GEMMs are measured at both
        widths = {lengths[m] for m in args.models} | ({32, 64, 128} if not args.smoke else set())
        tokens = sorted({b * w for w in widths for b in args.batches})
        gemm = section(sections, "gemm", budget, 5, lambda: gemm_peaks(tokens, device, args.smoke))
        save()
        if args.loader_workers:
            section(sections, "loader", budget, 20, lambda: loader_alone(args, device, budget))
            save()
        for which in args.models:
            for b in args.batches:
                what = ("step", "profile", "sync_debug") if b == args.detail_batch else ("step",)
                estimate = (
                    15
                    if args.smoke
                    else 20 + 0.0005 * b * lengths[which] / 64 * (1 + (which != "student") * 2)
                )
                measure = lambda w=which, b=b, what=what: step_section(  # noqa: E731
                    args, w, b, [], work, device, gemm, peak, what
                )
                section(sections, f"step/{which}/b{b}", budget, estimate, measure)
                save()
        if args.deepspeed:
            section(sections, "deepspeed_zero2", budget, 30 if args.smoke else 60,
                    lambda: deepspeed_child(args, budget, work))  # fmt: skip
            save()
        # --unpadded and --compile: the step timed alone; each --variant: timed, profiled and sync-checked
        timed_only = ("step",)
        variants = [("unpadded", ["--train.unpadded=true"], timed_only)] * args.unpadded
        variants += [(f"compile={m}", [f"--train.compile={m}"], timed_only) for m in args.compile]
        variants += [
            (label, extra, ("step", "profile", "sync_debug"))
            for label, *extra in map(str.split, args.variant)
        ]
        for label, extra, what in variants:
            for which in args.models:
                b = args.detail_batch
                measure = lambda w=which, b=b, extra=extra, what=what: variant_step(  # noqa: E731
                    args, w, b, extra, work, device, gemm, peak, what
                )
                estimate = 30 if args.smoke else (90 if any("compile" in x for x in extra) else 40)
                section(sections, f"{label}/{which}/b{b}", budget, estimate, measure)
                save()
    finally:
        save()
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} ({results['elapsed_s']} s)")
    return 0


# a --variant's words that switch torch's SDPA backends off for its section (not config overrides)
SDP_SWITCHES = {
    "sdp=no_cudnn": "cudnn_sdp",
    "sdp=no_flash": "flash_sdp",
    "sdp=no_efficient": "mem_efficient_sdp",
}


def variant_step(
    args: argparse.Namespace, which: str, batch: int, extra: list[str], work: Path, device: str,
    gemm: dict[str, Any] | None, peak: float | None, what: tuple[str, ...],
) -> dict[str, Any]:  # fmt: skip
    """The step with config overrides and SDPA backends switched off (``extra``), measured as ``what``
    asks (:func:`step_section`); the backends are switched back afterwards."""
    import torch

    switches = [SDP_SWITCHES[x] for x in extra if x in SDP_SWITCHES]
    overrides = [x for x in extra if x not in SDP_SWITCHES]
    before = {name: getattr(torch.backends.cuda, f"{name}_enabled")() for name in switches}
    for name in switches:
        getattr(torch.backends.cuda, f"enable_{name}")(False)
    try:
        record = step_section(args, which, batch, overrides, work, device, gemm, peak, what)
    finally:
        for name, enabled in before.items():
            getattr(torch.backends.cuda, f"enable_{name}")(enabled)
    record["sdp_off"] = switches
    return record


# ------------------------------------------------------------------------------------------ report
def report_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per step section of a ``run`` JSON: the wall-clock rate, the steps over 3x the median
    (one-off costs such as cuDNN attention plans for a new width or a recompile, which the wall clock
    over 20 steps keeps and a long run does not), and the step at its median span (CUDA events)."""
    peak = result.get("nominal_bf16_tflops")
    rows = []
    for name, r in result["sections"].items():
        if not isinstance(r, dict) or "step_ms_wall" not in r:
            continue
        median = (r.get("sections_ms_median") or {}).get("step")
        flops = r["tflops_padded"] * 1e9 * r["step_ms_wall"]  # per step: padded FLOPs over the wall clock
        spans = r.get("step_span_ms_each")
        slow = "—"
        if spans and median:  # one-off costs (cuDNN attention plans, recompiles): steps over 3x the median
            over = [t for t in spans if t > 3 * median]
            slow = f"{len(over)}, up to {max(over):,.0f}" if over else "0"
        tflops = flops / median / 1e9 if median else None
        syncs = (r.get("sync_debug") or {}).get("syncs", "—")
        profile = r.get("profile") or {}
        rows.append([
            name, f"{r['padded_length_median']:.0f}", f"{r['sequences_per_s']:,.0f}", slow,
            f"{median:.1f}" if median else "—", f"{r['batch'] / median * 1e3:,.0f}" if median else "—",
            f"{tflops:.0f}" if tflops else "—", f"{100 * tflops / peak:.1f} %" if tflops and peak else "—",
            str(profile.get("kernels_per_step", "—")), str(profile.get("kernel_ms_per_step", "—")),
            str(syncs), str(r.get("max_memory_gib", "—")),
        ])  # fmt: skip
    return rows


REPORT_HEADER = (
    "section", "padded width", "sequences/s (wall, 20 steps)", "steps > 3x median: count, ms",
    "median step ms", "sequences/s at the median", "TFLOPS at the median", "MFU", "kernels/step",
    "kernel ms/step", "syncs in 20 steps", "peak GiB",
)  # fmt: skip


def report(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import table

    for path in args.json:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
        print(f"{path}: {result['device']}, torch {result['torch']}")
        print(table(REPORT_HEADER, report_rows(result)))
    return 0


def deepspeed_child(args: argparse.Namespace, budget: Budget, work: Path) -> dict[str, Any]:
    """The DeepSpeed section in a child process with a timeout: DeepSpeed's process group and engine
    stay out of this process, and a hang costs the rest of the budget at most ``--deepspeed_timeout_s``."""
    out = work / "deepspeed.json"
    argv = (
        [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]] if sys.argv[1:2] == ["run"] else None
    )
    if argv is None:  # called as a function (tests): rebuild the command line from the parsed arguments
        raise RuntimeError("the DeepSpeed section runs from the command line only")
    argv = [a for a in argv if a != "--deepspeed"] + ["--deepspeed_only", "--out", str(out)]
    timeout = max(10.0, min(args.deepspeed_timeout_s, budget.left() - 10))
    try:
        done = subprocess.run(argv, timeout=timeout, capture_output=True, text=True, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s (DeepSpeed start-up or step hung)"}
    if not out.is_file():
        return {"error": f"exited {done.returncode} without results", "stderr_tail": done.stderr[-2000:]}
    record = json.loads(out.read_text())["sections"].get("deepspeed_zero2", {})
    return {**record, "child_exit": done.returncode}


def deepspeed_section(
    args: argparse.Namespace, work: Path, device: str, gemm: dict[str, Any] | None, peak: float | None
) -> dict[str, Any]:
    """The student's step under DeepSpeed ZeRO-2 (bf16 from the config) in this one process."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # an optional engine: its absence is a result
        return {"skipped": f"not available: deepspeed does not import ({type(exc).__name__}: {exc})"}
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # DeepSpeed makes its process group from env:// even for one process
    try:
        return step_section(
            args,
            "student",
            args.detail_batch,
            [f"--train.deepspeed_config={ZERO2}"],
            work,
            device,
            gemm,
            peak,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="build the small data folder here (CPU)")
    pp.add_argument("--out", type=Path, default=ROOT / "out" / "gpu_bench")
    pp.add_argument("--model", type=Path, default=ROOT / "models" / "e5-small", help="e5-small's folder")
    pp.add_argument(
        "--teacher_model", type=Path, default=None, help="the teacher stage's model (default --model)"
    )
    pp.add_argument("--student_layers", default="0,4,8,11")
    pp.add_argument("--student", type=Path, default=None, help="a student folder (else cut one)")
    pp.add_argument("--lines", type=int, nargs=2, default=[4000, 3000],
                    help="first lines of the People's Daily and Taobao files (~14k sentences)")  # fmt: skip
    pp.add_argument("--lengths", type=int, nargs=2, default=[64, 128], help="max_length: student, e5-small")
    pp.add_argument(
        "--teacher_precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="the teacher stage's CPU precision (auto: bf16 where the CPU has native bf16)",
    )
    pp.add_argument("--drop_build", action="store_true", help="delete the student's weights after copying")
    pp.add_argument("--overwrite", action="store_true")
    pr = sub.add_parser("run", help="measure (a GPU machine; --smoke on CPU)")
    pr.add_argument("--data", type=Path, default=ROOT / "out" / "gpu_bench", help="the prepare folder")
    pr.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_step.json")
    pr.add_argument(
        "--budget_s", type=float, default=420.0, help="global time budget (sections skipped past it); 0: none"
    )
    pr.add_argument("--models", nargs="+", default=["student", "e5-small"], choices=list(MODELS))
    pr.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    pr.add_argument(
        "--detail_batch", type=int, default=1024, help="the batch profiled, sync-checked, compiled"
    )
    pr.add_argument("--workers", type=int, default=8, help="the trainer's loader workers")
    pr.add_argument("--warmup", type=int, default=5)
    pr.add_argument("--steps", type=int, default=20)
    pr.add_argument("--profile_steps", type=int, default=3)
    pr.add_argument("--sync_steps", type=int, default=20)
    pr.add_argument("--loader_workers", type=int, nargs="*", default=[8], help="loader alone (none: skip)")
    pr.add_argument("--loader_batch", type=int, default=512, help="several batches per worker per epoch")
    pr.add_argument("--loader_repeats", type=int, default=2)
    pr.add_argument(
        "--compile", nargs="*", default=[], help="train.compile modes to try (e.g. default reduce-overhead)"
    )
    pr.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'LABEL OVERRIDE...'",
        help="one quoted word list: a label, then config overrides (and sdp=no_cudnn|no_flash|"
        "no_efficient); the detail batch's step, profiled and sync-checked; repeatable",
    )
    pr.add_argument("--unpadded", action="store_true", help="also the step with train.unpadded=true")
    pr.add_argument("--deepspeed", action="store_true", help="also the student's step under ZeRO-2")
    pr.add_argument("--deepspeed_timeout_s", type=float, default=150.0, help="the DeepSpeed child's limit")
    pr.add_argument("--deepspeed_only", action="store_true", help=argparse.SUPPRESS)
    pr.add_argument("--smoke", action="store_true", help="CPU, tiny: the prepared tiny data, a few steps")
    pr.add_argument("--allow_cpu", action="store_true", help="full sizes on CPU (slow; for checks)")
    pp = sub.add_parser("report", help="markdown table of the step sections of run JSONs")
    pp.add_argument("json", nargs="+", type=Path)
    args = p.parse_args(argv)
    return {"prepare": prepare, "run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
