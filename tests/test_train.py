"""Single-process training: schedule, a LUSE run end to end, GradCache equivalence, supervised objectives."""

import json
import math

import pytest
import torch
from _train_data import debug_config, debug_luse, full_and_resumed, sample_sentences

from pipeline.config import load_config
from pipeline.model import SentenceEncoder
from pipeline.train.config import PROJECT_ROOT, Config
from pipeline.train.schedule import lr_factor

DEBUG = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def shards(tiny_shards):
    return tiny_shards([[40, 24], [32]], num_variants=3)


def debug_cfg(tmp_path, shards, **overrides):
    return debug_config(tmp_path, shards, **{"train.eval_max_pairs": 32, **overrides})


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_schedule_is_a_pure_function_of_the_step():
    assert lr_factor(0, 10, 100, "linear") == pytest.approx(1 / 11)
    assert lr_factor(9, 10, 100, "linear") == pytest.approx(10 / 11)
    assert lr_factor(10, 10, 100, "linear") == pytest.approx(1.0)
    assert lr_factor(100, 10, 100, "linear", 0.1) == pytest.approx(0.1)
    assert lr_factor(55, 10, 100, "cosine") == pytest.approx(0.5)
    assert lr_factor(50, 0, 100, "constant") == 1.0


@pytest.mark.parametrize("minutes, evaluated", [(0.0, [7]), (1e-9, [0, 3, 6, 7])])
def test_evaluation_by_wall_time_falls_on_log_steps(tmp_path, shards, minutes, evaluated):
    """train.eval_every_minutes: the clock is read at log steps (every 3 here), so a rule whose minutes
    have always passed evaluates at each of them (and the initial model, as any scored run); off, with
    no step rule, only the last step is evaluated."""
    from pipeline.train.run import run

    over = {"train.max_steps": 7, "train.log_every": 3, "train.eval_every": 0, "train.final_model": "last",
            "train.eval_every_minutes": minutes, "checkpoint.every_minutes": 0}  # fmt: skip
    cfg = debug_cfg(tmp_path, shards, **over)
    assert run(cfg) == 0
    assert [r["step"] for r in read_metrics(cfg.run_dir) if r.get("event") == "eval"] == evaluated


def test_a_negative_eval_every_minutes_is_refused():
    from pipeline.errors import ConfigError
    from pipeline.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"train\.eval_every_minutes must be >= 0"):
        TrainConfig(eval_every_minutes=-1)


def test_luse_run_writes_metrics_model_and_tokenizer(tmp_path, shards):
    from pipeline.train.run import run

    cfg = debug_cfg(tmp_path, shards, **{"train.max_steps": 6, "train.eval_every": 3})
    assert run(cfg) == 0
    rd = cfg.run_dir
    records = read_metrics(rd)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["samples_seen"] == 6 * 16 and steps[0]["queue_fill"] == 0.5
    assert {"alignment", "uniformity", "sentences_per_s", "lr"} <= set(steps[-1])
    evals = [r for r in records if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 3, 6]  # step 0: the untrained model, where the curve starts
    assert any(r.get("event") == "unk_rate" for r in records)
    assert (rd / "config.yaml").is_file() and (rd / "tensorboard").is_dir()
    # the saved model and its char tokenizer round-trip
    loaded = SentenceEncoder.from_pretrained(rd / "model")
    text = sample_sentences(1)[0]
    from pipeline.model import make_tokenizer

    assert (
        loaded.tokenizer(text)["input_ids"]
        == make_tokenizer(rd / "tokenizer" / "vocab.txt")(text)["input_ids"]
    )
    assert loaded.tokenizer.unk_token_id not in loaded.tokenizer(text)["input_ids"]


def _safetensors_bytes(model_dir):
    return (model_dir / "model.safetensors").read_bytes()


def test_final_model_best_is_the_best_checkpoint(tmp_path, shards):
    from pipeline.train.checkpoint import Checkpointer
    from pipeline.train.run import run

    overrides = {"train.max_steps": 8, "train.eval_every": 2, "train.final_model": "best", "optim.lr": 3e-2}
    cfg = debug_cfg(tmp_path, shards, **overrides)
    assert run(cfg) == 0
    evals = [r for r in read_metrics(cfg.run_dir) if r.get("event") == "eval"]
    scored = {e["step"]: e["sts_b_valid_spearman"] for e in evals}  # step 0 (the init) is a candidate
    best_step = max(scored, key=lambda s: (scored[s], -s))  # ties: the first one reached stays best
    checkpoints = Checkpointer(cfg.run_dir)
    assert checkpoints.best().name == f"step-{best_step:08d}"
    assert _safetensors_bytes(cfg.run_dir / "model") == _safetensors_bytes(checkpoints.best() / "model")
    if best_step != 8:  # then the last step's weights differ from what was exported
        assert _safetensors_bytes(cfg.run_dir / "model") != _safetensors_bytes(checkpoints.latest() / "model")
    assert SentenceEncoder.from_pretrained(cfg.run_dir / "model").encode(["一句话"]).shape == (1, 32)


