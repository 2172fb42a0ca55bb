"""Loading the encoder a search index uses, and giving it a prefix for a block of texts.

Both the index builder (:mod:`pipeline.search.index`) and the query side (:mod:`pipeline.search.api`)
use these; they live here so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.evaluate.resolve import Resolved


def load_encoder(
    ref: str, max_length: int | None, device: str, pooling: str | None = None, prefix: str | None = None
) -> tuple[Any, Resolved]:
    """A model folder, checkpoint, run directory or Hub name (see pipeline.evaluate.resolve), loaded.

    ``pooling``/``prefix`` override the folder's rule; queries reuse the ones the index was built with.
    """
    import torch

    from pipeline.evaluate.resolve import load_encoder as load_resolved
    from pipeline.evaluate.resolve import resolve

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = resolve(ref)
    encoder = load_resolved(resolved, device, pooling, prefix)
    if max_length is not None:
        encoder.max_length = max_length
    return encoder, resolved


@contextmanager
def with_prefix(encoder: Any, prefix: str | None) -> Iterator[Any]:
    """``encoder`` with ``prefix`` put before every text for the block (None: leave its own)."""
    if prefix is None:
        yield encoder
        return
    own, encoder.prefix = encoder.prefix, prefix
    try:
        yield encoder
    finally:
        encoder.prefix = own
