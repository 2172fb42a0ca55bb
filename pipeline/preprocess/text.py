"""Text cleaning for Chinese: normalisation, whitespace removal, sentence splitting, filters.

Everything here runs once per record in the hot path of pass 1, so it is built from precompiled
regular expressions and ``str.translate`` tables (both loop in C) rather than per-character Python.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Full-width forms whose half-width twin means the same thing in Chinese text: letters, digits and
# the symbols that only occur inside numbers, code or Latin text. Full-width ，。！？；：（）and the
# Chinese quotes stay as they are: they are the normal Chinese punctuation, and LUSE keeps them.
_KEEP_FULL_WIDTH = set("！，；：？（）")
_FULL_TO_HALF = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F) if chr(cp) not in _KEEP_FULL_WIDTH}
_FULL_TO_HALF[0x3000] = 0x20  # ideographic space -> space (then removed like any whitespace)

# Control characters and invisible format characters carry no text: C0 except tab/newline/CR (which
# are whitespace and handled below), DEL, C1, zero-width space/joiners, BOM, bidi controls.
_CONTROL = [c for c in range(0x20) if c not in (0x09, 0x0A, 0x0D)] + [0x7F] + list(range(0x80, 0xA0))
_INVISIBLE = [0x200B, 0x200C, 0x200D, 0x200E, 0x200F, 0x2060, 0xFEFF] + list(range(0x202A, 0x202F))
CONTROL_RE = re.compile("[" + "".join(re.escape(chr(c)) for c in _CONTROL + _INVISIBLE) + "]")

# Only the half-width mapping goes in the table: control characters are removed by CONTROL_RE first.
_FULL_WIDTH_TABLE = str.maketrans(_FULL_TO_HALF)
_FULL_WIDTH_RUN_RE = re.compile("[\uff01-\uff5e\u3000]+")


def _to_half_width(match: re.Match[str]) -> str:
    return match.group().translate(_FULL_WIDTH_TABLE)


_WHITESPACE_RE = re.compile(r"\s+")
# A space survives only between two pieces of Latin text ("Windows 10", "New York"); every other
# space (next to a Chinese character or Chinese punctuation) is removed, as in LUSE's corpus.
_DROP_SPACE_RE = re.compile(r"(?<![A-Za-z0-9.,;:!?%)\]'\"]) | (?![A-Za-z0-9(\['\"])")

# A sentence ends with a run of terminators (。！？；… and their half-width forms, so "！？" and
# "……" stay one end); closing quotes and brackets that follow belong to the same sentence.
_SENTENCE_RE = re.compile(r"[^。！？；!?;…]*(?:[。！？；!?;…]+[”’」』）)】》〕〗〉\"']*)?")

# CJK ideographs: the unified block, extensions A-F and the compatibility ideographs.
_NON_CJK_RE = re.compile(r"[^\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef]+")


def normalise(text: str) -> str:
    """Full-width letters/digits/symbols -> half-width; control and invisible characters removed."""
    # Translating only the (few, short) full-width runs is ~2x faster than translating every line.
    return _FULL_WIDTH_RUN_RE.sub(_to_half_width, CONTROL_RE.sub("", text))


def remove_whitespace(text: str) -> str:
    """Drop whitespace inside Chinese text; keep one space between two Latin words."""
    if _WHITESPACE_RE.search(text) is None:
        return text
    return _DROP_SPACE_RE.sub("", _WHITESPACE_RE.sub(" ", text).strip())


def split_sentences(paragraph: str) -> list[str]:
    """Split one cleaned paragraph (no newlines) into sentences, terminators kept at the end."""
    return [s for s in _SENTENCE_RE.findall(paragraph) if s]


def cjk_count(text: str) -> int:
    return len(_NON_CJK_RE.sub("", text))


def has_control(text: str) -> bool:
    return CONTROL_RE.search(text) is not None


def clean_paragraphs(texts: Iterable[str]) -> list[str]:
    """Raw field values -> cleaned paragraphs: one per input line, normalised, no inner blanks."""
    out = []
    for text in texts:
        for line in normalise(text).splitlines():
            line = remove_whitespace(line)
            if line:
                out.append(line)
    return out
