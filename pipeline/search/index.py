"""``python -m pipeline index MODEL --input SENTENCES --out INDEX_DIR``: embed a corpus into a faiss index.

The corpus is encoded with the model's document prompt (e5's ``passage: ``, from the folder's
``config_sentence_transformers.json``) and queries with its query prompt, as the model was trained for
retrieval; a folder with one prompt encodes both sides with it. The manifest records both
(``model.prefix``, ``model.document_prefix``).

Encoding is restartable by chunk (see :mod:`pipeline.search.chunks`): rerunning the same command
after a crash encodes only the missing chunks and produces the same index as an uninterrupted run.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline import __version__
from pipeline.config import option, to_dict
from pipeline.errors import ConfigError, InputError
from pipeline.evaluate.resolve import Resolved
from pipeline.io import atomic_write_json, atomic_write_parquet
from pipeline.search import layout
from pipeline.search.backend import build_index, default_nlist, faiss_module, write_index
from pipeline.search.chunks import ChunkStore
from pipeline.search.corpus import Corpus, read_corpus
from pipeline.search.encoder import load_encoder, with_prefix
from pipeline.search.reduction import Reduction, ReductionKind, fit_reduction

log = logging.getLogger(__name__)


@dataclass
class Config:
    model: str | None = option(
        None, "Model: a Hub name, a saved encoder folder, a checkpoint or run directory."
    )
    input: Path | None = option(
        None, "A UTF-8 sentence file (one per line) or a shard directory (manifest.json)."
    )
    out: Path | None = option(None, "Index directory to write.")
    batch_size: int = option(128, "Sentences per forward pass.")
    progress: bool = option(True, "Show progress: a bar on a terminal, a line every 30 s in a log.")
    chunk_size: int = option(
        4096, "Sentences per restart unit; each chunk's embeddings are saved as one file."
    )
    max_length: int | None = option(None, "Token limit per sentence (default: the model's encoder.json).")
    pooling: Literal["cls", "mean", "first_last_avg"] | None = option(
        None, "Override the model's pooling (empty = the folder's rule; needed for a folder without one)."
    )
    prefix: str | None = option(
        None,
        "Override the query prefix (empty = the folder's default prompt); without --document-prefix the "
        "corpus gets it too, as before prompts had two sides.",
    )
    document_prefix: str | None = option(
        None,
        "Prompt put before every corpus text (empty = the folder's document prompt, e5's 'passage: ', "
        "else the query prefix). Queries keep the query prefix.",
    )
    device: str = option(
        "auto", "Torch device for encoding: auto (cuda if available), cpu, cuda, cuda:1, ..."
    )
    dedup: bool = option(True, "Index each distinct sentence once (duplicates are counted in the manifest).")
    reduce: ReductionKind = option(
        "none", "Dimension reduction fitted on the corpus: none, pca or whitening."
    )
    reduce_dim: int = option(256, "Output dimension of the reduction (<= the model's hidden size).")
    fit_sample: int = option(
        100_000, "At most this many corpus rows (seeded sample) fit the reduction / IVF."
    )
    index_type: Literal["flat", "ivf", "hnsw"] = option("flat", "flat (exact inner product), ivf or hnsw.")
    nlist: int = option(0, "IVF: number of inverted lists (0: about 4*sqrt(N)).")
    nprobe: int = option(16, "IVF: lists visited per query (stored; `search --nprobe` overrides).")
    hnsw_m: int = option(32, "HNSW: neighbours per node.")
    ef_construction: int = option(80, "HNSW: candidate list size while building.")
    ef_search: int = option(
        64, "HNSW: candidate list size per query (stored; `search --ef-search` overrides)."
    )
    gpu: bool = option(True, "Build flat/IVF indexes on GPU 0 when faiss-gpu sees one (written back as CPU).")
    seed: int = option(0, "Seed of the fitting sample.")
    overwrite: bool = option(False, "Replace a finished index in --out.")
    keep_work: bool = option(False, "Keep the encoded chunks (.work/) after a successful build.")

    def __post_init__(self) -> None:
        if self.model is None:
            raise ConfigError("name the model: python -m pipeline index MODEL --input FILE --out DIR")
        if self.input is None or self.out is None:
            raise ConfigError(
                "set both --input (sentence file or shard directory) and --out (index directory)"
            )
        for name in ("batch_size", "chunk_size", "reduce_dim", "fit_sample", "nprobe", "hnsw_m"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.nlist < 0:
            raise ConfigError(f"--nlist must be >= 0 (0 picks about 4*sqrt(N)), got {self.nlist}")
        if self.ef_construction < 1 or self.ef_search < 1:
            raise ConfigError("--ef-construction and --ef-search must be >= 1")


def document_prefix(resolved: Resolved, encoder: Any, cfg: Config) -> str:
    """The corpus side's prompt: --document-prefix, else the folder's document prompt (unless --prefix
    overrides the folder's rule), else the query prefix (a folder with one prompt, as before)."""
    if cfg.document_prefix is not None:
        return cfg.document_prefix
    if cfg.prefix is not None:
        return encoder.prefix
    from pipeline.model.rules import read_rule

    folder = resolved.skeleton_dir or resolved.model_dir or resolved.spec
    found = read_rule(folder).document_prefix if folder else None
    return encoder.prefix if found is None else found


def encode_chunks(
    encoder: Any, corpus: Corpus, store: ChunkStore, batch_size: int, show_progress: bool = True
) -> None:
    from pipeline import progress

    missing = store.missing()
    if len(missing) < store.num_chunks:
        log.info(
            "resuming: %d of %d chunks already encoded", store.num_chunks - len(missing), store.num_chunks
        )
    todo = sum(store.bounds(i)[1] - store.bounds(i)[0] for i in missing)
    with progress.bar(total=todo, desc="encode", unit="sent", disable=not show_progress) as bar:
        for i in missing:
            start, end = store.bounds(i)
            store.write(i, encoder.encode(corpus.texts[start:end], batch_size=batch_size))
            bar.update(end - start)


def index_params(cfg: Config, n: int) -> dict[str, Any]:
    if cfg.index_type == "ivf":
        nlist = cfg.nlist or default_nlist(n)
        if nlist > n:
            raise ConfigError(f"--nlist {nlist} exceeds the {n} sentences to index; lower --nlist")
        return {"nlist": nlist, "nprobe": cfg.nprobe}
    if cfg.index_type == "hnsw":
        return {"hnsw_m": cfg.hnsw_m, "ef_construction": cfg.ef_construction, "ef_search": cfg.ef_search}
    return {}


def write_corpus(path: Path, corpus: Corpus) -> None:
    import pyarrow as pa

    table = pa.table({"id": pa.array(corpus.ids, pa.uint64()), "text": pa.array(corpus.texts, pa.string())})
    atomic_write_parquet(path, table)


def check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; pass a directory for the index")
    if (out / layout.MANIFEST).is_file() and not overwrite:
        raise InputError(f"{out} already holds a finished index; pass --overwrite or choose another --out")


def clear_out(out: Path) -> None:
    """Remove a finished index's files, the manifest first: a crash then never leaves a stale, valid index."""
    (out / layout.MANIFEST).unlink(missing_ok=True)
    for name in (layout.INDEX_FILE, layout.CORPUS_FILE, layout.REDUCTION_FILE, layout.ENCODER_COPY):
        (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def run(cfg: Config) -> int:
    started = time.time()
    out = Path(cfg.out)
    check_out(out, cfg.overwrite)
    corpus = read_corpus(cfg.input, dedup=cfg.dedup)
    encoder, resolved = load_encoder(cfg.model, cfg.max_length, cfg.device, cfg.pooling, cfg.prefix)
    clear_out(out)  # only now that the input and the model are known to be good
    n, dim = len(corpus.texts), encoder.dim
    corpus_prefix = document_prefix(resolved, encoder, cfg)
    model_dir = resolved.skeleton_dir or resolved.model_dir  # where encoder.json lives
    model_info = {
        "ref": cfg.model,
        "kind": resolved.kind,
        "path": str(Path(resolved.model_dir).resolve()) if resolved.model_dir else resolved.spec,
        "weights_sha256": layout.model_fingerprint(resolved.model_dir),
        "pooling": encoder.pooling,
        "max_length": encoder.max_length,
        "prefix": encoder.prefix,  # the query side; `search` encodes queries with it
        "document_prefix": corpus_prefix,  # the corpus side (the document prompt)
        "dim": dim,
    }
    state = {"texts_sha256": corpus.fingerprint(), "rows": n, "chunk_size": cfg.chunk_size,
             "batch_size": cfg.batch_size, "model": model_info}  # fmt: skip
    store = ChunkStore(out / layout.WORK_DIR, n, cfg.chunk_size, state)
    with with_prefix(encoder, corpus_prefix):
        encode_chunks(encoder, corpus, store, cfg.batch_size, cfg.progress)

    sample = np.sort(np.random.default_rng(cfg.seed).choice(n, size=min(n, cfg.fit_sample), replace=False))
    reduction: Reduction | None = None
    if cfg.reduce != "none":
        if cfg.reduce_dim > dim:
            raise ConfigError(f"--reduce-dim {cfg.reduce_dim} exceeds the model's {dim} dimensions; lower it")
        if cfg.reduce_dim > len(sample):
            raise ConfigError(f"--reduce-dim {cfg.reduce_dim} needs at least that many sentences (have {n})")
        reduction = fit_reduction(cfg.reduce, store.take(sample), cfg.reduce_dim)
        log.info("fitted %s to %d dims on %d rows", cfg.reduce, cfg.reduce_dim, len(sample))

    def reduce(x: np.ndarray) -> np.ndarray:
        return reduction.apply(x) if reduction is not None else x

    index_dim = reduction.dim if reduction is not None else dim
    params = index_params(cfg, n)
    train = reduce(store.take(sample)) if cfg.index_type == "ivf" else None
    index, built_on = build_index(cfg.index_type, index_dim, params, train, map(reduce, store), cfg.gpu)

    write_index(index, out / layout.INDEX_FILE)
    write_corpus(out / layout.CORPUS_FILE, corpus)
    files = [layout.INDEX_FILE, layout.CORPUS_FILE]
    if reduction is not None:
        reduction.save(out / layout.REDUCTION_FILE)
        files.append(layout.REDUCTION_FILE)
    if model_dir is not None and (Path(model_dir) / layout.ENCODER_COPY).is_file():
        shutil.copyfile(Path(model_dir) / layout.ENCODER_COPY, out / layout.ENCODER_COPY)
        files.append(layout.ENCODER_COPY)
    manifest = {
        "format": layout.FORMAT,
        "format_version": layout.FORMAT_VERSION,
        "tool_version": __version__,
        "config": to_dict(cfg),
        "input": {"path": str(cfg.input), "kind": corpus.kind, "texts_sha256": state["texts_sha256"]},
        "counts": dict(corpus.counts),
        "model": model_info,
        "embedding_dim": dim,
        "index_dim": index_dim,
        "reduction": None
        if reduction is None
        else {
            "kind": reduction.kind,
            "dim": reduction.dim,
            "fit_rows": int(len(sample)),
            "file": layout.REDUCTION_FILE,
        },
        "index": {
            "type": cfg.index_type,
            "metric": "inner_product",
            "params": params,
            "ntotal": int(index.ntotal),
            "built_on": built_on,
            "faiss_version": _faiss_version(),
        },
        "files": {name: layout.file_entry(out / name) for name in files},
    }
    atomic_write_json(out / layout.MANIFEST, manifest)
    if not cfg.keep_work:
        store.remove()
    log.info("indexed %d sentences into %s (%s, %d dims) in %.1fs", n, out, cfg.index_type, index_dim,
             time.time() - started)  # fmt: skip
    return 0


def _faiss_version() -> str:
    return str(getattr(faiss_module(), "__version__", "unknown"))
