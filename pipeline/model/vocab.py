"""A character-level Chinese vocabulary and a small BERT built from scratch (no download needed).

The vocabulary is counted from training text only (the corpus shards), never from the evaluation
sets. ASCII letters and digits also get ``##x`` continuation pieces so that any Latin word or number
splits into known pieces instead of becoming [UNK].
"""

from __future__ import annotations

import json
import string
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.resources import EVAL_DIR

# The package's own from-scratch BERT (model.scratch_config left empty): 4 layers, hidden 128.
SCRATCH_SMALL = Path(__file__).resolve().parent / "scratch_small.json"

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_ASCII = string.ascii_lowercase + string.digits


def build_char_vocab(texts: Iterable[str], min_count: int = 2, max_size: int = 8000) -> list[str]:
    """Special tokens, ASCII pieces, then the most frequent characters (ties broken by code point)."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(text.lower())
    vocab = list(SPECIAL_TOKENS)
    vocab += list(_ASCII) + [f"##{c}" for c in _ASCII]
    seen = set(vocab)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    for char, count in ranked:
        if len(vocab) >= max_size or count < min_count:
            break
        if char in seen or char.isspace():
            continue
        vocab.append(char)
        seen.add(char)
    return vocab


def write_vocab(vocab: list[str], path: str | Path) -> None:
    Path(path).write_text("\n".join(vocab) + "\n", encoding="utf-8")


def make_tokenizer(vocab_path: str | Path) -> Any:
    """A fast BERT tokenizer over ``vocab_path``.

    transformers 5.x ignores ``vocab_file=`` here (a 5-token vocabulary, everything [UNK]), so the
    path goes in as ``vocab=``.
    """
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizerFast(vocab=str(vocab_path), do_lower_case=True, tokenize_chinese_chars=True)
    if tokenizer.vocab_size < len(SPECIAL_TOKENS) + 1:
        raise RuntimeError(f"tokenizer built from {vocab_path} has only {tokenizer.vocab_size} tokens")
    return tokenizer


def build_scratch_backbone(model_config: dict[str, Any], vocab_size: int, seed: int) -> Any:
    """A randomly initialised BERT (no pooler) from a dict of ``BertConfig`` fields."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(**{**model_config, "vocab_size": vocab_size})
    torch.manual_seed(seed)
    return BertModel(config, add_pooling_layer=False)


def read_model_config(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def unk_rate(tokenizer: Any, texts: Iterable[str]) -> float:
    """Share of produced tokens (special tokens excluded) that are [UNK]; one batch call."""
    texts = list(texts)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    total = sum(len(x) for x in ids)
    return sum(x.count(tokenizer.unk_token_id) for x in ids) / max(total, 1)


def eval_unk_rates(tokenizer: Any, lines: int = 500) -> dict[str, float]:
    """[UNK] share of tokens (:func:`unk_rate`) on each bundled evaluation set, over its first ``lines``
    pairs' texts (scores are left out), by set name: the evaluation sets' text is never in the vocabulary."""
    rates = {}
    for path in sorted(EVAL_DIR.glob("*.tsv")):
        texts = []
        for line in path.read_text(encoding="utf-8").splitlines()[:lines]:
            texts.extend(f for f in line.split("\t") if f and not f.lstrip("-").isdigit())
        rates[path.stem] = round(unk_rate(tokenizer, texts), 5)
    return rates
