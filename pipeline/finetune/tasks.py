"""The labelled tasks of the fine-tuning evaluation and their train / dev / test splits.

A task is classification (``label<TAB>text`` with that header; labels are integers or class names) or
similarity (pairs: :func:`pipeline.data.pairs.read_pairs` formats, 0/1 or graded labels). Where a set
ships three splits (STS-B) they are used as given; a set with one labelled file (the others) is split
here, once, with a fixed seed (``split_seed``) that does not depend on the training seed: test first,
then dev, the rest is the training pool. Pairs (or texts) repeated in a file are kept once before
splitting, so no test item also sits in train. Train is the first ``max_train`` of the pool, so a
smaller budget is a prefix of a larger one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from pipeline.errors import InputError
from pipeline.evaluate.probe import read_label_text_tsv
from pipeline.resources import EVAL_DIR, SENTIMENT

Kind = Literal["classification", "similarity"]
SPLITS = ("train", "dev", "test")


@dataclass
class Split:
    """One split: texts (classification) or two text columns (similarity) and float labels."""

    texts_a: list[str]
    labels: np.ndarray  # (N,) float64; class ids for classification
    texts_b: list[str] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray) -> Split:
        b = None if self.texts_b is None else [self.texts_b[i] for i in index]
        return Split([self.texts_a[i] for i in index], self.labels[index], b)

    def texts(self) -> list[str]:
        return self.texts_a + (self.texts_b or [])


@dataclass
class Task:
    name: str
    kind: Kind
    splits: dict[str, Split]
    classes: list[str] = field(default_factory=list)  # classification: class names, index = id
    source: str = ""  # where the splits came from (the table and finetune.json say it)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def unique_texts(self) -> list[str]:
        """Every text of every split once, first-seen order (what FreezeBERT encodes)."""
        return list(dict.fromkeys(t for s in SPLITS for t in self.splits[s].texts()))


@dataclass(frozen=True)
class TaskSpec:
    """Where a task's data is: one file to split, or three split files."""

    kind: Kind
    files: tuple[Path, ...]  # one file, or (train, dev, test)


BUILTIN: dict[str, TaskSpec] = {
    "sentiment": TaskSpec("classification", (SENTIMENT,)),
    "thucnews": TaskSpec("classification", (EVAL_DIR / "thucnews_titles.tsv",)),
    "STS-B": TaskSpec(
        "similarity",
        (EVAL_DIR / "STS-B.train.tsv", EVAL_DIR / "STS-B.valid.tsv", EVAL_DIR / "STS-B.test.tsv"),
    ),
    "LCQMC": TaskSpec("similarity", (EVAL_DIR / "LCQMC.dev.tsv",)),
    "BQ": TaskSpec("similarity", (EVAL_DIR / "BQ.dev.tsv",)),
    "PAWSX": TaskSpec("similarity", (EVAL_DIR / "PAWSX.dev.tsv",)),
    "ATEC": TaskSpec("similarity", (EVAL_DIR / "ATEC.test.tsv",)),
}


def read_classification(path: str | Path) -> tuple[list[str], list[str]]:
    """A ``label<TAB>text`` file with that header: (labels as written, texts). Errors name file:line."""
    rows = read_label_text_tsv(path, "task file")
    labels, texts = [label for _, label, _ in rows], [text for _, _, text in rows]
    if len(set(labels)) < 2:
        raise InputError(f"task file {path}: fewer than two classes; a classification task needs two")
    return labels, texts


def class_names(labels: list[str]) -> list[str]:
    """Integer labels keep their numeric order (0, 1, ...); names are sorted."""
    unique = set(labels)
    if all(label.lstrip("-").isdigit() for label in unique):
        return [str(v) for v in sorted(int(label) for label in unique)]
    return sorted(unique)


