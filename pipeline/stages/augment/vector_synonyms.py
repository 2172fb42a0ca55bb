"""``python -m pipeline synonyms --vectors FILE --out CACHE.parquet``: a word-vector synonym cache.

Reads word vectors in word2vec text (``N D`` header, then ``word v1 ... vD`` per line) or binary
format (e.g. Tencent AI Lab's 8M x 200 embedding, which LUSE used), L2-normalises them and finds,
for every word, its ``top_k`` nearest neighbours by cosine with faiss, keeping those above
``threshold`` and never the word itself. Queries run in batches against the index, so memory is
the index plus one ``batch_size x (top_k + 1)`` result, never an all-pairs matrix.

The cache is Parquet with columns ``word`` (string), ``synonyms`` (list<string>, best first) and
``scores`` (list<float32>, cosine), one row per word (possibly with no synonyms), and the build
parameters as JSON in the schema metadata key ``synonym_cache``. The build is restartable: query
chunks of ``chunk_size`` words are written as part files in ``CACHE.parquet.parts/`` (skipped when
present on a rerun), then merged into the cache atomically.
"""

from __future__ import annotations

import json
import logging
import mmap
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import option, to_dict
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write, atomic_write_json, atomic_write_parquet

log = logging.getLogger(__name__)

METADATA_KEY = b"synonym_cache"
SCHEMA = pa.schema(
    [
        pa.field("word", pa.string(), nullable=False),
        pa.field("synonyms", pa.list_(pa.string()), nullable=False),
        pa.field("scores", pa.list_(pa.float32()), nullable=False),
    ]
)
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
GPU_MAX_K = 2048  # faiss GPU indexes return at most 2048 neighbours and probe at most 2048 lists


@dataclass
class Config:
    vectors: Path = option(help="Word vectors in word2vec text or binary format.")
    out: Path = option(help="The synonym cache to write (Parquet).")
    format: Literal["auto", "text", "binary"] = option(
        "auto", "Vector file format; auto: binary for *.bin, else sniffed from the first record."
    )
    max_words: int | None = option(
        None, "Keep only the first N words (after cjk_only); Tencent's file is ordered by frequency."
    )
    cjk_only: bool = option(False, "Keep only words with at least one CJK character.")
    top_k: int = option(10, "Neighbours kept per word at most.")
    threshold: float = option(0.6, "Minimum cosine similarity for a neighbour to count as a synonym.")
    index: Literal["flat", "ivf", "hnsw"] = option(
        "flat", "flat: exact inner product; ivf: IVF-Flat (nlist, nprobe); hnsw: HNSW (hnsw_m, ef_search)."
    )
    nlist: int = option(0, "ivf: number of lists (0: 4 * sqrt(words)).")
    nprobe: int = option(32, "ivf: lists visited per query (more: slower, higher recall).")
    train_size: int = option(0, "ivf: vectors sampled for k-means training (0: min(words, 64 * nlist)).")
    hnsw_m: int = option(32, "hnsw: graph degree.")
    ef_construction: int = option(200, "hnsw: candidate list size while building.")
    ef_search: int = option(128, "hnsw: candidate list size while searching (>= top_k + 1).")
    batch_size: int = option(8192, "Words per faiss search call.")
    chunk_size: int = option(200_000, "Words per part file; a rerun skips finished parts.")
    device: Literal["auto", "cpu", "gpu"] = option(
        "auto", "auto: faiss-gpu when faiss.get_num_gpus() > 0, else CPU; gpu fails without one."
    )
    threads: int = option(0, "CPU threads for faiss (0: faiss's default, all cores).")
    seed: int = option(0, "Seed for sampling IVF training vectors.")
    progress: bool = option(True, "Show a progress bar (words/s).")

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError("top_k must be >= 1")
        if not -1.0 <= self.threshold <= 1.0:
            raise ConfigError(f"threshold is a cosine in [-1, 1], got {self.threshold}")
        if self.max_words is not None and self.max_words < 2:
            raise ConfigError("max_words must be >= 2 (or unset for all words)")
        for name in ("batch_size", "chunk_size", "nprobe", "hnsw_m", "ef_construction"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in ("nlist", "train_size", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 picks a default)")
        if self.index == "hnsw" and self.ef_search < self.top_k + 1:
            raise ConfigError(f"ef_search must be >= top_k + 1 = {self.top_k + 1} for hnsw")
        if self.out.suffix != ".parquet":
            raise ConfigError(f"out should be a .parquet file, got {self.out}")


# --------------------------------------------------------------------------------------------- reading
@dataclass
class Vectors:
    words: list[str]
    matrix: np.ndarray  # (N, D) float32, L2-normalised rows
    counts: dict[str, int]  # read, kept, and what was skipped (duplicate, non_cjk, zero_vector)


class _Collector:
    """Applies the word filters while reading, so a capped read stops early."""

    def __init__(self, cfg: Config, dim: int, expected: int) -> None:
        self.cfg, self.dim = cfg, dim
        self.words: list[str] = []
        self.seen: set[str] = set()
        # One preallocated matrix: a list of 8M small arrays would cost ~100 bytes each plus a copy.
        capacity = max(1, min(expected, cfg.max_words or expected))
        self.matrix = np.empty((capacity, dim), dtype=np.float32)
        self.counts = {"read": 0, "kept": 0, "duplicate": 0, "non_cjk": 0}

    @property
    def full(self) -> bool:
        return self.cfg.max_words is not None and len(self.words) >= self.cfg.max_words

    def wants(self, word: str) -> bool:
        self.counts["read"] += 1
        if self.cfg.cjk_only and not _CJK.search(word):
            self.counts["non_cjk"] += 1
            return False
        if word in self.seen:
            self.counts["duplicate"] += 1
            return False
        return True

    def add(self, word: str, vector: np.ndarray) -> None:
        if len(self.words) == len(self.matrix):  # the header undercounted: grow
            self.matrix = np.resize(self.matrix, (2 * len(self.matrix), self.dim))
        self.matrix[len(self.words)] = vector
        self.seen.add(word)
        self.words.append(word)


def _parse_header(line: bytes, path: Path) -> tuple[int, int]:
    parts = line.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise InputError(f"{path}:1: expected a word2vec header 'N D', got {line[:60]!r}")
    return int(parts[0]), int(parts[1])


def sniff_format(path: Path) -> str:
    if path.suffix == ".bin":
        return "binary"
    with open(path, "rb") as f:
        _, dim = _parse_header(f.readline(), path)
        first = f.readline(64 * dim + 4096)
    try:
        fields = first.decode("utf-8").rstrip().rsplit(" ", dim)
        [float(v) for v in fields[1:]]
        return "text" if len(fields) == dim + 1 else "binary"
    except (UnicodeDecodeError, ValueError):
        return "binary"


def _read_text(path: Path, collect: _Collector, dim: int) -> None:
    with open(path, encoding="utf-8", errors="strict") as f:
        f.readline()
        try:
            for line_no, line in enumerate(f, 2):
                parts = line.rstrip().rsplit(" ", dim)  # rsplit: a word may itself contain spaces
                if len(parts) != dim + 1:
                    if not line.strip():
                        continue
                    raise InputError(f"{path}:{line_no}: expected a word and {dim} numbers")
                if not collect.wants(parts[0]):
                    continue
                try:
                    vector = np.array(parts[1:], dtype=np.float32)
                except ValueError:
                    raise InputError(f"{path}:{line_no}: a vector value is not a number") from None
                collect.add(parts[0], vector)
                if collect.full:
                    return
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{path}: not UTF-8 text ({exc}); pass --format binary if it is binary"
            ) from None


