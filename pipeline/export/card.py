"""The model card: YAML metadata the Hub reads, and the text a user reads, generated from the run."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError, InputError
from pipeline.losses import trained_loss
from pipeline.run_layout import MODEL_DIR, step_of

log = logging.getLogger(__name__)


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
    if resolved.kind == "model" and model_dir is not None and model_dir.name == MODEL_DIR:
        run_dir = model_dir.parent  # RUN_DIR/model: the run's final model
    elif resolved.kind == "checkpoint" and resolved.run_dir and resolved.checkpoint_dir:
        run_dir, step = Path(resolved.run_dir), step_of(Path(resolved.checkpoint_dir).name)
        if step is None:  # not one of the run's step-* checkpoints
            return None
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
    if found is None or (step is not None and step != found.get("step")):
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
    trained = trained_loss(config)["prefix_dims"] if config.get("loss") else None
    if trained is None or whitened:
        return []
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


def fmt_number(value: Any) -> str:
    """A value as the card prints it: every number in a form that keeps its magnitude.

    1e-3 is "0.001", 3e-5 is "3e-5" (never "0.00"), 0.995 stays "0.995", 28800 is "28,800"; booleans are
    yes/no and lists are comma-separated.
    """
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if value.is_integer() and abs(value) < 1e15:
            return f"{int(value):,}"
        if abs(value) < 1e-3 or abs(value) >= 1e6:
            mantissa, exponent = f"{value:.2e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_number(v) for v in value)
    return str(value)


def recipe_rows(config: dict[str, Any], checkpoint_info: dict[str, Any]) -> list[tuple[str, Any]]:
    """The training recipe as (what, value) rows; fields the config lacks are left out."""
    loss = trained_loss(config)  # the terms trained; an earlier version's `objective:` read as training did
    rows = [
        ("loss", loss["loss"]),
        ("objective", loss["objective"]),
        ("temperature", loss["temperature"]),
        ("augmented views per sentence (k)", _get(config, "data.num_variants")),
        ("dropout views (d)", _get(config, "data.num_dropout_views")),
        *loss["rows"],  # what the terms say of themselves (luse: its queue size and momentum)
        ("global batch size", _get(config, "train.global_batch_size")),
        ("peak learning rate", _get(config, "optim.lr")),
        ("weight decay", _get(config, "optim.weight_decay")),
        ("warmup steps", _get(config, "optim.warmup_steps")),
        ("max sequence length (training)", _get(config, "data.max_length")),
        ("precision", _get(config, "train.precision")),
        ("max steps (config)", _get(config, "train.max_steps")),
        ("steps trained", checkpoint_info.get("step")),
        ("samples seen", checkpoint_info.get("samples_seen")),
    ]
    return [(k, v) for k, v in rows if v is not None]


# ------------------------------------------------------------------------------------ the corpus
def corpus_manifests(shards: str | None) -> list[dict[str, Any]]:
    """The manifests from the training shards back to the preprocessed corpus (each stage's manifest
    names its input shards in ``config.shards``); [] when the shards are not on this machine."""
    chain: list[dict[str, Any]] = []
    seen: set[Path] = set()
    current = Path(shards) if shards else None
    while current is not None and (current / "manifest.json").is_file() and current.resolve() not in seen:
        seen.add(current.resolve())
        try:
            manifest = json.loads((current / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            break
        chain.append(manifest)
        upstream = (manifest.get("config") or {}).get("shards")
        current = Path(upstream) if isinstance(upstream, str) else None
    return chain


def corpus_lines(shards: str | None) -> list[str]:
    """The card's section on the training text: collections, counts and cleaning, from the manifests."""
    chain = corpus_manifests(shards)
    if not chain:
        return ["The training shards' manifests were not found beside the run, so the corpus cannot be "
                "described here.\n"]  # fmt: skip
    lines = []
    by_stage = {m.get("stage"): m for m in chain}
    pre = by_stage.get("preprocess")
    if pre:
        config, counts = pre.get("config") or {}, pre.get("counts") or {}
        inputs = [Path(p).name for p in config.get("inputs") or []]
        dropped = {k: v for k, v in (counts.get("dropped") or {}).items() if v}
        rules = {k: v for k, v in ((pre.get("audit") or {}).get("rules") or {}).items() if v}
        lines.append(
            f"- **Collections**: {', '.join(f'`{n}`' for n in inputs) or 'not recorded'} "
            f"({fmt_number(counts.get('records'))} records, {fmt_number(counts.get('sentences_split'))} "
            f"sentences after splitting).\n"
            f"- **Cleaning** (`python -m pipeline preprocess`): kept {fmt_number(counts.get('kept'))} "
            f"sentences of {fmt_number(config.get('min_chars'))}–{fmt_number(config.get('max_chars'))} "
            f"characters with a CJK share of at least {fmt_number(config.get('min_cjk_ratio'))}; dropped "
            + (", ".join(f"{k.replace('_', ' ')} {fmt_number(v)}" for k, v in dropped.items()) or "none")
            + "; fields changed by cleaning rules: "
            + (", ".join(f"{k.replace('_', ' ')} {fmt_number(v)}" for k, v in rules.items()) or "none")
            + (
                f"; near-duplicates removed (MinHash, {config.get('near_dup_bands')} bands)"
                if config.get("near_duplicates")
                else "; exact duplicates removed"
            )  # fmt: skip
            + ".\n"
        )
    aug = by_stage.get("augment")
    if aug:
        config, counts = aug.get("config") or {}, aug.get("counts") or {}
        lines.append(
            f"- **Augmentation** (EDA, Wei and Zou 2019): {fmt_number(config.get('num_variants'))} variants "
            f"per sentence by {', '.join(config.get('ops') or [])} with {config.get('synonyms')} synonyms "
            f"({fmt_number(counts.get('variants'))} variants of {fmt_number(counts.get('sentences'))} "
            "sentences).\n"
        )
    teacher = by_stage.get("teacher")
    if teacher and isinstance(teacher.get("teacher"), dict):
        t = dict(teacher["teacher"])
        name = str(t.get("name") or "")
        if name and Path(name).is_dir():  # a local folder: its name, and its upstream if it records one
            record = Path(name) / "PROVENANCE.json"
            upstream = (
                json.loads(record.read_text(encoding="utf-8")).get("upstream") if record.is_file() else None
            )
            t["name"] = f"`{Path(name).name}`" + (f" ({upstream})" if upstream else "")
        lines.append(
            f"- **Teacher embeddings**: {t.get('name') or t.get('model') or 'recorded'} "
            f"({fmt_number(t.get('dim'))}-d, {t.get('pooling')} pooling, prefix `{t.get('prefix', '')}`), "
            f"cached for {fmt_number((teacher.get('totals') or {}).get('sentences'))} sentences.\n"
        )
    return lines


