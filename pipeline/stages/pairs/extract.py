"""What each record of the five collections gives as (anchor, positive) pairs, and the pair-level rules.

Per collection (fields as the corpora ship them; ``group`` = the record's id, ``batch key`` = the field
a source-homogeneous batcher may group by):

==================  ====================================================  ============  ============
collection          pairs (kind: anchor <-> positive)                      group         batch key
==================  ====================================================  ============  ============
webtext2019zh       question-answer: title (+ desc) <-> content            qid           topic
baike2018qa         question-answer: title <-> answer;                     qid           category
                    question-desc: title <-> desc
news2016zh          title-desc: title <-> desc;                            news_id       source
                    title-lead: title <-> lead sentences of content
wiki_zh             title-paragraph: title <-> first paragraph of text     id            (none)
translation2019zh   zh-en: chinese <-> english                             chinese text  (none)
plain (optional)    neighbour: a sentence <-> the next one in its line     the line      (none)
==================  ====================================================  ============  ============

Every field goes through preprocess's cleaning (``Cleaner``: markup, normalisation, whitespace) and
sentence splitting (``split_sentences``). A positive is cut to whole leading sentences within its
budget (``lead_chars`` for news leads and wiki paragraphs, ``max_positive_chars`` for answers and
descriptions): it never ends mid-sentence, and a first sentence longer than the budget makes the pair
``too_long``. webtext2019zh's ``content`` is cut at a fixed length in the corpus: its unterminated last
sentence is dropped, as preprocess does.

The "too easy" rule (:func:`too_easy`), on the ``normalize_text`` forms of the two sides: a pair is too
easy when the shorter side is a prefix of the longer one and at least ``easy_prefix_ratio`` of its
length (a news ``desc`` equal to or cut from its title), or when the character-3-gram Jaccard
similarity of the two sides is at least ``easy_jaccard`` (computed only when the shorter side is at
least ``easy_jaccard`` of the longer: a Jaccard can never exceed that ratio). A short title at the
start of a long body (wiki_zh's "经济学" <-> "经济学是一门…") is not too easy: it is how those records
are written. ``sibling_duplicate``: news2016zh's desc is usually the first sentences of its content,
cut at a fixed length; a title <-> desc pair whose desc (less its unterminated tail) is a prefix of
the record's lead, or too easy against it, is dropped: the title <-> lead pair says the same in whole
sentences.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.normalize import key_text, key_texts, mapped_keys
from pipeline.stages.preprocess.text import (
    CONTROL,
    FULL_TO_HALF,
    INVISIBLE,
    LEADING,
    WHITESPACE_RE,
    Cleaner,
    char_class,
    ends_sentence,
    remove_whitespace,
    split_sentences,
)

KINDS = (
    "question-answer",
    "question-desc",
    "title-desc",
    "title-lead",
    "title-paragraph",
    "zh-en",
    "neighbour",
)
GROUP_FIELD = {"webtext2019zh": "qid", "baike2018qa": "qid", "news2016zh": "news_id", "wiki_zh": "id"}
BATCH_KEY_FIELD = {"webtext2019zh": "topic", "baike2018qa": "category", "news2016zh": "source"}
RAW_SLACK = 3  # a field is cut to RAW_SLACK x its budget (+ 64) characters before cleaning: speed


@dataclass(frozen=True)
class PairRules:
    """The per-pair limits and rules (small and picklable: travels to the workers)."""

    min_anchor_chars: int = 2
    max_anchor_chars: int = 128
    min_positive_chars: int = 5
    max_positive_chars: int = 384
    lead_chars: int = 256
    min_cjk_ratio: float = 0.5
    easy_prefix_ratio: float = 0.5
    easy_jaccard: float = 0.6
    plain_neighbours: bool = False
    to_simplified: bool = False


@dataclass(slots=True)
class Candidate:
    """One extracted pair before the length, CJK, too-easy and dedup rules."""

    kind: str
    anchor: str
    positive: str
    group: int
    batch_key: str
    latin_positive: bool = False  # translation2019zh's English side: no CJK share asked of it
    sibling: Candidate | None = None  # news2016zh's title-desc: the record's title-lead pair
    positive_key: str | None = None  # key_text(positive) when ``sibling_duplicates`` computed it


# blake2b states after a fixed prefix: copying one and hashing the rest is the hash of the whole
# text, twice as fast as building a hasher per call (its keyword parameters are parsed each time).
_GROUP_PREFIX: dict[str, Any] = {}
_PAIR_HASHER = hashlib.blake2b(digest_size=8)


def group_id(source: str, record_id: str) -> int:
    """A stable 64-bit group id: blake2b of ``f"{source}\\x1f{record_id}"``."""
    prefix = _GROUP_PREFIX.get(source)
    if prefix is None:
        prefix = _GROUP_PREFIX[source] = hashlib.blake2b(f"{source}\x1f".encode(), digest_size=8)
    hasher = prefix.copy()
    hasher.update(record_id.encode())
    return int.from_bytes(hasher.digest(), "little")


def _digest(text: str) -> bytes:
    hasher = _PAIR_HASHER.copy()
    hasher.update(text.encode())
    return hasher.digest()


def pair_id(anchor_key: str, positive_key: str) -> int:
    """The pair's 64-bit id: blake2b of the two ``key_text`` forms (the exact-dedup key)."""
    return int.from_bytes(_digest(f"{anchor_key}\x1f{positive_key}"), "little")


