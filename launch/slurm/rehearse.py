"""README's "On a GPU cluster", rehearsed as real SLURM jobs on the local one-node cluster.

    .venv/bin/python launch/slurm/rehearse.py --out runs/rehearsal            # the bundled sample, e5-small
    .venv/bin/python launch/slurm/rehearse.py --out /tmp/rehearsal --tiny     # seconds-long stages (CI)

The commands are read from README.md's "On a GPU cluster" block and submitted as they are written: the
same scripts, configs, arguments and `--dependency=afterok` chain. Only what a CPU node cannot match is
replaced, each by a rule below that must still find its text in the README (else the rehearsal stops,
naming the rule): the GPU and node requests (CPU, one node, two training processes, arrays of two; of
one with --tiny), the corpus (the bundled sample; with --tiny its first 200 lines, and a random 12-layer,
64-wide character BERT as the teacher), `runs/cluster` (--out), and for training the GPU-only settings
(train.device=cpu, train.compile=off), a length of a few hundred steps of a CPU-sized batch, and
checkpoints and STS-B valid by steps (the same steps in every run, so runs can be compared bit for bit).

Then it checks:
1. every job of the chain ends COMPLETED;
2. sentence-transformers loads the export, and its vectors equal the trained model's own;
3. the export's avg5 is within 0.3 of the same training and evaluation run by one process
   (`launch/pretrain.py` outside SLURM, at the same global batch and steps);
4. the README's pretrain job submitted again, with one rank killed (SIGKILL) mid-run, is requeued, resumes
   and ends COMPLETED with the same final weights (sha256) as the chain's uninterrupted job.

It prints one line per check and writes OUT/rehearsal.json; exit status 1 when a check fails. The local
cluster must be running (`bash launch/slurm/local_cluster.sh start`); SLURM_CONF is read from it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CORPUS = [
    "pipeline/resources/corpus/peoples_daily_199801.txt",
    "pipeline/resources/corpus/taobao_dialogues.jsonl",
]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


class RehearsalError(RuntimeError):
    """The rehearsal cannot go on (README changed under a rule, a job failed, the cluster is missing)."""


# ----------------------------------------------------------------------------------- the README's block
def cluster_block(readme: str) -> list[str]:
    """The commands of README's first ```bash block under "## On a GPU cluster", continuations joined."""
    section = readme.split("\n## On a GPU cluster", 1)[-1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    if match is None:
        raise RehearsalError("README.md has no ```bash block under '## On a GPU cluster'")
    joined = match.group(1).replace("\\\n", " ")
    return [re.sub(r"\s+", " ", line).strip() for line in joined.splitlines() if line.strip()
            and not line.lstrip().startswith("#")]  # fmt: skip


@dataclass(frozen=True)
class Form:
    """What the rehearsal puts in place of what a CPU node cannot match."""

    name: str
    batch: int  # the global batch: two ranks of batch / 2
    steps: int
    eval_every: int  # STS-B valid, by steps
    checkpoint_every: int
    max_pairs: int  # per STS set, in the final evaluation
    kill_at: int  # the step after which a rank of the second pretrain job is killed
    timeout: float  # seconds for the chain
    array: int = 2  # tasks of each array job (preprocess's phases, augment, teacher, tokenize)
    extra_train: tuple[str, ...] = ()

    def train_overrides(self) -> list[str]:
        return [
            "--train.device=cpu", "--train.compile=off", f"--train.global_batch_size={self.batch}",
            f"--train.max_samples={self.batch * self.steps}",
            f"--optim.warmup_steps={max(1, self.steps // 30)}",  # 3 %, as the recipe's
            f"--train.log_every={self.checkpoint_every}", f"--train.eval_every={self.eval_every}",
            "--train.eval_every_minutes=0", f"--checkpoint.every_steps={self.checkpoint_every}",
            "--checkpoint.every_minutes=0", "--data.num_workers=1", "--train.progress=false",
            *self.extra_train,
        ]  # fmt: skip


TINY_WIDTH = 64  # the random teacher's (and so the student's) width; e5-small's is 384
FULL = Form("full", batch=64, steps=300, eval_every=100, checkpoint_every=50, max_pairs=1000, kill_at=120,
            timeout=4 * 3600.0)  # fmt: skip
TINY = Form("tiny", batch=16, steps=40, eval_every=20, checkpoint_every=4, max_pairs=64, kill_at=9,
            timeout=1800.0, array=1,
            extra_train=("--train.eval_max_pairs=64", f"--data.teacher_dim={TINY_WIDTH}"))  # fmt: skip


@dataclass
class Rule:
    """Replace ``pattern`` (a regex) by ``replacement`` in every command; it must match at least once."""

    pattern: str
    replacement: str
    why: str
    hits: int = field(default=0, compare=False)

    def apply(self, command: str) -> str:
        new, n = re.subn(self.pattern, self.replacement, command)
        self.hits += n
        return new


def rules(form: Form, out: Path, corpus: list[str], teacher: str | None) -> list[Rule]:
    train = " ".join(form.train_overrides())
    found = [
        Rule(r"^TORCH_CUDA=\S+ EXTRA=gpu bash launch/setup\.sh$", "", "set up already: this .venv"),
        Rule(r"runs/cluster", str(out), "the rehearsal's folder"),
        Rule(r"/shared/nlp_chinese_corpus", " ".join(corpus), "the bundled sample"),
        Rule(r"\bTASKS=8\b", f"TASKS={form.array}", "smaller arrays"),
        Rule(r"--array=0-7\b", f"--array=0-{form.array - 1}", "smaller arrays"),
        Rule(r"--cpus-per-task=8\b", "--cpus-per-task=1", "one CPU a task (the node has two)"),
        Rule(r"--gres=gpu:1\b", "--gres=none", "no GPU"),
        Rule(r" --gpus-per-node=8\b", "", "no GPU"),
        Rule(r"--nodes=2 --ntasks-per-node=8\b", "--nodes=1 --ntasks-per-node=2", "two training processes"),
        Rule(r"--nodes=2 --ntasks-per-node=1\b", "--nodes=1 --ntasks-per-node=1", "one node"),
        Rule(r"--device cuda\b", "--device cpu", "no GPU"),
        Rule(r"(launch/slurm/pretrain\.sbatch [^)]*--run_dir=[^\s)]+)", rf"\1 {train}", "CPU, fewer steps"),
        Rule(r"(pipeline\.sbatch eval [^)]*)", rf"\1 --max_pairs {form.max_pairs}", "fewer pairs a set"),
    ]  # fmt: skip
    if teacher is not None:
        found += [
            Rule(r"^\.venv/bin/python -m pipeline models fetch e5-small --out models/e5-small$", "",
                 "a random 12-layer teacher instead"),
            Rule(r"(?<![\w/])models/e5-small\b", teacher, "the random teacher"),
        ]  # fmt: skip
    return found


def localise(commands: list[str], found: list[Rule]) -> list[str]:
    out = []
    for command in commands:
        for rule in found:
            command = rule.apply(command)
        if command:
            out.append(command)
    missing = [f"{r.pattern!r} ({r.why})" for r in found if not r.hits]
    if missing:
        raise RehearsalError(f"README's cluster block changed: no text for the rule(s) {', '.join(missing)}")
    return out


# ----------------------------------------------------------------------------------------- tiny inputs
def tiny_inputs(out: Path, lines: int = 200) -> tuple[list[str], str]:
    """The first ``lines`` lines of the People's Daily sample, and a random 12-layer BERT of width
    TINY_WIDTH with a character vocabulary as the teacher (the README's student keeps 6 of its 12
    layers)."""
    from pipeline.model import (
        SentenceEncoder,
        build_char_vocab,
        build_scratch_backbone,
        make_tokenizer,
        write_vocab,
    )

    out.mkdir(parents=True, exist_ok=True)
    text = (REPO / CORPUS[0]).read_text(encoding="utf-8").splitlines()[:lines]
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(text) + "\n", encoding="utf-8")
    teacher = out / "models" / "e5-small"  # the config's data.teacher names the teacher by its folder
    if not (teacher / "config.json").exists():
        teacher.mkdir(parents=True, exist_ok=True)
        vocab = build_char_vocab(text, min_count=1)
        write_vocab(vocab, teacher / "vocab.txt")
        config = dict(hidden_size=TINY_WIDTH, num_hidden_layers=12, num_attention_heads=2,
                      intermediate_size=TINY_WIDTH, max_position_embeddings=64)  # fmt: skip
        backbone = build_scratch_backbone(config, len(vocab), seed=0)
        SentenceEncoder(backbone, make_tokenizer(teacher / "vocab.txt"), "mean", 48, "").save_pretrained(
            teacher
        )
    return [str(corpus)], str(teacher)


