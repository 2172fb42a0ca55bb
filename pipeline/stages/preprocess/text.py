"""Text cleaning for Chinese: markup removal, normalisation, whitespace, sentence splitting, filters.

Everything here runs once per record in the hot path of pass 1, so it is built from precompiled
regular expressions, ``str.replace`` and numpy (all loop in C) rather than per-character Python;
the length and CJK filters work on a whole batch of sentences at once. A field goes through the
markup rules only when one cheap search finds something they could change.

``Cleaner`` applies the rules and keeps the audit: how many fields each rule changed and the first
few examples (before -> after), which end up in the manifest.
"""

from __future__ import annotations

import html
import itertools
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.stages.corpus.passes import SAMPLES_PER_RULE  # examples per rule or reason (unit, run)

SAMPLE_CHARS = 80  # an example is cut to about this many characters
MIN_CJK = 2  # a kept sentence has at least this many CJK ideographs, whatever its share


def char_class(codepoints: Iterable[int]) -> str:
    """A regex character class written as ranges: sre tests ranges much faster than long char lists."""
    points = sorted(set(codepoints))
    ranges: list[list[int]] = []
    for cp in points:
        if ranges and cp == ranges[-1][1] + 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    parts = (re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)
    return "[" + "".join(parts) + "]"


# Full-width forms whose half-width twin means the same thing in Chinese text: letters, digits and
# the symbols that only occur inside numbers, code or Latin text. Full-width ，。！？；：（）and the
# Chinese quotes stay as they are: they are the normal Chinese punctuation, and LUSE keeps them.
_KEEP_FULL_WIDTH = set("！，；：？（）")
FULL_TO_HALF = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F) if chr(cp) not in _KEEP_FULL_WIDTH}
FULL_TO_HALF[0x3000] = 0x20  # ideographic space -> space (then removed like any whitespace)

# Control characters and invisible format characters carry no text: C0 except tab/newline/CR (which
# are whitespace and handled below), DEL, C1, zero-width space/joiners, BOM, bidi controls.
CONTROL = [c for c in range(0x20) if c not in (0x09, 0x0A, 0x0D)] + [0x7F] + list(range(0x80, 0xA0))
# Lone surrogates (JSON can encode them, UTF-8 cannot) are removed too.
INVISIBLE = [0x200B, 0x200C, 0x200D, 0x200E, 0x200F, 0x2060, 0xFEFF] + list(range(0x202A, 0x202F))
CONTROL_RE = re.compile(char_class(CONTROL + INVISIBLE + list(range(0xD800, 0xE000))))

_HALF_WIDTH = {chr(k): chr(v) for k, v in FULL_TO_HALF.items()}
_FULL_WIDTH_RE = re.compile(char_class(FULL_TO_HALF))

# What str.split() treats as whitespace, spelled out: 3x faster to search than \s in Unicode mode.
WHITESPACE_RE = re.compile(
    char_class(
        [9, 10, 11, 12, 13, 0x1C, 0x1D, 0x1E, 0x1F, 0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F]
    )[:-1]
    + "\u2000-\u200a\u205f\u3000]+"
)
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
# Latin letters: ASCII and the accented ones (Latin-1 Supplement and Extended-A/B), so "René Worms"
# keeps its space like "New York".
_LATIN = "A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f"
# A space survives only between two pieces of Latin text ("Windows 10", "René Worms"); every other
# space (next to a Chinese character or Chinese punctuation) is removed, as in LUSE's corpus.
# Written space first (the lookbehind then spans the space too): sre finds a pattern that starts with
# a literal by a fast scan, one that starts with a lookbehind by trying every position (3x slower).
_DROP_SPACE_RE = re.compile(rf" (?:(?<![{_LATIN}0-9.,;:!?%)\]'\"] )|(?![{_LATIN}0-9(\['\"]))")
# A space between two Chinese clauses (web QA text often separates clauses with a space instead of
# a comma: "故宫淡季门票40元 “黑导游”卖外地客140元"). It becomes "，" when the spaces in the line are
# rare (on average at least CLAUSE_CHARS Chinese characters per piece); a line with a space every
# word or two is word-segmented text, whose spaces are simply removed.
_CLAUSE_GAP_RE = re.compile(rf" (?<=[{_CJK}”」』）》] )(?=[{_CJK}“「『（《])")  # space first: as above
CLAUSE_CHARS = 6

