"""Quality study: which objective gives the better from-scratch sentence encoder?

Every trained condition starts from the same random small BERT (``launch/configs/luse_scratch.yaml``'s
model) on the same augmented shards, with the SAME compute: equal optimizer steps and equal encoded
sequences per step (``--sequences``; LUSE with n views takes sequences/n sentences, SimCSE with 2
views takes sequences/2). A momentum key encoder adds one forward pass of view 0 per step on top;
the table says which rows have it. Each condition runs for every seed; each run is scored with
``python -m pipeline eval --suite=[sts, probe] --max_pairs=M`` (the same seeded subsample for all),
and the script prints mean ± std of Spearman x100 per set, avg5 and the sentiment probe.

    python -m pipeline augment --shards runs/sample/shards --out runs/quality/augmented --num_variants 4
    OMP_NUM_THREADS=1 python benchmarks/quality.py --shards runs/quality/augmented --out runs/quality \\
        --steps 300 --sequences 192 --seeds 1 2 3 --jobs 2 --max-pairs 2000

Runs that already have ``eval/eval.json`` are reused, so an interrupted study continues where it
stopped; ``--conditions`` picks a subset (``--list`` shows them). ``--curve STEPS`` instead trains
the default condition once for STEPS steps with a checkpoint every ``--curve-every`` steps and
scores every checkpoint (avg5 and loss against steps). ``--plots DIR`` draws the study's figures
from what is on disk (bar chart of avg5, curve, cosine per gold label before/after training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    config_loss,
    loss_override,
    luse_fields,
    mean_std,
    overridden_loss,
    pretrain_command,
    quiet_env,
)
from _common import table as markdown_table

from pipeline.evaluate.sts import STS_SETS
from pipeline.run_layout import CHECKPOINTS_DIR, STEP_GLOB, step_of

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIG = ROOT / "launch" / "configs" / "luse_scratch.yaml"
STUDENT_CONFIG = ROOT / "launch" / "configs" / "distill.yaml"


@dataclass(frozen=True)
class Condition:
    """One row of the study: overrides of the default config, or a reference without training."""

    name: str
    label: str
    overrides: tuple[str, ...] = ()
    kind: str = "train"  # train | tfidf | untrained | model (score --student or --teacher as it is)
    config: Path = DEFAULT_CONFIG  # the base config the overrides apply to
    views: int = 0  # sequences encoded per sentence (0 = no training)
    momentum_forward: bool = False  # an extra key-encoder forward of view 0
    int8_teacher: bool = False  # train on the int8 copy of --shards (int8_shards) instead of --shards
    notes: dict[str, Any] = field(default_factory=dict)


def luse(name: str, label: str, k: int, d: int, queue: int, momentum: float) -> Condition:
    fields = {**luse_fields(config_loss(DEFAULT_CONFIG)), "queue_size": queue, "momentum": momentum}
    return Condition(
        name,
        label,
        (f"--data.num_variants={k}", f"--data.num_dropout_views={d}", loss_override({"luse": fields})),
        views=1 + k + d,
        momentum_forward=momentum > 0,
    )


def default_condition() -> Condition:
    """The README's main-job configuration as it is (only steps/batch/seed set by the study)."""
    import yaml

    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text(encoding="utf-8"))
    data = cfg.get("data", {})
    views = 1 + data.get("num_variants", 4) + data.get("num_dropout_views", 1)
    return Condition(
        "default", "default config (README main job)", views=views,
        momentum_forward=luse_fields(cfg.get("loss")).get("momentum", 0) > 0,
    )  # fmt: skip


