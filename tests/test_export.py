import base64
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_eval_fixtures import build_fake_run, build_tiny_encoder, tiny_model  # noqa: F401 (fixture)

from pipeline.cli import main
from pipeline.model import SentenceEncoder

SENTENCES = ["今天天气很好。", "花呗怎么还款", "一个男人在弹吉他，" * 12, "hello world 123", "好", ""]
FAKE_TOKEN = "hf_FAKEtoken0123456789abcdef"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def export(source, out, *extra):
    return main(["export", str(source), "--out", str(out), *extra])


def front_matter(readme: Path) -> dict:
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.mark.parametrize("pooling", ["cls", "mean", "first_last_avg"])
def test_export_loads_in_sentence_transformers_and_transformers(tmp_path, pooling):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    model_dir = build_tiny_encoder(tmp_path / "model", pooling, seed=3, max_length=24)
    out = tmp_path / "st"
    assert export(model_dir, out) == 0
    ours = SentenceEncoder.from_pretrained(model_dir).encode(SENTENCES)
    st = SentenceTransformer(str(out), device="cpu")
    assert st.max_seq_length == 24
    theirs = st.encode(SENTENCES, batch_size=4, convert_to_numpy=True)
    assert theirs.shape == ours.shape
    assert np.abs(theirs - ours).max() < 1e-5
    assert AutoModel.from_pretrained(str(out)).config.hidden_size == 32
    modules = json.loads((out / "modules.json").read_text())
    assert modules[0]["type"] == "sentence_transformers.models.Transformer"
    assert modules[-1]["type"] == "sentence_transformers.models.Normalize"
    assert (pooling == "first_last_avg") == any("WeightedLayerPooling" in m["type"] for m in modules)
    pooling_cfg = json.loads((out / modules[-2]["path"] / "config.json").read_text())
    assert pooling_cfg["pooling_mode_cls_token"] is (pooling == "cls")
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 24
    for name in ("config.json", "model.safetensors", "tokenizer.json", "config_sentence_transformers.json"):
        assert (out / name).is_file()


def test_model_card_has_metadata_recipe_and_eval_table(tiny_model, tmp_path):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    ckpt = run / "checkpoints" / "step-00000020"
    (ckpt / "eval").mkdir()
    result = {
        "sts": {
            "sets": ["ATEC", "BQ", "LCQMC", "PAWSX", "STS-B"],
            "pairs": {"ATEC": 20000},
            "model": {"ATEC": 31.25, "avg5": 44.44},
            "tfidf": {"ATEC": 25.7, "avg5": 36.87},
        }
    }
    (ckpt / "eval" / "eval.json").write_text(json.dumps(result))
    out = tmp_path / "st"
    assert export(run, out, "--license", "mit") == 0
    meta = front_matter(out / "README.md")
    assert meta["language"] == ["zh"] and meta["license"] == "mit"
    assert meta["library_name"] == "sentence-transformers" and meta["pipeline_tag"] == "sentence-similarity"
    assert {"sentence-transformers", "sentence-similarity", "feature-extraction", "luse"} <= set(meta["tags"])
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "data/augmented" not in card and "manifests were not found" in card  # the corpus is not a path
    for row in (
        "| objective | luse |",
        "| negative queue size | 4,096 |",
        "| augmented views per sentence (k) | 4 |",
        "| steps trained | 20 |",
        "| 31.25 |",
        "| 44.44 |",
    ):
        assert row in card, row