def pair_ids(anchor_keys: list[str], positive_keys: list[str]) -> np.ndarray:
    """``[pair_id(a, p) for ...]`` as one uint64 array: the digests joined and read as little-endian
    integers at once (tests/test_pairs_fast.py checks)."""
    texts = [f"{a}\x1f{p}" for a, p in zip(anchor_keys, positive_keys, strict=True)]
    return np.frombuffer(b"".join(map(_digest, texts)), dtype="<u8").astype(np.uint64)


def _shingles(text: str, n: int = 3) -> set[str]:
    return {text[i : i + n] for i in range(max(1, len(text) - n + 1))}


def too_easy(a: str, b: str, prefix_ratio: float, jaccard: float) -> bool:
    """The "too easy" rule on two ``key_text`` forms (module docstring)."""
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    if not short:
        return True
    if long.startswith(short) and len(short) >= prefix_ratio * len(long):
        return True
    if len(short) < jaccard * len(long):
        return False
    sa, sb = _shingles(a), _shingles(b)
    return len(sa & sb) >= jaccard * len(sa | sb)


# --------------------------------------------------------------------------------------------- fields
_BREAKS = "\n\r\u2028\u2029"  # the line breaks of str.splitlines that cleaning leaves in place


def _cleaning_points() -> list[int]:
    """Every character some cleaning rule acts on: markup starts (``<``, ``&``, braces), control and
    invisible characters, full-width forms, whitespace other than ``_BREAKS`` (which holds the other
    line breaks of str.splitlines)."""
    spaces = [cp for cp in range(0x3001) if WHITESPACE_RE.fullmatch(chr(cp)) and chr(cp) not in _BREAKS]
    points = CONTROL + INVISIBLE + list(range(0xD800, 0xE000)) + list(FULL_TO_HALF) + spaces
    return points + [ord(c) for c in "<&{}"]


_CLEANING_POINTS = _cleaning_points()
NEEDS_CLEANING = re.compile(char_class(_CLEANING_POINTS))  # built at import: 3 ms
# the same or a line break: a value without one is a single clean line (one search tells)
_CLEANING_OR_BREAK = re.compile(char_class(_CLEANING_POINTS + [ord(c) for c in _BREAKS]))
# the same less the spaces (" ", and "\u3000" which cleaning makes one): a value whose only cleaning
# characters are those needs only ``Cleaner.line_spaces`` on each line (no markup, control,
# full-width or other whitespace character)
_SPACES = " \u3000"
_CLEANING_BUT_SPACES = re.compile(char_class(cp for cp in _CLEANING_POINTS if chr(cp) not in _SPACES))


def field_paragraphs(cleaner: Cleaner, value: str) -> list[str]:
    """``cleaner.paragraphs(value)``; a value no cleaning rule touches (one or two searches) is only
    cut into its non-empty lines, one whose only such characters are spaces gets only the whitespace
    rules: the same list (and audit) without the per-rule passes."""
    if cleaner.converter is None:
        found = _CLEANING_OR_BREAK.search(value)
        if found is None:
            return [value] if value else []
        dirt = NEEDS_CLEANING.search(value, found.start())
        if dirt is None:
            return [line for line in value.splitlines() if line]
        if _CLEANING_BUT_SPACES.search(value, dirt.start()) is None:
            lines = value.replace("\u3000", " ").splitlines()  # normalise's one change here
            return [line for line in map(cleaner.line_spaces, lines) if line]
    return cleaner.paragraphs(value)


