"""Tiny random char-vocabulary sentence encoders saved as model folders (built, never downloaded)."""

from __future__ import annotations

from pathlib import Path


def build_char_encoder(
    directory: Path,
    texts: list[str],
    hidden_size: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int = 0,
    max_length: int = 48,
    prefix: str = "",
) -> Path:
    """A 2-layer BERT with a character vocabulary of ``texts`` and mean pooling, saved in ``directory``."""
    from pipeline.model import (
        SentenceEncoder,
        build_char_vocab,
        build_scratch_backbone,
        make_tokenizer,
        write_vocab,
    )

    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_char_vocab(texts)
    write_vocab(vocab, directory / "vocab.txt")
    config = dict(
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    backbone = build_scratch_backbone(config, len(vocab), seed)
    tokenizer = make_tokenizer(directory / "vocab.txt")
    SentenceEncoder(backbone, tokenizer, "mean", max_length, prefix).save_pretrained(directory)
    return directory


def xlmr_fast_tokenizer(backend, model_input_names: list[str] | None = None):
    """Wrap a ``tokenizers`` backend whose first ids are <s> <pad> </s> <unk> as an XLM-R-style fast
    tokenizer: ``<s> A </s>`` (pairs ``<s> A </s> </s> B </s>``), <s> as CLS, </s> as SEP."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    extra = {"model_input_names": model_input_names} if model_input_names is not None else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        **extra,
    )