def test_keep_best_exports_the_initial_weights_when_no_step_beats_them(tmp_path, shards, monkeypatch, caplog):
    from pipeline.train.callbacks import Callbacks
    from pipeline.train.checkpoint import Checkpointer
    from pipeline.train.run import run

    class BelowTheInit(Callbacks):
        """the real evaluation (logged), but every trained step is made to score below the init"""

        def on_evaluate(self, t, score):
            return score if t.state.step == 0 else -100.0 + t.state.step

    overrides = {"train.max_steps": 4, "train.eval_every": 2, "train.final_model": "best"}
    cfg = debug_cfg(tmp_path, shards, **overrides)
    with caplog.at_level("WARNING", logger="pipeline.train.checkpointing"):
        assert run(cfg, BelowTheInit()) == 0
    assert "no step beat the initial model" in caplog.text
    checkpoints = Checkpointer(cfg.run_dir)
    assert checkpoints.best().name == "step-00000000"
    assert _safetensors_bytes(cfg.run_dir / "model") == _safetensors_bytes(checkpoints.best() / "model")
    assert _safetensors_bytes(cfg.run_dir / "model") != _safetensors_bytes(checkpoints.latest() / "model")
    final = [r for r in read_metrics(cfg.run_dir) if r.get("event") == "final_model"]
    assert len(final) == 1 and final[0]["step"] == 0 and final[0]["initial_weights"] is True