def teacher_folder(shards: str | None) -> Path | None:
    """The teacher model's folder named by the teacher shards' manifest, if it is on this machine."""
    for manifest in corpus_manifests(shards):
        teacher = manifest.get("teacher")
        if isinstance(teacher, dict):
            for key in ("folder", "path", "model_dir", "name"):
                value = teacher.get(key)
                if isinstance(value, str) and Path(value).is_dir():
                    return Path(value)
    return None


def teacher_result(shards: str | None, explicit: Path | None) -> tuple[str | None, dict[str, Any] | None]:
    """(teacher name, its eval.json) from ``--teacher-eval-json`` or TEACHER/eval/eval.json."""
    folder = teacher_folder(shards)
    name = folder.name if folder is not None else None
    paths = [explicit] if explicit is not None else (
        [folder / "eval" / "eval.json", folder / "eval.json"] if folder is not None else [])  # fmt: skip
    if explicit is not None and not explicit.is_file():
        raise InputError(f"--teacher-eval-json {explicit} does not exist")
    for path in paths:
        if path.is_file():
            try:
                return name or path.parent.name, json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return name, None


# ------------------------------------------------------------------------------------ metadata
def sts_split(name: str) -> str:
    """The Hub split a bundled STS set is scored on: test for its ``*.test.tsv`` file, else validation."""
    from pipeline.evaluate.sts import STS_SETS

    return "test" if STS_SETS.get(name, ".test.tsv").endswith(".test.tsv") else "validation"