def read_similarity(path: str | Path) -> Split:
    from pipeline.data.pairs import read_pairs

    try:
        pairs = read_pairs(path)
    except InputError as exc:
        # the reader's advice is about its API (label_map, strict=False): keep the file:line part
        first = str(exc).split("; ")[0]
        raise InputError(
            f"{first}; fix or remove the line (labels are numbers: 0/1 or a graded score)"
        ) from None
    if not pairs:
        raise InputError(f"task file {path} has no pairs")
    return Split(
        [p.text_a for p in pairs], np.asarray([p.label for p in pairs], float), [p.text_b for p in pairs]
    )


def _dedup(split: Split) -> Split:
    keys = (
        split.texts_a
        if split.texts_b is None
        else [tuple(sorted(ab)) for ab in zip(split.texts_a, split.texts_b, strict=True)]
    )
    first = list({k: i for i, k in reversed(list(enumerate(keys)))}.values())
    return split.take(np.sort(np.asarray(first, dtype=int)))


def split_one(data: Split, max_train: int, max_dev: int, max_test: int, seed: int) -> dict[str, Split]:
    """Test (30 %, at most ``max_test``), dev (20 %, at most ``max_dev``), train = the rest's prefix."""
    data = _dedup(data)
    n = len(data)
    order = np.random.default_rng(seed).permutation(n)
    n_test = min(max_test, round(0.3 * n))
    n_dev = min(max_dev, round(0.2 * n))
    test, dev, pool = order[:n_test], order[n_test : n_test + n_dev], order[n_test + n_dev :]
    return {"train": data.take(pool[:max_train]), "dev": data.take(dev), "test": data.take(test)}


def _cap(split: Split, limit: int, seed: int) -> Split:
    if len(split) <= limit:
        return split
    return split.take(np.sort(np.random.default_rng(seed).permutation(len(split))[:limit]))


def load_task(
    name: str,
    spec: TaskSpec,
    max_train: int = 1000,
    max_dev: int = 500,
    max_test: int = 1000,
    split_seed: int = 0,
) -> Task:
    classes: list[str] = []
    if spec.kind == "classification":
        parts = [read_classification(f) for f in spec.files]
        classes = class_names([label for labels, _ in parts for label in labels])
        ids = {c: i for i, c in enumerate(classes)}
        raw = [Split(texts, np.asarray([ids[x] for x in labels], float)) for labels, texts in parts]
    else:
        raw = [read_similarity(f) for f in spec.files]
    if len(raw) == 1:
        splits = split_one(raw[0], max_train, max_dev, max_test, split_seed)
        source = (
            f"{spec.files[0].name}, split {split_seed}: test 30 % (<= {max_test}), dev 20 % (<= {max_dev})"
        )
    elif len(raw) == 3:
        caps = (max_train, max_dev, max_test)
        splits = {s: _cap(_dedup(r), cap, split_seed) for s, r, cap in zip(SPLITS, raw, caps, strict=True)}
        source = ", ".join(f.name for f in spec.files)
    else:
        raise InputError(f"task {name}: give one file (split here) or three (train, dev, test)")
    for s in SPLITS:
        if len(splits[s]) < 2:
            raise InputError(f"task {name}: its {s} split has {len(splits[s])} examples; give more data")
    return Task(name, spec.kind, splits, classes, source)


def parse_task_file(spec: str) -> tuple[str, TaskSpec]:
    """``NAME=KIND:FILE`` or ``NAME=KIND:TRAIN,DEV,TEST`` (KIND: classification or similarity)."""
    name, eq, rest = spec.partition("=")
    kind, colon, files = rest.partition(":")
    if not (eq and colon and name and files) or kind not in ("classification", "similarity"):
        raise InputError(
            f"--task-files {spec!r}: write NAME=classification:FILE or NAME=similarity:TRAIN,DEV,TEST"
        )
    paths = tuple(Path(p) for p in files.split(","))
    if len(paths) not in (1, 3):
        raise InputError(f"--task-files {spec!r}: give one file (split here) or three (train, dev, test)")
    return name, TaskSpec(kind, paths)  # type: ignore[arg-type]