def _read_binary(path: Path, collect: _Collector, dim: int) -> None:
    record = 4 * dim
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = mm.find(b"\n") + 1
        size = len(mm)
        while pos < size:
            while pos < size and mm[pos : pos + 1] in (b"\n", b" "):
                pos += 1  # records may be separated by a newline
            if pos >= size:
                break
            space = mm.find(b" ", pos)
            if space < 0 or space + 1 + record > size:
                raise InputError(f"{path}: truncated record at byte {pos}; the file is incomplete")
            try:
                word = mm[pos:space].decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{path}: the word at byte {pos} is not UTF-8") from None
            if collect.wants(word):
                collect.add(word, np.frombuffer(mm, np.float32, dim, space + 1).copy())
                if collect.full:
                    return
            pos = space + 1 + record


def read_vectors(cfg: Config) -> Vectors:
    path = cfg.vectors
    if not path.is_file():
        raise InputError(f"vector file {path} not found")
    with open(path, "rb") as f:
        count, dim = _parse_header(f.readline(), path)
    fmt = sniff_format(path) if cfg.format == "auto" else cfg.format
    collect = _Collector(cfg, dim, count)
    (_read_text if fmt == "text" else _read_binary)(path, collect, dim)
    if not collect.words:
        raise InputError(f"{path}: no words left to index (header says {count}); check --cjk-only")
    matrix = collect.matrix[: len(collect.words)]
    norms = np.linalg.norm(matrix, axis=1)
    nonzero = norms > 0  # a zero vector has no direction: it cannot be anyone's synonym
    words = collect.words
    if not nonzero.all():
        words = [w for w, keep in zip(words, nonzero) if keep]
        matrix, norms = matrix[nonzero], norms[nonzero]
    matrix /= norms[:, None]  # in place: no second copy of a multi-GB matrix
    matrix = np.ascontiguousarray(matrix)
    counts = collect.counts | {"zero_vector": int((~nonzero).sum()), "kept": len(words)}
    log.info("read %s (%s, dim %d): %s", path, fmt, dim, counts)
    return Vectors(words, matrix, counts)


