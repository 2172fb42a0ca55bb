"""The fine-tuning evaluation (issue 26 item 1) on a tiny random encoder and tiny toy tasks."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from _tiny_models import build_char_encoder

from pipeline.cli import main
from pipeline.evaluate import resolve
from pipeline.finetune import run as finetune_run
from pipeline.finetune.heads import bce_cosine_loss, cosent_loss
from pipeline.finetune.run import Config, Model, frozen_features, load_tasks
from pipeline.finetune.train import Budget, run_freeze_cell, run_train_cell

POSITIVE = "好棒赞美优秀喜欢满意开心"
NEGATIVE = "差烂糟坏讨厌失望难过垃圾"
FILLER = (
    "的了是在我有这个们来到时大地为子中你说生国年着就那和要她出也得里后自以会家可下而"
    "过天去能对小多然于心学么之都好看起发当没成只如事把还用第样道想作种开美总从无情己"
    "面最女但现前些所同日手又行意动方期它头经长儿回位分爱老因很给名法间斯知世什两次使"
    "身者被高已亲其进此话常与活正感"
)


def _text(rng: random.Random, chars: str, n: int) -> str:
    return "".join(rng.choice(chars) for _ in range(n))


def toy_classification(path, n=160, seed=0):
    """Separable: a positive review holds only characters of POSITIVE, a negative one of NEGATIVE."""
    rng = random.Random(seed)
    lines = ["label\ttext"]
    for i in range(n):
        label = i % 2
        chars = POSITIVE if label else NEGATIVE
        lines.append(f"{label}\t{_text(rng, chars, rng.randint(3, 6))}{_text(rng, FILLER, 2)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def toy_pairs(path, n=160, seed=0):
    """Label 1: the second sentence is the first with one character changed; 0: an unrelated sentence."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        a = _text(rng, FILLER, 8)
        if i % 2:
            k = rng.randrange(len(a))
            b, label = a[:k] + rng.choice(FILLER) + a[k + 1 :], 1
        else:
            b, label = _text(rng, FILLER, 8), 0
        lines.append(f"{a}\t{b}\t{label}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    model = build_char_encoder(
        root / "model",
        [POSITIVE + NEGATIVE + FILLER],
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=64,
        max_length=32,
    )
    cls = toy_classification(root / "toy_cls.tsv")
    sim = toy_pairs(root / "toy_sim.tsv")
    return {"model": model, "cls": cls, "sim": sim, "root": root}


def _args(toy, out, *extra):
    return [
        "finetune",
        str(toy["model"]),
        "--out",
        str(out),
        "--task-files",
        f"toycls=classification:{toy['cls']}",
        "--task-files",
        f"toysim=similarity:{toy['sim']}",
        "--seeds",
        "0",
        "--train-lrs",
        "1e-3",
        "--head-lr",
        "1e-2",
        "--train-epochs",
        "8",
        "--freeze-lrs",
        "3e-3",
        "--freeze-epochs",
        "30",
        "--batch-size",
        "16",
        "--progress",
        "false",
        *extra,
    ]


def test_it_learns_a_separable_task_in_both_regimes(toy, tmp_path):
    out = tmp_path / "run"
    assert main(_args(toy, out)) == 0
    result = json.loads((out / "finetune.json").read_text(encoding="utf-8"))
    cls = result["tasks"]["toycls"]
    assert cls["sizes"] == {"train": 80, "dev": 32, "test": 48}
    # chance is 50 %; the classes share no character, so a trained head separates them
    assert cls["regimes"]["freeze"]["mean"] >= 80.0
    assert cls["regimes"]["train"]["mean"] >= 80.0
    sim = result["tasks"]["toysim"]
    # chance is 0; near-copies against unrelated sentences must stay clearly ranked after training
    assert sim["regimes"]["freeze"]["mean"] > 20.0
    assert sim["regimes"]["train"]["mean"] > 20.0
    # FreezeBERT's cache (and the zero-shot reference read from it) holds the *loaded* encoder's
    # outputs, although TrainBERT cells of the same task ran before and changed the weights
    task = load_tasks(
        Config(model=str(toy["model"]), out=out, task_files=[f"toysim=similarity:{toy['sim']}"])
    )[0]
    encoder = resolve.load_encoder(resolve.resolve(str(toy["model"])))
    (cache,) = (out / "cache").glob("toysim-*.npy")
    cached = np.load(cache)
    cached /= np.linalg.norm(cached, axis=1, keepdims=True)
    assert np.allclose(cached, encoder.encode(task.unique_texts()), atol=1e-5)
    assert -100.0 <= sim["zero_shot"]["test"] <= 100.0
    assert "zero_shot" not in cls
    assert (out / "finetune.md").read_text(encoding="utf-8").count("| toycls |") == 2
    assert (out / "finetune.png").stat().st_size > 1000
    assert len(list((out / "cells").rglob("*.json"))) == 4


