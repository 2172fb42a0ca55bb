"""Preprocessing throughput, scaling, memory and size: prints figures (not a timed test).

    python benchmarks/preprocess.py                       # 5M sentences; RSS at 1M vs 4M
    python benchmarks/preprocess.py --sentences 500000 --rss-sizes 100000,400000   # a quick check

The bundled sample (People's Daily, ~47k sentences) is blown up into N sentences of nlp_chinese_corpus
JSON lines, one copy of the sample per file, the five collections in turn. Every copy varies its
sentences (a per-copy token before each sentence end) except one paragraph in ten, which stays
verbatim in every copy: exact duplicates across files that dedup has to find.

Figures (targets from the issue):
  sentences/s per worker (>= 100k), 2 workers over 1 (>= 1.7x), peak RSS at 1M vs 4M sentences
  (ratio <= 1.2; the largest single process, polled with psutil), shard bytes / UTF-8 text bytes (<= 1.3).
Each phase runs as its own `python -m pipeline preprocess --phase ...` process so it is timed alone;
CPU seconds (getrusage of the children) are printed next to wall time because on a shared machine
the wall time also measures the neighbours.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pyarrow.compute as pc

from pipeline.resources import SAMPLE_CORPUS
from pipeline.shards import read_manifest, read_shard
from pipeline.stages.preprocess.text import clean_paragraphs, split_sentences

REPO = Path(__file__).resolve().parents[1]

PHASES = ("split", "dedup", "shards", "finalize")
TOKEN_CHARS = "甲乙丙丁戊己庚辛壬癸"
COLLECTIONS = ("wiki_zh", "news2016zh", "baike2018qa", "webtext2019zh", "translation2019zh")
PARAGRAPHS_PER_RECORD = 5


def copy_token(k: int) -> str:
    digits = ""
    while True:
        digits = TOKEN_CHARS[k % 10] + digits
        k //= 10
        if k == 0:
            return digits


def vary(paragraph: str, token: str) -> str:
    for end in "。！？；":
        paragraph = paragraph.replace(end, token + end)
    return paragraph


def record(collection: str, i: int, paragraphs: list[str]) -> dict:
    head, rest = paragraphs[0], "".join(paragraphs[1:])
    if collection == "wiki_zh":
        return {
            "id": str(i),
            "url": f"https://zh.wikipedia.org/wiki?curid={i}",
            "title": head[:8],
            "text": "\n\n".join(paragraphs),
        }
    if collection == "news2016zh":
        return {
            "news_id": str(i),
            "keywords": "",
            "desc": "",
            "title": head,
            "source": "人民日报",
            "time": "1998-01-01 00:00",
            "content": rest,
        }
    if collection == "baike2018qa":
        return {"qid": str(i), "category": "社会", "title": head, "desc": "", "answer": rest}
    if collection == "webtext2019zh":
        return {
            "qid": str(i),
            "title": head,
            "desc": "",
            "topic": "新闻",
            "star": 1,
            "content": rest,
            "answer_id": str(i),
            "answerer_tags": "",
        }
    return {"english": "(translation)", "chinese": "".join(paragraphs)}  # fmt: skip


def make_corpus(directory: Path, sentences: int) -> int:
    """Write ~``sentences`` sentences as JSON lines into ``directory``; return the sentence count."""
    paragraphs = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()
    per_copy = sum(len(split_sentences(p)) for p in clean_paragraphs(paragraphs))
    copies = max(1, math.ceil(sentences / per_copy))
    directory.mkdir(parents=True, exist_ok=True)
    for k in range(copies):
        collection = COLLECTIONS[k % len(COLLECTIONS)]
        token = copy_token(k)
        varied = [p if i % 10 == 0 else vary(p, token) for i, p in enumerate(paragraphs)]
        with open(directory / f"{collection}-{k:05d}.json", "w", encoding="utf-8") as f:
            for i in range(0, len(varied), PARAGRAPHS_PER_RECORD):
                obj = record(collection, k * 100000 + i, varied[i : i + PARAGRAPHS_PER_RECORD])
                f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    return copies * per_copy


class PeakRSS:
    """Polls a process tree; ``peak`` is the largest RSS any one process reached.

    ``kind(proc, tree)`` sorts the processes (tree: the root's descendants) into named classes, each
    with its own peak in ``peaks`` (None: not counted); by default every process is one class, "any".
    """

    def __init__(self, pid: int, interval: float = 0.05, kind: Callable[..., str | None] | None = None):
        self.root, self.interval = psutil.Process(pid), interval
        self.kind = kind or (lambda proc, tree: "any")
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=0)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                tree = self.root.children(recursive=True)
                for proc in [self.root, *tree]:
                    name = self.kind(proc, tree)
                    if name is not None:
                        self.peaks[name] = max(self.peaks.get(name, 0), proc.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def preprocess(
    corpus: Path, out: Path, workers: int, options: list[str]
) -> tuple[dict[str, float], dict[str, float], int]:
    """Run the four phases one after another: wall seconds and CPU seconds per phase, peak RSS."""
    wall, cpu, peak = {}, {}, 0
    base = [
        sys.executable,
        "-m",
        "pipeline",
        "preprocess",
        str(corpus),
        f"--out={out}",
        f"--workers={workers}",
    ]
    base += options
    shutil.rmtree(out, ignore_errors=True)
    for phase in PHASES:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.Popen([*base, f"--phase={phase}"], cwd=REPO, stderr=subprocess.DEVNULL)
        rss = PeakRSS(proc.pid)
        if proc.wait() != 0:
            raise SystemExit(f"preprocess --phase {phase} failed; run it by hand: {' '.join(base)}")
        wall[phase] = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the pool workers, once joined
        cpu[phase] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        peak = max(peak, rss.stop())
    return wall, cpu, peak


def text_bytes(out: Path) -> int:
    total = 0
    for entry in read_manifest(out)["shards"]:
        for table in read_shard(out / entry["name"]):
            total += pc.sum(pc.binary_length(table.column("text"))).as_py()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sentences", type=int, default=5_000_000, help="corpus size for throughput")
    parser.add_argument("--rss-sizes", default="1000000,4000000", help="two corpus sizes for the RSS ratio")
    parser.add_argument("--workers", default="1,2", help="worker counts to time")
    parser.add_argument(
        "--options",
        default="--sentences_per_shard=100000 --rows_per_block=4000",
        help="extra preprocess options (default: the shard sizes docs/preprocess.md suggests at scale)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="bench-preprocess-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        run(args, scratch)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, scratch: Path) -> None:
    print(f"python {sys.version.split()[0]}, {psutil.cpu_count()} CPUs, scratch {scratch}")
    print(f"preprocess options: {args.options}")
    started = time.perf_counter()
    corpus = scratch / "corpus"
    n = make_corpus(corpus, args.sentences)
    size = sum(p.stat().st_size for p in corpus.iterdir())
    print(
        f"corpus: ~{n:,} sentences, {size / 1e6:.0f} MB of JSON lines ({time.perf_counter() - started:.0f}s)"
    )

    rates = {}
    for workers in [int(w) for w in args.workers.split(",")]:
        out = scratch / f"out-w{workers}"
        wall, cpu, peak = preprocess(corpus, out, workers, args.options.split())
        counts = read_manifest(out)["counts"]
        split = counts["sentences_split"]
        total = sum(wall.values())
        rates[workers] = split / total
        print(
            f"workers={workers}: {split:,} sentences, kept {counts['kept']:,}, "
            f"duplicates {counts['dropped']['duplicate']:,}, peak RSS {peak / 2**20:.0f} MiB"
        )
        for phase, seconds, cpu_seconds in [
            *((p, wall[p], cpu[p]) for p in PHASES),
            ("all", total, sum(cpu.values())),
        ]:
            print(
                f"  {phase:<8} {seconds:6.1f}s wall {cpu_seconds:6.1f}s CPU  "
                f"{split / seconds / workers:>9,.0f} sentences/s per worker (wall)  "
                f"{split / cpu_seconds:>9,.0f} per CPU-second"
            )
    if 1 in rates and 2 in rates:
        print(f"speedup 2 workers / 1 (whole run, wall): {rates[2] / rates[1]:.2f}x (target >= 1.7x)")

    out = scratch / f"out-w{min(rates)}"
    shard_bytes = read_manifest(out)["totals"]["bytes"]
    utf8 = text_bytes(out)
    ratio = shard_bytes / utf8
    print(f"shard bytes / UTF-8 text bytes: {shard_bytes:,} / {utf8:,} = {ratio:.3f} (target <= 1.3)")

    peaks = []
    for target in [int(s) for s in args.rss_sizes.split(",")]:
        shutil.rmtree(corpus, ignore_errors=True)
        n = make_corpus(corpus, target)
        _, _, peak = preprocess(corpus, scratch / "out-rss", 1, args.options.split())
        peaks.append(peak)
        print(f"peak RSS at ~{n:,} sentences (workers=1): {peak / 2**20:.0f} MiB")
    if len(peaks) == 2:
        print(f"RSS ratio {peaks[1] / peaks[0]:.2f} (target <= 1.2)")
    print(f"benchmark took {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
