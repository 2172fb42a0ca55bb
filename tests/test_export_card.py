"""The export a user deploys (issue 34): a card that is true (licence and base model from the init, the
corpus by its manifests, numbers by magnitude, model-index), both prompts, and the Hub dry run."""

import json
import logging
import re
import shutil
import warnings

import numpy as np
import pytest
from test_eval_fixtures import build_fake_run, build_tiny_encoder

from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.model import SentenceEncoder

SENTENCES = ["今天天气很好。", "花呗怎么还款", "一个男人在弹吉他。"]
UPSTREAM = "intfloat/multilingual-e5-small"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def write_json(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The main job's chain in miniature: a fetched model (PROVENANCE.json, e5's two prompts), a student of
    it (student_surgery.source), shards whose manifests lead back to the corpus, a run trained from the
    student at lr 1e-3, its eval.json, and the teacher's eval.json."""
    root = tmp_path_factory.mktemp("mainjob")
    base = root / "models" / "e5-small"
    tiny = build_tiny_encoder(root / "tiny", "mean", seed=3, max_length=32)
    SentenceEncoder.from_pretrained(tiny, prefix="query: ").save_pretrained(base)
    st_config = base / "config_sentence_transformers.json"
    settings = json.loads(st_config.read_text())
    settings["prompts"] = {"query": "query: ", "passage": "passage: "}
    st_config.write_text(json.dumps(settings))
    write_json(
        base / "PROVENANCE.json",
        {
            "model": "e5-small",
            "upstream": UPSTREAM,
            "license": "MIT",
            "conversion": "4-bit Q4_0 weights dequantized to fp32",
        },
    )
    student = root / "student"
    shutil.copytree(base, student)
    (student / "PROVENANCE.json").unlink()  # the student stage does not copy it: the chain must be followed
    config = json.loads((student / "config.json").read_text())
    config["student_surgery"] = {"source": str(base), "layers": [0, 1], "source_layers": 2, "vocab": None}
    (student / "config.json").write_text(json.dumps(config))

    shards, augmented, teacher = root / "shards", root / "augmented", root / "teacher"
    write_json(
        shards / "manifest.json",
        {
            "stage": "preprocess",
            "totals": {"sentences": 68545},
            "config": {
                "inputs": ["pipeline/resources/corpus/peoples_daily_199801.txt", "/x/taobao_dialogues.jsonl"],
                "min_chars": 5,
                "max_chars": 256,
                "min_cjk_ratio": 0.5,
                "near_duplicates": False,
            },
            "counts": {
                "records": 33075,
                "sentences_split": 112080,
                "kept": 68545,
                "dropped": {"duplicate": 23868, "too_short": 17783, "low_cjk": 0},
            },
            "audit": {"rules": {"empty_brackets": 10, "html_tags": 0}},
        },
    )
    write_json(
        augmented / "manifest.json",
        {
            "stage": "augment",
            "config": {
                "shards": str(shards),
                "num_variants": 4,
                "ops": ["sr", "ri", "rs", "rd"],
                "synonyms": "cilin",
            },
            "counts": {"sentences": 68545, "variants": 273593},
            "totals": {"sentences": 68545},
        },
    )
    write_json(
        teacher / "manifest.json",
        {
            "stage": "teacher",
            "config": {"shards": str(augmented)},
            "totals": {"sentences": 68545},
            "teacher": {
                "name": str(base),
                "path": str(base),
                "dim": 32,
                "pooling": "mean",
                "prefix": "query: ",
            },
        },
    )
    sts = {"sets": ["ATEC", "BQ", "LCQMC", "PAWSX", "STS-B"], "pairs": {"ATEC": 100, "BQ": 100}}
    write_json(
        base / "eval" / "eval.json", {"sts": {**sts, "model": {"ATEC": 30.5, "BQ": 40.25, "avg5": 50.0}}}
    )

    run = build_fake_run(root / "run", student)
    text = (run / "config.yaml").read_text()
    text = text.replace("  shards: data/augmented", f"  shards: {teacher}")
    text += f"model:\n  name_or_path: {student}\noptim:\n  lr: 0.001\n  weight_decay: 0.0\n"
    for path in [run / "config.yaml", *run.glob("checkpoints/*/config.yaml")]:
        path.write_text(text)
    ckpt = run / "checkpoints" / "step-00000020"
    write_json(
        ckpt / "eval" / "eval.json",
        {
            "sts": {
                **sts,
                "model": {"ATEC": 31.25, "BQ": 40.5, "avg5": 44.44},
                "tfidf": {"ATEC": 25.7, "avg5": 36.87},
            }
        },
    )
    return {"root": root, "base": base, "student": student, "run": run}


def parse_card(text):
    """Metadata through huggingface_hub's own classes; any warning they log or raise fails the test."""
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, hub_log = Collect(logging.WARNING), logging.getLogger("huggingface_hub")
    hub_log.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            card = ModelCard(text, ignore_metadata_errors=False)
            data = card.data.to_dict()
            name, results = (
                model_index_to_eval_results(data["model-index"]) if "model-index" in data else (None, [])
            )
    finally:
        hub_log.removeHandler(handler)
    assert records == []
    return card, data, name, results


