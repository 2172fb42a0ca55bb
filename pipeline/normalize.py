"""A text key for "the same sentence": what near-identical texts share.

Used wherever two texts must count as one regardless of spacing, width, case and punctuation: the
miner's and the teacher stage's filter against near-duplicate negatives, the dialogue sample's check
against the evaluation sets, and the false-negative control's text hashes (pipeline/data/collate.py).
"""

from __future__ import annotations

import unicodedata

__all__ = ["normalize_text"]


def normalize_text(text: str) -> str:
    """NFKC, case-folded, without whitespace or punctuation: '你好！ ' and '你好!' are the same text."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return "".join(c for c in text if not unicodedata.category(c).startswith(("P", "Z", "C")))
