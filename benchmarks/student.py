"""Student surgery on a real model: what the vocabulary trim keeps, and whether it changes anything.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/student.py --model models/e5-small \
        --shards /tmp/sx/aug --keep_layers 3 --work /tmp/sx/bench

Builds two students of ``--model`` with ``python -m pipeline student``'s code: the layer cut alone
(whole vocabulary) and the layer cut plus the vocabulary trimmed to the ``--shards`` corpus. Then:

* pieces kept, parameters and disk size of both;
* every evaluation sentence (pipeline/resources/eval/*.tsv, with the model's prefix) tokenised by both:
  *covered* sentences are those whose original pieces are all kept; the share whose pieces changed is
  reported for covered (goal 0) and not-covered sentences, with how many of the latter now hold an unk;
* ``python -m pipeline eval FOLDER --suite sts --max_pairs N`` for both (avg5 before/after trimming),
  and the same sampled pairs split into covered pairs (both sentences covered) and the rest, scored
  in-process, so the covered/uncovered difference is visible per set.

Evaluation text is only measured here; it never chooses the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.evaluate.sts import STS_SETS, load_sts_sets, pair_cosine, spearman100  # noqa: E402
from pipeline.model import SentenceEncoder  # noqa: E402
from pipeline.resources import EVAL_DIR  # noqa: E402
from pipeline.stages.student import Config, dir_bytes, make_student, token_strings  # noqa: E402


def eval_sentences() -> list[str]:
    texts: set[str] = set()
    for path in sorted(EVAL_DIR.glob("*.tsv")):
        for line in path.read_text(encoding="utf-8").splitlines():
            texts.update(
                f for f in line.split("\t") if f.strip() and not f.lstrip("-").replace(".", "").isdigit()
            )
    return sorted(texts)


def tokenisation_stats(source: SentenceEncoder, student: SentenceEncoder, texts: list[str]) -> dict:
    """Per sentence: covered (all original pieces kept), changed pieces, unk after the trim."""
    kept = student.tokenizer.get_vocab()
    prefixed = [student.prefix + t for t in texts]
    before, after = token_strings(source.tokenizer, prefixed), token_strings(student.tokenizer, prefixed)
    unk_id = student.tokenizer.unk_token_id
    after_ids = student.tokenizer(prefixed, add_special_tokens=False)["input_ids"]
    rows = {}
    for text, b, a, ids in zip(texts, before, after, after_ids, strict=True):
        rows[text] = {"covered": all(p in kept for p in b), "changed": a != b, "unk": unk_id in ids}
    return rows


def summarise(rows: dict) -> dict:
    cov = [r for r in rows.values() if r["covered"]]
    unc = [r for r in rows.values() if not r["covered"]]
    return {
        "sentences": len(rows),
        "covered": len(cov),
        "covered_changed": sum(r["changed"] for r in cov),
        "uncovered": len(unc),
        "uncovered_changed": sum(r["changed"] for r in unc),
        "uncovered_with_unk": sum(r["unk"] for r in unc),
    }


def official_eval(folder: Path, out: Path, max_pairs: int) -> dict:
    cmd = [sys.executable, "-m", "pipeline", "eval", str(folder), "--suite", "sts"]
    cmd += ["--max_pairs", str(max_pairs), "--out", str(out)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scores = json.loads((out / "eval.json").read_text(encoding="utf-8"))["sts"]["model"]
    return {**scores, "seconds": round(time.perf_counter() - start, 1)}


def split_scores(encoder: SentenceEncoder, rows: dict, max_pairs: int, seed: int = 0) -> dict:
    """Spearman x100 on the sampled pairs of each set: all, covered pairs, the other pairs."""
    out = {}
    for pairs in load_sts_sets():
        sample = pairs.subsample(max_pairs, seed)
        a, b = encoder.encode(sample.sentence1), encoder.encode(sample.sentence2)
        cos = pair_cosine(a, b)
        covered = np.array(
            [rows[x]["covered"] and rows[y]["covered"] for x, y in zip(sample.sentence1, sample.sentence2)]
        )
        out[pairs.name] = {
            "all": spearman100(cos, sample.labels),
            "covered": spearman100(cos[covered], sample.labels[covered]) if covered.sum() > 2 else None,
            "uncovered": spearman100(cos[~covered], sample.labels[~covered])
            if (~covered).sum() > 2
            else None,
            "pairs_covered": int(covered.sum()),
            "pairs": len(sample),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/e5-small")
    parser.add_argument("--shards", nargs="+", required=True, help="training corpus shard directories")
    parser.add_argument("--keep_layers", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/student_bench"))
    parser.add_argument("--max_pairs", type=int, default=1000)
    parser.add_argument("--no_eval", action="store_true", help="skip the STS evaluations")
    parser.add_argument("--seen_char_pieces", action="store_true", help="student --seen_char_pieces")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    base = dict(model=args.model, keep_layers=args.keep_layers)
    cut = make_student(Config(**base, out=args.work / "cut", trim_vocab=False, overwrite=True))
    shards = [Path(s) for s in args.shards]
    trimmed = make_student(
        Config(
            **base,
            out=args.work / "trimmed",
            shards=shards,
            seen_char_pieces=args.seen_char_pieces,
            overwrite=True,
        )
    )
    source = SentenceEncoder.from_pretrained(args.work / "cut")
    student = SentenceEncoder.from_pretrained(args.work / "trimmed")
    rows = tokenisation_stats(source, student, eval_sentences())
    result = {
        "model": args.model,
        "layers": trimmed["layers"],
        "pieces": {"before": trimmed["vocab"]["pieces_before"], "kept": trimmed["vocab"]["pieces_kept"]},
        "parameters": {
            "source": trimmed["parameters_before"],
            "cut": cut["parameters_after"],
            "cut_trimmed": trimmed["parameters_after"],
        },
        "disk_bytes": {"cut": dir_bytes(args.work / "cut"), "cut_trimmed": dir_bytes(args.work / "trimmed")},
        "surgery_seconds": round(trimmed["seconds"], 1),
        "eval_tokenisation": summarise(rows),
    }
    if not args.no_eval:
        result["avg5"] = {
            "cut": official_eval(args.work / "cut", args.work / "eval-cut", args.max_pairs),
            "cut_trimmed": official_eval(args.work / "trimmed", args.work / "eval-trimmed", args.max_pairs),
        }
        result["split"] = {
            "cut": split_scores(source, rows, args.max_pairs),
            "cut_trimmed": split_scores(student, rows, args.max_pairs),
        }
    print(json.dumps(result, indent=2, ensure_ascii=False) if args.json else markdown(result))
    return 0


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def markdown(r: dict) -> str:
    t, p, disk = r["eval_tokenisation"], r["parameters"], r["disk_bytes"]
    lines = [
        f"Student of {r['model']}: layers {r['layers']}",
        "",
        "| | source | layer cut | layer cut + vocab trim |",
        "| --- | --- | --- | --- |",
        f"| pieces | {r['pieces']['before']:,} | {r['pieces']['before']:,} | {r['pieces']['kept']:,} |",
        f"| parameters | {p['source']:,} | {p['cut']:,} | {p['cut_trimmed']:,} |",
        f"| disk MiB | – | {disk['cut'] / 2**20:.1f} | {disk['cut_trimmed'] / 2**20:.1f} |",
        "",
        f"Evaluation sentences ({t['sentences']:,} unique, pipeline/resources/eval/*.tsv):",
        f"- covered (all original pieces kept): {t['covered']:,}; tokenisation changed: "
        f"{t['covered_changed']} ({t['covered_changed'] / max(t['covered'], 1):.2%})",
        f"- not covered: {t['uncovered']:,}; tokenisation changed: {t['uncovered_changed']:,} "
        f"({t['uncovered_changed'] / max(t['uncovered'], 1):.2%}), "
        f"now with an unk: {t['uncovered_with_unk']:,}",
    ]
    if "avg5" in r:
        sets = [*STS_SETS, "avg5"]
        lines += ["", "| Spearman x100 | " + " | ".join(sets) + " | seconds |"]
        lines += ["| --- " * (len(sets) + 2) + "|"]
        for name in ("cut", "cut_trimmed"):
            a = r["avg5"][name]
            lines.append(
                f"| {name} (pipeline eval) | " + " | ".join(_f(a[s]) for s in sets) + f" | {a['seconds']} |"
            )
        for part in ("covered", "uncovered"):
            for name in ("cut", "cut_trimmed"):
                s = r["split"][name]
                vals = [s[x][part] for x in STS_SETS]
                avg = None if None in vals else float(np.mean(vals))
                lines.append(f"| {name}, {part} pairs | " + " | ".join(_f(v) for v in [*vals, avg]) + " | |")
        covered = [f"{x} {s['pairs_covered']}/{s['pairs']}" for x, s in r["split"]["cut"].items()]
        lines += ["", "Covered pairs per set: " + ", ".join(covered)]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
