"""Every folder the project writes gives our vectors under SentenceTransformer, and loading a model does
not print transformers' report about BERT's unused pooler (but still reports missing weights)."""

import json
import logging

import numpy as np
import pytest
from test_eval_fixtures import build_tiny_encoder

from pipeline.model import SentenceEncoder
from pipeline.model.encoder import _without_unused_pooler_report, load_backbone

SENTENCES = ["今天天气很好。", "花呗怎么还款", "一个男人在弹吉他，" * 12, "hello world 123", "好", ""]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("pooling", ["cls", "mean", "first_last_avg"])
def test_a_saved_model_folder_gives_our_vectors_in_sentence_transformers(tmp_path, pooling, caplog):
    """SentenceEncoder.save_pretrained is what the trainer writes (RUN/model, checkpoints' model/)."""
    from sentence_transformers import SentenceTransformer

    source = SentenceEncoder.from_pretrained(
        build_tiny_encoder(tmp_path / "src", pooling, seed=4, max_length=20)
    )
    source.prefix = "query: "
    folder = tmp_path / "model"
    source.save_pretrained(folder)
    assert json.loads((folder / "encoder.json").read_text())["prefix"] == "query: "  # our reader's rule

    ours = SentenceEncoder.from_pretrained(folder).encode(SENTENCES)
    caplog.set_level(logging.WARNING, logger="transformers.modeling_utils")
    st = SentenceTransformer(str(folder), device="cpu")
    # built without the pooler the weights lack (sentence_bert_config model_args): no load report at all
    assert not [r for r in caplog.records if "LOAD REPORT" in r.getMessage()]
    assert getattr(st[0].model, "pooler", None) is None
    assert st.max_seq_length == 20 and st.default_prompt_name == "query"
    theirs = st.encode(SENTENCES, batch_size=4)
    assert np.abs(theirs - ours).max() <= 1e-5
    # without the prefix the vectors differ: the folder is what makes sentence-transformers add it
    unprefixed = st.encode(SENTENCES, batch_size=4, prompt="")
    assert np.abs(unprefixed - ours).max() > 1e-3
    assert np.abs(source.encode(SENTENCES) - ours).max() <= 1e-6  # saving changed nothing for us


def test_saved_weights_hold_no_pooler_so_checkpoints_resume_strictly(tmp_path):
    from safetensors import safe_open

    folder = build_tiny_encoder(tmp_path / "model", "mean")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    encoder = SentenceEncoder.from_pretrained(folder)
    assert keys == set(encoder.backbone.state_dict())  # what the trainer's strict resume compares


def _reports(caplog) -> str:
    text = "\n".join(r.getMessage() for r in caplog.records if "LOAD REPORT" in r.getMessage())
    caplog.clear()
    return text


def test_unused_pooler_is_not_reported_but_missing_weights_are(tmp_path, caplog):
    from transformers import AutoModel

    caplog.set_level(logging.WARNING, logger="transformers.modeling_utils")
    with_pooler = tmp_path / "with_pooler"  # as our exports and fetched models are
    AutoModel.from_pretrained(str(build_tiny_encoder(tmp_path / "plain", "cls"))).save_pretrained(with_pooler)
    caplog.clear()

    backbone = load_backbone(with_pooler)
    assert backbone.pooler is None and _reports(caplog) == ""
    encoder = SentenceEncoder.from_pretrained(with_pooler, pooling="cls")
    assert encoder.backbone.pooler is None and _reports(caplog) == ""

    # the filter on its own: the unused pooler's report is dropped ...
    with _without_unused_pooler_report():
        AutoModel.from_pretrained(str(with_pooler), add_pooling_layer=False)
    assert _reports(caplog) == ""
    # ... where transformers alone reports it (so the assertion above can fail)
    AutoModel.from_pretrained(str(with_pooler), add_pooling_layer=False)
    assert "UNEXPECTED" in _reports(caplog)
    # missing weights are still reported under the filter
    with _without_unused_pooler_report():
        AutoModel.from_pretrained(str(tmp_path / "plain"))  # BertModel with a pooler the folder lacks
    report = _reports(caplog)
    assert "MISSING" in report and "pooler.dense.weight" in report


def test_other_transformers_warnings_pass_the_filter(caplog):
    logger = logging.getLogger("transformers.modeling_utils")
    with (
        _without_unused_pooler_report(),
        caplog.at_level(logging.WARNING, logger="transformers.modeling_utils"),
    ):
        logger.warning("something else went wrong")
    assert "something else went wrong" in caplog.text


def test_a_training_runs_model_folders_load_in_sentence_transformers(tmp_path, tiny_shards, caplog):
    """The trainer's own output (RUN/model and a checkpoint's model/) on the debug config, with a prefix."""
    from _train_data import debug_config
    from accelerate.state import AcceleratorState
    from sentence_transformers import SentenceTransformer

    from pipeline.train.run import run

    overrides = {"train.max_steps": 2, "checkpoint.every_steps": 2, "model.prefix": "query: "}
    cfg = debug_config(tmp_path, tiny_shards([[32]], num_variants=2), **overrides)
    AcceleratorState._reset_state(True)
    assert run(cfg) == 0
    folders = [cfg.run_dir / "model", *sorted((cfg.run_dir / "checkpoints").glob("step-*/model"))]
    assert len(folders) == 2
    caplog.set_level(logging.WARNING, logger="transformers.modeling_utils")
    for folder in folders:
        ours = SentenceEncoder.from_pretrained(folder)
        assert ours.prefix == "query: "
        theirs = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, batch_size=4)
        assert np.abs(theirs - ours.encode(SENTENCES)).max() <= 1e-5, folder
    assert not [r for r in caplog.records if "LOAD REPORT" in r.getMessage()]