def test_resume_skips_recorded_cells_and_loses_nothing(toy, tmp_path, monkeypatch):
    extra = ["--seeds", "0,1", "--freeze-lrs", "1e-3,3e-3", "--train-epochs", "1", "--freeze-epochs", "5"]
    full = tmp_path / "full"
    assert main(_args(toy, full, *extra)) == 0
    cells = sorted(p.relative_to(full) for p in (full / "cells").rglob("*.json"))
    assert len(cells) == 2 * (2 * 1 + 2 * 2)  # tasks x (train: seeds x 1 lr + freeze: seeds x 2 lrs)

    calls: list[str] = []
    killed: list[str] = []
    real = finetune_run.run_cell

    def dies_on_the_fifth(cell, *args, **kwargs):
        calls.append(cell.name)
        if len(calls) == 5 and not killed:
            killed.append(cell.name)
            raise KeyboardInterrupt  # as a kill in the middle of the fifth cell
        return real(cell, *args, **kwargs)

    monkeypatch.setattr(finetune_run, "run_cell", dies_on_the_fifth)
    part = tmp_path / "part"
    assert main(_args(toy, part, *extra)) == 130
    assert len(list((part / "cells").rglob("*.json"))) == 4
    assert not (part / "finetune.json").exists()
    first = list(calls)
    calls.clear()
    assert main(_args(toy, part, *extra)) == 0
    # nothing redone: the rerun computed exactly the cells the first attempt had not finished
    assert len(calls) == len(cells) - 4 and not set(calls) & set(first[:4])
    assert calls[0] == first[4]
    # nothing lost: every cell equals the uninterrupted run's
    for rel in cells:
        a = json.loads((full / rel).read_text(encoding="utf-8"))
        b = json.loads((part / rel).read_text(encoding="utf-8"))
        assert (a["dev"], a["test"], a["epoch_losses"]) == (b["dev"], b["test"], b["epoch_losses"])
    # and a third run recomputes nothing
    calls.clear()
    assert main(_args(toy, part, *extra)) == 0
    assert calls == []


def test_other_setting_in_the_same_out_is_refused(toy, tmp_path, capsys):
    out = tmp_path / "run"
    args = _args(toy, out, "--regimes", "freeze", "--freeze-epochs", "2")
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--max-train", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max_train: 1000 there, 50 now" in err and "new --out" in err