# --------------------------------------------------------------------------------------------- index
def use_gpu(cfg: Config) -> bool:
    import faiss

    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if cfg.device == "gpu" and gpus == 0:
        raise ConfigError("device=gpu but faiss sees no GPU (is faiss-gpu installed?); use --device auto")
    return cfg.device != "cpu" and gpus > 0


def build_index(cfg: Config, matrix: np.ndarray, saved: Path | None = None) -> tuple[Any, dict[str, Any]]:
    """A searchable index over ``matrix`` and the parameters that describe it (for the cache metadata).

    ``saved``: where a trained approximate index is kept so a restarted build searches the very same
    index (IVF k-means is not bit-reproducible across thread counts).
    """
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # it logs each CPU variant it tries
    import faiss

    if cfg.threads:
        faiss.omp_set_num_threads(cfg.threads)
    n, dim = matrix.shape
    gpu = use_gpu(cfg)
    params: dict[str, Any] = {"index": cfg.index, "device": "gpu" if gpu else "cpu"}
    if cfg.index == "flat":
        index = faiss.IndexFlatIP(dim)
    elif saved is not None and saved.is_file():
        index = faiss.read_index(str(saved))
    elif cfg.index == "ivf":
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, _nlist(cfg, n), faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexHNSWFlat(dim, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cfg.ef_construction
    if cfg.index == "ivf":
        nprobe = min(cfg.nprobe, index.nlist, GPU_MAX_K if gpu else index.nlist)
        params |= {
            "nlist": index.nlist,
            "nprobe": nprobe,
            "train_size": min(n, cfg.train_size or 64 * index.nlist),
        }
    if cfg.index == "hnsw":
        params |= {"hnsw_m": cfg.hnsw_m, "ef_construction": cfg.ef_construction, "ef_search": cfg.ef_search}
        if gpu:  # faiss has no GPU HNSW; the CPU graph is still far faster than exact search
            log.warning("hnsw runs on the CPU (faiss-gpu has no HNSW index)")
            gpu, params["device"] = False, "cpu"
    if gpu:
        if cfg.top_k + 1 > GPU_MAX_K:
            raise ConfigError(
                f"faiss-gpu returns at most {GPU_MAX_K} neighbours; lower top_k or use --device cpu"
            )
        if not index.is_trained:  # k-means on one GPU; every GPU then gets the same trained lists
            trainer = _to_gpus(index, single=True)
            trainer.train(_training_sample(cfg, matrix, params["train_size"]))
            index = faiss.index_gpu_to_cpu(trainer)
        index, params["gpus"] = _to_gpus(index), faiss.get_num_gpus()
    if index.ntotal == 0:
        if not index.is_trained:
            index.train(_training_sample(cfg, matrix, params["train_size"]))
        index.add(matrix)
        if saved is not None and cfg.index != "flat":
            cpu_index = faiss.index_gpu_to_cpu(index) if gpu else index
            atomic_write(saved, lambda tmp: faiss.write_index(cpu_index, str(tmp)))
    if cfg.index == "ivf" and gpu:
        faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", params["nprobe"])
    elif cfg.index == "ivf":
        index.nprobe = params["nprobe"]
    if cfg.index == "hnsw":
        index.hnsw.efSearch = cfg.ef_search
    return index, params


def _to_gpus(index: Any, single: bool = False) -> Any:
    """Copy a CPU index to the GPU(s); with several GPUs the database is sharded across them."""
    import faiss

    if single or faiss.get_num_gpus() == 1:
        resources = faiss.StandardGpuResources()
        gpu_index = faiss.index_cpu_to_gpu(resources, 0, index, faiss.GpuClonerOptions())
        faiss.add_to_referenced_objects(gpu_index, resources)  # the resources must outlive the index
        return gpu_index
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    return faiss.index_cpu_to_all_gpus(index, options)


def _nlist(cfg: Config, n: int) -> int:
    nlist = cfg.nlist or int(4 * np.sqrt(n))
    return max(1, min(nlist, n))


def _training_sample(cfg: Config, matrix: np.ndarray, size: int) -> np.ndarray:
    if size == len(matrix):
        return matrix
    rows = np.sort(np.random.default_rng(cfg.seed).choice(len(matrix), size, replace=False))
    return matrix[rows]


def neighbours(index: Any, queries: np.ndarray, query_ids: np.ndarray, top_k: int, threshold: float):
    """Top-k neighbours of each query above ``threshold``, excluding the query itself.

    Returns ``(ids, scores)``, one list per query, best first.
    """
    scores, ids = index.search(queries, top_k + 1)  # one extra: the word itself is usually first
    keep = (ids != query_ids[:, None]) & (ids >= 0) & (scores >= threshold)
    out_ids, out_scores = [], []
    for row_ids, row_scores, row_keep in zip(ids, scores, keep):
        out_ids.append(row_ids[row_keep][:top_k])
        out_scores.append(row_scores[row_keep][:top_k])
    return out_ids, out_scores


# --------------------------------------------------------------------------------------------- build
def _fingerprint(cfg: Config, vectors: Vectors) -> dict[str, Any]:
    stat = cfg.vectors.stat()
    keep = (
        "format",
        "max_words",
        "cjk_only",
        "top_k",
        "threshold",
        "index",
        "nlist",
        "nprobe",
        "train_size",
        "hnsw_m",
        "ef_construction",
        "ef_search",
        "chunk_size",
        "seed",
    )
    return {
        "vectors": {"path": str(cfg.vectors), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns},
        "config": {k: v for k, v in to_dict(cfg).items() if k in keep},
        "words": len(vectors.words),
        "dim": int(vectors.matrix.shape[1]),
        "counts": vectors.counts,
    }


def _part_table(words: list[str], start: int, ids: list[np.ndarray], scores: list[np.ndarray]) -> pa.Table:
    return pa.table(
        {
            "word": words[start : start + len(ids)],
            "synonyms": [[words[j] for j in row] for row in ids],
            "scores": [row.tolist() for row in scores],
        },
        schema=SCHEMA,
    )


def read_cache_metadata(path: str | Path) -> dict[str, Any]:
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta.get(METADATA_KEY, b"{}"))


