"""The EDA operations, the Cilin loader and variant generation on small Chinese sentences."""

import logging
import random
from collections import Counter

import jieba
import pytest

from pipeline.errors import InputError
from pipeline.resources import CILIN
from pipeline.stages.augment.eda import (
    Augmenter,
    EdaParams,
    Sentence,
    random_deletion,
    random_insertion,
    random_swap,
    synonym_replacement,
)
from pipeline.stages.augment.run import STOPWORDS
from pipeline.stages.augment.synonyms import SynonymSource, load_cilin, load_stopwords

SENTENCE = "我们今天去公园散步，天气非常好。"


@pytest.fixture(scope="module")
def cilin():
    return load_cilin(CILIN)


@pytest.fixture(scope="module")
def stopwords():
    return load_stopwords(STOPWORDS)


def segment(text):
    jieba.setLogLevel(logging.WARNING)
    return jieba.lcut(text, HMM=False)


def words_only(tokens):
    return [t for t in tokens if t not in "，。"]


def test_cilin_keeps_only_equal_groups(cilin):
    # Aa01B03# 良民 顺民 is a related-words group: 顺民 has no synonyms, and 良民 only those of its `=` group.
    assert cilin.get("顺民") == ()
    assert "顺民" not in cilin.get("良民")
    assert "好人" in cilin.get("良民")
    assert "角色" not in cilin  # an @ line: a word with no synonym
    assert "园林" in cilin.get("公园") and "公园" not in cilin.get("公园")


def test_cilin_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "cilin.txt"
    path.write_text("Aa01A01= 人 士\nthis is not cilin\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"cilin.txt:2: not a Cilin line"):
        load_cilin(path)


def test_synonym_replacement_uses_listed_synonyms(cilin, stopwords):
    s = Sentence(segment(SENTENCE), cilin, stopwords)
    for seed in range(20):
        out = synonym_replacement(s, 0.3, random.Random(seed), cilin)
        assert len(out) == len(s.words)
        changed = [(a, b) for a, b in zip(s.words, out) if a != b]
        assert 1 <= len(changed) <= 3  # n = int(0.3 * 8) = 2 positions, a synonym may equal nothing else
        for original, new in changed:
            assert new in cilin.get(original)
            assert original not in stopwords


def test_stopwords_are_never_replaced(stopwords):
    synonyms = SynonymSource({"的": ("之",), "书": ("书本",)}, "test")
    s = Sentence(["我", "的", "书"], synonyms, stopwords)
    for seed in range(20):
        out = synonym_replacement(s, 1.0, random.Random(seed), synonyms)
        assert out == ["我", "的", "书本"]


def test_random_insertion_adds_a_synonym_of_a_word(cilin, stopwords):
    s = Sentence(segment(SENTENCE), cilin, stopwords)
    for seed in range(20):
        out = random_insertion(s, 0.1, random.Random(seed), cilin)
        added = Counter(out) - Counter(s.words)
        assert sum(added.values()) == 1 and len(out) == len(s.words) + 1
        (inserted,) = added
        assert any(inserted in cilin.get(w) for w in s.words if w not in stopwords)


def test_random_swap_keeps_the_multiset_of_words(cilin, stopwords):
    s = Sentence(segment(SENTENCE), cilin, stopwords)
    orders = set()
    for seed in range(20):
        out = random_swap(s, 0.2, random.Random(seed), cilin)
        assert Counter(out) == Counter(s.words)
        assert [i for i, w in enumerate(out) if w in "，。"] == [
            i for i, w in enumerate(s.words) if w in "，。"
        ]
        orders.add(tuple(out))
    assert len(orders) > 5


def test_random_deletion_removes_words(cilin, stopwords):
    s = Sentence(segment(SENTENCE), cilin, stopwords)
    for seed in range(20):
        out = random_deletion(s, 0.3, random.Random(seed), cilin)
        assert 1 <= len(words_only(out)) < len(words_only(s.words))
        assert not Counter(out) - Counter(s.words)  # only removals
        assert "，" in out and "。" in out  # punctuation stays


def test_ops_that_cannot_apply_return_none(cilin, stopwords):
    s = Sentence(["顺民"], cilin, stopwords)
    for op in (synonym_replacement, random_insertion, random_swap, random_deletion):
        assert op(s, 0.5, random.Random(0), cilin) is None


def test_variants_are_deterministic_distinct_and_never_the_original(cilin, stopwords):
    aug = Augmenter(EdaParams(seed=3), cilin, stopwords, segment)
    variants, ops = aug.augment(42, SENTENCE)
    assert ops == ["sr", "ri", "rs", "rd"]  # the default cycle: one variant per op
    assert len(set(variants)) == 4 and SENTENCE not in variants and all(variants)
    assert aug.augment(42, SENTENCE) == (variants, ops)
    assert aug.augment(43, SENTENCE) != (variants, ops)  # a different id is a different stream
    assert Augmenter(EdaParams(seed=4), cilin, stopwords, segment).augment(42, SENTENCE)[0] != variants


def test_short_sentences_get_fewer_variants_and_count_rejections(stopwords):
    synonyms = SynonymSource({"好": ("佳",)}, "test")
    aug = Augmenter(EdaParams(num_variants=8), synonyms, stopwords, segment)
    counts = {}
    # Two words, one with a single synonym: only 7 distinct variants exist, so fewer than 8 are stored.
    variants, ops = aug.augment(1, "天气好", counts)
    assert 4 <= len(variants) < 8 and len(set(variants)) == len(variants) and "天气好" not in variants
    assert counts["duplicates"] > 0
    # One word: below min_words, no variants at all.
    assert aug.augment(2, "好", counts) == ([], [])
    # Swapping two equal words gives the original back: rejected, never stored.
    aug = Augmenter(EdaParams(num_variants=2, ops=("rs", "rd")), synonyms, stopwords, lambda t: ["书", "书"])
    counts = {}
    assert aug.augment(3, "书书", counts) == (["书"], ["rd"])
    assert counts["rejected"] > 0


def test_sampled_mix_follows_weights(cilin, stopwords):
    params = EdaParams(ops=("sr", "rd", "sr+rs"), weights=(0.0, 1.0, 1.0), mix="sample")
    aug = Augmenter(params, cilin, stopwords, segment)
    seen = Counter()
    for i in range(30):
        seen.update(aug.augment(i, SENTENCE)[1])
    assert set(seen) == {"rd", "sr+rs"}
