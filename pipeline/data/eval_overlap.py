"""The scored sets stay zero-shot: labelled training records whose sentences occur in an evaluation set.

The five STS sets a model is scored on (ATEC, BQ, LCQMC, PAWSX, STS-B: ``pipeline.evaluate.sts.STS_SETS``)
must never be trained on, in any split. :func:`eval_index` reads every split file of the five in an
evaluation folder (``NAME.*.tsv``: the bundled ``pipeline/resources/eval`` holds ATEC test, BQ/LCQMC/
PAWSX dev and STS-B train, valid and test; ``pipeline eval`` reads the same folder) into one index of
sentence keys; :func:`filter_records` drops every record one of whose texts has a key in it. A key is
:func:`pipeline.normalize.normalize_text` (NFKC, case-folded, no whitespace, punctuation or control
characters), the same key the tests and the other near-duplicate checks use.

``python -m pipeline decontaminate IN --out OUT`` (:mod:`pipeline.stages.decontaminate`) is the command
form: it reads a pair or triple file in any form :mod:`pipeline.data.pairs` reads (TSV, JSON lines, a
CBLUE JSON array such as ``CHIP-STS_train.json``), writes the kept records to ``OUT`` and the counts to
``OUT``'s :func:`report_path` (``chip_sts.tsv`` -> ``chip_sts.overlap.json``). The corpus stages drop
the same sentences from unlabelled text with the same index: ``preprocess`` and ``pairs`` ``--exclude_eval``
(on by default; reason ``eval_overlap``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.data.pairs import Pair, Triple, read_pairs, read_triples
from pipeline.errors import InputError
from pipeline.normalize import normalize_text
from pipeline.resources import STS_SETS

__all__ = [
    "OverlapReport",
    "eval_files",
    "eval_index",
    "filter_records",
    "read_labelled",
    "record_texts",
    "report_path",
    "write_labelled",
]

Record = Pair | Triple


def scored_sets() -> tuple[str, ...]:
    """The names of the five scored sets, as ``pipeline eval`` names them."""
    return tuple(STS_SETS)


def eval_files(eval_dir: Path) -> list[Path]:
    """Every split file of the five scored sets in ``eval_dir`` (``ATEC.test.tsv``, ``STS-B.train.tsv``, ...).

    A set without any file is an InputError: an index that silently misses a set would let its sentences
    through."""
    files, missing = [], []
    for name in scored_sets():
        found = sorted(eval_dir.glob(f"{name}.*.tsv"))
        files.extend(found)
        if not found:
            missing.append(name)
    if missing:
        raise InputError(
            f"{eval_dir} holds no split file of {', '.join(missing)} (NAME.SPLIT.tsv); point --eval_dir at "
            "the evaluation folder (default: the bundled pipeline/resources/eval)"
        )
    return files


def eval_index(eval_dir: Path) -> dict[str, frozenset[str]]:
    """Every sentence key of every split of the five scored sets -> the splits (file stems) it occurs in."""
    index: dict[str, set[str]] = {}
    for path in eval_files(eval_dir):
        for pair in read_pairs(path, require_label=False):
            for text in (pair.text_a, pair.text_b):
                index.setdefault(normalize_text(text), set()).add(path.stem)
    index.pop("", None)  # a text of punctuation alone has no key; it matches nothing
    return {key: frozenset(splits) for key, splits in index.items()}


def record_texts(record: Record) -> tuple[str, ...]:
    """The texts of a pair (two) or a triple (three)."""
    if isinstance(record, Triple):
        return (record.anchor, record.positive, record.negative)
    return (record.text_a, record.text_b)


@dataclass
class OverlapReport:
    """What :func:`filter_records` kept and dropped: ``dropped_by_split[s]`` counts the dropped records
    with a sentence in split ``s`` (a record whose sentences occur in two splits counts in both)."""

    read: int = 0
    kept: int = 0
    dropped: int = 0
    dropped_by_split: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "dropped": self.dropped,
                "dropped_by_split": dict(sorted(self.dropped_by_split.items()))}  # fmt: skip


def filter_records(
    records: Sequence[Record], index: dict[str, frozenset[str]]
) -> tuple[list[Record], OverlapReport]:
    """The records none of whose texts has a key in ``index`` (:func:`eval_index`), in their order, and the
    counts."""
    kept: list[Record] = []
    by_split: Counter[str] = Counter()
    for record in records:
        splits = set().union(*(index.get(normalize_text(t), ()) for t in record_texts(record)))
        if splits:
            by_split.update(splits)
        else:
            kept.append(record)
    report = OverlapReport(len(records), len(kept), len(records) - len(kept), dict(by_split))
    return kept, report


def read_labelled(path: Path, triples: bool = False) -> list[Record]:
    """A pair file (labels optional) or, with ``triples``, a triple file, in any form the readers take."""
    return list(read_triples(path)) if triples else list(read_pairs(path, require_label=False))


def _label(value: float) -> str | float:
    return f"{value:g}" if value != int(value) else str(int(value))


def write_labelled(records: Sequence[Record], path: Path) -> None:
    """Records in the form ``path``'s suffix names, one the readers read back as they were: ``.tsv``
    (``text_a<TAB>text_b[<TAB>label]``, ``anchor<TAB>positive<TAB>negative``) or ``.jsonl``."""
    suffix = path.suffix.lower()
    if suffix not in (".tsv", ".jsonl"):
        raise InputError(f"--out {path}: write a .tsv or a .jsonl file (the forms training reads)")
    lines = []
    for r in records:
        if suffix == ".tsv":
            fields = list(record_texts(r))
            if any("\t" in f or "\n" in f for f in fields):
                raise InputError(f"--out {path}: a text holds a tab or a line break; write a .jsonl file")
            if isinstance(r, Pair) and r.label is not None:
                fields.append(_label(r.label))
            lines.append("\t".join(fields))
        elif isinstance(r, Triple):
            lines.append(json.dumps({"anchor": r.anchor, "positive": r.positive, "negative": r.negative},
                                    ensure_ascii=False))  # fmt: skip
        else:
            row = {"sentence1": r.text_a, "sentence2": r.text_b}
            if r.label is not None:
                row["label"] = float(r.label)
            lines.append(json.dumps(row, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def report_path(out: Path) -> Path:
    """The counts' file beside ``out``: ``chip_sts.tsv`` -> ``chip_sts.overlap.json``."""
    return out.with_name(out.stem + ".overlap.json")