def clean_text(cleaner: Cleaner, value: str) -> str:
    """One field value -> one cleaned line (paragraphs joined; whitespace rules of preprocess)."""
    paragraphs = field_paragraphs(cleaner, value)
    if len(paragraphs) <= 1:
        return paragraphs[0] if paragraphs else ""
    return remove_whitespace(" ".join(paragraphs))


def lead(
    cleaner: Cleaner, value: str, budget: int, first_paragraph: bool = False, cut_tail: bool = False
) -> tuple[str, bool]:
    """The whole leading sentences of a field within ``budget`` characters, and whether any was
    left out. A first sentence over the budget is returned whole (the length rule drops the pair).
    ``cut_tail``: the field was cut at a fixed length in the corpus, its unterminated last sentence
    goes."""
    limit = int(RAW_SLACK * budget) + 64
    raw_cut = len(value) > limit
    if raw_cut:
        value = value[:limit]
    paragraphs = field_paragraphs(cleaner, value)
    if first_paragraph:
        paragraphs = paragraphs[:1]
    cut = raw_cut or cut_tail  # then an unterminated last sentence (of more than one) goes
    # A paragraph's sentences join back into it less its leading separators (``split_sentences``
    # leaves no other character out): a paragraph that fits whole is taken whole, unsplit.
    stripped = [s for p in paragraphs if (s := p.lstrip(LEADING))]
    whole = "".join(stripped)
    if len(whole) <= budget:
        if not cut or not whole or ends_sentence(whole):
            return whole, raw_cut
        last = split_sentences(stripped[-1])  # cut by us (or by the corpus) mid-sentence: it goes,
        if len(stripped) > 1 or len(last) > 1:  # unless it is the only sentence
            return whole[: len(whole) - len(last[-1])], raw_cut
        return whole, raw_cut
    # Else paragraph by paragraph; the one the budget ends in is split into sentences.
    out: list[str] = []
    total = 0
    for number, paragraph in enumerate(stripped):
        if total + len(paragraph) <= budget:
            out.append(paragraph)
            total += len(paragraph)
            continue
        sentences = split_sentences(paragraph)
        for index, sentence in enumerate(sentences):
            if out and total + len(sentence) > budget:
                last = index == len(sentences) - 1 and number == len(stripped) - 1
                if last and cut and not ends_sentence(sentence):
                    return "".join(out), raw_cut  # the unterminated last sentence went first
                return "".join(out), True
            out.append(sentence)
            total += len(sentence)
    return "".join(out), raw_cut  # one sentence, longer than the budget