# ------------------------------------------------------------------------------------------ SLURM jobs
def run(cmd: list[str], env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, **kw)


def jobs(env: dict[str, str], logs: Path, since: int = 0) -> list[dict[str, str]]:
    """``scontrol show job`` records of the jobs whose log is under ``logs`` (this rehearsal's) and whose
    id is above ``since`` (the controller keeps a finished job's record for minutes: an earlier
    rehearsal's in the same folder)."""
    text = run(["scontrol", "-o", "show", "job"], env).stdout
    records = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in text.splitlines()]
    return [r for r in records if r.get("StdOut", "").startswith(str(logs) + "/") and int(r["JobId"]) > since]


def newest_job(env: dict[str, str]) -> int:
    text = run(["scontrol", "-o", "show", "job"], env).stdout
    return max((int(x) for x in re.findall(r"^JobId=(\d+)", text, re.MULTILINE)), default=0)


def cancel(env: dict[str, str], records: list[dict[str, str]]) -> None:
    ids = [r["JobId"] for r in records if r.get("JobState") not in FINAL]
    if ids:
        run(["scancel", *ids], env)


def wait_for(
    env: dict[str, str], logs: Path, since: int, done: Any, timeout: float, what: str
) -> list[dict[str, str]]:
    """Poll the rehearsal's jobs until ``done(records)``; a job that fails cancels the rest. Returns the
    last record seen of every job: the controller forgets a finished job after MinJobAge (10 minutes
    on the local cluster), long before a chain on the bundled sample ends."""
    deadline, seen = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        records = jobs(env, logs, since)
        seen.update((r["JobId"], r) for r in records)
        failed = [r for r in records if r["JobState"] in FINAL - {"COMPLETED"}]
        if failed:
            cancel(env, records)
            names = ", ".join(f"{r['JobName']} {r['JobId']} {r['JobState']} ({r['StdOut']})" for r in failed)
            raise RehearsalError(f"{what}: {names}")
        if records and done(records):
            return sorted(seen.values(), key=lambda r: int(r["JobId"]))
        time.sleep(2)
    cancel(env, jobs(env, logs, since))
    raise RehearsalError(f"{what}: not done in {timeout:.0f} s")


