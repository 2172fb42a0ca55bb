"""The typed batch (pipeline/data/collate.py ``Batch``): its split into micro-batches keeps every field,
and it crosses the DataLoader (worker pickling, the pin-memory thread) as a Batch."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from pipeline.data.collate import LAYOUT, ROWS, SCALAR, SENTENCES, Batch, unpad

# set only in the unpadded layout (tests/test_unpadded.py); a padded batch holds None there
FLAT_ONLY = {"position_ids", "cu_seqlens", "max_seqlen"}


def full_batch(n: int = 2, m: int = 1, b: int = 4) -> Batch:
    """Every field set; row r of input_ids holds r, sentence i's per-sentence values hold i."""
    rows = torch.arange((n + m) * b)[:, None].repeat(1, 3)
    per_sentence = {
        f.name: torch.arange(b) * 10 + k
        for k, f in enumerate(dataclasses.fields(Batch))
        if f.metadata["split"] == SENTENCES
    }
    return Batch(
        input_ids=rows, attention_mask=torch.ones_like(rows), num_views=n, num_hard_negatives=m,
        epoch=3, batch=7, **per_sentence,
    )  # fmt: skip


def test_every_field_declares_how_it_splits():
    kinds = (ROWS, SENTENCES, SCALAR, LAYOUT)
    assert all(f.metadata.get("split") in kinds for f in dataclasses.fields(Batch))


def test_split_cuts_rows_view_major_and_keeps_every_field():
    batch = full_batch(n=2, m=1, b=4)
    first, second = batch.split(2)
    # micro-batch 2 holds sentences 2, 3: their view 0, view 1 and hard-negative rows, in block order
    assert second.input_ids[:, 0].tolist() == [2, 3, 6, 7, 10, 11]
    assert first.input_ids[:, 0].tolist() == [0, 1, 4, 5, 8, 9]
    for f in dataclasses.fields(Batch):
        whole, a, b = (getattr(x, f.name) for x in (batch, first, second))
        if f.name in FLAT_ONLY:
            assert a is None and b is None, f.name
            continue
        assert a is not None and b is not None, f.name  # nothing dropped
        if f.metadata["split"] == SENTENCES:
            assert torch.equal(torch.cat([a, b]), whole), f.name
        elif f.metadata["split"] == SCALAR:
            assert a == b == whole, f.name
    assert batch.split(1) == [batch]
    with pytest.raises(ValueError, match="does not split"):
        batch.split(3)


def test_split_of_the_unpadded_layout_keeps_every_field():
    absent = {"attention_mask", "mlm_input_ids", "mlm_labels"}  # the mlm term reads padded rows only
    batch = unpad(dataclasses.replace(full_batch(n=2, m=1, b=4), mlm_input_ids=None, mlm_labels=None))
    for part in batch.split(2):
        for f in dataclasses.fields(Batch):
            assert (getattr(part, f.name) is None) == (f.name in absent), f.name
        assert part.num_sentences == 2 and part.cu_seqlens.tolist() == [0, 3, 6, 9, 12, 15, 18]


def test_fields_are_attributes_only():
    batch = full_batch()
    assert batch.num_views == 2 and batch.teacher is not None and batch.epoch == 3
    for name in ("__getitem__", "__setitem__", "__contains__", "get", "keys", "items", "of"):
        assert not hasattr(Batch, name), name  # no reading by name: a misspelt field fails where it is read
    with pytest.raises(TypeError):
        batch["num_views"]  # noqa: B018


def _collate(i: int) -> Batch:
    ids = torch.full((4, 3), i)
    return Batch(input_ids=ids, attention_mask=torch.ones_like(ids), num_views=2, ids=torch.arange(2) + i)


def test_a_batch_crosses_loader_workers():
    batch = full_batch()
    again = pickle.loads(pickle.dumps(batch))
    assert all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(dataclasses.astuple(batch), dataclasses.astuple(again))
    )
    loader = torch.utils.data.DataLoader(range(3), batch_size=None, num_workers=1, collate_fn=_collate)
    out = list(loader)
    assert all(isinstance(x, Batch) for x in out) and [int(x.ids[0]) for x in out] == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_the_pin_memory_thread_pins_every_tensor():
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = pin_memory(full_batch())
    assert isinstance(pinned, Batch) and pinned.epoch == 3
    values = [getattr(pinned, f.name) for f in dataclasses.fields(Batch)]
    assert all(v.is_pinned() for v in values if isinstance(v, torch.Tensor))
