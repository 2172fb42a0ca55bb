"""``python -m pipeline export CHECKPOINT --out DIR [--push-to-hub OWNER/NAME]``.

Writes a standard sentence-transformers folder that ``SentenceTransformer(DIR)`` and
``transformers.AutoModel.from_pretrained(DIR)`` load without our code::

    DIR/config.json, model.safetensors, tokenizer.json, tokenizer_config.json   the transformer
    DIR/modules.json                  Transformer -> [WeightedLayerPooling] -> Pooling -> Normalize
    DIR/sentence_bert_config.json     max_seq_length
    DIR/config_sentence_transformers.json   the text prefix as the default prompt ("query")
    DIR/1_Pooling/config.json         cls or mean pooling
    DIR/N_Normalize/                  L2 normalisation (cosine = dot product)
    DIR/README.md                     model card: YAML metadata, training recipe, evaluation table

``--whitening [--whitening-dim k]`` fits BERT-whitening on bundled corpus sentences (never on a
scored set) and writes it as stock modules: ``Pooling -> Normalize -> Dense (identity activation,
weight W^T, bias -mu W) -> Normalize``, so ``SentenceTransformer(DIR).encode`` returns whitened vectors.

``--calibrate`` fits a monotone map cosine -> P(same meaning) on labelled training pairs (default: the
bundled STS-B train split; never a scored set) and stores it as ``DIR/similarity_calibration.json``
(:mod:`pipeline.evaluate.calibration`), with its held-out Brier score, ECE and a threshold table in the
card; ``python -m pipeline similarity DIR "句子一" "句子二"`` reads it.

A run trained with the ``matryoshka`` loss term (docs/objectives.md) needs nothing more in the folder:
``SentenceTransformer(DIR, truncate_dim=k)`` keeps the first k dimensions and
``encode(..., normalize_embeddings=True)`` re-normalises them, which is what our
``SentenceEncoder.encode(texts, truncate_dim=k)`` returns. The card lists the trained widths (the
run's ``matryoshka.dims`` and the full width, or ``--matryoshka-dims``) with their scores from the
``dims`` of eval.json (``eval --dims``).

``first_last_avg`` (mean of the first and last layer's mean-pooled states) is exact in stock modules:
a ``WeightedLayerPooling`` over layers 1..L with weights (1, 0, ..., 0, 1) averages the two layers per
token, and mean pooling is linear, so mean-then-average equals average-then-mean.
The module files use the long-standing ``sentence_transformers.models.*`` names and
``pooling_mode_*`` keys, which every sentence-transformers release from 2.x to 6.x reads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.config import option
from pipeline.errors import ConfigError, InputError
from pipeline.losses import trained_loss
from pipeline.model.st_folder import dense_config, write_module_files

log = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
VERIFY_SENTENCES = [
    "今天天气很好。",
    "花呗怎么还款",
    "一个男人在弹吉他，旁边有一只狗在睡觉。",
    "hello world 123",
    "好",
]


@dataclass
class Config:
    checkpoint: str = option(
        "", "CHECKPOINT: our checkpoint, run dir, model folder or DeepSpeed ZeRO checkpoint folder."
    )
    out: Path | None = option(None, "Output folder for the sentence-transformers model (required).")
    overwrite: bool = option(False, "Replace --out if it already holds an export (or is empty).")
    push_to_hub: str | None = option(
        None, "Also upload to this Hub repo (OWNER/NAME); token from HF_TOKEN or login."
    )
    private: bool = option(False, "Create the Hub repo as private.")
    eval_json: Path | None = option(
        None, "eval.json for the model card's table (default: the checkpoint's or run's eval/eval.json)."
    )
    license: str = option("apache-2.0", "License named in the model card metadata.")
    select: Literal["latest", "best"] = option("latest", "For a run directory: which checkpoint to export.")
    skeleton: Path | None = option(
        None,
        "DeepSpeed checkpoint: model folder with config/tokenizer/encoder.json (default: found beside it).",
    )
    verify: bool = option(True, "Reload the written folder with transformers and compare embeddings (1e-5).")
    pooling: Literal["cls", "mean", "first_last_avg"] | None = option(
        None, "Override the model's pooling (empty = the folder's rule; needed for a folder without one)."
    )
    prefix: str | None = option(
        None, "Override the text prefix put before every sentence (empty = the folder's rule)."
    )
    whitening: bool = option(
        False, "Fit BERT-whitening on bundled corpus sentences and export it as a Dense module."
    )
    whitening_dim: int | None = option(None, "Keep this many whitened dimensions (empty = all).")
    whitening_sentences: int = option(10000, "How many corpus sentences to fit the whitening on.")
    seed: int = option(0, "Seed of the corpus sample for whitening (and of the calibration split).")
    calibrate: bool = option(
        False, "Fit cosine -> P(same meaning) on labelled pairs; write similarity_calibration.json."
    )
    calibration_pairs: Path | None = option(
        None, "Labelled pairs to fit on (.tsv/.jsonl; default: the bundled STS-B train split)."
    )
    calibration_holdout: Path | None = option(
        None,
        "Labelled pairs for Brier/ECE (default: bundled STS-B valid with the default pairs, else a "
        "seeded 20% of --calibration-pairs held out from the fit).",
    )
    calibration_positive: float | None = option(
        None, "A pair means the same when label >= this (empty: 1 for 0/1 labels, 4 for 0-5 scores)."
    )

    # `--matryoshka-dims 384,256,128,64` arrives as one string, `--matryoshka-dims 128` as an int: parsed in
    # __post_init__
    matryoshka_dims: list[int | str] | int = option(
        factory=list,
        help="Matryoshka widths the card lists, e.g. 384,256,128,64 (empty: the run's matryoshka.dims "
        "and the full width, if it trained that term).",
    )

    def __post_init__(self) -> None:
        from pipeline.evaluate.run import parse_dims

        self.matryoshka_dims = parse_dims(self.matryoshka_dims, "--matryoshka-dims")
        if self.matryoshka_dims and self.whitening:
            raise ConfigError(
                "--matryoshka-dims with --whitening: the whitening rotates the space the prefixes were "
                "trained in; export the Matryoshka model without --whitening"
            )
        if not self.checkpoint:
            raise ConfigError("name the CHECKPOINT to export (a checkpoint, run dir or model folder)")
        if self.out is None:
            raise ConfigError("--out DIR is required: the folder to write the sentence-transformers model to")
        if self.push_to_hub is not None:
            check_repo_id(self.push_to_hub)
        if self.whitening_dim is not None and self.whitening_dim < 1:
            raise ConfigError("--whitening-dim must be >= 1 (or empty for all dimensions)")
        if self.whitening_sentences < 2:
            raise ConfigError("--whitening-sentences must be >= 2")


def check_repo_id(repo_id: str) -> None:
    """OWNER/NAME with letters, digits, '-', '_', '.'; raises ConfigError saying what is wrong."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not REPO_ID.match(repo_id):
        raise ConfigError(
            f"--push-to-hub {repo_id!r} is not a Hub repo id; "
            "write OWNER/NAME using letters, digits, '-', '_', '.'"
        )
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConfigError(
            f"--push-to-hub {repo_id!r} is not a valid repo id: {str(exc).splitlines()[0]}"
        ) from None