def run(cfg: Config) -> int:
    from pipeline import progress

    vectors = read_vectors(cfg)
    fingerprint = _fingerprint(cfg, vectors)
    parts = cfg.out.with_name(cfg.out.name + ".parts")
    if cfg.out.is_file():
        if {k: v for k, v in read_cache_metadata(cfg.out).items() if k in fingerprint} == fingerprint:
            log.info("%s is already built from these vectors and parameters; nothing to do", cfg.out)
            shutil.rmtree(parts, ignore_errors=True)  # left if a run was stopped right after the merge
            return 0
        raise InputError(
            f"{cfg.out} exists from other vectors or parameters; delete it or pick another --out"
        )
    parts.mkdir(parents=True, exist_ok=True)
    meta_file = parts / "build.json"
    if meta_file.is_file() and json.loads(meta_file.read_text(encoding="utf-8")) != fingerprint:
        raise InputError(f"{parts} holds parts of a different build; delete it or pick another --out")
    atomic_write_json(meta_file, fingerprint)

    n = len(vectors.words)
    chunks = [(i, start) for i, start in enumerate(range(0, n, cfg.chunk_size))]
    todo = [(i, start) for i, start in chunks if not (parts / f"part-{i:06d}.parquet").is_file()]
    log.info("%d words, %d chunk(s), %d to do", n, len(chunks), len(todo))
    params = {}
    if todo:
        index, params = build_index(cfg, vectors.matrix, saved=parts / "index.faiss")
        atomic_write_json(parts / "index.json", params)
        bar = progress.bar(
            desc="synonyms",
            total=sum(min(cfg.chunk_size, n - s) for _, s in todo),
            unit="word",
            disable=not cfg.progress,
        )
        for i, start in todo:
            stop = min(start + cfg.chunk_size, n)
            ids: list[np.ndarray] = []
            scores: list[np.ndarray] = []
            for b in range(start, stop, cfg.batch_size):
                e = min(b + cfg.batch_size, stop)
                batch_ids, batch_scores = neighbours(
                    index, vectors.matrix[b:e], np.arange(b, e), cfg.top_k, cfg.threshold
                )
                ids += batch_ids
                scores += batch_scores
                bar.update(e - b)
            part = _part_table(vectors.words, start, ids, scores)
            atomic_write_parquet(parts / f"part-{i:06d}.parquet", part)
        bar.close()
    else:
        params = json.loads((parts / "index.json").read_text(encoding="utf-8"))
    table = pa.concat_tables(pq.read_table(parts / f"part-{i:06d}.parquet", schema=SCHEMA) for i, _ in chunks)
    with_synonyms = int(_count_nonempty(table))
    metadata = fingerprint | {"search": params, "words_with_synonyms": with_synonyms}
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata, ensure_ascii=False)})
    atomic_write_parquet(cfg.out, table)
    shutil.rmtree(parts, ignore_errors=True)
    log.info("wrote %s: %d words, %d with synonyms (cosine >= %s)", cfg.out, n, with_synonyms, cfg.threshold)
    return 0


def _count_nonempty(table: pa.Table) -> int:
    import pyarrow.compute as pc

    return pc.sum(pc.greater(pc.list_value_length(table.column("synonyms")), 0)).as_py() or 0