def eval_results(result: dict[str, Any] | None) -> list[Any]:
    """huggingface_hub EvalResults for the model's STS scores (the card's ``model-index``)."""
    from huggingface_hub import EvalResult

    sts = (result or {}).get("sts") or {}
    scores = sts.get("model") or {}
    out = []
    for name in sts.get("sets") or []:
        value = scores.get(name)
        if value is None:
            continue
        out.append(EvalResult(
            task_type="sentence-similarity", task_name="Semantic Textual Similarity",
            dataset_type=f"C-MTEB/{name}" if name != "STS-B" else "C-MTEB/STSB", dataset_name=f"{name} (zh)",
            dataset_split=sts_split(name), metric_type="spearman_cosine",
            metric_name="Spearman (cosine) x100", metric_value=round(float(value), 2),
        ))  # fmt: skip
    return out


def card_metadata(
    origin: Any, license: str, result: dict[str, Any] | None, terms: list[str], name: str, onnx: bool
) -> Any:
    """The card's YAML front matter as huggingface_hub's ModelCardData (validated by its own classes)."""
    from huggingface_hub import ModelCardData

    tags = ["sentence-transformers", "sentence-similarity", "feature-extraction", "chinese", *terms]
    if onnx:
        tags.append("onnx")
    results = eval_results(result)
    return ModelCardData(
        language=["zh"], license=license, library_name="sentence-transformers",
        pipeline_tag="sentence-similarity", tags=list(dict.fromkeys(tags)),
        base_model=origin.base_model, base_model_relation="finetune" if origin.base_model else None,
        model_name=name if results else None, eval_results=results or None,
    )  # fmt: skip


LOSSY_CONVERSION = ("quantiz", "quantis")  # in PROVENANCE.json's `conversion`: not the published weights


def base_model_note(origin: Any) -> str | None:
    """What the card says beside ``base_model`` when the weights descend from a lossy copy of it rather than
    from the checkpoint its Hub id names (``models fetch e5-small``: 4-bit Q4_0 weights dequantised to
    fp32, from PROVENANCE.json's ``conversion``); None when nothing needs saying."""
    conversion = str((origin.provenance or {}).get("conversion") or "")
    if not origin.base_model or not any(word in conversion.lower() for word in LOSSY_CONVERSION):
        return None
    how = conversion.split(";")[0].strip()
    return (
        f"the weights descend from a copy of {origin.base_model} ({how}): close to, but not the same as, "
        "the checkpoint published on the Hub"
    )


def front_matter(data: Any, note: str | None) -> str:
    """The card's YAML, with ``note`` as a comment at the end of the ``base_model`` line: the Hub reads the
    same metadata, and a reader of the YAML sees the provenance where the base model is named."""
    text = data.to_yaml()
    if note:
        line = re.compile(r"^(base_model:[^\n]*)$", re.MULTILINE)
        text = line.sub(lambda m: f"{m.group(1)}  # {note}", text, count=1)
    return text


