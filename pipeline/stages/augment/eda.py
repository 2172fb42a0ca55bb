"""Easy Data Augmentation (Wei & Zou 2019, "EDA: Easy Data Augmentation Techniques for Boosting
Performance on Text Classification Tasks") over jieba words.

The four operations, each on a list of words with ``n = max(1, int(alpha * number_of_words))``:

- ``sr`` synonym replacement: ``n`` distinct non-stopwords that have synonyms are replaced by one of
  their synonyms;
- ``ri`` random insertion: ``n`` times, a synonym of a random non-stopword of the sentence is
  inserted at a random position;
- ``rs`` random swap: ``n`` times, two words swap places;
- ``rd`` random deletion: each word is deleted with probability ``alpha``; at least one word is
  deleted and at least one is kept.

"Words" are jieba tokens with a letter, digit or CJK character; punctuation and spaces keep their
places under swap and deletion (moving a full stop into the middle of a sentence teaches nothing).
Chinese is written without spaces, so a variant is its words joined with ``""``.

Everything random comes from one ``random.Random`` seeded from ``(seed, sentence id)``, so a
sentence's variants do not depend on which process, shard or order it was augmented in.
"""

from __future__ import annotations

import hashlib
import random
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.stages.augment.synonyms import SynonymSource

OPS = ("sr", "ri", "rs", "rd")
Words = list[str]

# A token is a word if it has a letter, digit or CJK character (``\w`` minus ``_``).
_WORD = re.compile(r"[^\W_]")


def is_word(token: str) -> bool:
    return _WORD.search(token) is not None