@pytest.mark.parametrize(
    "kind, text, message",
    [
        ("classification", "label\ttext\n1\t好的\n0\n", ":3: expected 2 tab-separated fields"),
        ("classification", "label\ttext\n1\t好的\n\t差的\n", ":3: empty label"),
        ("classification", "text\tlabel\n好的\t1\n", ":1: expected the header"),
        ("similarity", "好的\t很好\t1\n好的\t差的\tyes\n", ":2: label 'yes' is not a number"),
        ("similarity", "好的\t很好\t1\n好的\t差的\n", ":2: expected 3 tab-separated columns"),
    ],
)
def test_bad_task_file_is_one_line_naming_file_and_line(toy, tmp_path, capsys, kind, text, message):
    bad = tmp_path / "bad.tsv"
    bad.write_text(text, encoding="utf-8")
    args = ["finetune", str(toy["model"]), "--out", str(tmp_path / "o"), "--task-files", f"bad={kind}:{bad}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{bad}{message}" in err and ("fix" in err or "add it" in err)
    assert not (tmp_path / "o").exists()  # refused before anything was written


def _loaded(toy, tmp_path, regimes):
    cfg = Config(
        model=str(toy["model"]),
        out=tmp_path,
        task_files=[f"toycls=classification:{toy['cls']}"],
        regimes=regimes,
    )
    task = load_tasks(cfg)[0]
    return cfg, task, Model(cfg, resolve.resolve(cfg.model))


def test_freeze_leaves_the_encoder_unchanged_and_train_changes_it(toy, tmp_path):
    cfg, task, model = _loaded(toy, tmp_path, ["train", "freeze"])
    before = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    features = frozen_features(model, task, tmp_path, finetune_run.Progress(False))
    record = run_freeze_cell(*features, task, Budget(epochs=10, batch_size=16, lr=3e-3, seed=0))
    assert record["test"]["accuracy"] > 50.0
    after = model.encoder.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the cache holds the encoder's own pooled outputs, and a second call reads them back
    assert np.array_equal(
        frozen_features(model, task, tmp_path, finetune_run.Progress(False))[0], features[0]
    )

    budget = Budget(epochs=1, batch_size=16, lr=1e-3, seed=0, head_lr=1e-2)
    first = run_train_cell(model.encoder, model.initial_state, task, budget)
    trained = model.encoder.state_dict()
    changed = [k for k in before if not torch.equal(before[k], trained[k])]
    assert "encoder.layer.0.attention.self.query.weight" in {k.removeprefix("backbone.") for k in changed}
    assert len(changed) > len(before) // 2
    # every cell starts from the loaded weights: the same seed gives the same result again
    assert all(torch.equal(before[k], model.initial_state[k]) for k in before)
    again = run_train_cell(model.encoder, model.initial_state, task, budget)
    assert (first["dev"], first["epoch_losses"]) == (again["dev"], again["epoch_losses"])


def test_bce_and_cosent_losses_match_their_formulas():
    cos = torch.tensor([0.9, -0.2, 0.4, 0.1])
    target = torch.tensor([1.0, 0.0, 0.6, 0.0])
    p = (1 + cos) / 2
    expected = -(target * p.log() + (1 - target) * (1 - p).log()).mean()
    assert torch.allclose(bce_cosine_loss(cos, target), expected)
    score = torch.tensor([5.0, 0.0, 3.0, 0.0])
    terms = [20 * (cos[j] - cos[i]) for i in range(4) for j in range(4) if score[i] > score[j]]
    naive = torch.log(1 + torch.exp(torch.stack(terms)).sum())
    assert len(terms) == 5 and torch.allclose(cosent_loss(cos, score), naive)


def test_sigkill_mid_run_then_rerun_redoes_nothing_and_loses_nothing(toy, tmp_path, caplog):
    """The real thing: the command in a child process, killed with SIGKILL once cells are recorded."""
    import logging
    import os
    import signal
    import subprocess
    import sys
    import time

    extra = ["--regimes", "freeze", "--seeds", "0,1,2,3,4,5", "--freeze-epochs", "40"]
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *_args(toy, out, *extra)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300  # liveness only: start-up alone can take a minute on a loaded machine
    while len(list((out / "cells").rglob("*.json"))) < 3 and time.monotonic() < deadline:
        if child.poll() is not None:
            break
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    recorded = {p.relative_to(out): p.read_text(encoding="utf-8") for p in (out / "cells").rglob("*.json")}
    total = 2 * 6  # tasks x seeds x 1 lr
    assert 3 <= len(recorded) < total, "the child finished before it could be killed; make it slower"
    assert not (out / "finetune.json").exists()

    caplog.set_level(logging.INFO, logger="pipeline.finetune.run")
    assert main(_args(toy, out, *extra)) == 0
    assert f"{len(recorded)} of {total} cells were recorded" in caplog.text
    computed = [r for r in caplog.records if "dev " in r.getMessage() and "test " in r.getMessage()]
    assert len(computed) == total - len(recorded)  # nothing redone
    for rel, text in recorded.items():  # nothing lost or rewritten
        assert (out / rel).read_text(encoding="utf-8") == text
    reference = tmp_path / "reference"
    assert main(_args(toy, reference, *extra)) == 0
    for path in (reference / "cells").rglob("*.json"):
        a = json.loads(path.read_text(encoding="utf-8"))
        b = json.loads((out / path.relative_to(reference)).read_text(encoding="utf-8"))
        assert (a["dev"], a["test"]) == (b["dev"], b["test"])


def test_cosent_head_trains_the_similarity_task(toy, tmp_path):
    out = tmp_path / "cosent"
    args = _args(toy, out, "--sim-head", "cosent", "--tasks", "toysim")
    assert main(args) == 0
    result = json.loads((out / "finetune.json").read_text(encoding="utf-8"))
    assert list(result["tasks"]) == ["toysim"] and result["config"]["sim_head"] == "cosent"
    for regime in ("train", "freeze"):
        assert result["tasks"]["toysim"]["regimes"][regime]["mean"] > 20.0
    (freeze,) = (out / "cells" / "toysim").glob("freeze-*.json")
    curve = json.loads(freeze.read_text(encoding="utf-8"))["epoch_losses"]
    # the MLP's CoSENT loss fell; it starts near ln(1 + 8 * 8) = 4.2 (16 pairs a batch, half positive)
    assert curve[-1] < curve[0] - 0.2