def all_conditions() -> dict[str, Condition]:
    rows = [
        Condition("tfidf", "char TF-IDF (no training)", kind="tfidf"),
        Condition("untrained", "untrained encoder (same architecture)", kind="untrained"),
        Condition(
            "simcse",
            "unsup. SimCSE (2 dropout views)",
            (loss_override({"simcse": {}}),),
            views=2,
        ),
        luse("luse", "LUSE k=4 EDA + 1 dropout view", 4, 1, 0, 0.0),
        luse("luse_q256", "LUSE + queue 256 (memory bank, m=0)", 4, 1, 256, 0.0),
        luse("luse_q1024_m999", "LUSE + queue 1024, momentum 0.999", 4, 1, 1024, 0.999),
        default_condition(),
    ]
    return {c.name: c for c in rows}


def student(name: str, label: str, views: int, *overrides: str) -> Condition:
    """A run from the student folder on teacher shards (``launch/configs/distill.yaml`` + overrides)."""
    return Condition(name, label, tuple(overrides), views=views, config=STUDENT_CONFIG)


def luse_views(k: int, d: int) -> tuple[str, ...]:
    return (f"--data.num_variants={k}", f"--data.num_dropout_views={d}")


def student_conditions() -> dict[str, Condition]:
    """The distillation study: a 4-layer cut of e5-small, the 12-layer teacher beside it."""
    distill = {"distill": {"loss": "cosine"}}  # launch/configs/distill.yaml's term
    rows = [
        Condition("tfidf", "char TF-IDF (no training)", kind="tfidf"),
        Condition("init", "student init: e5-small layers 0,4,8,11, trimmed vocab", kind="model"),
        Condition("teacher", "teacher: e5-small, 12 layers", kind="model"),
        student("s_simcse", "unsup. SimCSE", 2, loss_override({"simcse": {}})),
        student("s_luse", "LUSE k=2 EDA + 1 dropout view", 4, *luse_views(2, 1), loss_override({"luse": {}})),
        student("s_distill", "embedding distillation (cosine) alone = main job", 1),
        student(
            "s_distill_lr1e-4",
            "distillation at the previous recipe: lr 1e-4, dropout 0.1, fp32",
            1,
            "--optim.lr=1e-4",
            "--model.dropout=0.1",
            "--train.mixed_precision=no",
        ),  # fmt: skip
        student(
            "s_distill_bucketed", "distillation, length-bucketed batches", 1, "--data.length_bucketing=true"
        ),  # fmt: skip
        student(
            "s_luse_bucketed",
            "LUSE k=2 EDA + 1 dropout view, length-bucketed batches",
            4,
            *luse_views(2, 1),
            loss_override({"luse": {}}),
            "--data.length_bucketing=true",
        ),  # fmt: skip
        student("s_kl", "in-batch similarity KL alone", 1, loss_override({"kl": {}})),
        student("s_distill_kl", "distillation + KL", 1, loss_override(distill, {"kl": {}})),
        student(
            "s_luse_distill",
            "LUSE + distillation",
            4,
            *luse_views(2, 1),
            loss_override({"luse": {}}, distill),
        ),  # fmt: skip
        student(
            "s_luse_tpos",
            "LUSE + distillation + teacher as a positive",
            4,
            *luse_views(2, 1),
            loss_override({"luse": {"teacher_positive": True}}, distill),
        ),  # fmt: skip
        # 4 mined hard negatives per sentence are encoded too: 2 + 1 + 1 views + 4 = 8 sequences a sentence
        student(
            "s_luse_distill_hn",
            "LUSE + distillation + 4 mined hard negatives",
            8,
            *luse_views(2, 1),
            loss_override({"luse": {}}, distill),
            "--data.num_hard_negatives=4",
        ),  # fmt: skip
        student(
            "s_scratch_distill",
            "distillation into the student's architecture, random init",
            1,
            "--model.random_init=true",
        ),  # fmt: skip
        # the main job's row on the same teacher vectors stored as int8 + a per-row scale
        Condition(
            "s_distill_int8",
            "embedding distillation, teacher vectors stored int8 (main job)",
            views=1,
            config=STUDENT_CONFIG,
            int8_teacher=True,
        ),  # fmt: skip
    ]
    return {c.name: c for c in rows}


