"""Collators: rows of the shards (or of a pairs file) -> the tensors of one batch.

Every collator runs in the loader workers, so it holds only picklable state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.losses.mlm import MASK_PROB, batch_generator, mask_tokens


class MLMCollator:
    """Wraps a view collator: adds ``mlm_input_ids`` / ``mlm_labels`` (B, L), view 0 masked
    (:func:`pipeline.losses.mlm.mask_tokens`, seeded by :func:`pipeline.losses.mlm.batch_generator`).

    Runs in the loader workers (picklable: only ints and the wrapped collator). View 0 is the first B
    rows of the view-major batch, the original sentences.
    """

    def __init__(
        self,
        collate: Callable[[dict[str, list[Any]]], dict[str, Any]],
        tokenizer: Any,
        seed: int,
        mask_prob: float = MASK_PROB,
    ):
        self.collate, self.seed, self.mask_prob = collate, seed, mask_prob
        self.columns = getattr(collate, "columns", None)
        self.special_ids = sorted({int(i) for i in tokenizer.all_special_ids})
        self.mask_id = int(tokenizer.mask_token_id)
        self.vocab_size = len(tokenizer)

    def __call__(self, rows: dict[str, list[Any]]) -> dict[str, Any]:
        out = self.collate(rows)
        b = len(rows["id"])
        generator = batch_generator(self.seed, np.asarray(rows["id"], dtype=np.uint64).tolist())
        out["mlm_input_ids"], out["mlm_labels"] = mask_tokens(
            out["input_ids"][:b],
            out["attention_mask"][:b],
            self.special_ids,
            self.mask_id,
            self.vocab_size,
            generator,
            self.mask_prob,
        )
        return out