def all_final(records: list[dict[str, str]]) -> bool:
    return all(r["JobState"] in FINAL for r in records)


def rank_process(job: str, rank: int) -> Any:
    import psutil

    for p in psutil.process_iter(["name"]):
        try:
            e = p.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if e.get("SLURM_JOB_ID") == job and e.get("RANK") == str(rank) and "python" in (p.info["name"] or ""):
            return p
    return None


def logged_step(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines() if '"loss"' in x]
    return max(steps, default=0)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def final_weights(run_dir: Path) -> dict[str, str]:
    last = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return {"model": sha256(run_dir / "model" / "model.safetensors"),
            last.name: sha256(last / "model" / "model.safetensors")}  # fmt: skip


def avg5(eval_dir: Path) -> float:
    return json.loads((eval_dir / "eval.json").read_text())["sts"]["model"]["avg5"]


# ------------------------------------------------------------------------------------------ the checks
def words_after(command: str, script: str) -> list[str]:
    words = shlex.split(command.replace("$(", " ").rstrip(")"))
    return words[words.index(next(w for w in words if w.endswith(script))) + 1 :]


def st_loads(model: Path) -> float:
    """Loads the export in sentence-transformers; returns the least cosine of its vectors to ours."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from pipeline.model import SentenceEncoder

    texts = ["花呗怎么还款", "花呗如何还钱", "今天北京的天气怎么样"]
    theirs = SentenceTransformer(str(model), device="cpu").encode(texts, normalize_embeddings=True)
    ours = SentenceEncoder.from_pretrained(model).encode(texts)
    return float(np.min(np.sum(theirs * ours, axis=1)))


def check(passed: bool, message: str) -> None:
    if not passed:
        raise RehearsalError(message)


def submit_chain(
    out: Path, commands: list[str], env: dict[str, str], since: int, form: Form
) -> list[dict[str, str]]:
    """1. The chain, submitted as README writes it; every job must end COMPLETED."""
    (out / "submit.sh").write_text("set -euo pipefail\n" + "\n".join(commands) + "\n", encoding="utf-8")
    submitted = run(["bash", str(out / "submit.sh")], env)
    if submitted.returncode:
        raise RehearsalError(f"submitting the chain failed: {submitted.stderr.strip()[-2000:]}")
    return wait_for(env, out / "logs", since, all_final, form.timeout, "the chain")


def one_process(out: Path, pretrain: str, env: dict[str, str]) -> subprocess.Popen:
    """3a. The chain's training, run by one process outside SLURM (started; ``one_process_eval`` ends it)."""
    args = [a for a in words_after(pretrain, "pretrain.sbatch") if not a.startswith("--run_dir=")]
    log = (out / "one_process.log").open("w")
    cmd = [sys.executable, "launch/pretrain.py", *args, f"--run_dir={out / 'one_process'}"]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def one_process_eval(out: Path, process: subprocess.Popen, evaluate: str, env: dict[str, str]) -> float:
    """3b. Its evaluation by the chain's eval command; returns its avg5."""
    if process.wait():
        raise RehearsalError(f"the one-process run failed: {(out / 'one_process.log').read_text()[-2000:]}")
    one = out / "one_process"
    args = [a.replace(str(out / "train"), str(one)) for a in words_after(evaluate, "pipeline.sbatch")]
    evaluated = run([sys.executable, "-m", "pipeline", *args, "--progress=false"], env)
    if evaluated.returncode:
        raise RehearsalError(f"evaluating the one-process run failed: {evaluated.stderr.strip()[-2000:]}")
    return avg5(one / "eval")