# ------------------------------------------------------------------------------------------- runs
def int8_shards(args: argparse.Namespace) -> Path:
    """Where the int8 copy of --shards is: --int8-shards, else SHARDS-int8 beside --shards."""
    given = getattr(args, "int8_shards", None)
    return given or args.shards.parent / f"{args.shards.name}-int8"


def ensure_int8_shards(args: argparse.Namespace) -> None:
    """Convert --shards (float16 teacher vectors) to int8 once, without the teacher model (seconds)."""
    target = int8_shards(args)
    if not (target / "manifest.json").is_file():
        command = [sys.executable, "-m", "pipeline", "teacher", f"--shards={args.shards}", f"--out={target}",
                   "--dtype=int8", "--progress=false"]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT, env=quiet_env())


def run_dir(args: argparse.Namespace, cond: Condition, seed: int) -> Path:
    return args.out / f"{cond.name}_seed{seed}"


def batch_for(args: argparse.Namespace, cond: Condition) -> int:
    if args.sequences % cond.views:
        raise SystemExit(
            f"--sequences {args.sequences} is not a multiple of {cond.name}'s {cond.views} views"
        )
    return args.sequences // cond.views


def train_command(
    args: argparse.Namespace, cond: Condition, seed: int, out: Path, steps: int, equal_compute: bool = True
) -> list[str]:
    """The pretrain command of one run; ``equal_compute=False`` keeps the config's own batch."""
    batch = batch_for(args, cond) if equal_compute else None
    queue = luse_fields(overridden_loss(cond.overrides)).get("queue_size", 0)
    if batch and queue and queue % batch:
        raise SystemExit(f"{cond.name}: queue is not a multiple of its batch {batch}; change --sequences")
    return pretrain_command(
        cond.config,
        out,
        f"--data.shards={int8_shards(args) if cond.int8_teacher else args.shards}",
        *([f"--model.name_or_path={args.student}"] if cond.config == STUDENT_CONFIG else []),
        f"--train.seed={seed}",
        f"--train.max_steps={steps}",
        *([f"--train.global_batch_size={batch}", f"--train.eval_every={args.eval_every}"] if batch else []),
        "--train.final_model=best" if args.select_best else "--train.final_model=last",
        "--train.log_every=10",
        "--data.num_workers=1",
        *(f"--{o.removeprefix('--')}" for o in getattr(args, "set", None) or ()),
        *cond.overrides,
    )


def eval_command(
    args: argparse.Namespace, model: Path | None, out: Path, suite: str = "[sts, probe]"
) -> list[str]:
    command = [
        sys.executable, "-m", "pipeline", "eval", *([str(model)] if model else []), f"--suite={suite}",
        "--progress=false", f"--out={out}", f"--seed={args.eval_seed}",
    ]  # fmt: skip
    if args.max_pairs:
        command.append(f"--max_pairs={args.max_pairs}")
    return command


def save_untrained(args: argparse.Namespace, seed: int, out: Path) -> Path:
    """The default architecture at initialisation (same vocabulary rule and seed as a run)."""
    from pipeline.config import load_config
    from pipeline.train.build import build_encoder
    from pipeline.train.config import Config

    overrides = {"data.shards": str(args.shards), "run_dir": str(out), "train.seed": seed}
    cfg = load_config(Config, DEFAULT_CONFIG, overrides)
    model = out / "model"
    if not (model / "encoder.json").is_file():
        build_encoder(cfg).save_pretrained(model)
    return model


