"""A text key for "the same sentence": what near-identical texts share.

Used wherever two texts must count as one regardless of spacing, width, case and punctuation: the
miner's and the teacher stage's filter against near-duplicate negatives, the dialogue sample's check
against the evaluation sets, and the false-negative control's text hashes (pipeline/data/collate.py).
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

__all__ = ["key_text", "key_texts", "mapped_keys", "normalize_text"]


def normalize_text(text: str) -> str:
    """NFKC, case-folded, without whitespace or punctuation: '你好！ ' and '你好!' are the same text."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return "".join(c for c in text if not unicodedata.category(c).startswith(("P", "Z", "C")))


# --------------------------------------------------------------------------------------------- keys
_DROP_BMP: re.Pattern | None = None
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _drop_bmp() -> re.Pattern:
    """One regex class of the BMP code points of Unicode categories P*, Z* and C* (built once, 20 ms;
    a class with the astral ranges too falls off re's fast path and is 20x slower)."""
    global _DROP_BMP
    if _DROP_BMP is None:
        ranges: list[tuple[int, int]] = []
        for cp in range(0x10000):
            if unicodedata.category(chr(cp))[0] in "PZC":
                if ranges and ranges[-1][1] == cp - 1:
                    ranges[-1] = (ranges[-1][0], cp)
                else:
                    ranges.append((cp, cp))
        parts = [re.escape(chr(lo)) + ("" if lo == hi else "-" + re.escape(chr(hi))) for lo, hi in ranges]
        _DROP_BMP = re.compile("[" + "".join(parts) + "]+")
    return _DROP_BMP


def _compat() -> tuple[re.Pattern, dict[str, str]]:
    """BMP characters whose NFKD decomposition is other, pure-ASCII text (full-width forms, "…", no-break
    and ideographic spaces) and that text: replacing one by its decomposition keeps the NFKD (hence the
    NFKC) of any string, and leaves most Chinese text NFKC-stable, so the costly normalisation is skipped."""
    global _COMPAT
    if _COMPAT is None:
        table = {}
        for cp in range(0x80, 0x10000):
            c = chr(cp)
            d = unicodedata.normalize("NFKD", c)
            if d != c and d.isascii():
                table[c] = d
        _COMPAT = (re.compile("[" + "".join(re.escape(c) for c in table) + "]"), table)
    return _COMPAT


_COMPAT: tuple[re.Pattern, dict[str, str]] | None = None


def key_text(text: str) -> str:
    """``pipeline.normalize.normalize_text`` (NFKC, case-folded, no whitespace or punctuation), faster:
    compatibility characters with ASCII decompositions replaced first (the NFKC stays the same), NFKC
    only when the quick check says the text still needs it, the character filter as one regex over the
    BMP; a text with astral characters goes to ``normalize_text`` itself. The same string
    (tests/test_pairs_stage.py checks), about 10x faster on news text."""
    if _ASTRAL.search(text) is not None:
        return normalize_text(text)
    pattern, table = _compat()
    for char in set(pattern.findall(text)):
        text = text.replace(char, table[char])
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return _drop_bmp().sub("", text.casefold())


_SEP = "\x1f"  # joins a batch of texts in ``key_texts``: a control character, dropped from every key
_DROPPED = 0xFFFF  # ``_key_map`` values: two noncharacters, which no character becomes in a key:
_SPECIAL = 0xFFFE  # the character leaves the key, or its text goes to ``key_text`` whole
_KEY_MAP: np.ndarray | None = None


def _key_map() -> np.ndarray:
    """What ``key_text`` makes of each character of a text it does not normalise, by code point
    (the last entry, 0x10000, stands for every astral one): the one BMP character it becomes (its
    ASCII compatibility decomposition, case-folded, when that leaves one character; else itself
    case-folded), ``_DROPPED`` (a P/Z/C character, or a decomposition of only such) or ``_SPECIAL``:
    the character needs the whole text (NFKC may change it or a neighbour: not NFKC quick-check
    Yes, or a combining mark; a multi-character case folding or decomposition; an astral character
    or a lone surrogate). Little-endian uint32, as the UTF-32 it maps."""
    global _KEY_MAP
    if _KEY_MAP is None:
        _, table = _compat()
        seconds = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))  # Hangul V and T jamo
        for cp in range(0x10000):
            parts = unicodedata.decomposition(chr(cp)).split()
            if parts and not parts[0].startswith("<"):
                seconds.update(int(p, 16) for p in parts[1:])  # may compose with what precedes it

        def dropped(c: str) -> bool:
            return unicodedata.category(c)[0] in "PZC"

        out = np.full(0x10000, _SPECIAL, dtype=np.uint16)
        for cp in range(0x10000):
            c = chr(cp)
            if c in table:  # replaced before the quick check; the ASCII it becomes is NFKC-stable
                kept = "".join(x for x in table[c].casefold() if not dropped(x))
                out[cp] = _DROPPED if not kept else (ord(kept) if len(kept) == 1 else _SPECIAL)
            elif 0xD800 <= cp < 0xE000 or cp in seconds or unicodedata.combining(c):
                continue
            elif unicodedata.normalize("NFKC", c) != c:
                continue
            else:
                folded = c.casefold()
                if len(folded) != 1 or ord(folded) >= 0xD800:  # a kept value stays below the surrogates
                    continue  # and the two markers: the few characters past them go whole
                out[cp] = _DROPPED if dropped(folded) else ord(folded)
        out[ord(_SEP)] = ord(_SEP)
        _KEY_MAP = np.append(out, _SPECIAL).astype("<u4")
    return _KEY_MAP


def key_texts(texts: list[str]) -> list[str]:
    """``[key_text(t) for t in texts]``, vectorised: the batch joined, encoded as UTF-32 once and
    mapped character by character through ``_key_map``; a text with a character the map cannot
    decide alone goes to ``key_text`` itself. The same strings (tests/test_pairs_fast.py checks)."""
    return mapped_keys(texts)[0]


def mapped_keys(texts: list[str]) -> tuple[list[str], list[bool]]:
    """``key_texts(texts)`` and, for each text, whether its key is its characters mapped one by one
    through ``_key_map`` (no character went to ``key_text``): then the key of any prefix of the
    text is a prefix of its key."""
    if not texts:
        return [], []
    joined = _SEP.join(texts)
    if joined.count(_SEP) != len(texts) - 1:  # a text holds the separator itself
        return [key_text(t) for t in texts], [False] * len(texts)
    # UTF-32 (not 16): encoded and decoded twice as fast; a lone surrogate passes as itself
    codes = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    mapped = _key_map()[np.minimum(codes, 0x10000)]
    kept = mapped[mapped < _SPECIAL]
    keys = kept.tobytes().decode("utf-32-le").split(_SEP)
    by_map = [True] * len(texts)
    special = np.flatnonzero(mapped == _SPECIAL)
    if len(special):
        seps = np.flatnonzero(codes == ord(_SEP))
        for i in np.unique(np.searchsorted(seps, special)).tolist():
            keys[i] = key_text(texts[i])
            by_map[i] = False
    return keys, by_map