def kill_a_rank(out: Path, pretrain: str, env: dict[str, str], since: int, form: Form) -> dict[str, Any]:
    """4. README's pretrain job again, rank 1 killed (SIGKILL) mid-run: requeued, resumed, COMPLETED."""
    killed = out / "train_killed"
    again = re.sub(r"--dependency=afterok:\S+ ", "", pretrain)
    again = again.replace(f"--run_dir={out}/train ", f"--run_dir={killed} ")
    submitted = run(["bash", "-c", f"set -euo pipefail; {again}; echo $run"], env)
    job = submitted.stdout.strip().splitlines()[-1] if submitted.returncode == 0 else ""
    if not job.isdigit():
        raise RehearsalError(f"resubmitting the pretrain job failed: {submitted.stderr.strip()[-2000:]}")
    deadline = time.monotonic() + form.timeout
    while logged_step(killed) < form.kill_at and time.monotonic() < deadline:
        time.sleep(0.2)
    victim, step = rank_process(job, 1), logged_step(killed)
    if victim is None or step >= form.steps:
        raise RehearsalError(f"no rank 1 of job {job} to kill at step {step}")
    victim.send_signal(signal.SIGKILL)

    def completed(records: list[dict[str, str]]) -> bool:
        return any(r["JobId"] == job and r["JobState"] == "COMPLETED" for r in records)

    records = wait_for(env, out / "logs", since, completed, form.timeout, "the killed pretrain job")
    info = next(r for r in records if r["JobId"] == job)
    log = Path(info["StdOut"]).read_text(encoding="utf-8")
    requeued = re.search(r"failure requeue 1 of \d+, to resume from checkpoint (step-\d+)", log)
    check(info["Restarts"] == "1" and requeued is not None, f"job {job} was not requeued once: {log[-3000:]}")
    return {"job": job, "killed_after_step": step, "restarts": int(info["Restarts"]),
            "resumed_from": requeued.group(1)}  # fmt: skip