# ------------------------------------------------------------------------------------ citations
CITATIONS = {
    "e5": "@article{wang2024multilingual,\n  title={Multilingual E5 Text Embeddings: A Technical Report},\n"
    "  author={Wang, Liang and Yang, Nan and Huang, Xiaolong and Yang, Linjun and Majumder, Rangan "
    "and Wei, Furu},\n  journal={arXiv preprint arXiv:2402.05672},\n  year={2024}\n}",
    "luse": "@misc{luse,\n  title={LUSE: Chinese sentence encoders pretrained with multi-positive "
    "contrastive learning},\n  author={DunZhang},\n  howpublished={\\url{https://github.com/DunZhang/LUSE}}\n}",
    "simcse": "@inproceedings{gao2021simcse,\n  title={{SimCSE}: Simple Contrastive Learning of Sentence "
    "Embeddings},\n  author={Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},\n  "
    "booktitle={EMNLP},\n  year={2021}\n}",
    "cosent": "@misc{su2022cosent,\n  title={{CoSENT}: a more efficient sentence vector scheme than "
    "Sentence-BERT},\n  author={Su, Jianlin},\n  year={2022},\n  "
    "howpublished={\\url{https://kexue.fm/archives/8847}}\n}",
    "sbert": "@inproceedings{reimers2019sentencebert,\n  title={Sentence-{BERT}: Sentence Embeddings using "
    "Siamese {BERT}-Networks},\n  author={Reimers, Nils and Gurevych, Iryna},\n  "
    "booktitle={EMNLP},\n  year={2019}\n}",
    "distill": "@inproceedings{reimers2020multilingual,\n  title={Making Monolingual Sentence Embeddings "
    "Multilingual using Knowledge Distillation},\n  author={Reimers, Nils and Gurevych, Iryna},"
    "\n  booktitle={EMNLP},\n  year={2020}\n}",
    "eda": "@inproceedings{wei2019eda,\n  title={{EDA}: Easy Data Augmentation Techniques for Boosting "
    "Performance on Text Classification Tasks},\n  author={Wei, Jason and Zou, Kai},\n  "
    "booktitle={EMNLP-IJCNLP},\n  year={2019}\n}",
    "whitening": "@article{su2021whitening,\n  title={Whitening Sentence Representations for Better "
    "Semantics and Faster Retrieval},\n  author={Su, Jianlin and Cao, Jiarun and Liu, Weijie "
    "and Ou, Yangyiwen},\n  journal={arXiv preprint arXiv:2103.15316},\n  year={2021}\n}",
    "matryoshka": "@inproceedings{kusupati2022matryoshka,\n  title={Matryoshka Representation Learning},\n"
    "  author={Kusupati, Aditya and others},\n  booktitle={NeurIPS},\n  year={2022}\n}",
    "moco": "@inproceedings{he2020moco,\n  title={Momentum Contrast for Unsupervised Visual Representation "
    "Learning},\n  author={He, Kaiming and Fan, Haoqi and Wu, Yuxin and Xie, Saining and Girshick, "
    "Ross},\n  booktitle={CVPR},\n  year={2020}\n}",
}
# the project's methods, always cited; then what the run used
ALWAYS_CITED = ("luse", "simcse", "cosent", "sbert")


def citation_keys(origin: Any, terms: list[str], config: dict[str, Any], whitened: bool) -> list[str]:
    keys = list(ALWAYS_CITED)
    if origin.base_model and "e5" in origin.base_model.lower():
        keys.insert(0, "e5")
    loss = trained_loss(config) if config else {}
    keys += loss.get("cite", [])  # what each term cites of itself (luse with a queue or momentum: MoCo too)
    if _get(config, "data.num_variants"):
        keys.append("eda")
    if whitened:
        keys.append("whitening")
    return list(dict.fromkeys(keys))


def framework_versions(onnx: bool) -> list[tuple[str, str]]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import pipeline

    names = ["sentence-transformers", "transformers", "torch", "tokenizers", "huggingface_hub", "safetensors"]
    if onnx:
        names += ["onnx", "onnxruntime"]
    rows = [
        ("python", platform.python_version()),
        ("sentence_pretrain (this pipeline)", pipeline.__version__),
    ]
    for name in names:
        try:
            rows.append((name, version(name)))
        except PackageNotFoundError:
            continue
    return rows


# ------------------------------------------------------------------------------------ the card
POOLING_TEXT = {
    "cls": "the [CLS] token's final hidden state",
    "mean": "the mean of the final hidden states over non-padding tokens",
    "first_last_avg": "the average of the mean-pooled first and last transformer layers",
}


@dataclass
class CardInputs:
    """Everything the card is generated from (built by :func:`pipeline.export.run`)."""

    encoder: Any
    resolved: Any
    config: dict[str, Any]
    result: dict[str, Any] | None
    license: str
    repo_id: str | None
    origin: Any
    prompts: dict[str, str] = field(default_factory=dict)
    whitening: dict[str, Any] | None = None
    calibration: Any = None
    dims: list[int] = field(default_factory=list)
    onnx: dict[str, Any] | None = None  # what export --onnx wrote and measured
    teacher: tuple[str | None, dict[str, Any] | None] = (None, None)
    unrelated_cosine: dict[str, float] | None = None  # cosines of unrelated sentence pairs


