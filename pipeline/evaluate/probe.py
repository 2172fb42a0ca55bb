"""Frozen-encoder linear probe: logistic regression on sentence embeddings of the bundled sentiment
reviews (LUSE's "FreezeBERT" columns). The encoder is never updated; only the linear classifier is fit,
so the score says how linearly separable sentiment is in the embedding space.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import InputError
from pipeline.evaluate.sts import Embedder
from pipeline.resources import SENTIMENT


@dataclass
class LabelledTexts:
    texts: list[str]
    labels: np.ndarray  # (N,) int


def read_label_text_tsv(path: str | Path, what: str = "labelled file") -> list[tuple[int, str, str]]:
    """A ``label<TAB>text`` file with that header: (line number, label as written, text) per row. Blank
    lines are skipped; a malformed row is an error naming its file:line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} does not exist")
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header != ["label", "text"]:
            raise InputError(f"{path}:1: expected the header 'label<TAB>text', got {header!r}; add it")
        for lineno, row in enumerate(reader, start=2):
            if not row or row == [""]:
                continue
            if len(row) != 2:
                raise InputError(
                    f"{path}:{lineno}: expected 2 tab-separated fields (label, text), got {len(row)}; "
                    "fix or remove the line"
                )
            label, text = row[0].strip(), row[1].strip()
            if not label or not text:
                missing = "label" if not label else "text"
                raise InputError(f"{path}:{lineno}: empty {missing}; fix or remove the line")
            rows.append((lineno, label, text))
    return rows


def read_labelled_tsv(path: str | Path = SENTIMENT) -> LabelledTexts:
    """A ``label<TAB>text`` file with integer labels (the probe's data); errors name file:line."""
    texts, labels = [], []
    for lineno, label, text in read_label_text_tsv(path, "probe data"):
        try:
            labels.append(int(label))
        except ValueError:
            raise InputError(f"{path}:{lineno}: label {label!r} is not an integer") from None
        texts.append(text)
    return LabelledTexts(texts, np.asarray(labels))


def linear_probe(
    embed: Embedder,
    data: LabelledTexts,
    test_size: float = 0.2,
    seed: int = 0,
    max_examples: int | None = None,
) -> dict[str, float | int]:
    """Fit on a seeded stratified split; returns accuracy and macro F1 (x100) on the held-out part."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    index = np.arange(len(data.labels))
    if max_examples is not None and len(index) > max_examples:
        index, _ = train_test_split(index, train_size=max_examples, stratify=data.labels, random_state=seed)
    train, test = train_test_split(index, test_size=test_size, stratify=data.labels[index], random_state=seed)
    vectors = np.asarray(embed([data.texts[i] for i in index]))  # (n, H), rows in `index` order
    position = {int(i): k for k, i in enumerate(index)}
    x_train = vectors[[position[int(i)] for i in train]]
    x_test = vectors[[position[int(i)] for i in test]]
    # Standardise each coordinate (fitted on the training split only): contrastive embeddings of a
    # briefly trained encoder live in a narrow cone, where C=1 logistic regression on the raw unit
    # vectors predicts the majority class; standardising is what the FreezeBERT-style probes do.
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=1.0))
    clf.fit(x_train, data.labels[train])
    predicted = clf.predict(x_test)
    return {
        "accuracy": float(accuracy_score(data.labels[test], predicted) * 100),
        "macro_f1": float(f1_score(data.labels[test], predicted, average="macro") * 100),
        "train": int(len(train)),
        "test": int(len(test)),
    }
