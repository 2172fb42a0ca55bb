"""The model card says where `base_model` is named that the weights descend from a dequantised 4-bit copy of
it (what `models fetch e5-small` converts), not from the Hub's fp32 checkpoint; a Hub init gets no note."""

import re

import yaml
from test_export_card import UPSTREAM, main_job, offline, parse_card  # noqa: F401 (fixtures)

from pipeline.cli import main
from pipeline.export.card import base_model_note, front_matter
from pipeline.export.origin import Origin

CONVERSION = "4-bit Q4_0 weights dequantized to fp32; no pooler, no MLM head (identity pooler added)"


def test_note_only_for_a_lossy_copy():
    fetched = Origin(base_model=UPSTREAM, provenance={"upstream": UPSTREAM, "conversion": CONVERSION})
    note = base_model_note(fetched)
    assert note and "Q4_0" in note and "not the same as" in note and UPSTREAM in note
    assert base_model_note(Origin(base_model=UPSTREAM)) is None  # a Hub init: the published weights
    assert base_model_note(Origin(base_model=UPSTREAM, provenance={"conversion": "as published"})) is None
    assert base_model_note(Origin(scratch=True)) is None


def test_front_matter_comment_keeps_the_metadata():
    from huggingface_hub import ModelCardData

    data = ModelCardData(language=["zh"], license="mit", base_model=UPSTREAM, base_model_relation="finetune")
    text = front_matter(data, "the weights descend from a copy: close to, but not the same as, it")
    line = next(line for line in text.splitlines() if line.startswith("base_model:"))
    assert line.endswith("# the weights descend from a copy: close to, but not the same as, it")
    assert yaml.safe_load(text) == yaml.safe_load(data.to_yaml())
    assert front_matter(data, None) == data.to_yaml()


def test_exported_card_names_the_copy_beside_base_model(main_job, tmp_path):  # noqa: F811
    out = tmp_path / "st"
    assert main(["export", str(main_job["run"]), "--out", str(out)]) == 0
    text = (out / "README.md").read_text(encoding="utf-8")
    _, data, _, _ = parse_card(text)  # the Hub's parser reads the same metadata, without a warning
    assert data["base_model"] == UPSTREAM
    metadata = text.split("---")[1]
    assert re.search(rf"^base_model: {re.escape(UPSTREAM)}  # .*4-bit Q4_0.*not the same as", metadata, re.M)
    body = text.split("---", 2)[2]
    initialised = body.index(f"Initialised from [{UPSTREAM}]")
    note = body.index("**Not the Hub's checkpoint:**")
    assert 0 < note - initialised < 1000 and "4-bit Q4_0" in body[note : note + 300]