def evaluation_lines(inp: CardInputs) -> list[str]:
    from pipeline.evaluate.tables import markdown_table, result_markdown

    result = inp.result
    if not result:
        return ["Not evaluated yet: run `python -m pipeline eval CHECKPOINT` and export again.\n"]
    lines = [
        "Spearman x100 between cosine similarity and the gold label on ATEC, BQ, LCQMC, PAWSX and STS-B "
        "(Chinese; `python -m pipeline eval`); avg5 is their mean. The char TF-IDF row is the floor "
        "a learned encoder must beat.\n",
        result_markdown(result, heading_level=3),
    ]
    teacher_name, teacher = inp.teacher
    sts, teacher_sts = result.get("sts") or {}, (teacher or {}).get("sts") or {}
    if teacher_sts.get("model"):
        columns = [*(sts.get("sets") or teacher_sts.get("sets") or []), "avg5"]
        rows = [["this model", *[(sts.get("model") or {}).get(c) for c in columns]],
                [f"teacher ({teacher_name})", *[teacher_sts["model"].get(c) for c in columns]]]  # fmt: skip
        same_pairs = sts.get("pairs") == teacher_sts.get("pairs")
        lines += [
            "### Beside the teacher\n",
            markdown_table(["Spearman x100", *columns], rows) + "\n",
            ("" if same_pairs else "The teacher was scored on a different number of pairs per set "
             f"({teacher_sts.get('pairs')}); compare with care.\n"),
        ]  # fmt: skip
    elif teacher_name:
        lines.append(
            f"The teacher ({teacher_name}) has no eval.json beside it; `python -m pipeline eval TEACHER "
            "--out "
            "TEACHER/eval` and export again to show its scores here.\n"
        )
    return lines


def limitations_lines(inp: CardInputs) -> list[str]:
    encoder = inp.encoder
    prompt_tokens = {
        name: len(encoder.tokenizer(text, add_special_tokens=False)["input_ids"])
        for name, text in inp.prompts.items()
    }
    lines = [
        "## Limitations\n",
        f"- **Length**: texts are cut at {encoder.max_length} tokens, the prompt and [CLS]/[SEP] included "
        + (
            f"({', '.join(f'`{n}` prompt {k} tokens' for n, k in prompt_tokens.items())}); "
            if prompt_tokens
            else "; "
        )  # fmt: skip
        + "a Chinese character is usually one token, so a document longer than about "
        f"{max(encoder.max_length - 2 - max(prompt_tokens.values(), default=0), 1)} characters is "
        "represented "
        "by its beginning only. Split long documents into passages before indexing.\n",
        "- **Language and domain**: trained and evaluated on Chinese only; the scores above are on short "
        "sentence pairs (questions, paraphrases, captions), not on long-document retrieval.\n",
    ]
    if inp.unrelated_cosine:
        u = inp.unrelated_cosine
        lines.append(
            f"- **What a cosine means**: cosines are not probabilities and are not centred at 0. Between "
            f"unrelated sentences ({fmt_number(int(u['pairs']))} random pairs of bundled corpus sentences, "
            f"measured at export) the median cosine is {fmt_number(round(u['median'], 3))} (5th–95th "
            f"percentile {fmt_number(round(u['p05'], 3))}–{fmt_number(round(u['p95'], 3))}); rank by "
            'cosine, and do not read a fixed value as "similar".\n'
        )
    if inp.calibration is not None:
        lines.append(
            "- **Calibration's scope**: the probabilities and thresholds in *Calibrated similarity* hold for "
            "pairs like the ones it was fitted on; on another domain, refit it on labelled pairs from that "
            "domain (`export --calibrate --calibration-pairs FILE`).\n"
        )
    else:
        lines.append(
            "- **Thresholds**: the export carries no calibration, so no cosine threshold is validated; fit "
            "one on labelled pairs of your domain (`python -m pipeline export ... --calibrate`).\n"
        )
    if inp.whitening:
        lines.append(
            "- **Whitening**: fitted on news sentences; it can hurt another domain (the scores above are "
            "of the model before whitening).\n"
        )
    return lines


