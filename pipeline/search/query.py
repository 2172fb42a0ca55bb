"""``python -m pipeline search INDEX_DIR "query" ["query2" ...] [-k 10] [--queries-file F] [--json]``."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from pipeline.errors import ConfigError
from pipeline.search.api import SearchIndex, check_queries
from pipeline.search.corpus import read_lines

log = logging.getLogger(__name__)


@dataclass
class Config:
    index_dir: Path | None = option(None, "Index directory written by `python -m pipeline index`.")
    queries: list[str] = option(factory=list, help="Query sentences (positional).")
    queries_file: Path | None = option(None, "UTF-8 file with one query per line, searched in one batch.")
    k: int = option(10, "Hits per query.")
    json: bool = option(False, "Print one JSON object per query (JSON Lines) instead of a table.")
    model: str | None = option(None, "Encode queries with this model instead of the one in the manifest.")
    nprobe: int | None = option(None, "IVF: lists visited per query (default: the value stored at build).")
    ef_search: int | None = option(None, "HNSW: candidate list size per query (default: stored value).")
    batch_size: int = option(128, "Queries per forward pass.")
    device: str = option("auto", "Torch device for encoding queries.")
    verify: bool = option(True, "Check the sha256 of the index files before loading.")

    def __post_init__(self) -> None:
        if self.index_dir is None:
            raise ConfigError('name the index: python -m pipeline search INDEX_DIR "query" [-k 10]')
        if self.k < 1:
            raise ConfigError(f"-k must be >= 1, got {self.k}")
        if not self.queries and self.queries_file is None:
            raise ConfigError("give at least one query after INDEX_DIR, or --queries-file FILE")
        for name in ("nprobe", "ef_search"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")


def run(cfg: Config) -> int:
    queries = list(cfg.queries)
    if cfg.queries_file is not None:
        lines, blank = read_lines(Path(cfg.queries_file), "queries file")
        if blank:
            log.info("%s: skipped %d blank lines", cfg.queries_file, blank)
        queries += [text for _, text in lines]
    queries = check_queries(queries)  # before loading anything: a bad query fails fast
    index = SearchIndex.load(
        cfg.index_dir, model=cfg.model, device=cfg.device, nprobe=cfg.nprobe, ef_search=cfg.ef_search,
        verify=cfg.verify,
    )  # fmt: skip
    results = index.search(queries, k=cfg.k, batch_size=cfg.batch_size)
    out = sys.stdout
    for n, (query, hits) in enumerate(zip(queries, results), start=1):
        if cfg.json:
            rows = [
                {"rank": r, "score": round(h.score, 6), "id": h.id, "text": h.text}
                for r, h in enumerate(hits, 1)
            ]
            record = {"query": query, "hits": rows}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            continue
        out.write(f"query {n}: {query}\n")
        for rank, hit in enumerate(hits, start=1):
            out.write(f"{rank:>4}  {hit.score:7.4f}  {hit.id:>20}  {hit.text}\n")
        out.write("\n")
    out.flush()
    return 0