# ------------------------------------------------------------------------------------ the folder
def write_sentence_transformers_folder(encoder: Any, out: Path) -> None:
    """The transformer files plus the module files; ``out`` must not exist yet or be empty."""
    backbone, tokenizer = encoder.backbone, encoder.tokenizer
    num_layers = int(backbone.config.num_hidden_layers)
    config_flag = backbone.config.output_hidden_states
    tokenizer_max = tokenizer.model_max_length
    # WeightedLayerPooling reads all layers only if the saved config asks the model to return them;
    # the tokenizer's model_max_length is the truncation length sentence-transformers applies.
    backbone.config.output_hidden_states = encoder.pooling == "first_last_avg"
    tokenizer.model_max_length = encoder.max_length
    try:
        backbone.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    finally:
        backbone.config.output_hidden_states = config_flag
        tokenizer.model_max_length = tokenizer_max
    _add_identity_pooler(backbone, out)
    prompts = {"query": encoder.prefix} if encoder.prefix else {}
    hidden, max_length = int(backbone.config.hidden_size), encoder.max_length
    default_prompt = "query" if prompts else None
    write_module_files(
        out, encoder.pooling, hidden, num_layers, max_length, prompts, default_prompt, dense_config(encoder)
    )
    if encoder.dense is not None:
        from safetensors.torch import save_file

        dense_dir = next(out.glob("*_Dense"))
        tensors = {"linear.weight": encoder.dense.weight.detach().contiguous()}
        if encoder.dense.bias is not None:
            tensors["linear.bias"] = encoder.dense.bias.detach().contiguous()
        save_file(tensors, str(dense_dir / "model.safetensors"))