def _string(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    return value if isinstance(value, str) else ("" if value is None else str(value))


# --------------------------------------------------------------------------------------------- records
Extractor = Callable[[dict[str, Any], Cleaner, PairRules, Any], list[Candidate]]


def _webtext(obj: dict[str, Any], cleaner: Cleaner, rules: PairRules, note: Any) -> list[Candidate]:
    title = clean_text(cleaner, _string(obj, "title"))
    desc = clean_text(cleaner, _string(obj, "desc"))
    anchor = title
    if desc and key_text(desc) not in key_text(title):
        joined = remove_whitespace(f"{title} {desc}") if title else desc
        if len(joined) <= rules.max_anchor_chars:  # else the title alone: a long desc keeps the pair
            anchor = joined
    answer, _ = lead(cleaner, _string(obj, "content"), rules.max_positive_chars, cut_tail=True)
    group = group_id("webtext2019zh", _string(obj, "qid"))
    return [Candidate("question-answer", anchor, answer, group, _string(obj, "topic"))]


def _baike(obj: dict[str, Any], cleaner: Cleaner, rules: PairRules, note: Any) -> list[Candidate]:
    title = clean_text(cleaner, _string(obj, "title"))
    group, key = group_id("baike2018qa", _string(obj, "qid")), _string(obj, "category")
    answer, _ = lead(cleaner, _string(obj, "answer"), rules.max_positive_chars)
    out = [Candidate("question-answer", title, answer, group, key)]
    if _string(obj, "desc").strip():
        desc, _ = lead(cleaner, _string(obj, "desc"), rules.max_positive_chars)
        out.append(Candidate("question-desc", title, desc, group, key))
    return out


def _news(obj: dict[str, Any], cleaner: Cleaner, rules: PairRules, note: Any) -> list[Candidate]:
    title = clean_text(cleaner, _string(obj, "title"))
    group, key = group_id("news2016zh", _string(obj, "news_id")), _string(obj, "source")
    body, _ = lead(cleaner, _string(obj, "content"), rules.lead_chars)
    title_lead = Candidate("title-lead", title, body, group, key)
    if _string(obj, "desc").strip():
        # desc is cut at a fixed length in the corpus: its unterminated tail goes, as content's would
        desc, _ = lead(cleaner, _string(obj, "desc"), rules.max_positive_chars, cut_tail=True)
        # ``sibling_duplicates`` decides it, for a batch of records at once
        return [Candidate("title-desc", title, desc, group, key, sibling=title_lead), title_lead]
    return [title_lead]


def sibling_duplicates(candidates: list[Candidate], rules: PairRules) -> list[bool]:
    """For each candidate with a ``sibling`` (news2016zh's title-desc): whether its desc is a prefix
    of the record's lead or too easy against it (module docstring); False for the others. Both
    sides' keys stay on the candidates (``positive_key``) for the pair rules, but for a dropped desc:
    one that is a prefix of its lead as written, when the lead's key is its characters mapped one by
    one (``mapped_keys``), needs no key of its own: its key is a prefix of the lead's."""
    pending = [c for c in candidates if c.sibling is not None]
    if not pending:
        return [False] * len(candidates)
    leads: list[Candidate] = [c.sibling for c in pending]  # type: ignore[misc]
    lead_keys, by_map = mapped_keys([s.positive for s in leads])
    for s, b in zip(leads, lead_keys, strict=True):
        s.positive_key = b
    dropped = [
        m and bool(s.positive) and s.positive.startswith(c.positive)
        for c, s, m in zip(pending, leads, by_map, strict=True)
    ]
    rest = [n for n, d in enumerate(dropped) if not d]
    for n, d in zip(rest, key_texts([pending[n].positive for n in rest]), strict=True):
        pending[n].positive_key, b = d, lead_keys[n]
        easy = b.startswith(d) or too_easy(d, b, rules.easy_prefix_ratio, rules.easy_jaccard)
        dropped[n] = bool(leads[n].positive) and easy
    verdicts = iter(dropped)
    return [next(verdicts) if c.sibling is not None else False for c in candidates]


def _wiki(obj: dict[str, Any], cleaner: Cleaner, rules: PairRules, note: Any) -> list[Candidate]:
    title = _string(obj, "title")
    text = _string(obj, "text")
    if title.strip() and text.startswith(title) and text[len(title) : len(title) + 1] in ("\n", ""):
        text = text[len(title) :]  # the article's title line (preprocess's ``title``)
    paragraph, _ = lead(cleaner, text, rules.lead_chars, first_paragraph=True)
    anchor = clean_text(cleaner, title)
    return [Candidate("title-paragraph", anchor, paragraph, group_id("wiki_zh", _string(obj, "id")), "")]


def _translation(obj: dict[str, Any], cleaner: Cleaner, rules: PairRules, note: Any) -> list[Candidate]:
    chinese = clean_text(cleaner, _string(obj, "chinese"))
    english = clean_text(cleaner, _string(obj, "english"))
    return [Candidate("zh-en", chinese, english, group_id("translation2019zh", chinese), "", True)]


EXTRACTORS: dict[str, Extractor] = {
    "webtext2019zh": _webtext,
    "baike2018qa": _baike,
    "news2016zh": _news,
    "wiki_zh": _wiki,
    "translation2019zh": _translation,
}
# the fields a record must have (as strings or numbers) to give any pair
REQUIRED = {
    "webtext2019zh": ("title", "content"),
    "baike2018qa": ("title", "answer"),
    "news2016zh": ("title",),
    "wiki_zh": ("title", "text"),
    "translation2019zh": ("chinese", "english"),
}


def plain_pairs(line: str, cleaner: Cleaner, rules: PairRules) -> list[Candidate]:
    """Neighbouring sentences of one plain-text line (one paragraph or document)."""
    sentences = [s for p in field_paragraphs(cleaner, line) for s in split_sentences(p)]
    group = group_id("plain", line)
    return [Candidate("neighbour", a, b, group, "") for a, b in zip(sentences, sentences[1:], strict=False)]
