"""Semantic search over a sentence corpus: build a faiss index, query it, mine hard negatives.

``python -m pipeline index`` writes an index directory (layout in ``docs/search.md`` and
:mod:`pipeline.search.layout`); :class:`SearchIndex` loads one for queries from Python.
"""

from pipeline.search.api import Hit, SearchIndex

__all__ = ["Hit", "SearchIndex"]