def run_one(args: argparse.Namespace, cond: Condition, seed: int) -> dict[str, float]:
    out = run_dir(args, cond, seed)
    result = out / "eval" / "eval.json"
    if not result.is_file():
        out.mkdir(parents=True, exist_ok=True)
        start = time.time()
        log = (out / "study.log").open("a", encoding="utf-8")
        if cond.kind == "tfidf":
            command = eval_command(args, None, out / "eval", "[tfidf]")
            subprocess.run(command, check=True, cwd=ROOT, stdout=log, stderr=log, env=quiet_env())
        else:
            if cond.kind == "train":
                command = train_command(args, cond, seed, out, args.steps)
                subprocess.run(command, check=True, cwd=ROOT, stdout=log, stderr=log, env=quiet_env())
                model = out / "model"
            elif cond.kind == "model":
                model = args.student if cond.name == "init" else args.teacher
            else:
                model = save_untrained(args, seed, out)
            trained = time.time()
            command = eval_command(args, model, out / "eval")
            subprocess.run(command, check=True, cwd=ROOT, stdout=log, stderr=log, env=quiet_env())
            timing = {"train_s": round(trained - start, 1), "eval_s": round(time.time() - trained, 1)}
            (out / "timing.json").write_text(json.dumps(timing), encoding="utf-8")
    last = out / "eval_last" / "eval.json"
    if cond.kind == "train" and args.select_best and not last.is_file():
        # The best checkpoint is what the run exports; the last step shows where training was heading.
        command = eval_command(args, out, last.parent) + ["--checkpoint=latest"]
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=quiet_env())
    return scores(out, cond)


def scores(out: Path, cond: Condition) -> dict[str, float]:
    data = json.loads((out / "eval" / "eval.json").read_text(encoding="utf-8"))
    sts = data["sts"]["tfidf" if cond.kind == "tfidf" else "model"]
    row = {s: sts[s] for s in STS_SETS}
    row["avg5"] = statistics.mean(row.values())
    if "probe" in data:
        row["probe_acc"], row["probe_f1"] = data["probe"]["accuracy"], data["probe"]["macro_f1"]
    last = out / "eval_last" / "eval.json"
    if last.is_file():
        at_last = json.loads(last.read_text(encoding="utf-8"))
        row["avg5_last"] = statistics.mean(at_last["sts"]["model"][s] for s in STS_SETS)
        row["probe_acc_last"] = at_last["probe"]["accuracy"]
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        logged = [
            json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()
        ]
        evals = {r["step"]: r["sts_b_valid_spearman"] for r in logged if r.get("event") == "eval"}
        if evals:
            row["valid_step0"] = evals.get(0, float("nan"))
            row["best_step"] = float(
                max((s for s in evals if s > 0), key=lambda s: (evals[s], -s), default=0)
            )
        last = [r for r in logged if "loss" in r]
        if last:
            row["loss"] = last[-1].get("contrastive_loss", last[-1]["loss"])
            row["uniformity"] = last[-1].get("uniformity", float("nan"))
    timing = out / "timing.json"
    if timing.is_file():
        row.update(json.loads(timing.read_text(encoding="utf-8")))
    return row


# ------------------------------------------------------------------------------------------ tables
def table(
    results: dict[str, list[dict[str, float]]], conditions: dict[str, Condition], args: argparse.Namespace
) -> str:
    cols = ["avg5", *STS_SETS, "probe_acc", "avg5_last", "probe_acc_last", "best_step", "loss", "uniformity"]
    lines = []
    for name, rows in results.items():
        cond = conditions[name]
        shape = f"{batch_for(args, cond)} × {cond.views}" if cond.views else "–"
        if cond.momentum_forward:
            shape += " (+ key fwd)"
        cells = []
        for c in cols:
            values = [r.get(c, float("nan")) for r in rows]
            if c == "best_step":  # which checkpoint each seed exported: a list, not a mean
                cells.append("/".join(f"{v:.0f}" for v in values if v == v) or "–")
            else:
                cells.append(mean_std(values, 3 if c in ("loss", "uniformity") else 2))
        lines.append([cond.label, shape, str(len(rows)), *cells])
    return markdown_table(["condition", "batch × views", "seeds", *cols], lines)


