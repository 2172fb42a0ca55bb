"""The full rehearsal of README's "On a GPU cluster" on the local SLURM cluster, and its tables.

    bash launch/slurm/local_cluster.sh start
    .venv/bin/python benchmarks/cluster_rehearsal.py run --out runs/rehearsal   # about 1 h on 2 cores
    .venv/bin/python benchmarks/cluster_rehearsal.py report --out runs/rehearsal

``run`` is ``launch/slurm/rehearse.py --out OUT`` (the bundled sample, the fetched e5-small, 300 steps of 64
on two SLURM tasks; what it replaces and checks: its docstring, docs/guide.md "Rehearsed on a local
cluster"), then ``report``. ``report`` prints, from OUT/rehearsal.json and the jobs' logs: every job with its
state, restarts and run time; the checks (avg5 of the chain's export and of one process, the
sha256 of the final weights uninterrupted and after the kill); and the wall times.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from _common import ROOT, table

REHEARSE = ROOT / "launch" / "slurm" / "rehearse.py"


def job_rows(result: dict) -> list[list[str]]:
    return [[j["JobId"], j["JobName"], j["JobState"], j["Restarts"], j["RunTime"]] for j in result["jobs"]]


def logged_jobs(out: Path) -> list[list[str]]:
    """Every job of OUT/logs, from its log file's name and last lines (a run of the rehearsal whose JSON
    lists only the jobs the controller still held at the end)."""
    rows = []
    for log in sorted((out / "logs").glob("*.out"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
        name, job = log.stem.rsplit("-", 1)
        text = log.read_text(encoding="utf-8", errors="replace")
        last = [x for x in text.splitlines() if x.strip()][-1:] or [""]
        rows.append([job, name, re.sub(r"\s+", " ", last[0])[:100]])
    return rows


def report(out: Path) -> str:
    result = json.loads((out / "rehearsal.json").read_text(encoding="utf-8"))
    parts = ["Jobs (scontrol's last record of each):", table(["job", "name", "state", "restarts", "run time"],
                                                              job_rows(result))]  # fmt: skip
    parts += ["Every job's log, its last line:", table(["job", "name", "last line"], logged_jobs(out))]
    avg = result["avg5"]
    sha = result["sha256"]
    kill = result["kill"]
    checks = [
        ["avg5, 1,000 pairs a set: the chain's export (2 SLURM tasks)", f"{avg['slurm, 2 ranks']:.2f}"],
        ["avg5: the same training and evaluation in one process", f"{avg['one process']:.2f}"],
        ["sentence-transformers against our vectors, least cosine", f"{result['st_min_cosine']:.6f}"],
        ["the pretrain job again, rank 1 killed after step", str(kill["killed_after_step"])],
        ["its restarts; resumed from", f"{kill['restarts']}; {kill['resumed_from']}"],
        *[[f"sha256 of {k}, uninterrupted", v] for k, v in sha["uninterrupted"].items()],
        *[[f"sha256 of {k}, killed and requeued", v] for k, v in sha["killed and requeued"].items()],
    ]
    times = [["the chain, submission to the last job's end", f"{result['chain_s']:.0f} s"],
             ["then the killed job and the one-process run side by side", f"{result['after_chain_s']:.0f} s"],
             ["the whole rehearsal", f"{result['total_s']:.0f} s"]]  # fmt: skip
    return "\n\n".join([*parts, table(["check", "result"], checks), table(["wall time", ""], times)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["run", "report"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.action == "run":
        code = subprocess.run([sys.executable, str(REHEARSE), "--out", str(args.out)], cwd=ROOT).returncode
        if code:
            return code
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