# --------------------------------------------------------------------------------------------- markup
# MediaWiki language conversion, innermost first: -{zh-cn:域;zh-tw:体}-, -{A|zh-hans:…;zh-hant:…}-,
# -{庄}-, -{}-. The simplified variant is kept (in this order of preference), else the first one.
_LANG_CONV_RE = re.compile(r"-\{([^{}]*)\}-")
_VARIANT_RE = re.compile(r"\s*(zh(?:-[A-Za-z]+)?)\s*:(.*)", re.S)
_FLAGS_RE = re.compile(r"[A-Za-z;\s\-]*")
VARIANT_PREFERENCE = ("zh-cn", "zh-hans", "zh-sg", "zh-my", "zh", "zh-hant", "zh-tw", "zh-hk", "zh-mo")
# Tags whose content is not running text (citations, formulas, scripts, comments): removed whole.
_DROPPED_ELEMENT_RE = re.compile(
    r"<!--.*?(?:-->|$)|<(ref|math|script|style|gallery|timeline|templatestyles|score|graph)\b[^<>]*?/>"
    r"|<(ref|math|script|style|gallery|timeline|templatestyles|score|graph)\b[^<>]*>.*?(?:</\2\s*>|$)",
    re.I | re.S,
)
# Tags that break a line (the text on either side is a separate paragraph) ...
_BLOCK_TAG_RE = re.compile(
    r"</?(?:br|p|div|poem|blockquote|li|ul|ol|dl|dd|dt|tr|td|th|table|tbody|thead|caption|h[1-6]|hr|"
    r"center|pre|section|references)\b[^<>]*>",
    re.I,
)
# ... and inline tags, removed with their content kept (<nowiki>-{x}-</nowiki> keeps -{x}-, etc.).
_INLINE_TAG_RE = re.compile(
    r"</?(?:a|b|i|u|s|em|strong|small|big|sup|sub|font|span|nowiki|code|tt|del|ins|strike|abbr|cite|q|"
    r"mark|wbr|img|ruby|rt|rp|var|kbd|samp|noinclude|includeonly|onlyinclude|syntaxhighlight|source|"
    r"chem|ce|hiero|indicator)\b[^<>]*>",
    re.I,
)
_ENTITY_RE = re.compile(r"&(?:#\d{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")
# Brackets the wiki extractor emptied (a removed date or name leaves "（）", "（，）", "「」"), and
# separators left at the inside edge of a bracket ("（Robin Söderling，）").
_EMPTY_BRACKETS_RE = re.compile(
    r"[（(][\s，,、；;：:]*[）)]|「\s*」|『\s*』|【\s*】|《\s*》|〈\s*〉|“\s*”|‘\s*’|\[\s*\]"
)
_SEPARATORS = r"\s，,、；;：:"
_BRACKET_EDGE_RE = re.compile(
    rf"(?<=[（(])[{_SEPARATORS}]+(?=[^{_SEPARATORS}）)])|(?<=[^{_SEPARATORS}（(])[{_SEPARATORS}]+(?=[）)])"
)
# --------------------------------------------------------------------------------------------- split
# A sentence ends with a run of terminators (。！？；… and their half-width forms, so "！？" and
# "……" stay one end); closing quotes and brackets that follow belong to the same sentence. It does
# not end there when what follows continues it: a comma, enumeration comma or colon ("“好！”，他说"),
# or after an ellipsis, a closing bracket or quote and more text ("（甲，乙……）里" is an enumeration).
# Separators and closing marks at the start of a paragraph are dropped (only there can a sentence
# start with one: after a terminator they either continue the sentence or belong to its end).
# Possessive quantifiers: nothing here ever needs to backtrack, and sre is faster told so.
_TERMINATORS = "。！？；!?;…"
_CLOSERS = "”’」』）)】》〕〗〉\"'"
_CONTINUATION = "，、,：:"
# what no sentence starts with: split_sentences (and the pairs stage's leads) strip it off a paragraph
LEADING = "，、,：:；;" + _CLOSERS.replace('"', "").replace("'", "")
_SENTENCE_RE = re.compile(
    rf"(?:[^{_TERMINATORS}]++|[{_TERMINATORS}]++[{_CLOSERS}]*+(?=[{_CONTINUATION}])"
    rf"|…++[{_CLOSERS}]++(?=[^{_TERMINATORS}]))*+(?:[{_TERMINATORS}]++[{_CLOSERS}]*+)?"
)
_ENDS_SENTENCE = tuple(_TERMINATORS + _CLOSERS)