def test_export_with_explicit_eval_json_and_best(tiny_model, tmp_path):  # noqa: F811
    run = build_fake_run(tmp_path / "run", tiny_model)
    eval_json = tmp_path / "e.json"
    eval_json.write_text(json.dumps({"probe": {"accuracy": 77.5, "macro_f1": 70.25, "train": 8, "test": 2}}))
    out = tmp_path / "st"
    assert export(run, out, "--select", "best", "--eval-json", str(eval_json), "--verify", "false") == 0
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "| 77.50 | 70.25 |" in card and "| steps trained | 10 |" in card


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_export_refuses_existing_out_and_overwrites_an_export(tiny_model, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "st"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert export(tiny_model, out) == 2
    assert "exists; pass --overwrite" in _one_line_error(capsys)
    assert export(tiny_model, out, "--overwrite") == 2
    assert "not an earlier export" in _one_line_error(capsys)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert export(tiny_model, out, "--overwrite") == 0
    assert export(tiny_model, out, "--overwrite", "--verify", "false") == 0
    assert (out / "modules.json").is_file() and not list(tmp_path.glob(".st.tmp-*"))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m, t: t / "missing", "does not exist"),
        (
            lambda m, t: (
                shutil.copytree(m, t / "bad")
                and (t / "bad" / "config.json").write_text("{oops")
                and t / "bad"
            ),
            "cannot load model",
        ),
        (
            lambda m, t: (
                shutil.copytree(m, t / "trunc")
                and (t / "trunc" / "model.safetensors").write_bytes(b"\x01" * 64)
                and t / "trunc"
            ),
            "cannot load model",
        ),
    ],
)
def test_export_bad_checkpoint_is_one_line(tiny_model, tmp_path, capsys, make, message):  # noqa: F811
    assert export(make(tiny_model, tmp_path), tmp_path / "st") == 2
    assert message in _one_line_error(capsys)
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("repo_id", ["no-owner", "a/b/c", "me/bad name", "me/-x", "me/x..y", "/x"])
def test_export_invalid_repo_id_is_one_line(tiny_model, tmp_path, capsys, repo_id):  # noqa: F811
    assert export(tiny_model, tmp_path / "st", "--push-to-hub", repo_id) == 2
    assert "repo id" in _one_line_error(capsys)
    assert not (tmp_path / "st").exists()  # rejected before any work


class FakeHub:
    """Answers the Hub endpoints create_repo + upload_folder call, recording every request."""

    def __init__(self):
        self.requests = []
        self.committed = {}

    def __call__(self, request):
        import httpx2

        self.requests.append(request)
        path = request.url.path
        if path == "/api/repos/create":
            return httpx2.Response(200, json={"url": "https://huggingface.co/me/tiny", "name": "me/tiny"})
        if path == "/api/validate-yaml":
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        if path.endswith("/preupload/main"):
            files = json.loads(request.content)["files"]
            return httpx2.Response(
                200,
                json={
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]
                },
            )
        if path.endswith("/commit/main"):
            for line in request.content.decode().splitlines():
                op = json.loads(line)
                if op["key"] == "file":
                    self.committed[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
            return httpx2.Response(
                200, json={"commitUrl": "https://huggingface.co/me/tiny/commit/abc", "commitOid": "abc"}
            )
        return httpx2.Response(404, json={"error": f"not mocked: {path}"})


@pytest.fixture
def fake_hub(monkeypatch):
    import httpx2
    from huggingface_hub.utils import _http, set_client_factory

    hub = FakeHub()
    previous = _http._GLOBAL_CLIENT_FACTORY
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setattr(_http.constants, "HF_HUB_OFFLINE", False)  # the mock transport is the only "network"
    set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub)))
    yield hub
    set_client_factory(previous)


def test_push_to_hub_sends_every_file_and_never_the_token(tiny_model, tmp_path, fake_hub, capsys, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "st"
    assert export(tiny_model, out, "--push-to-hub", "me/tiny") == 0
    paths = [r.url.path for r in fake_hub.requests]
    assert "/api/repos/create" in paths and "/api/models/me/tiny/commit/main" in paths
    local = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert set(fake_hub.committed) == set(local)
    assert all(fake_hub.committed[k] == v for k, v in local.items())
    assert {"model.safetensors", "modules.json", "README.md", "1_Pooling/config.json"} <= set(local)
    hub_requests = [r for r in fake_hub.requests if r.url.path != "/api/agent-harnesses"]
    assert all(r.headers["authorization"] == f"Bearer {FAKE_TOKEN}" for r in hub_requests)
    captured = capsys.readouterr()
    assert "pushed" in captured.out
    for text in (
        captured.out,
        captured.err,
        caplog.text,
        *(v.decode("utf-8", "replace") for v in local.values()),
    ):
        assert FAKE_TOKEN not in text


def test_push_without_token_is_one_line(tiny_model, tmp_path, fake_hub, capsys, monkeypatch):  # noqa: F811
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    assert export(tiny_model, tmp_path / "st", "--push-to-hub", "me/tiny") == 2
    assert "no Hugging Face token" in _one_line_error(capsys)
    assert not (tmp_path / "st").exists() and not fake_hub.requests


def test_push_rejected_by_the_hub_is_one_line(tiny_model, tmp_path, fake_hub, capsys, monkeypatch):  # noqa: F811
    import httpx2

    def forbidden(request):
        return httpx2.Response(403, json={"error": "You don't have the rights"})

    from huggingface_hub.utils import set_client_factory

    set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(forbidden)))
    assert export(tiny_model, tmp_path / "st", "--push-to-hub", "me/tiny") == 2
    line = _one_line_error(capsys)
    assert "HTTP 403" in line and FAKE_TOKEN not in line


