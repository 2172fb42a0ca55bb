"""BERT masking of token ids (Devlin et al. 2019, "BERT", section 3.1), drawn in the data-loader workers
(:class:`pipeline.data.collate.MLMCollator`) for the mlm loss term (pipeline/losses/mlm.py).

Each non-special, non-padding token is selected with probability ``mask_prob`` (0.15); of the selected,
80% become ``[MASK]``, 10% a random ordinary token, 10% stay unchanged. Labels are the original ids at
selected positions and -100 elsewhere. The generator of a batch is seeded by the run seed and the ids of
its sentences (:func:`batch_generator`), so masks are a pure function of the data position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100  # label of unselected positions (cross_entropy's default ignore_index)
MASK_PROB = 0.15  # BERT's selection rate; the mlm term's probability overrides it
# BERT's split of the selected tokens; fixed constants, as in BERT/RoBERTa (no run has tuned them)
MASK_TOKEN_SHARE = 0.8  # -> [MASK]
RANDOM_TOKEN_SHARE = 0.1  # -> a random ordinary token; the remaining 10% keep their token


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    special_ids: Sequence[int],
    mask_id: int,
    vocab_size: int,
    generator: torch.Generator,
    mask_prob: float = MASK_PROB,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of (B, L) ids; returns (masked ids (B, L), labels (B, L) with -100 where unselected).

    Special tokens ([CLS], [SEP], [PAD], ...) and padding (attention_mask 0) are never selected. Random
    replacements are drawn from the non-special ids only, so no [CLS]/[SEP] appears mid-sentence.
    Pure: the inputs are not modified and the result depends only on the arguments and the generator.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask differ in shape")
    special = torch.tensor(sorted(set(special_ids)), dtype=input_ids.dtype)
    candidate = attention_mask.bool() & ~torch.isin(input_ids, special)  # (B, L)
    draw = torch.rand(input_ids.shape, generator=generator)  # (B, L): selection
    split = torch.rand(input_ids.shape, generator=generator)  # (B, L): which of the 80/10/10
    selected = candidate & (draw < mask_prob)
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    to_mask = selected & (split < MASK_TOKEN_SHARE)
    to_random = selected & (split >= MASK_TOKEN_SHARE) & (split < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE)
    every_id = torch.arange(vocab_size, dtype=input_ids.dtype)  # (V,)
    ordinary = every_id[~torch.isin(every_id, special)]  # (V - specials,)
    random_ids = ordinary[torch.randint(len(ordinary), input_ids.shape, generator=generator)]  # (B, L)
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(to_random, random_ids, masked)
    return masked, labels


def batch_generator(seed: int, sentence_ids: Sequence[int]) -> torch.Generator:
    """A generator seeded by the run seed and a batch's sentence ids (uint64 values as Python ints).

    The masks of a batch then depend only on which sentences it holds, so resuming at the same data
    position (and world size) redraws them exactly; a sentence seen in another epoch sits in another
    batch and gets a fresh mask (dynamic masking, as in RoBERTa).
    """
    entropy = [int(seed) & 0xFFFFFFFFFFFFFFFF, *(int(i) & 0xFFFFFFFFFFFFFFFF for i in sentence_ids)]
    state = np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))