def sentence_rng(seed: int, sentence_id: int) -> random.Random:
    """The generator for one sentence: a pure function of (seed, id), independent of worker layout."""
    digest = hashlib.blake2b(struct.pack("<qQ", seed, sentence_id), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def num_changes(alpha: float, num_words: int) -> int:
    return max(1, int(alpha * num_words))


# Token kinds: punctuation/space, a word, a word that synonym replacement and insertion may use.
NOT_WORD, WORD, REPLACEABLE = 0, 1, 2


def token_kind(token: str, synonyms: SynonymSource, stopwords: frozenset[str]) -> int:
    if not is_word(token):
        return NOT_WORD
    return REPLACEABLE if token not in stopwords and token in synonyms else WORD


class Sentence:
    """A segmented sentence: its words and the positions each operation may touch (computed once)."""

    __slots__ = ("words", "word_pos", "syn_pos")

    def __init__(
        self,
        words: Words,
        synonyms: SynonymSource,
        stopwords: frozenset[str],
        kinds: Sequence[int] | None = None,
    ) -> None:
        if kinds is None:
            kinds = [token_kind(w, synonyms, stopwords) for w in words]
        self.words = words
        self.word_pos = [i for i, k in enumerate(kinds) if k]
        self.syn_pos = [i for i, k in enumerate(kinds) if k == REPLACEABLE]


# --------------------------------------------------------------------------------------------- ops
# Each returns a new word list, or None when the operation does not apply to this sentence.
def synonym_replacement(s: Sentence, alpha: float, rng: random.Random, synonyms: SynonymSource):
    if not s.syn_pos:
        return None
    k = min(num_changes(alpha, len(s.word_pos)), len(s.syn_pos))
    out = s.words.copy()
    for i in rng.sample(s.syn_pos, k):
        out[i] = rng.choice(synonyms.get(s.words[i]))
    return out


def random_insertion(s: Sentence, alpha: float, rng: random.Random, synonyms: SynonymSource):
    if not s.syn_pos:
        return None
    out = s.words.copy()
    for _ in range(num_changes(alpha, len(s.word_pos))):
        source_word = s.words[rng.choice(s.syn_pos)]
        out.insert(rng.randint(0, len(out)), rng.choice(synonyms.get(source_word)))
    return out


def random_swap(s: Sentence, alpha: float, rng: random.Random, synonyms: SynonymSource):
    if len(s.word_pos) < 2:
        return None
    out = s.words.copy()
    for _ in range(num_changes(alpha, len(s.word_pos))):
        a, b = rng.sample(s.word_pos, 2)
        out[a], out[b] = out[b], out[a]
    return out


def random_deletion(s: Sentence, alpha: float, rng: random.Random, synonyms: SynonymSource):
    if len(s.word_pos) < 2:
        return None
    deleted = {i for i in s.word_pos if rng.random() < alpha}
    if not deleted:
        deleted = {rng.choice(s.word_pos)}
    elif len(deleted) == len(s.word_pos):
        deleted.discard(rng.choice(s.word_pos))
    return [w for i, w in enumerate(s.words) if i not in deleted]


OP_FUNCS: dict[str, Callable] = {
    "sr": synonym_replacement,
    "ri": random_insertion,
    "rs": random_swap,
    "rd": random_deletion,
}


def parse_op(spec: str) -> tuple[str, ...]:
    """``"sr+rd"`` -> ``("sr", "rd")``; raises ValueError naming an unknown operation."""
    parts = tuple(p.strip() for p in spec.split("+"))
    for part in parts:
        if part not in OP_FUNCS:
            raise ValueError(f"unknown EDA operation {part!r} in {spec!r}; use {', '.join(OPS)}")
    return parts


# --------------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class EdaParams:
    num_variants: int = 4
    alpha: dict[str, float] | None = None  # op -> alpha; None: 0.1 each (EDA's default)
    ops: tuple[str, ...] = OPS  # op specs, each an op or a "+"-joined sequence such as "sr+rd"
    weights: tuple[float, ...] | None = None  # for mix="sample"; None: equal
    mix: str = "cycle"  # "cycle": variant i uses the i-th applicable spec; "sample": weighted draw
    max_attempts: int = 10  # candidates tried per variant before giving up on it
    min_words: int = 2  # sentences with fewer words get no variants
    seed: int = 0


class Augmenter:
    """Builds the variants of one sentence from one segmentation (jieba runs once per sentence)."""

    def __init__(
        self,
        params: EdaParams,
        synonyms: SynonymSource,
        stopwords: frozenset[str],
        segment: Callable[[str], Words],
    ) -> None:
        self.params = params
        self.synonyms = synonyms
        self.stopwords = stopwords
        self.segment = segment
        self.alpha = {op: 0.1 for op in OPS} | (params.alpha or {})
        self.specs = [parse_op(spec) for spec in params.ops]
        self.spec_names = ["+".join(spec) for spec in self.specs]
        self.weights = list(params.weights) if params.weights else [1.0] * len(self.specs)
        # What each spec needs to apply: a replaceable word (sr, ri) and/or two words (rs, rd).
        self.needs = [
            (any(op in ("sr", "ri") for op in spec), any(op in ("rs", "rd") for op in spec))
            for spec in self.specs
        ]
        self._kinds: dict[str, int] = {}  # token -> kind; a few dict hits replace regex and set lookups

    def _kind(self, token: str) -> int:
        kind = self._kinds.get(token)
        if kind is None:
            kind = token_kind(token, self.synonyms, self.stopwords)
            if len(self._kinds) < 2_000_000:  # bounded: a web corpus has an endless tail of tokens
                self._kinds[token] = kind
        return kind

    def sentence(self, text: str) -> Sentence:
        words = self.segment(text)
        get = self._kinds.get
        kinds = [k if (k := get(w)) is not None else self._kind(w) for w in words]
        return Sentence(words, self.synonyms, self.stopwords, kinds)

    def _apply(self, s: Sentence, spec: Sequence[str], rng: random.Random) -> Words | None:
        words: Words | None = None
        for step, op in enumerate(spec):
            if step > 0:  # a later op of a sequence sees the words the earlier one produced
                s = Sentence(words, self.synonyms, self.stopwords)
            words = OP_FUNCS[op](s, self.alpha[op], rng, self.synonyms)
            if words is None:
                return None
        return words

    def augment(self, sentence_id: int, text: str, counts: dict[str, int] | None = None):
        """Return ``(variants, ops)`` for one sentence; add ``rejected``/``duplicates`` to ``counts``."""
        p = self.params
        s = self.sentence(text)
        variants: list[str] = []
        ops: list[str] = []
        if len(s.word_pos) < p.min_words:
            return variants, ops
        has_synonym, has_two = bool(s.syn_pos), len(s.word_pos) >= 2
        usable = [
            i for i, (syn, two) in enumerate(self.needs) if (has_synonym or not syn) and (has_two or not two)
        ]
        if not usable:
            return variants, ops
        weights = [self.weights[i] for i in usable]
        rng = sentence_rng(p.seed, sentence_id)
        seen = {text}
        rejected = duplicates = 0
        for slot in range(p.num_variants):
            for attempt in range(p.max_attempts):
                if p.mix == "cycle":
                    spec_index = usable[(slot + attempt) % len(usable)]
                else:
                    spec_index = rng.choices(usable, weights)[0]
                words = self._apply(s, self.specs[spec_index], rng)
                if words is None:
                    continue
                candidate = "".join(words)
                if candidate == text or not candidate.strip():
                    rejected += 1
                    continue
                if candidate in seen:
                    duplicates += 1
                    continue
                seen.add(candidate)
                variants.append(candidate)
                ops.append(self.spec_names[spec_index])
                break
        if counts is not None:
            counts["rejected"] = counts.get("rejected", 0) + rejected
            counts["duplicates"] = counts.get("duplicates", 0) + duplicates
        return variants, ops