# --------------------------------------------------------------------------------------- whitening
def run_whitening(args: argparse.Namespace, cond: Condition) -> None:
    """Raw vs BERT-whitened avg5 of one condition's exported models (whitening fitted on corpus text)."""
    raw, white = [], []
    for seed in args.seeds:
        out = run_dir(args, cond, seed)
        target = out / "eval_whitened"
        if not (target / "eval.json").is_file():
            command = eval_command(args, out / "model", target, "[sts]") + ["--whitening"]
            subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=quiet_env())
        sts = json.loads((target / "eval.json").read_text(encoding="utf-8"))["sts"]
        raw.append(statistics.mean(sts["model"][s] for s in STS_SETS))
        white.append(statistics.mean(sts["model_whitened"][s] for s in STS_SETS))
        per_set = " ".join(f"{s} {sts['model_whitened'][s]:.2f}" for s in STS_SETS)
        print(f"{cond.name} seed={seed}: avg5 raw {raw[-1]:.2f} whitened {white[-1]:.2f} ({per_set})")
    print(f"{cond.label}: avg5 raw {mean_std(raw)}, whitened {mean_std(white)} over seeds {args.seeds}")


# ------------------------------------------------------------------------------------------- curve
def run_curve(args: argparse.Namespace) -> list[dict[str, float]]:
    """Train the default condition once, checkpointing every --curve-every steps; score each one."""
    cond = all_conditions()["default"]
    out = args.out / f"curve_seed{args.seeds[0]}"
    if not (out / "model" / "encoder.json").is_file():
        command = train_command(args, cond, args.seeds[0], out, args.curve, equal_compute=False)
        command += [
            f"--checkpoint.every_steps={args.curve_every}",
            "--checkpoint.every_minutes=0",
            f"--checkpoint.keep_last={args.curve // args.curve_every + 1}",
        ]
        out.mkdir(parents=True, exist_ok=True)
        with (out.parent / f"{out.name}.log").open("a", encoding="utf-8") as log:
            subprocess.run(command, check=True, cwd=ROOT, stdout=log, stderr=log, env=quiet_env())
    points = [(0, save_untrained(args, args.seeds[0], args.out / f"untrained_seed{args.seeds[0]}"))]
    steps = {step_of(p.name): p for p in (out / CHECKPOINTS_DIR).glob(STEP_GLOB)}
    points += sorted((s, p) for s, p in steps.items() if s is not None)
    rows = []
    for step, model in points:
        target = out / "curve" / f"step_{step:07d}"
        if not (target / "eval.json").is_file():
            subprocess.run(eval_command(args, model, target, "[sts]"), check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL, env=quiet_env())  # fmt: skip
        data = json.loads((target / "eval.json").read_text(encoding="utf-8"))["sts"]["model"]
        row = {"step": step, **{s: data[s] for s in STS_SETS}}
        row["avg5"] = statistics.mean(data[s] for s in STS_SETS)
        rows.append(row)
        print(f"step {step}: avg5 {row['avg5']:.2f}", flush=True)
    (out / "curve.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return rows


# ------------------------------------------------------------------------------------------- plots
def draw_plots(args: argparse.Namespace, conditions: dict[str, Condition]) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.plots.mkdir(parents=True, exist_ok=True)
    study = args.out / "study.json"
    if study.is_file():
        results = json.loads(study.read_text(encoding="utf-8"))
        names = [n for n in results if n in conditions]
        means = [statistics.mean(r["avg5"] for r in results[n]) for n in names]
        stds = [
            statistics.stdev([r["avg5"] for r in results[n]]) if len(results[n]) > 1 else 0 for n in names
        ]
        last = [[r["avg5_last"] for r in results[n] if "avg5_last" in r] for n in names]
        fig, ax = plt.subplots(figsize=(8, 0.55 * len(names) + 1.2))
        y = np.arange(len(names))
        ax.barh(
            y - 0.2, means, 0.4, xerr=stds, color="#4c72b0", alpha=0.85, capsize=3, label="exported model"
        )
        ax.barh(
            y + 0.2, [statistics.mean(v) if v else 0 for v in last], 0.4,
            xerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in last],
            color="#dd8452", alpha=0.85, capsize=3, label="last step",
        )  # fmt: skip
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        low = min([m for m in means if m > 0] + [min(v) for v in last if v])
        ax.set_xlim(left=max(0.0, 5 * (low // 5) - 5))  # differences of a point must stay visible
        ax.set_yticks(y, [conditions[n].label for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("avg5 (Spearman × 100, mean ± std over seeds; the axis does not start at 0)")
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        fig.savefig(args.plots / "quality_avg5.png", dpi=110)
        plt.close(fig)
    curve = args.out / f"curve_seed{args.seeds[0]}"
    if (curve / "curve.json").is_file():
        from pipeline.evaluate.plots import metric_series, read_metrics

        rows = json.loads((curve / "curve.json").read_text(encoding="utf-8"))
        train, _ = metric_series(read_metrics(curve / "metrics.jsonl")[0])
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
        for key in ("loss", "contrastive_loss"):
            if key in train:
                left.plot(*train[key], label=key)
        left.set_xlabel("optimizer step")
        left.set_ylabel("training loss")
        left.legend(fontsize=8)
        left.grid(alpha=0.3)
        steps = [r["step"] for r in rows]
        for s in (*STS_SETS, "avg5"):
            right.plot(steps, [r[s] for r in rows], marker="o" if s == "avg5" else ".",
                       lw=2.5 if s == "avg5" else 1, label=s)  # fmt: skip
        if study.is_file() and "tfidf" in results:
            floor = statistics.mean(r["avg5"] for r in results["tfidf"])
            right.axhline(floor, color="grey", ls="--", lw=1, label=f"TF-IDF avg5 {floor:.1f}")
        right.set_xlabel("optimizer step")
        right.set_ylabel("Spearman × 100")
        right.legend(fontsize=7, ncol=2)
        right.grid(alpha=0.3)
        fig.suptitle("default configuration: loss and STS against steps")
        fig.tight_layout()
        fig.savefig(args.plots / "quality_curve.png", dpi=110)
        plt.close(fig)
    student_study = "default" not in conditions
    before = args.student if student_study else args.out / f"untrained_seed{args.seeds[0]}" / "model"
    main_row = conditions["s_distill" if student_study else "default"]
    after = args.after or run_dir(args, main_row, args.seeds[0]) / "model"
    if before.is_dir() and after.is_dir():
        from pipeline.evaluate.plots import plot_similarity
        from pipeline.evaluate.report import Config as ReportConfig
        from pipeline.evaluate.report import similarity_by_set
        from pipeline.evaluate.resolve import resolve

        for tag, model in (("before", before), ("after", after)):
            cfg = ReportConfig(run_dir=model, max_pairs=args.max_pairs or 2000, progress=False)
            cosines = similarity_by_set(resolve(str(model)), cfg, None)
            state = "untrained" if tag == "before" else "trained"
            title = f"cosine per gold label, {state} encoder ({model.parent.name})"
            plot_similarity(cosines, args.plots / f"quality_cosine_{tag}.png", title)
    print(f"plots in {args.plots}")


# -------------------------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shards", type=Path, default=Path("runs/quality/augmented"), help="augmented shards (>= 4 variants)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/quality"), help="one run dir per condition and seed"
    )
    p.add_argument("--conditions", nargs="+", default=None, help="subset of conditions (default: all)")
    p.add_argument("--list", action="store_true", help="list the conditions and exit")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="train.seed of each repeat")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (equal for all)")
    p.add_argument("--sequences", type=int, default=192, help="encoded sequences per step (equal for all)")
    p.add_argument("--max-pairs", type=int, default=2000, help="eval subsample per set and probe (0 = all)")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the eval subsample and probe split")
    p.add_argument("--eval-every", type=int, default=50, help="STS-B valid eval interval during training")
    p.add_argument(
        "--select-best", action=argparse.BooleanOptionalAction, default=True,
        help="score each run's best STS-B valid checkpoint (train.final_model=best) instead of its last step",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one BLAS thread each)")
    p.add_argument(
        "--curve",
        type=int,
        default=0,
        help="train the default once for this many steps and score checkpoints",
    )
    p.add_argument("--curve-every", type=int, default=100, help="checkpoint interval of --curve")
    p.add_argument("--whitening", default=None, help="score this condition's models raw and whitened")
    p.add_argument("--plots", type=Path, default=None, help="draw figures from the results into this folder")
    p.add_argument(
        "--after",
        type=Path,
        default=None,
        help="trained model for the cosine-after plot (default: default_seed1)",
    )
    p.add_argument(
        "--study", choices=("scratch", "student"), default="scratch",
        help="scratch: objectives from a random small BERT; student: distillation of a cut of "
        "e5-small on teacher shards (needs --student and --teacher)",
    )  # fmt: skip
    p.add_argument("--student", type=Path, default=Path("runs/sample/student"), help="student folder")
    p.add_argument("--teacher", type=Path, default=Path("models/e5-small"), help="teacher folder")
    p.add_argument(
        "--int8-shards", type=Path, default=None,
        help="s_distill_int8's shards: --shards with int8 teacher vectors (default SHARDS-int8 beside "
        "--shards, converted from --shards by `pipeline teacher --dtype int8` when missing)",
    )  # fmt: skip
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE",
        help="config overrides for every training run, before each row's own (e.g. optim.fused=false)",
    )  # fmt: skip
    args = p.parse_args()
    args.student, args.teacher = args.student.resolve(), args.teacher.resolve()
    args.shards, args.out = args.shards.resolve(), args.out.resolve()
    conditions = student_conditions() if args.study == "student" else all_conditions()
    if args.list:
        for c in conditions.values():
            print(f"{c.name:18s} {c.label}  {' '.join(c.overrides)}")
        return
    if args.plots:
        draw_plots(args, conditions)
        return
    if args.curve:
        run_curve(args)
        return
    if args.whitening:
        run_whitening(args, conditions[args.whitening])
        return
    names = args.conditions or list(conditions)
    unknown = [n for n in names if n not in conditions]
    if unknown:
        raise SystemExit(f"unknown condition(s) {unknown}; --list shows them")
    if any(conditions[n].int8_teacher for n in names):
        args.int8_shards = args.int8_shards.resolve() if args.int8_shards else None
        ensure_int8_shards(args)

    # seed-major: partial grids compare; rows without training are scored once
    cells = [
        (conditions[n], s) for s in args.seeds for n in names
        if conditions[n].kind in ("train", "untrained") or s == args.seeds[0]
    ]  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [(cond, seed, pool.submit(run_one, args, cond, seed)) for cond, seed in cells]
        for cond, seed, future in futures:
            row = future.result()
            results[cond.name].append(row)
            took = f" (train {row['train_s']:.0f} s, eval {row['eval_s']:.0f} s)" if "train_s" in row else ""
            print(f"{cond.name} seed={seed}: avg5 {row['avg5']:.2f}{took}", flush=True)
    previous = args.out / "study.json"
    merged = json.loads(previous.read_text(encoding="utf-8")) if previous.is_file() else {}
    merged.update(results)
    previous.write_text(json.dumps(merged, indent=1), encoding="utf-8")
    print(f"\n{args.steps} steps x {args.sequences} encoded sequences per step, seeds {args.seeds}, "
          f"eval on {args.max_pairs or 'all'} pairs per set")  # fmt: skip
    print(table(results, conditions, args))


if __name__ == "__main__":
    main()