# CJK ideographs: the unified block, extensions A-F and the compatibility ideographs.
_NON_CJK_RE = re.compile(r"[^\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef]+")


def normalise(text: str) -> str:
    """Full-width letters/digits/symbols -> half-width; control and invisible characters removed."""
    if CONTROL_RE.search(text) is not None:
        text = CONTROL_RE.sub("", text)
    # One str.replace per distinct full-width character: 2-4x faster than str.translate (a dict
    # lookup per character) or a regex callback per full-width run.
    for char in set(_FULL_WIDTH_RE.findall(text)):
        text = text.replace(char, _HALF_WIDTH[char])
    return text


def remove_whitespace(text: str) -> str:
    """Drop whitespace inside Chinese text; keep one space between two Latin words; a space between
    two Chinese clauses becomes "，" unless the line looks word-segmented (see ``CLAUSE_CHARS``)."""
    if WHITESPACE_RE.search(text) is None:
        return text
    text = WHITESPACE_RE.sub(" ", text).strip()
    gaps = len(_CLAUSE_GAP_RE.findall(text))
    if gaps and cjk_count(text) >= CLAUSE_CHARS * (gaps + 1):
        text = _CLAUSE_GAP_RE.sub("，", text)
    return _DROP_SPACE_RE.sub("", text)


def split_sentences(paragraph: str) -> list[str]:
    """Split one cleaned paragraph (no newlines) into sentences, terminators kept at the end."""
    return [s for s in _SENTENCE_RE.findall(paragraph.lstrip(LEADING)) if s]


def _conversion(match: re.Match) -> str:
    """One -{...}- block -> the text MediaWiki shows a reader of simplified Chinese."""
    body = match.group(1)
    flags, bar, rest = body.partition("|")
    if bar and _FLAGS_RE.fullmatch(flags):
        letters = set(flags.upper())
        if letters & {"H", "T", "-"}:  # a page-wide rule, a title rule or a rule removal: shows nothing
            return ""
        if "R" in letters:  # raw: shown as written
            return rest
        body = rest
    variants: dict[str, str] = {}
    for item in body.split(";"):
        found = _VARIANT_RE.match(item)
        if found:
            variants.setdefault(found.group(1).lower(), found.group(2).strip())
    if not variants:  # -{庄}-, -{FIFA}-: protected from conversion, shown as written
        return body
    for code in VARIANT_PREFERENCE:
        if code in variants:
            return variants[code]
    return next(iter(variants.values()))


def convert_language_markup(text: str) -> str:
    for _ in range(4):  # nested blocks, innermost first; real text nests at most twice
        converted = _LANG_CONV_RE.sub(_conversion, text)
        if converted == text:
            break
        text = converted
    return text.replace("-{", "").replace("}-", "")  # a block cut off by truncation


def strip_html(text: str) -> str:
    if "<" not in text:
        return text
    text = _DROPPED_ELEMENT_RE.sub("", text)
    text = _BLOCK_TAG_RE.sub("\n", text)
    return _INLINE_TAG_RE.sub("", text)


