"""Python API over an index directory::

index = SearchIndex.load("idx/")
for hit in index.search(["北京今天的天气"], k=5)[0]:
    print(hit.score, hit.id, hit.text)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import InputError
from pipeline.search import layout
from pipeline.search.backend import GpuPlacement, read_index, set_search_params
from pipeline.search.encoder import with_prefix
from pipeline.search.reduction import Reduction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hit:
    id: int  # the sentence's stable id (pipeline.shards.sentence_id of its text)
    text: str
    score: float  # inner product of normalised vectors: cosine similarity
    row: int  # position in the index / corpus.parquet


def check_queries(queries: Sequence[str]) -> list[str]:
    if isinstance(queries, str):
        raise InputError("queries must be a list of strings, not one string")
    out = []
    for n, query in enumerate(queries, start=1):
        if not isinstance(query, str) or not query.strip():
            raise InputError(f"query {n} is empty; give a non-blank query")
        out.append(query.strip())
    if not out:
        raise InputError("no queries given; pass at least one query or --queries-file")
    return out


class SearchIndex:
    def __init__(
        self,
        directory: Path,
        manifest: dict[str, Any],
        index: Any,
        ids: np.ndarray,
        texts: list[str],
        reduction: Reduction | None,
        encoder: Any,
    ):
        self.directory = directory
        self.manifest = manifest
        self.index = index
        self.ids = ids
        self.texts = texts
        self.reduction = reduction
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def dim(self) -> int:
        return int(self.manifest["index_dim"])

    @classmethod
    def load(
        cls,
        directory: str | Path,
        model: str | None = None,
        encoder: Any = None,
        device: str = "auto",
        nprobe: int | None = None,
        ef_search: int | None = None,
        verify: bool = True,
        gpu: bool = True,
    ) -> SearchIndex:
        """Load ``directory``; the encoder is the manifest's model unless ``model`` or ``encoder`` is given.

        ``verify`` checks every file's sha256 against the manifest (seconds for a GB-sized index).
        """
        import pyarrow.parquet as pq

        directory = Path(directory)
        manifest = layout.read_index_manifest(directory)
        layout.check_files(directory, manifest, checksums=verify)
        index = read_index(directory / layout.INDEX_FILE)
        table = pq.read_table(directory / layout.CORPUS_FILE)
        if table.num_rows != index.ntotal:
            raise InputError(
                f"{directory}: {layout.CORPUS_FILE} has {table.num_rows} rows but the index "
                f"{index.ntotal}; rebuild the index"
            )
        reduction = None
        if manifest.get("reduction"):
            reduction = Reduction.load(directory / layout.REDUCTION_FILE)
        if index.d != manifest["index_dim"]:
            raise InputError(
                f"{directory}: index has {index.d} dims, manifest {manifest['index_dim']}; rebuild"
            )
        params = manifest["index"]["params"]
        set_search_params(index, nprobe or params.get("nprobe"), ef_search or params.get("ef_search"))
        index_type = manifest["index"]["type"]
        placement = GpuPlacement(gpu)
        index = placement.to_device(index, index_type)
        self = cls(
            directory,
            manifest,
            index,
            table.column("id").to_numpy(),
            table.column("text").to_pylist(),
            reduction,
            None,
        )
        self._placement = placement  # keeps GPU resources alive as long as the index
        self.encoder = encoder if encoder is not None else self._load_encoder(model, device)
        self._check_encoder()
        return self

    def _load_encoder(self, model: str | None, device: str) -> Any:
        from pipeline.search.encoder import load_encoder

        info = self.manifest["model"]
        ref = model or info["path"]
        if model is None and info["path"].startswith("/") and not Path(info["path"]).exists():
            raise InputError(
                f"the index's model {info['path']} no longer exists; pass --model with the same model"
            )
        return load_encoder(ref, info.get("max_length"), device, info.get("pooling"), info.get("prefix"))[0]

    def _check_encoder(self) -> None:
        info = self.manifest["model"]
        if self.encoder.dim != self.manifest["embedding_dim"]:
            raise InputError(
                f"dimension mismatch: the model gives {self.encoder.dim}-d embeddings but {self.directory} "
                f"was built from {self.manifest['embedding_dim']}-d ones ({info['ref']}); use that model"
            )
        if info.get("pooling") and self.encoder.pooling != info["pooling"]:
            log.warning(
                "model pools with %s, the index was built with %s", self.encoder.pooling, info["pooling"]
            )

    # ---------------------------------------------------------------------------------- queries
    def embed(self, texts: Sequence[str], batch_size: int = 128, document: bool = False) -> np.ndarray:
        """Texts as vectors in the index space (encoded, reduced, normalised): (N, dim) float32.

        Queries by default (the index's query prefix); ``document=True`` encodes them as the corpus was
        (its document prompt, e.g. e5's ``passage: ``), for comparing texts with the indexed ones.
        """
        prefix = self.manifest["model"].get("document_prefix") if document else None
        with with_prefix(self.encoder, prefix):
            x = self.encoder.encode(list(texts), batch_size=batch_size)
        return self.reduction.apply(x) if self.reduction is not None else x

    def search_vectors(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss search: scores (Q, k) and rows (Q, k); rows are -1 where fewer than k were found."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise InputError(f"query vectors have shape {vectors.shape}; the index needs (Q, {self.dim})")
        return self.index.search(vectors, min(k, len(self)))

    def search(self, queries: Sequence[str], k: int = 10, batch_size: int = 128) -> list[list[Hit]]:
        """Top-``k`` hits per query, best first."""
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        queries = check_queries(queries)
        scores, rows = self.search_vectors(self.embed(queries, batch_size), k)
        return [
            [Hit(int(self.ids[r]), self.texts[r], float(s), int(r)) for s, r in zip(srow, rrow) if r >= 0]
            for srow, rrow in zip(scores, rows)
        ]

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        """Stored vectors of ``rows`` (IVF needs a direct map, built on first use)."""
        from pipeline.search.backend import faiss_module

        faiss = faiss_module()
        rows = np.asarray(rows, dtype=np.int64)
        try:
            return self.index.reconstruct_batch(rows)
        except RuntimeError:
            faiss.extract_index_ivf(self.index).make_direct_map()
            return self.index.reconstruct_batch(rows)
