from pipeline.model.encoder import POOLINGS, SentenceEncoder, pool
from pipeline.model.vocab import (
    build_char_vocab,
    build_scratch_backbone,
    make_tokenizer,
    unk_rate,
    write_vocab,
)

__all__ = [
    "POOLINGS",
    "SentenceEncoder",
    "pool",
    "build_char_vocab",
    "build_scratch_backbone",
    "make_tokenizer",
    "unk_rate",
    "write_vocab",
]