def model_card(inp: CardInputs) -> str:
    """The README.md of the export: metadata the Hub reads, then what a user needs to use it well."""
    from pipeline.evaluate.resolve import describe
    from pipeline.evaluate.tables import markdown_table

    encoder, origin = inp.encoder, inp.origin
    terms = trained_loss(inp.config)["terms"] if inp.config else []
    title = inp.repo_id.split("/")[-1] if inp.repo_id else "Chinese sentence encoder"
    name = inp.repo_id or "PATH/TO/THIS/FOLDER"
    data = card_metadata(origin, inp.license, inp.result, terms, title, inp.onnx is not None)
    note = base_model_note(origin)
    lines = [
        f"---\n{front_matter(data, note)}\n---\n",
        f"# {title}\n",
        f"A Chinese sentence encoder ({encoder.dim}-dimensional, L2-normalised embeddings; cosine similarity "
        f"= dot product). Texts are truncated at {encoder.max_length} tokens and pooled with "
        f"{POOLING_TEXT[encoder.pooling]}.\n",
    ]
    if origin.base_model:
        lines.append(
            f"Initialised from [{origin.base_model}](https://huggingface.co/{origin.base_model}) "
            f"(licence {inp.license.upper() if inp.license == 'mit' else inp.license}): "
            + "; ".join(origin.steps)
            + ".\n"
        )
        if note:
            lines.append(f"**Not the Hub's checkpoint:** {note}.\n")
    elif origin.scratch:
        lines.append("Trained from a randomly initialised model (no pretrained weights).\n")
    else:
        lines.append(
            "The origin of the initial weights was not recorded (no `PROVENANCE.json`, no training config "
            f"naming them); the licence `{inp.license}` is the exporter's choice: check it before "
            "publishing.\n"
        )
    lines += prompt_lines(inp, name)
    if inp.whitening:
        w = inp.whitening
        lines.append(
            f"The embeddings are BERT-whitened (Su et al. 2021) to {w['dim']} dimensions: the `Dense` module "
            f"maps the normalised pooled vector x to (x - mu) W, fitted on {fmt_number(w['sentences'])} "
            f"sentences of the {w['source']} (no evaluation sentence), then `Normalize`. Directions with an "
            f"eigenvalue below {fmt_number(w['eigenvalue_floor'])} of the largest carry only noise and are "
            f"dropped ({w['dropped']} of the requested ones), so W's condition number is {w['max_gain']:.0f} "
            f"(at most {w['eigenvalue_floor'] ** -0.5:.0f}) and rounding noise is not amplified. The "
            "evaluation table below is of the model before whitening.\n"
        )
    lines += [
        "## Usage\n",
        "```python\nfrom sentence_transformers import SentenceTransformer\n\n"
        f'model = SentenceTransformer("{name}")\n'
        'embeddings = model.encode(["今天天气很好", "今天是个好天气"])\n'
        "print(model.similarity(embeddings, embeddings))\n```\n",
        "With plain `transformers`, load `AutoModel`/`AutoTokenizer` from the same folder, prepend the "
        "prompt, pool as described above and L2-normalise. BERT's pooler was not trained: the export "
        "holds an identity pooler (`pooler_output` = tanh of the [CLS] state); do not use "
        "`pooler_output` as the sentence embedding.\n",
    ]
    if inp.onnx:
        lines += onnx_lines(inp.onnx, name)
    lines.append("## Training\n")
    lines += corpus_lines(_get(inp.config, "data.shards"))
    lines.append("")
    rows = recipe_rows(inp.config, describe(inp.resolved)) if inp.config else []
    if rows:
        lines.append(markdown_table(["setting", "value"], [[k, fmt_number(v)] for k, v in rows]) + "\n")
    else:
        lines.append("No training configuration was found beside the checkpoint.\n")
    selected = final_model_event(inp.resolved) or {}
    # what the best checkpoint was chosen on (train.select_on; runs before it: STS-B valid)
    on = "STS-B valid" if selected.get("select_on", "sts_b") == "sts_b" else (
        "the mean of STS-B valid and the teacher agreement on held-out training rows")  # fmt: skip
    score = selected.get("selection_score", selected.get("sts_b_valid_spearman"))
    if selected.get("initial_weights") and score is not None:
        lines.append(
            f"**No training step beat the initial model** on {on} ({score:.2f} at step 0): these are the "
            "initial weights.\n"
        )
    elif score is not None:
        lines.append(
            f"Exported weights: step {fmt_number(selected['step'])} ({selected['selected']}), {on} "
            f"{score:.2f}; step 0 (the initial model) was a candidate.\n"
        )
    if inp.calibration is not None:
        lines += calibration_card(inp.calibration)
    if inp.dims:
        lines += matryoshka_card(inp.dims, inp.result, name)
    lines.append("## Evaluation\n")
    lines += evaluation_lines(inp)
    lines += limitations_lines(inp)
    versions = framework_versions(inp.onnx is not None)
    lines += ["## Framework versions\n", "\n".join(f"- {k}: {v}" for k, v in versions) + "\n"]
    keys = citation_keys(origin, terms, inp.config, inp.whitening is not None)
    lines += ["## Citation\n", "```bibtex\n" + "\n\n".join(CITATIONS[k] for k in keys) + "\n```\n"]
    return "\n".join(lines)