def test_card_is_true_and_parses_without_warnings(main_job, tmp_path):
    out = tmp_path / "st"
    assert main(["export", str(main_job["run"]), "--out", str(out)]) == 0
    text = (out / "README.md").read_text(encoding="utf-8")
    card, data, _, results = parse_card(text)
    assert data["license"] == "mit"  # the init's (PROVENANCE.json: MIT), not a default
    assert data["base_model"] == UPSTREAM and data["base_model_relation"] == "finetune"
    assert {(r.dataset_type, r.metric_value) for r in results} >= {
        ("C-MTEB/ATEC", 31.25),
        ("C-MTEB/BQ", 40.5),
    }
    assert all(r.metric_type == "spearman_cosine" for r in results)
    # every number keeps its magnitude: lr 1e-3 is 0.001, never "0.00"
    assert "| peak learning rate | 0.001 |" in text
    assert not re.search(r"(?<![\d.])0\.0+(?![\d.]*[1-9])", text.split("## Citation")[0].replace("0.001", ""))
    # the corpus by its manifests, not a path; the teacher beside the student; what the card must say
    assert str(main_job["root"]) not in text
    assert "`peoples_daily_199801.txt`, `taobao_dialogues.jsonl`" in text and "33,075 records" in text
    assert "EDA" in text and "4 variants" in text
    assert "| teacher (e5-small) | 30.50 | 40.25 |" in text
    assert "## Limitations" in text and "32 tokens" in text and "median cosine" in text
    assert "## Framework versions" in text and "- transformers: " in text
    for key in ("luse", "gao2021simcse", "su2022cosent", "wang2024multilingual", "wei2019eda", "he2020moco"):
        assert key in text, key
    assert "student of `e5-small`" in text and "4-bit Q4_0" in text


def test_both_prompts_are_carried_and_sentence_transformers_uses_them(main_job, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "st"
    assert main(["export", str(main_job["run"]), "--out", str(out)]) == 0
    settings = json.loads((out / "config_sentence_transformers.json").read_text())
    # e5's names, and "document" too: sentence-transformers 6.2's encode_document reads that one
    assert settings["prompts"] == {"query": "query: ", "passage": "passage: ", "document": "passage: "}
    assert settings["default_prompt_name"] == "query"
    model = SentenceTransformer(str(out), device="cpu")
    ours = SentenceEncoder.from_pretrained(out)
    assert ours.prefix == "query: "
    assert np.abs(model.encode_query(SENTENCES) - ours.encode(SENTENCES)).max() <= 1e-5
    ours.prefix = "passage: "
    assert np.abs(model.encode_document(SENTENCES) - ours.encode(SENTENCES)).max() <= 1e-5
    assert np.abs(model.encode(SENTENCES, prompt_name="passage") - ours.encode(SENTENCES)).max() <= 1e-5
    assert np.abs(model.encode_document(SENTENCES) - model.encode_query(SENTENCES)).max() > 1e-3
    text = (out / "README.md").read_text(encoding="utf-8")
    assert "`passage` | `passage: `" in text and "encode_document" in text


def test_licence_rules(main_job, tmp_path, capsys):
    # an explicit --license wins; a from-scratch run gets the project's MIT
    assert (
        main(["export", str(main_job["run"]), "--out", str(tmp_path / "a"), "--license", "apache-2.0"]) == 0
    )
    assert "license: apache-2.0" in (tmp_path / "a" / "README.md").read_text()
    scratch = build_fake_run(tmp_path / "scratch", build_tiny_encoder(tmp_path / "m", "cls"))
    assert main(["export", str(scratch), "--out", str(tmp_path / "b")]) == 0
    _, data, _, _ = parse_card((tmp_path / "b" / "README.md").read_text())
    assert data["license"] == "mit" and "base_model" not in data
    assert "randomly initialised" in (tmp_path / "b" / "README.md").read_text()
    capsys.readouterr()
    # a licence the Hub does not know fails the export, in one line
    assert (
        main(["export", str(main_job["run"]), "--out", str(tmp_path / "c"), "--license", "MIT License"]) == 2
    )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "not a Hub licence identifier" in errors[0] and "Traceback" not in err
    assert not (tmp_path / "c").exists()


def test_push_dry_run_lists_files_and_metadata_offline(main_job, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no token needed for a dry run
    out = tmp_path / "st"
    argv = ["export", str(main_job["run"]), "--out", str(out), "--push-to-hub", "me/tiny-zh", "--dry-run"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "dry run: would upload" in printed and "https://huggingface.co/me/tiny-zh" in printed
    size = (out / "model.safetensors").stat().st_size
    assert f"{size:>12,}  model.safetensors" in printed and "README.md" in printed
    assert f"base_model: {UPSTREAM}" in printed and "license: mit" in printed and "model-index" in printed


def test_check_card_refuses_what_the_hub_would_reject():
    from pipeline.export.hub import check_card

    good = "---\nlicense: mit\nlanguage:\n- zh\n---\n# x\n"
    assert check_card(good)["license"] == "mit"
    with pytest.raises(InputError, match="would be rejected"):
        check_card("---\nlicense: [mit\n---\n# x\n")  # broken YAML
    with pytest.raises(InputError, match="not a Hub licence identifier"):
        check_card("---\nlicense: MIT License\n---\n")
    with pytest.raises(InputError, match="not a Hub repo id"):
        check_card("---\nlicense: mit\nbase_model: not a/repo id\n---\n")
    bad_index = "---\nlicense: mit\nmodel-index:\n- name: x\n  results:\n  - task: {}\n---\n"
    with pytest.raises(InputError, match="would be rejected"):
        check_card(bad_index)


def test_fmt_number_keeps_magnitude():
    from pipeline.export.card import fmt_number

    assert [fmt_number(v) for v in (1e-3, 3e-5, 2.5e-4, 0.995, 0.05, 0.0, 28800, 1.0, 12.5, True)] == [
        "0.001",
        "3e-5",
        "2.5e-4",
        "0.995",
        "0.05",
        "0",
        "28,800",
        "1",
        "12.5",
        "yes",
    ]
