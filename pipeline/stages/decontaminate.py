"""``python -m pipeline decontaminate IN --out OUT``: a pair/triple file without the scored sets' sentences.

Reads ``IN`` (TSV, JSON lines, or a CBLUE JSON array such as ``CHIP-STS_train.json`` /
``KUAKE-QQR_train.json``: :mod:`pipeline.data.pairs`), drops every record one of whose sentences occurs,
after :func:`pipeline.normalize.normalize_text`, in any split of the five scored sets in ``--eval_dir``
(:mod:`pipeline.data.eval_overlap`), and writes the rest to ``OUT`` (``.tsv`` or ``.jsonl``, the forms
``data.supervised_file`` reads) and the counts to ``OUT``'s ``.overlap.json`` beside it. Prints the
counts per evaluation split. docs/objectives.md, "Labelled pairs", gives the commands for the configs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from pipeline.data.eval_overlap import eval_index, filter_records, read_labelled, report_path, write_labelled
from pipeline.errors import ConfigError
from pipeline.resources import EVAL_DIR

USAGE = "usage: python -m pipeline decontaminate IN --out OUT.tsv [--triples] [--eval_dir DIR]"


@dataclass
class Config:
    input: Path | None = option(None, "Pair or triple file to filter (.tsv, .txt, .jsonl, a .json array).")
    out: Path | None = option(None, "Where the kept records go (.tsv or .jsonl); the counts go beside it.")
    triples: bool = option(False, "The input holds (anchor, positive, negative) triples; else pairs.")
    eval_dir: Path = option(EVAL_DIR, "Evaluation folder: every NAME.SPLIT.tsv of the five sets is read.")

    def __post_init__(self) -> None:
        if self.input is None or self.out is None:
            raise ConfigError(USAGE)
        if self.out.resolve() == self.input.resolve():
            raise ConfigError(f"--out {self.out} is the input file; write the filtered records elsewhere")


def run(cfg: Config) -> int:
    records = read_labelled(cfg.input, cfg.triples)
    kept, report = filter_records(records, eval_index(cfg.eval_dir))
    write_labelled(kept, cfg.out)
    counts = {"input": str(cfg.input), "eval_dir": str(cfg.eval_dir), **report.as_dict()}
    report_path(cfg.out).write_text(json.dumps(counts, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    by_split = ", ".join(f"{k} {v}" for k, v in counts["dropped_by_split"].items()) or "none"
    print(f"{cfg.input}: read {report.read}, kept {report.kept}, dropped {report.dropped} "
          f"(by evaluation split: {by_split}) -> {cfg.out}", file=sys.stdout)  # fmt: skip
    return 0