def remove_empty_brackets(text: str) -> str:
    text = _BRACKET_EDGE_RE.sub("", text)
    return _EMPTY_BRACKETS_RE.sub("", text)


def cjk_count(text: str) -> int:
    return len(_NON_CJK_RE.sub("", text))


# One class byte per code point below 0x30000 (higher ones are CJK extensions or nothing we count).
# Low 3 bits: the CJK-share unit a character is or starts; high bits: its role in an empty bracket.
_CJK_UNIT, _LATIN, _DIGIT, _OTHER_LETTER, _UNIT_BITS = 1, 2, 3, 4, 7
_OPEN, _CLOSE, _SEP, _PAREN_CLOSE = 8, 16, 32, 64


def _class_table() -> np.ndarray:
    table = np.zeros(0x30000, np.uint8)
    for lo, hi in ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2EBEF)):
        table[lo : hi + 1] = _CJK_UNIT
    table[ord("A") : ord("Z") + 1] = table[ord("a") : ord("z") + 1] = _LATIN
    table[0xC0:0x250] = _LATIN
    table[[0xD7, 0xF7]] = 0  # × ÷
    table[ord("0") : ord("9") + 1] = _DIGIT
    # letters of other scripts (Greek to Ethiopic, kana, hangul): each one is a unit
    for lo, hi in ((0x370, 0x1FFF), (0x3040, 0x30FF), (0x3130, 0x318F), (0xAC00, 0xD7AF)):
        table[lo : hi + 1] = _OTHER_LETTER
    table[[ord(c) for c in "（(「『【《〈“‘["]] |= _OPEN
    table[[ord(c) for c in "）)」』】》〉”’]"]] |= _CLOSE
    table[[ord(c) for c in "，,、；;：: "]] |= _SEP
    table[[ord(c) for c in "）)"]] |= _PAREN_CLOSE
    return table


_CLASS = _class_table()


