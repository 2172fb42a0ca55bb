"""``python -m pipeline mine INDEX_DIR --input PAIRS --out triples.jsonl``: hard negatives from retrieval.

For each (anchor, positive) pair the anchor is searched in the index; negatives are drawn (seeded,
without replacement) from ranks ``[rank_start, rank_end]`` (1-based, inclusive) of its results,
skipping the positive, the anchor, near-duplicates of either (equal after :func:`normalize_text`)
and candidates whose cosine to the positive exceeds ``max_similarity`` (likely unlabeled
positives). This is FlagEmbedding's ``hn_mine`` recipe. Starting the range below rank 1 avoids
the false negatives that crowd the very top.

Output: one triple per negative, as JSON Lines ``{"anchor", "positive", "negative"}`` (``.jsonl``)
or ``anchor<TAB>positive<TAB>negative`` (``.tsv``): the supervised SimCSE reader's formats.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import option
from pipeline.data import pairs as pair_reader
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_bytes
from pipeline.normalize import normalize_text
from pipeline.search.api import SearchIndex

log = logging.getLogger(__name__)

OUTPUT_SUFFIXES = (".jsonl", ".tsv")


@dataclass
class Config:
    index_dir: Path | None = option(None, "Index directory to mine from (positional).")
    input: Path | None = option(
        None, "Pairs: TSV `anchor<TAB>positive[<TAB>label]` or JSONL (see docs/search.md)."
    )
    out: list[Path] = option(
        factory=list, help="Output file(s): .jsonl and/or .tsv; repeat the flag for both."
    )
    rank_start: int = option(10, "First rank (1-based) negatives may come from.")
    rank_end: int = option(100, "Last rank (inclusive); the index is searched this deep.")
    num_negatives: int = option(1, "Negatives (= output triples) per pair.")
    max_similarity: float = option(0.95, "Skip candidates with cosine to the positive above this.")
    min_label: float | None = option(None, "TSV with a label column: keep pairs with label >= this.")
    seed: int = option(0, "Seed of the sampling within the rank range.")
    model: str | None = option(None, "Encode with this model instead of the index's.")
    batch_size: int = option(128, "Sentences per forward pass.")
    progress: bool = option(True, "Show progress: a bar on a terminal, a line every 30 s in a log.")
    search_batch: int = option(1024, "Pairs searched per faiss call.")
    device: str = option("auto", "Torch device for encoding.")
    nprobe: int | None = option(None, "IVF: lists visited per query (default: stored value).")
    ef_search: int | None = option(None, "HNSW: candidate list size (default: stored value).")
    overwrite: bool = option(False, "Replace existing output files.")

    def __post_init__(self) -> None:
        if self.index_dir is None or self.input is None or not self.out:
            raise ConfigError("usage: python -m pipeline mine INDEX_DIR --input PAIRS --out triples.jsonl")
        if not 1 <= self.rank_start <= self.rank_end:
            raise ConfigError(
                f"need 1 <= --rank-start <= --rank-end, got {self.rank_start} and {self.rank_end}"
            )
        if self.num_negatives < 1 or self.batch_size < 1 or self.search_batch < 1:
            raise ConfigError("--num-negatives, --batch-size and --search-batch must be >= 1")
        if not -1.0 <= self.max_similarity <= 1.0:
            raise ConfigError(f"--max-similarity is a cosine in [-1, 1], got {self.max_similarity}")
        for path in self.out:
            if path.suffix not in OUTPUT_SUFFIXES:
                raise ConfigError(f"--out {path}: name it *.jsonl or *.tsv to choose the format")


# ---------------------------------------------------------------------------------------- input
def read_pairs(path: Path, min_label: float | None, counts: Counter) -> list[tuple[str, str]]:
    """(anchor, positive) pairs; format and errors: :func:`pipeline.data.pairs.read_pairs`.

    The label is optional (mining needs only pairs) unless ``min_label`` filters on it.
    """
    read = pair_reader.read_pairs(path, require_label=min_label is not None, counts=counts)
    pairs = [(p.text_a, p.text_b) for p in read if min_label is None or p.label >= min_label]
    counts["below_min_label"] = len(read) - len(pairs)
    counts["pairs"] = len(pairs)
    if not pairs:
        raise InputError(f"{path} holds no pair with a label >= --min-label {min_label}")
    return pairs


# ---------------------------------------------------------------------------------------- mining
def mine_negatives(
    index: SearchIndex,
    pairs: list[tuple[str, str]],
    rank_start: int,
    rank_end: int,
    num_negatives: int,
    max_similarity: float,
    seed: int,
    counts: Counter,
    batch_size: int = 128,
    search_batch: int = 1024,
    show_progress: bool = True,
) -> list[tuple[str, str, str]]:
    """Triples (anchor, positive, negative), ``num_negatives`` per pair where enough candidates remain."""
    from pipeline import progress

    triples: list[tuple[str, str, str]] = []
    batches = range(0, len(pairs), search_batch)
    for start in progress.bar(iterable=batches, desc="mine", unit="batch", disable=not show_progress):
        batch = pairs[start : start + search_batch]
        anchors = index.embed([a for a, _ in batch], batch_size)  # (B, d)
        positives = index.embed([p for _, p in batch], batch_size, document=True)  # (B, d), as the corpus
        _, rows = index.search_vectors(anchors, rank_end)  # (B, rank_end)
        for offset, ((anchor, positive), ranked) in enumerate(zip(batch, rows)):
            window = [int(r) for r in ranked[rank_start - 1 : rank_end] if r >= 0]
            keep = _filter(index, anchor, positive, positives[offset], window, max_similarity, counts)
            # Seeded per pair, so a pair's negatives do not depend on the batch size or on other pairs.
            rng = np.random.default_rng([seed, start + offset])
            chosen = rng.choice(len(keep), size=min(num_negatives, len(keep)), replace=False) if keep else []
            if len(chosen) < num_negatives:
                counts["short" if len(chosen) else "no_negative"] += 1
            triples += [(anchor, positive, index.texts[keep[c]]) for c in sorted(chosen)]
    counts["triples"] = len(triples)
    return triples


def _filter(
    index: SearchIndex,
    anchor: str,
    positive: str,
    positive_vector: np.ndarray,
    rows: list[int],
    max_similarity: float,
    counts: Counter,
) -> list[int]:
    positive_key, anchor_key = normalize_text(positive), normalize_text(anchor)
    kept = []
    for row in rows:
        key = normalize_text(index.texts[row])
        if key == positive_key:
            counts["skipped_positive"] += 1
        elif key == anchor_key:
            counts["skipped_anchor"] += 1
        else:
            kept.append(row)
    if kept and max_similarity < 1.0:
        cosine = index.vectors(np.array(kept)) @ positive_vector  # (len(kept),)
        counts["skipped_similar"] += int((cosine > max_similarity).sum())
        kept = [row for row, c in zip(kept, cosine) if c <= max_similarity]
    return kept


# ---------------------------------------------------------------------------------------- output
def write_triples(path: Path, triples: list[tuple[str, str, str]], counts: Counter) -> None:
    lines = []
    for anchor, positive, negative in triples:
        if path.suffix == ".jsonl":
            record = {"anchor": anchor, "positive": positive, "negative": negative}
            lines.append(json.dumps(record, ensure_ascii=False))
        else:
            fields = [anchor, positive, negative]
            if any("\t" in t or "\n" in t for t in fields):
                counts["tsv_tabs_replaced"] += 1  # a tab inside a sentence would shift the columns
                fields = [" ".join(t.split()) for t in fields]
            lines.append("\t".join(fields))
    atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode("utf-8"))


def run(cfg: Config) -> int:
    for path in cfg.out:
        if path.exists() and not cfg.overwrite:
            raise InputError(f"{path} exists; pass --overwrite or choose another --out")
        if not path.parent.is_dir():
            raise InputError(f"output directory {path.parent} does not exist; create it first")
    counts: Counter = Counter()
    pairs = read_pairs(cfg.input, cfg.min_label, counts)
    # On the CPU even with faiss-gpu: the cosine filter reads stored vectors back (reconstruct), which
    # GPU IVF indexes do not support.
    index = SearchIndex.load(
        cfg.index_dir,
        model=cfg.model,
        device=cfg.device,
        nprobe=cfg.nprobe,
        ef_search=cfg.ef_search,
        gpu=False,
    )
    if cfg.rank_end > len(index):
        raise ConfigError(f"--rank-end {cfg.rank_end} exceeds the {len(index)} sentences in {cfg.index_dir}")
    triples = mine_negatives(
        index, pairs, cfg.rank_start, cfg.rank_end, cfg.num_negatives, cfg.max_similarity, cfg.seed, counts,
        cfg.batch_size, cfg.search_batch, cfg.progress,
    )  # fmt: skip
    for path in cfg.out:
        write_triples(path, triples, counts)
    log.info("mined %d triples from %d pairs into %s", len(triples), len(pairs), ", ".join(map(str, cfg.out)))
    print(json.dumps({"counts": dict(counts)}, ensure_ascii=False))
    return 0