def rehearse(out: Path, form: Form, env: dict[str, str]) -> dict[str, Any]:
    started = time.monotonic()
    result: dict[str, Any] = {"form": form.name, "out": str(out)}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    corpus, teacher = tiny_inputs(out) if form is TINY else (CORPUS, None)
    commands = localise(cluster_block(README.read_text(encoding="utf-8")), rules(form, out, corpus, teacher))
    pretrain = next(c for c in commands if "launch/slurm/pretrain.sbatch" in c)
    evaluate = next(c for c in commands if "pipeline.sbatch eval" in c)
    env = {**env, "SBATCH_OUTPUT": str(out / "logs" / "%x-%j.out"), "PYTHONPATH": str(REPO)}
    since = newest_job(env)  # the jobs after it with their logs in OUT/logs are this rehearsal's

    chain = submit_chain(out, commands, env, since, form)
    fields = ("JobId", "JobName", "JobState", "Restarts", "RunTime")
    result["jobs"] = [{k: r[k] for k in fields} for r in chain]
    result["chain_s"] = round(time.monotonic() - started, 1)
    print(f"rehearse: {len(chain)} jobs, all COMPLETED, in {result['chain_s']:.0f} s", flush=True)

    t0 = time.monotonic()  # the one-process run beside the killed job: they do not depend on each other
    reference = one_process(out, pretrain, env)
    try:
        result["st_min_cosine"] = st_loads(out / "model")  # 2. sentence-transformers loads the export
        check(result["st_min_cosine"] > 0.999, f"sentence-transformers' vectors: {result['st_min_cosine']}")
        print(f"rehearse: sentence-transformers loads {out / 'model'}: min cosine to our vectors "
              f"{result['st_min_cosine']:.6f}", flush=True)  # fmt: skip
        result["kill"] = kill_a_rank(out, pretrain, env, since, form)
        result["avg5"] = {"slurm, 2 ranks": avg5(out / "train" / "eval"),
                          "one process": one_process_eval(out, reference, evaluate, env)}  # fmt: skip
    finally:
        reference.kill()  # a no-op once it has ended
    result["after_chain_s"] = round(time.monotonic() - t0, 1)

    gap = abs(result["avg5"]["slurm, 2 ranks"] - result["avg5"]["one process"])
    print(f"rehearse: avg5 {result['avg5']['slurm, 2 ranks']:.2f} (2 ranks) against "
          f"{result['avg5']['one process']:.2f} (one process): {gap:.2f} apart", flush=True)  # fmt: skip
    check(gap <= 0.3, f"avg5 {gap:.2f} apart, more than 0.3")
    uninterrupted, requeued = final_weights(out / "train"), final_weights(out / "train_killed")
    result["sha256"] = {"uninterrupted": uninterrupted, "killed and requeued": requeued}
    kill, same = result["kill"], "the same" if uninterrupted == requeued else "DIFFERENT"
    print(f"rehearse: rank 1 of job {kill['job']} killed after step {kill['killed_after_step']}, "
          f"requeued, resumed from {kill['resumed_from']}: {same} final weights as the chain's job",
          flush=True)  # fmt: skip
    check(uninterrupted == requeued, f"the final weights differ: {uninterrupted} != {requeued}")
    result["total_s"] = round(time.monotonic() - started, 1)
    return result


def cluster_env() -> dict[str, str]:
    script = REPO / "launch" / "slurm" / "local_cluster.sh"
    env = {**os.environ}
    if "SLURM_CONF" not in env:
        env["SLURM_CONF"] = run(["bash", str(script), "env"], env).stdout.strip().split("=", 1)[1]
    if run(["bash", str(script), "status"], env).returncode:
        raise RehearsalError("the local cluster is not running: bash launch/slurm/local_cluster.sh start")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="the rehearsal's folder (README's runs/cluster)"
    )
    parser.add_argument("--tiny", action="store_true", help="a few hundred sentences, a random teacher (CI)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        print(f"rehearse: error: {out} is not empty; give a new --out", file=sys.stderr)
        return 2
    try:
        result = rehearse(out, TINY if args.tiny else FULL, cluster_env())
    except RehearsalError as exc:
        print(f"rehearse: FAILED: {exc}", file=sys.stderr)
        return 1
    (out / "rehearsal.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"rehearse: passed in {result['total_s']:.0f} s; {out / 'rehearsal.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