def _add_identity_pooler(backbone: Any, out: Path) -> None:
    """Give a pooler-less BERT an identity pooler so that loaders do not warn about missing weights.

    Our encoder never uses BERT's pooler (it is built without one), but ``AutoModel`` and
    sentence-transformers build ``BertModel`` with a pooler and would report it as randomly
    initialised on every load. With W = I and b = 0, ``pooler_output`` is tanh of the [CLS] state:
    deterministic and documented in the model card rather than random.
    """
    import torch
    from safetensors.torch import load_file, save_file

    weights_file = out / "model.safetensors"
    if (
        getattr(backbone.config, "model_type", None) != "bert"
        or getattr(backbone, "pooler", None) is not None
    ):
        return
    if not weights_file.is_file():  # sharded weights: leave them as transformers wrote them
        log.info("weights are sharded; the exported BERT keeps no pooler (loaders will report it missing)")
        return
    tensors = load_file(str(weights_file))
    hidden = int(backbone.config.hidden_size)
    tensors["pooler.dense.weight"] = torch.eye(
        hidden, dtype=tensors["embeddings.word_embeddings.weight"].dtype
    )
    tensors["pooler.dense.bias"] = torch.zeros(hidden, dtype=tensors["pooler.dense.weight"].dtype)
    save_file(tensors, str(weights_file), metadata={"format": "pt"})


def verify_folder(encoder: Any, out: Path, atol: float = 1e-5) -> float:
    """Reload ``out`` with plain transformers, pool as the modules say, compare with ``encoder``."""
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    from pipeline.model.encoder import pool

    model = AutoModel.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    texts = [encoder.prefix + t for t in VERIFY_SENTENCES]
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
        loaded = encoder.head(pool(states, batch["attention_mask"], encoder.pooling))
    ours = encoder.encode(VERIFY_SENTENCES)
    error = float(np.abs(loaded.numpy() - ours).max())
    if error > atol:
        raise InputError(
            f"exported folder {out} does not reproduce the encoder (max |diff| {error:.2e} > {atol})"
        )
    return error


def add_whitening(encoder: Any, cfg: Config) -> dict[str, Any]:
    """Fit BERT-whitening on a seeded sample of bundled corpus sentences; set it as ``encoder.dense``.

    Fitted on the encoder's normalised output, as ``eval --whitening`` does, so the exported head is
    Normalize -> Dense -> Normalize. Never fitted on evaluation sentences: the scored sets stay unseen.
    """
    from pipeline.evaluate.run import corpus_sentences
    from pipeline.evaluate.whitening import as_linear, fit_whitening

    if encoder.dense is not None:
        raise InputError("the model already ends in a Dense module; export --whitening needs one without")
    sentences = corpus_sentences(cfg.whitening_sentences, cfg.seed)
    vectors = encoder.encode(sentences, progress=True, desc="whitening")  # (N, H)
    dim = None if cfg.whitening_dim is None else min(cfg.whitening_dim, vectors.shape[1])
    if len(vectors) < vectors.shape[1]:
        log.warning("whitening fitted on %d sentences for %d dimensions: the covariance is rank-deficient",
                    len(vectors), vectors.shape[1])  # fmt: skip
    encoder.dense = as_linear(fit_whitening(vectors, dim)).to(next(encoder.parameters()).dtype)
    encoder.dense_activation, encoder.normalize_before_dense = "identity", True
    return {"source": "bundled People's Daily corpus (1998-01)", "sentences": len(sentences),
            "dim": encoder.dim, "seed": cfg.seed}  # fmt: skip


SCORED_SETS = ("ATEC.test.tsv", "BQ.dev.tsv", "LCQMC.dev.tsv", "PAWSX.dev.tsv", "STS-B.test.tsv")