ZERO_SCRIPT = """
import os, sys
from pathlib import Path
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
import torch, deepspeed
from pipeline.model import SentenceEncoder
skeleton, out = Path(sys.argv[1]), Path(sys.argv[2])
encoder = SentenceEncoder.from_pretrained(str(skeleton))
deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-2)  # DeepSpeed's own Adam would JIT-compile
engine, *_ = deepspeed.initialize(model=encoder, optimizer=optimizer, config=config)
batch = encoder.tokenize(["今天天气很好", "花呗怎么还款", "我们一起去吃饭", "股市大跌"])
emb = engine(**batch)
engine.backward((emb @ emb.T).logsumexp(-1).mean())
engine.step()
engine.save_checkpoint(str(out / "zero"))
encoder.save_pretrained(out / "reference")
"""


@pytest.mark.slow
def test_export_from_a_deepspeed_zero2_checkpoint(tiny_model, tmp_path):  # noqa: F811
    """A real one-step ZeRO-2 engine run on CPU (gloo) writes the checkpoint; export consolidates it."""
    script = tmp_path / "make_zero.py"
    script.write_text(ZERO_SCRIPT)
    env = dict(
        os.environ,
        TORCH_EXTENSIONS_DIR=os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path(".cache/torch_extensions").resolve())
        ),
    )
    with socket.socket() as probe:  # a free port for the one-process gloo group
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    subprocess.run(
        [sys.executable, str(script), str(tiny_model), str(tmp_path), port], check=True, env=env, timeout=600
    )
    zero = tmp_path / "zero"
    assert (zero / "latest").is_file() and list(zero.glob("global_step1/*optim_states.pt"))
    reference = SentenceEncoder.from_pretrained(tmp_path / "reference").encode(SENTENCES)
    untrained = SentenceEncoder.from_pretrained(tiny_model).encode(SENTENCES)
    assert np.abs(untrained - reference).max() > 1e-3  # the step changed the weights, so this is not vacuous
    from sentence_transformers import SentenceTransformer

    # the skeleton given explicitly, then found beside the engine folder as our trainer keeps it
    assert export(zero, tmp_path / "st1", "--skeleton", str(tiny_model)) == 0
    shutil.copytree(tiny_model, tmp_path / "model")
    assert export(zero, tmp_path / "st2") == 0
    for out in ("st1", "st2"):
        theirs = SentenceTransformer(str(tmp_path / out), device="cpu").encode(SENTENCES)
        assert np.abs(theirs - reference).max() < 1e-5


def test_deepspeed_folder_without_skeleton_is_one_line(tmp_path, capsys):
    zero = tmp_path / "zero"
    (zero / "global_step5").mkdir(parents=True)
    (zero / "latest").write_text("global_step5")
    (zero / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"junk")
    assert export(zero, tmp_path / "st") == 2
    assert "no model skeleton" in _one_line_error(capsys)


def test_corrupt_deepspeed_checkpoint_is_one_line(tiny_model, tmp_path, capsys):  # noqa: F811
    zero = tmp_path / "zero"
    (zero / "global_step5").mkdir(parents=True)
    (zero / "latest").write_text("global_step5")
    (zero / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"junk")
    assert export(zero, tmp_path / "st", "--skeleton", str(tiny_model)) == 2
    assert "cannot consolidate DeepSpeed checkpoint" in _one_line_error(capsys)


def test_final_model_event_names_the_exported_step_only_for_that_model(tmp_path):
    """The card's "these are the initial weights" line must describe the weights actually exported."""
    import json

    from pipeline.evaluate.resolve import Resolved
    from pipeline.export import final_model_event

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    event = {"event": "final_model", "selected": "best", "step": 0, "sts_b_valid_spearman": 65.0,
             "initial_weights": True}  # fmt: skip
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n" + json.dumps(event) + "\n")
    final = Resolved(str(run / "model"), "model", run / "model")
    assert final_model_event(final) == event
    step0 = Resolved(str(run), "checkpoint", run / "ckpt", run / "checkpoints" / "step-00000000", run)
    assert final_model_event(step0) == event
    later = Resolved(str(run), "checkpoint", run / "ckpt", run / "checkpoints" / "step-00000100", run)
    assert final_model_event(later) is None  # another step's weights: the line would be false
    assert final_model_event(Resolved("x", "model", tmp_path / "elsewhere")) is None