def prompt_lines(inp: CardInputs, name: str) -> list[str]:
    from pipeline.export.origin import document_prompt

    prompts = inp.prompts
    if not prompts:
        return ["No prompt: texts are encoded as they are, queries and documents alike.\n"]
    document = document_prompt(prompts)
    lines = [
        "## Prompts\n",
        "| prompt name | text | use for |\n| --- | --- | --- |\n"
        + "\n".join(
            f"| `{k}` | `{v}` | "
            + (
                "queries, and both sides of symmetric tasks (similarity, clustering); the default"
                if k == "query"
                else "the documents of a search index (the corpus side)"
                if v == document
                else ""
            )
            + " |"
            for k, v in prompts.items()
        )
        + "\n",  # fmt: skip
    ]
    if document is not None:
        lines.append(
            '```python\nq = model.encode_query(["怎么还花呗"])        # the query prompt\n'
            'd = model.encode_document(["花呗的还款方式有三种……"])  # the document prompt\n'
            "scores = model.similarity(q, d)\n```\n"
            f"(or `model.encode(texts, prompt_name=...)`). `python -m pipeline index {name} ...` encodes the "
            "corpus with the document prompt and `search` the queries with the query prompt.\n"
        )
    return lines


def onnx_lines(onnx: dict[str, Any], name: str) -> list[str]:
    from pipeline.evaluate.tables import markdown_table

    rows = [[f"`{f['file']}`", f["kind"], f"{f['bytes'] / 1e6:.1f} MB",
             f"{f['min_cosine']:.6f}" if f.get("min_cosine") is not None else "–"]
            for f in onnx["files"]]  # fmt: skip
    return [
        "## ONNX\n",
        "The transformer is also exported to ONNX (`onnx/`, inputs `input_ids`, `attention_mask`"
        + (", `token_type_ids`" if onnx.get("token_type_ids") else "")
        + '; output `last_hidden_state`), the layout sentence-transformers\' `backend="onnx"` reads '
        "(it needs `optimum`):\n",
        markdown_table(
            ["file", "what", "size", f"min cosine to PyTorch ({onnx['sentences']} sentences)"], rows
        )
        + "\n",
        '```python\nmodel = SentenceTransformer("' + name + '", backend="onnx", '
        f'model_kwargs={{"file_name": "{onnx["files"][-1]["file"]}"}})\n```\n',
        "Without torch (numpy, tokenizers and onnxruntime only): `pipeline/export/onnx_encode.py` of the "
        "sentence_pretrain project, `OnnxEncoder(folder).encode(texts)`.\n",
        *int8_note(onnx),
    ]


def int8_note(onnx: dict[str, Any]) -> list[str]:
    """What the int8 file is, what it needs, and on which kernels its cosine was measured."""
    checked = next((f["checked_with"] for f in onnx["files"] if "checked_with" in f), None)
    if checked is None:
        return []
    return [
        "The int8 file is onnxruntime's dynamic quantisation (int8 weights per channel, uint8 activations at "
        "run time), named as sentence-transformers names such a file; onnxruntime runs it on any x86-64 CPU "
        f"with AVX2. Its cosine above was measured on a CPU with {checked}. onnxruntime's int8 kernels use "
        "VNNI where the CPU has it; without VNNI their 16-bit intermediate sums can saturate (onnxruntime's "
        "quantization docs), so on such a CPU check the file against the fp32 one before relying on it.\n"
    ]