def add_calibration(encoder: Any, cfg: Config) -> Any:
    """Fit cosine -> P(same meaning) (isotonic) on labelled pairs; Brier/ECE/thresholds on held-out pairs.

    The scored evaluation sets are refused as fitting data: a calibration fitted on them would make
    the evaluation and the thresholds in the card optimistic.
    """
    import numpy as np

    from pipeline.evaluate import calibration as cal
    from pipeline.evaluate.sts import EVAL_DIR, embed_pair_set, read_pair_file

    default = cfg.calibration_pairs is None
    fit_path = EVAL_DIR / "STS-B.train.tsv" if default else Path(cfg.calibration_pairs)
    scored = {(EVAL_DIR / name).resolve() for name in SCORED_SETS}
    for path in (fit_path, cfg.calibration_holdout):
        if path is not None and Path(path).resolve() in scored:
            raise InputError(f"{path} is a scored evaluation set; calibrate on training pairs instead")
    if not fit_path.is_file():
        raise InputError(f"--calibration-pairs {fit_path} does not exist")

    def cosines(pairs: Any) -> np.ndarray:
        embed = lambda texts: encoder.encode(texts, progress=True, desc="calibration")  # noqa: E731
        return embed_pair_set(embed, pairs).cosines()

    pairs = read_pair_file(fit_path)
    scores = cosines(pairs)
    positive, rule = cal.positive_labels(pairs.labels, cfg.calibration_positive)
    holdout_path = cfg.calibration_holdout or (EVAL_DIR / "STS-B.valid.tsv" if default else None)
    if holdout_path is None:
        fit, held = cal.split_indices(len(pairs), 0.2, cfg.seed)
        held_scores, held_positive = scores[held], positive[held]
        held_name = f"{fit_path.name}: a seeded 20% ({len(held)} pairs, seed {cfg.seed}) left out of the fit"
        scores, positive = scores[fit], positive[fit]
    else:
        held_pairs = read_pair_file(holdout_path)
        held_scores = cosines(held_pairs)
        held_positive, _ = cal.positive_labels(held_pairs.labels, cfg.calibration_positive)
        held_name = Path(holdout_path).name
    calibration = cal.fit_isotonic(scores, positive)
    calibration.info = {
        "what": "P(the two sentences mean the same | cosine of their embeddings under this model)",
        "fitted_on": {
            "file": fit_path.name,
            "pairs": int(len(scores)),
            "positives": int(positive.sum()),
            "positive_rule": rule,
        },  # fmt: skip
        "held_out": {"file": held_name, **cal.summary(calibration, held_scores, held_positive)},
        "thresholds": cal.threshold_table(calibration, held_scores, held_positive),
        "transfer": cal.TRANSFER,
    }
    return calibration


def calibration_card(calibration: Any) -> list[str]:
    """The model card's section on the calibration file: held-out figures and the threshold table."""
    from pipeline.evaluate.calibration import CALIBRATION_FILE
    from pipeline.evaluate.tables import markdown_table

    info = calibration.info
    held, fitted = info["held_out"], info["fitted_on"]
    rows = [
        [f"{r['probability']:.1f}", _fmt(r["cosine"]), _fmt(r["precision"]), _fmt(r["recall"]),
         r["predicted_positive"]]
        for r in info["thresholds"]
    ]  # fmt: skip
    return [
        "## Calibrated similarity\n",
        f"`{CALIBRATION_FILE}` maps the cosine of two embeddings to the probability that the two sentences "
        f"mean the same ({calibration.method} regression, fitted on {fitted['pairs']} pairs of "
        f"`{fitted['file']}`, same meaning = {fitted['positive_rule']}). "
        '`python -m pipeline similarity THIS_FOLDER "句子一" "句子二"` prints both.\n',
        f"On held-out pairs ({held['file']}; {held['pairs']} pairs, {held['positives']} positive): Brier "
        f"score {held['brier']:.4f} (always predicting the base rate: {held['brier_base_rate']:.4f}), "
        f"expected calibration error {held['ece']:.4f} ({held['ece_bins']} bins).\n",
        'Calling a pair "same meaning" when P >= p, on the same held-out pairs:\n',
        markdown_table(["P >=", "cosine >=", "precision", "recall", "pairs called"], rows) + "\n",
        f"{info['transfer']}\n",
    ]