def _classify(sentences: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lengths, start offsets and the class byte of every character of the batch (UTF-32, one
    code unit per character)."""
    lengths = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences))
    codes = np.frombuffer("".join(sentences).encode("utf-32-le", "surrogatepass"), dtype="<u4")
    classes = _CLASS[np.minimum(codes, len(_CLASS) - 1)]
    return lengths, np.cumsum(lengths) - lengths, classes


def _pairs(first: np.ndarray, second: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Positions i where ``first[i]`` and ``second[i + 1]`` hold inside one sentence."""
    pairs = first[:-1] & second[1:]
    pairs[starts[(starts > 0) & (starts < len(first))] - 1] = False
    return np.flatnonzero(pairs)


def _run_starts(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """True where a run of ``mask`` begins (a run never continues across a sentence boundary)."""
    begins = mask.copy()
    begins[1:] &= ~mask[:-1]
    begins[starts] = mask[starts]
    return begins


def _empty_brackets(classes: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sentences (indices) with an opener right before a closer or separator, or a separator right
    before a closing parenthesis: where ``remove_empty_brackets`` may have work."""
    found = np.concatenate(
        [
            _pairs((classes & _OPEN) > 0, (classes & (_CLOSE | _SEP)) > 0, starts),
            _pairs((classes & _SEP) > 0, (classes & _PAREN_CLOSE) > 0, starts),
        ]
    )
    return np.unique(np.searchsorted(starts, found, side="right") - 1)


def filter_sentences(
    sentences: list[str], min_chars: int, max_chars: int, min_cjk_ratio: float
) -> tuple[list[str], dict[str, int], dict[str, np.ndarray], list[tuple[str, str]]]:
    """Repair empty brackets, then keep sentences of min..max characters in which CJK ideographs
    make ``min_cjk_ratio`` of the units.

    Units are what a reader sees as words: each CJK ideograph, each run of Latin letters (a word:
    "Windows", "René"), each run of digits (a number), each letter of another script. Punctuation,
    symbols and spaces count for nothing, so "使用Windows 10系统" has 4 CJK of 6 units, while an
    English sentence or a row of numbers has (nearly) none. A sentence also needs ``MIN_CJK``
    ideographs at least ("7019元；" is a fragment, not a sentence).

    Returns the kept sentences (in order), the drop counts (too_short, too_long, low_cjk; each
    sentence counted once, under the first rule it fails), the drop masks and the repaired
    sentences (before, after). Vectorised: the batch is encoded once as UTF-32, one table lookup
    classifies every character, per-sentence sums are differences of cumulative sums; the bracket
    regular expressions run only on the few sentences the classes point to.
    """
    lengths, starts, classes = _classify(sentences)
    ends = starts + lengths
    nonempty = starts[lengths > 0]
    unit = classes & _UNIT_BITS
    cjk_mask = unit == _CJK_UNIT
    units_mask = (
        cjk_mask
        | (unit == _OTHER_LETTER)
        | _run_starts(unit == _LATIN, nonempty)
        | _run_starts(unit == _DIGIT, nonempty)
    )
    # one cumulative sum for both counts: CJK in the low 32 bits, units in the high ones
    packed = np.concatenate([[0], np.cumsum(cjk_mask | (units_mask.astype(np.int64) << 32))])
    both = packed[ends] - packed[starts]
    cjk, units = both & 0xFFFFFFFF, both >> 32
    repaired = []
    for i in _empty_brackets(classes, starts).tolist():
        after = remove_empty_brackets(sentences[i])
        if after != sentences[i]:
            # only brackets and separators go, which are no units: the counts above still hold
            repaired.append((sentences[i], after))
            sentences[i] = after
            lengths[i] = len(after)
    too_short = lengths < min_chars
    too_long = ~too_short & (lengths > max_chars)
    low_cjk = ~too_short & ~too_long & ((cjk < min_cjk_ratio * units) | (cjk < MIN_CJK))
    keep = ~(too_short | too_long | low_cjk)
    kept = list(itertools.compress(sentences, keep.tolist()))
    masks = {"too_short": too_short, "too_long": too_long, "low_cjk": low_cjk}
    counts = {reason: int(mask.sum()) for reason, mask in masks.items()}
    return kept, counts, masks, repaired


def has_control(text: str) -> bool:
    return CONTROL_RE.search(text) is not None


def _shorten(text: str, at: int = 0) -> str:
    """About SAMPLE_CHARS characters of ``text`` around position ``at``."""
    start = max(0, min(at - SAMPLE_CHARS // 4, len(text) - SAMPLE_CHARS))
    piece = text[start : start + SAMPLE_CHARS]
    return ("…" if start > 0 else "") + piece + ("…" if start + SAMPLE_CHARS < len(text) else "")


class Cleaner:
    """Cleans field values into sentences and keeps the audit of what each rule did.

    ``rules`` counts the field values each cleaning rule changed; ``samples`` holds the first
    ``SAMPLES_PER_RULE`` examples per rule (``{"before", "after"}``) and per sentence drop reason
    (the dropped sentence). ``to_simplified`` converts traditional to simplified Chinese (OpenCC
    ``t2s``), after the markup is gone and before splitting.
    """

    RULES = (
        "wiki_markup",
        "html_tags",
        "html_entities",
        "empty_brackets",
        "clause_spaces",
        "to_simplified",
    )

    def __init__(self, to_simplified: bool = False):
        self.rules: Counter = Counter()
        self.samples: dict[str, list[Any]] = {}
        self.converter = _simplified_converter() if to_simplified else None

    def _note(self, rule: str, before: str, after: str, at: int = 0) -> None:
        self.rules[rule] += 1
        examples = self.samples.setdefault(rule, [])
        if len(examples) < SAMPLES_PER_RULE:
            examples.append({"before": _shorten(before, at), "after": _shorten(after, at)})

    def note_drop(self, reason: str, sentence: str) -> None:
        examples = self.samples.setdefault(reason, [])
        if len(examples) < SAMPLES_PER_RULE:
            examples.append(_shorten(sentence))

    def wants(self, reason: str) -> bool:
        return len(self.samples.get(reason, ())) < SAMPLES_PER_RULE

    def clean_field(self, text: str) -> str:
        """Markup, normalisation and (optionally) script conversion of one field value."""
        if "-{" in text or "}-" in text or "<" in text or "&" in text:  # 4 substring searches: cheap
            text = self._markup(text)
        text = normalise(text)
        if self.converter is not None:
            converted = self.converter.convert(text)
            if converted != text:
                self._note("to_simplified", text, converted)
                text = converted
        return text

    def _markup(self, text: str) -> str:
        if "&" in text and _ENTITY_RE.search(text) is not None:
            after = html.unescape(text)
            if after != text:
                self._note("html_entities", text, after, text.find("&"))
                text = after
        if "-{" in text or "}-" in text:
            after = convert_language_markup(text)
            if after != text:
                self._note("wiki_markup", text, after, max(text.find("-{"), 0))
                text = after
        if "<" in text:
            after = strip_html(text)
            if after != text:
                self._note("html_tags", text, after, text.find("<"))
                text = after
        return text

    def note_repaired(self, repaired: list[tuple[str, str]]) -> None:
        for before, after in repaired:
            found = _EMPTY_BRACKETS_RE.search(before) or _BRACKET_EDGE_RE.search(before)
            self._note("empty_brackets", before, after, found.start() if found else 0)

    def paragraphs(self, text: str) -> list[str]:
        """One cleaned field value -> its paragraphs (lines), whitespace handled."""
        out = []
        for line in self.clean_field(text).splitlines():
            line = self.line_spaces(line)
            if line:
                out.append(line)
        return out

    def line_spaces(self, line: str) -> str:
        """``remove_whitespace`` on one line; spaces that became clause commas are counted."""
        if WHITESPACE_RE.search(line) is None:
            return line
        cleaned = remove_whitespace(line)
        if "，" in cleaned and cleaned.count("，") > line.count("，"):
            self._note("clause_spaces", line, cleaned)
        return cleaned

    def audit(self) -> dict[str, Any]:
        return {"rules": dict(sorted(self.rules.items())), "samples": dict(sorted(self.samples.items()))}


def merged_audit(units: list[dict[str, Any]], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A manifest's ``audit`` from the units' ``Cleaner.audit()`` and bad-record examples and the
    partitions' samples: per cleaning rule the fields it changed, and for every rule and drop reason
    the first few examples (units, then partitions, in order: the same for any worker count)."""
    rules: Counter = Counter({r: 0 for r in Cleaner.RULES})
    samples: dict[str, list[Any]] = {}

    def add(name: str, examples: list[Any]) -> None:
        have = samples.setdefault(name, [])
        have.extend(examples[: SAMPLES_PER_RULE - len(have)])

    for unit in units:
        audit = unit.get("audit", {})
        rules.update(audit.get("rules", {}))
        for name, examples in audit.get("samples", {}).items():
            add(name, examples)
        for example in unit.get("examples", []):  # bad records: "file:line: reason: detail"
            add(example.split(": ", 2)[1] if example.count(": ") >= 2 else "bad_record", [example])
    for part in parts:
        for name, examples in part.get("samples", {}).items():
            add(name, examples)
    return {"rules": dict(rules), "samples": dict(sorted(samples.items()))}


def _simplified_converter() -> Any:
    """OpenCC's traditional -> simplified converter (imported only when the option is on)."""
    import opencc

    return opencc.OpenCC("t2s")


def ends_sentence(sentence: str) -> bool:
    return sentence.endswith(_ENDS_SENTENCE)


def clean_paragraphs(texts: Iterable[str]) -> list[str]:
    """Raw field values -> cleaned paragraphs: one per input line, markup removed, no inner blanks."""
    cleaner = Cleaner()
    return [p for text in texts for p in cleaner.paragraphs(text)]