def test_distillation_hard_negatives_and_teacher_queue_in_train_step(tmp_path, shards):
    from _train_data import with_teacher

    from pipeline.train.build import build
    from pipeline.train.loop import train_step

    shards = with_teacher(shards, tmp_path / "taught", 12)  # the terms read a teacher: the shards hold one

    overrides = {
        "loss": [
            *debug_luse(queue_size=16, teacher_positive=True),
            {"distill": {}, "weight": 1.0},
            {"kl": {}, "weight": 0.5},
        ],
        "data.teacher_dim": 12,
        "train.grad_accum_steps": 2,
    }
    t = build(debug_cfg(tmp_path, shards, **overrides))
    assert isinstance(t.module.head, torch.nn.Linear) and "teacher_queue" in t.states()
    batch = next(iter(t.stream))
    n, b = batch.num_views, batch.input_ids.shape[0] // batch.num_views
    g = torch.Generator().manual_seed(0)
    hard = torch.randint(0, b, (2 * b,), generator=g)  # m = 2 hard negatives: other sentences' originals
    batch.input_ids = torch.cat([batch.input_ids, batch.input_ids[hard]])
    batch.attention_mask = torch.cat([batch.attention_mask, batch.attention_mask[hard]])
    batch.num_hard_negatives = 2
    batch.teacher = torch.nn.functional.normalize(torch.randn(b, 12, generator=g), dim=-1)
    out = train_step(t, batch)
    assert {"loss", "contrastive_loss", "distill_loss", "kl_loss"} <= set(out)
    assert all(math.isfinite(float(v)) for k, v in out.items() if k.endswith("loss"))
    assert out["embeddings"].shape[:2] == (n, b // 2)  # the last micro-batch's views only
    # the teacher queue holds the teacher rows of the enqueued originals, in the same order as the keys
    queue, teacher_queue = t.loss.states()["queue"], t.loss.states()["teacher_queue"]  # the terms' own
    torch.testing.assert_close(teacher_queue.negatives(), batch.teacher.to(teacher_queue.keys.dtype))
    assert queue.fill == teacher_queue.fill == b
    t.close()


def test_grad_accumulation_and_simcse_run(tmp_path, shards):
    from pipeline.train.run import run

    over = {"train.max_steps": 3, "train.grad_accum_steps": 2, "loss": debug_luse(queue_size=8)}
    cfg = debug_cfg(tmp_path, shards, **over)
    assert run(cfg) == 0
    steps = [r for r in read_metrics(cfg.run_dir) if "loss" in r]
    assert len(steps) == 3 and all(math.isfinite(r["loss"]) for r in steps)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    cfg = debug_cfg(
        tmp_path / "s",
        shards,
        **{"loss": [{"simcse": {}}], "train.max_steps": 3},
    )
    assert run(cfg) == 0


def _grads(module):
    return [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradcache_matches_the_plain_step(tmp_path, shards, dropout):
    from pipeline.train.build import build
    from pipeline.train.engines import term_loss
    from pipeline.train.gradcache import chunked_forward_backward

    cfg = debug_cfg(
        tmp_path,
        shards,
        **{"model.dropout": dropout, "loss": debug_luse(queue_size=0), "train.gradcache_chunk_size": 20},
    )
    t = build(cfg)
    batch = next(iter(t.stream))
    inputs = {k: getattr(batch, k) for k in ("input_ids", "attention_mask")}
    size = cfg.train.gradcache_chunk_size

    # reference: a forward with graph, chunk by chunk from the same RNG state (dropout on), or whole (off)
    torch.manual_seed(7)
    if dropout:
        parts = [
            t.model(**{k: v[i : i + size] for k, v in inputs.items()})
            for i in range(0, len(inputs["input_ids"]), size)
        ]
        emb = torch.cat(parts)
    else:
        emb = t.model(**inputs)
    ref_loss = term_loss(t, emb, batch).total
    ref_loss.backward()
    ref = _grads(t.module)
    t.optimizer.zero_grad(set_to_none=True)

    torch.manual_seed(7)
    parts, cached = chunked_forward_backward(
        t.model, t.accelerator.backward, inputs, size, lambda rows: term_loss(t, rows, batch)
    )
    got = _grads(t.module)
    loss = parts.total
    assert cached.shape == (len(inputs["input_ids"]), emb.shape[-1])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    t.close()


def _pairs_file(path, n=48, triples=False):
    texts = sample_sentences(3 * n)
    lines = []
    for i in range(n):
        a, b, c = texts[3 * i : 3 * i + 3]
        lines.append(f"{a}\t{a[1:]}\t{c}" if triples else f"{a}\t{b if i % 2 else a[1:]}\t{i % 2 and 1 or 4}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("objective", ["cosent", "sup_simcse", "sbert"])
def test_supervised_objectives_train(tmp_path, objective):
    from pipeline.train.run import run

    f = _pairs_file(tmp_path / "data.tsv", triples=objective == "sup_simcse")
    over = {
        "loss": [{objective: {"num_labels": 5} if objective == "sbert" else {}}],
        "data.shards": None,
        "data.supervised_file": str(f),
        "train.max_steps": 4,
        "run_dir": str(tmp_path / "run"),
        "train.eval_max_pairs": 32,
    }
    cfg = load_config(Config, DEBUG, over)
    assert run(cfg) == 0
    steps = [r for r in read_metrics(cfg.run_dir) if "loss" in r]
    assert len(steps) == 4 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["samples_seen"] == 64


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, shards):
    """3 steps, stop, resume to 6 == 6 steps uninterrupted (queue, momentum encoder, cursor, RNG)."""
    common = {"loss": debug_luse(momentum=0.9), "train.debug_dump": True, "train.eval_max_pairs": 16}

    def make_cfg(run_dir, steps):
        return debug_cfg(tmp_path, shards, **{**common, "run_dir": str(run_dir), "train.max_steps": steps})

    full, resumed = full_and_resumed(tmp_path, make_cfg, stop=3, total=6)
    assert resumed["step"] == 6 and resumed["cursor"] == full["cursor"]
    assert resumed["queue_checksum"] == full["queue_checksum"]
    assert resumed["param_checksum"] == full["param_checksum"]
    losses = lambda d: [r["loss"] for r in read_metrics(d) if "loss" in r]  # noqa: E731
    assert losses(tmp_path / "split")[-3:] == losses(tmp_path / "full")[-3:]


def test_an_error_mid_run_stops_the_loader_workers(tmp_path, shards):
    """Workers ignore SIGTERM (preemption signals are the main process's), so multiprocessing's exit
    handler cannot end them: a run that raised while its loader was open hung at interpreter exit.
    The loop now closes the loader on every way out."""
    import multiprocessing

    from accelerate.state import AcceleratorState

    from pipeline.train.run import run

    def fail_at_step_2(trainer, batch):
        if trainer.state.step == 2:
            raise RuntimeError("disk full")

    cfg = debug_cfg(tmp_path, shards, **{"data.num_workers": 1, "train.max_steps": 6})
    AcceleratorState._reset_state(True)
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="disk full") as raised:
        run(cfg, fail_at_step_2)
    # the traceback (held by `raised`) keeps the loop's frame alive, as it does while Python exits
    assert raised.traceback is not None
    assert set(multiprocessing.active_children()) - before == set()


def test_a_scratch_model_without_a_config_file_is_the_package_s_small_bert(tmp_path, shards):
    """model.scratch_config left empty: the BertConfig shipped inside the package (an installed wheel has
    no launch/ folder), not a path into the source checkout."""
    from pipeline.model.vocab import SCRATCH_SMALL, read_model_config
    from pipeline.train.build import build_encoder

    cfg = debug_config(tmp_path, shards, **{"model.scratch_config": None, "run_dir": str(tmp_path / "r")})
    assert cfg.model.scratch_config is None and SCRATCH_SMALL.is_relative_to(PROJECT_ROOT / "pipeline")
    config = build_encoder(cfg).backbone.config
    wanted = read_model_config(SCRATCH_SMALL)
    assert (config.hidden_size, config.num_hidden_layers) == (
        wanted["hidden_size"],
        wanted["num_hidden_layers"],
    )


def test_unk_rate_counts_unknown_tokens_without_specials(tmp_path):
    from pipeline.model.vocab import build_char_vocab, make_tokenizer, unk_rate, write_vocab

    write_vocab(build_char_vocab(["你好世界"], 1, 200), tmp_path / "vocab.txt")
    tokenizer = make_tokenizer(tmp_path / "vocab.txt")
    assert unk_rate(tokenizer, ["你好", "世界"]) == 0.0
    assert unk_rate(tokenizer, ["你好吗", "界"]) == 0.25  # 吗 is unknown: 1 of 4 tokens
    assert unk_rate(tokenizer, []) == 0.0