def _fmt(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


# ------------------------------------------------------------------------------------ model card
def find_config_yaml(resolved: Any) -> dict[str, Any]:
    candidates = []
    for folder in (resolved.checkpoint_dir, resolved.run_dir):
        if folder is not None:
            candidates.append(Path(folder) / "config.yaml")
    if resolved.kind == "deepspeed":
        zero = Path(resolved.model_dir)
        candidates += [
            zero / "config.yaml",
            zero.parent / "config.yaml",
            Path(resolved.skeleton_dir).parent / "config.yaml",
        ]
    for path in candidates:
        if path.is_file():
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
            except yaml.YAMLError as exc:
                log.warning("ignoring unreadable %s in the model card: %s", path, str(exc).splitlines()[0])
                continue
            if isinstance(data, dict):
                return data
    return {}


def find_eval_json(resolved: Any, explicit: Path | None) -> dict[str, Any] | None:
    if explicit is not None:
        if not explicit.is_file():
            raise InputError(f"--eval-json {explicit} does not exist")
        candidates = [explicit]
    else:
        folders = [
            resolved.checkpoint_dir,
            resolved.run_dir,
            resolved.model_dir if resolved.kind != "hub" else None,
        ]
        candidates = [
            Path(f) / sub for f in folders if f is not None for sub in ("eval/eval.json", "eval.json")
        ]
    for path in candidates:
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return None


def final_model_event(resolved: Any) -> dict[str, Any] | None:
    """The run's ``final_model`` record in metrics.jsonl (which step was exported, and whether it is the
    initial model) when ``resolved`` is that model: RUN_DIR/model, or the checkpoint of that step."""
    model_dir = Path(resolved.model_dir) if resolved.model_dir else None
    step = None
    if resolved.kind == "model" and model_dir is not None and model_dir.name == "model":
        run_dir = model_dir.parent  # RUN_DIR/model: the run's final model
    elif resolved.kind == "checkpoint" and resolved.run_dir and resolved.checkpoint_dir:
        run_dir, step = Path(resolved.run_dir), Path(resolved.checkpoint_dir).name.rpartition("-")[2]
    else:
        return None
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    found = None
    for line in metrics.read_text(encoding="utf-8").splitlines():
        if '"final_model"' in line:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == "final_model":
                found = record
    if found is None or (step is not None and (not step.isdigit() or int(step) != found.get("step"))):
        return None
    return found


def matryoshka_dims(config: dict[str, Any], explicit: list[int], width: int, whitened: bool) -> list[int]:
    """The widths the card lists: ``explicit`` (each <= ``width``), else the run's matryoshka.dims and
    the full width; none for a whitened export (the whitening rotates the space the prefixes were
    trained in) or a run without the term."""
    if explicit:
        wide = [d for d in explicit if d > width]
        if wide:
            raise ConfigError(
                f"--matryoshka-dims {wide}: the model's embeddings are {width}-d; keep them <= {width}"
            )
        return explicit
    entry = next((e for e in config.get("loss") or [] if isinstance(e, dict) and "matryoshka" in e), None)
    if entry is None or whitened:
        return []
    trained = (entry["matryoshka"] or {}).get("dims") or [256, 128, 64]
    return sorted({width, *(d for d in trained if d <= width)}, reverse=True)


def matryoshka_card(dims: list[int], result: dict[str, Any] | None, name: str) -> list[str]:
    """The card's section on the Matryoshka widths: usage and each width's avg5 and probe (eval --dims)."""
    from pipeline.evaluate.tables import markdown_table

    lines = [
        "## Matryoshka dimensions\n",
        f"Trained so that the first k dimensions, re-normalised, are an embedding of their own, for k in "
        f"{', '.join(map(str, dims))}: {dims[-1]} of {dims[0]} dimensions are stored and searched at "
        f"{dims[-1] / dims[0]:.0%} of the cost.\n",
        "```python\nfrom sentence_transformers import SentenceTransformer\n\n"
        f'model = SentenceTransformer("{name}", truncate_dim={dims[len(dims) // 2]})\n'
        'embeddings = model.encode(["今天天气很好", "今天是个好天气"], normalize_embeddings=True)\n```\n',
        "`truncate_dim` keeps the first k dimensions; `normalize_embeddings=True` re-normalises them (or "
        "compare with `model.similarity`, a cosine).\n",
    ]
    scored = (result or {}).get("dims") or {}
    rows = []
    for dim in dims:
        entry = scored.get(str(dim)) or {}
        rows.append([dim, (entry.get("sts") or {}).get("avg5"), (entry.get("probe") or {}).get("accuracy")])
    if any(r[1] is not None or r[2] is not None for r in rows):
        lines.append(markdown_table(["dims", "avg5 (Spearman x100)", "probe accuracy"], rows) + "\n")
    else:
        lines.append(
            f"Not evaluated per width yet: run `python -m pipeline eval CHECKPOINT --dims "
            f"{','.join(map(str, dims))}` and export again.\n"
        )
    return lines


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def recipe_rows(config: dict[str, Any], checkpoint_info: dict[str, Any]) -> list[tuple[str, Any]]:
    """The training recipe as (what, value) rows; fields the config lacks are left out."""
    loss = trained_loss(config)  # the terms trained; an earlier version's `objective:` read as training did
    rows = [
        ("corpus", _get(config, "data.shards")),
        ("loss", loss["loss"]),
        ("objective", loss["objective"]),
        ("temperature", loss["temperature"]),
        ("augmented views per sentence (k)", _get(config, "data.num_variants")),
        ("dropout views (d)", _get(config, "data.num_dropout_views")),
        ("negative queue size", loss["queue_size"]),
        ("momentum encoder", loss["momentum"]),
        ("global batch size", _get(config, "train.global_batch_size")),
        ("peak learning rate", _get(config, "optim.lr")),
        ("max steps (config)", _get(config, "train.max_steps")),
        ("steps trained", checkpoint_info.get("step")),
        ("samples seen", checkpoint_info.get("samples_seen")),
    ]
    return [(k, v) for k, v in rows if v is not None]


def model_card(
    encoder: Any,
    resolved: Any,
    config: dict[str, Any],
    result: dict[str, Any] | None,
    license: str,
    repo_id: str | None,
    whitening: dict[str, Any] | None = None,
    calibration: Any = None,
    dims: list[int] | None = None,
) -> str:
    from pipeline.evaluate.resolve import describe
    from pipeline.evaluate.tables import markdown_table, result_markdown

    terms = trained_loss(config)["terms"]
    metadata = {
        "language": ["zh"],
        "license": license,
        "library_name": "sentence-transformers",
        "pipeline_tag": "sentence-similarity",
        "tags": ["sentence-transformers", "sentence-similarity", "feature-extraction", "chinese"] + terms,
    }
    front = yaml.safe_dump(metadata, allow_unicode=True, sort_keys=False)
    name = repo_id or "PATH/TO/THIS/FOLDER"
    pooling_text = {
        "cls": "the [CLS] token's final hidden state",
        "mean": "the mean of the final hidden states over non-padding tokens",
        "first_last_avg": "the average of the mean-pooled first and last transformer layers",
    }[encoder.pooling]
    lines = [
        f"---\n{front}---\n",
        f"# {repo_id.split('/')[-1] if repo_id else 'Chinese sentence encoder'}\n",
        f"A Chinese sentence encoder ({encoder.dim}-dimensional, L2-normalised embeddings; "
        "cosine similarity = dot product). "
        f"Sentences are truncated at {encoder.max_length} tokens and pooled with {pooling_text}.\n",
        *(
            [
                f"Every text is prefixed with `{encoder.prefix}` (the folder's default prompt, which "
                "`SentenceTransformer.encode` applies by itself; with plain `transformers`, prepend it).\n"
            ]
            if encoder.prefix
            else []
        ),
        *(
            [
                f"The embeddings are BERT-whitened (Su et al. 2021) to {whitening['dim']} dimensions: the "
                f"`Dense` module maps the normalised pooled vector x to (x - mu) W, fitted on "
                f"{whitening['sentences']} sentences of the {whitening['source']} (no evaluation sentence), "
                "then `Normalize`. The evaluation table below is of the model before whitening.\n"
            ]
            if whitening
            else []
        ),
        "## Usage\n",
        "```python\nfrom sentence_transformers import SentenceTransformer\n\n"
        f'model = SentenceTransformer("{name}")\n'
        'embeddings = model.encode(["今天天气很好", "今天是个好天气"])\n'
        "print(embeddings @ embeddings.T)\n```\n",
        "With plain `transformers`, load `AutoModel`/`AutoTokenizer` from the same folder, pool as described "
        "above and L2-normalise. BERT's pooler was not trained: the export holds an identity pooler "
        "(`pooler_output` = tanh of the [CLS] state); do not use `pooler_output` as the sentence "
        "embedding.\n",
        "## Training recipe\n",
    ]
    rows = recipe_rows(config, describe(resolved))
    if rows:
        lines.append(markdown_table(["setting", "value"], [[k, v] for k, v in rows]) + "\n")
    else:
        lines.append("No training configuration was found beside the checkpoint.\n")
    selected = final_model_event(resolved)
    if selected and selected.get("initial_weights"):
        lines.append(
            "**No training step beat the initial model** on STS-B valid "
            f"({selected['sts_b_valid_spearman']:.2f} at step 0): these are the initial weights.\n"
        )
    elif selected and selected.get("sts_b_valid_spearman") is not None:
        lines.append(
            f"Exported weights: step {selected['step']} ({selected['selected']}), STS-B valid "
            f"{selected['sts_b_valid_spearman']:.2f}; step 0 (the initial model) was a candidate.\n"
        )
    if calibration is not None:
        lines += calibration_card(calibration)
    if dims:
        lines += matryoshka_card(dims, result, name)
    lines.append("## Evaluation\n")
    if result:
        lines.append(
            "Spearman x100 between cosine similarity and the gold label on ATEC, BQ, LCQMC, PAWSX and STS-B; "
            "avg5 is their mean. The char TF-IDF row is the floor a learned encoder must beat.\n"
        )
        lines.append(result_markdown(result, heading_level=3))
    else:
        lines.append("Not evaluated yet: run `python -m pipeline eval CHECKPOINT` and export again.\n")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the Hub
def hub_token() -> str:
    """The token from HF_TOKEN or the login cache (huggingface_hub.get_token); never printed or stored."""
    import huggingface_hub

    token = huggingface_hub.get_token()
    if not token:
        raise InputError("no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again")
    return token


def push_folder(folder: Path, repo_id: str, token: str, private: bool = False) -> str:
    """create_repo + upload_folder with ``token``; returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message="Upload sentence encoder (pipeline export)",
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise InputError(
            f"Hub upload to {repo_id} failed (HTTP {status}); check the repo id and the token's rights"
        ) from None
    except (OSError, ValueError) as exc:  # connection errors; ValueError: the Hub rejected the card's YAML
        raise InputError(f"Hub upload to {repo_id} failed: {str(exc).splitlines()[0]}") from None
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")


# ------------------------------------------------------------------------------------ entry
def _prepare_out(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not overwrite:
        raise InputError(
            f"output folder {out} exists; pass --overwrite to replace it or choose another --out"
        )
    from pipeline.model.rules import ENCODER_FILE

    # model folders we save (training, checkpoints, models fetch) have modules.json too, and encoder.json
    earlier_export = (out / "modules.json").is_file() and not (out / ENCODER_FILE).is_file()
    if not out.is_dir() or (any(out.iterdir()) and not earlier_export):
        raise InputError(
            f"--overwrite refuses to delete {out}: it is not an earlier export (no modules.json, or a "
            f"model folder with {ENCODER_FILE})"
        )


def run(cfg: Config) -> int:
    from pipeline.evaluate import resolve

    out = Path(cfg.out)
    _prepare_out(out, cfg.overwrite)
    token = hub_token() if cfg.push_to_hub else None  # fail before the work, not after it
    resolved = resolve.resolve(cfg.checkpoint, cfg.select, cfg.skeleton)
    result = find_eval_json(resolved, cfg.eval_json)
    encoder = resolve.load_encoder(resolved, pooling=cfg.pooling, prefix=cfg.prefix)
    whitening = add_whitening(encoder, cfg) if cfg.whitening else None
    calibration = add_calibration(encoder, cfg) if cfg.calibrate else None
    config = find_config_yaml(resolved)
    dims = matryoshka_dims(config, cfg.matryoshka_dims, encoder.dim, whitening is not None)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_sentence_transformers_folder(encoder, tmp)
        card = model_card(
            encoder, resolved, config, result, cfg.license, cfg.push_to_hub, whitening, calibration, dims
        )  # fmt: skip
        if calibration is not None:
            from pipeline.evaluate.calibration import CALIBRATION_FILE

            calibration.save(tmp / CALIBRATION_FILE)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        if cfg.verify:
            error = verify_folder(encoder, tmp)
            log.info("reloaded export matches the encoder (max |diff| %.1e)", error)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    whitened = ", whitened" if whitening else ""
    nested = f", Matryoshka dims {','.join(map(str, dims))}" if dims else ""
    print(
        f"wrote sentence-transformers folder {out} ({encoder.pooling} pooling{whitened}, dim {encoder.dim}"
        f"{nested})"
    )
    if calibration is not None:
        held = calibration.info["held_out"]
        print(f"calibration: held-out {held['file']}: Brier {held['brier']:.4f}, ECE {held['ece']:.4f}")
    if cfg.push_to_hub:
        url = push_folder(out, cfg.push_to_hub, token, cfg.private)
        print(f"pushed {out} to {url}")
    return 0
