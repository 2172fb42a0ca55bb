"""``python -m pipeline export CHECKPOINT --out DIR [--onnx[-int8]] [--push-to-hub OWNER/NAME [--dry-run]]``.

Writes a standard sentence-transformers folder that ``SentenceTransformer(DIR)`` and
``transformers.AutoModel.from_pretrained(DIR)`` load without our code::

    DIR/config.json, model.safetensors, tokenizer.json, tokenizer_config.json   the transformer
    DIR/modules.json                  Transformer -> [WeightedLayerPooling] -> Pooling -> Normalize
    DIR/sentence_bert_config.json     max_seq_length
    DIR/config_sentence_transformers.json   prompts: the init's query and document prompts (e5: "query: ",
                                      "passage: "), "query" the default
    DIR/1_Pooling/config.json         cls or mean pooling
    DIR/N_Normalize/                  L2 normalisation (cosine = dot product)
    DIR/onnx/model.onnx, model_qint8_avx512_vnni.onnx   --onnx / --onnx-int8 (:mod:`.onnx_export`)
    DIR/README.md                     the model card (:mod:`.card`), checked with huggingface_hub

The package, one idea per module: :mod:`.folder` (the folder and its reload check), :mod:`.heads`
(``--whitening``: BERT-whitening as a Dense module; ``--calibrate``: cosine -> P(same meaning)),
:mod:`.origin` (base model, licence and prompts carried from the init), :mod:`.card` (the model card
and its metadata), :mod:`.onnx_export` and :mod:`.onnx_encode` (ONNX files and a torch-free encoder),
:mod:`.hub` (upload, dry run, the card check the Hub would apply).

A run trained with the ``matryoshka`` loss term needs nothing more in the folder:
``SentenceTransformer(DIR, truncate_dim=k)`` keeps the first k dimensions; the card lists the trained
widths with their scores from eval.json's ``dims``. ``first_last_avg`` is exact in stock modules: a
``WeightedLayerPooling`` over layers 1..L with weights (1, 0, ..., 0, 1), then mean pooling. The module
files use the long-standing ``sentence_transformers.models.*`` names, which 2.x to 6.x read.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.config import option
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def __getattr__(name: str) -> Any:
    """``from pipeline.export import final_model_event`` (and the card's helpers) without importing torch
    when only :mod:`.onnx_encode` is wanted."""
    if name in ("final_model_event", "model_card", "find_config_yaml", "find_eval_json"):
        from pipeline.export import card

        return getattr(card, name)
    raise AttributeError(f"module 'pipeline.export' has no attribute {name!r}")


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
    license: str | None = option(
        None,
        "Licence in the card's metadata, a Hub identifier (empty: the init's, e.g. mit for "
        "multilingual-e5-small; mit, the project's, for a model trained from scratch).",
    )
    teacher_eval_json: Path | None = option(
        None, "The teacher's eval.json, shown beside the model's scores (default: TEACHER/eval/eval.json)."
    )
    onnx: bool = option(False, "Also write onnx/model.onnx (checked against PyTorch: cosine >= 0.9999).")
    onnx_int8: bool = option(
        False, "Also write the int8 variant onnx/model_qint8_avx512_vnni.onnx (implies --onnx)."
    )
    onnx_sentences: int = option(200, "Bundled corpus sentences the ONNX files are checked on.")
    dry_run: bool = option(
        False, "With --push-to-hub: list the files, sizes and card metadata that would go up; upload nothing."
    )
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
        if self.dry_run and self.push_to_hub is None:
            raise ConfigError(
                "--dry-run goes with --push-to-hub OWNER/NAME (it shows what would be uploaded)"
            )
        if self.onnx_int8:
            self.onnx = True
        if self.onnx_sentences < 2:
            raise ConfigError("--onnx-sentences must be >= 2")
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


def unrelated_cosines(encoder: Any, seed: int, pairs: int = 200) -> dict[str, float]:
    """Cosines of random pairs of distinct bundled corpus sentences: what "unrelated" looks like here."""
    import numpy as np

    from pipeline.evaluate.run import corpus_sentences

    vectors = encoder.encode(corpus_sentences(2 * pairs, seed + 1))  # (2P, dim), unit rows
    half = len(vectors) // 2
    cosines = (vectors[:half] * vectors[half : 2 * half]).sum(axis=1)
    return {"pairs": float(half), "median": float(np.median(cosines)),
            "p05": float(np.percentile(cosines, 5)), "p95": float(np.percentile(cosines, 95))}  # fmt: skip


def folder_prompts(encoder: Any, origin: Any) -> dict[str, str]:
    """The prompts the export writes: the init's (query and document) when the encoder's prefix is its
    query prompt, else the encoder's prefix alone (an explicit --prefix, or an init without prompts)."""
    from pipeline.export.origin import document_prompt

    if not encoder.prefix:
        return {}
    if origin.prompts.get("query") != encoder.prefix:
        return {"query": encoder.prefix}
    prompts = dict(origin.prompts)
    document = document_prompt(prompts)
    if document is not None and "document" not in prompts:
        # sentence-transformers 6.2's encode_document applies a "document" prompt but, measured here, not
        # e5's "passage" one (it encodes without a prompt): carry both names
        prompts["document"] = document
    return prompts


def run(cfg: Config) -> int:
    from pipeline.evaluate import resolve
    from pipeline.export import card as cards
    from pipeline.export import hub
    from pipeline.export.folder import prepare_out, verify_folder, write_sentence_transformers_folder
    from pipeline.export.heads import add_calibration, add_whitening
    from pipeline.export.origin import find_origin

    out = Path(cfg.out)
    prepare_out(out, cfg.overwrite)
    if cfg.onnx:
        from pipeline.export.onnx_export import require_onnx

        require_onnx()
    token = hub.hub_token() if cfg.push_to_hub and not cfg.dry_run else None  # fail before the work
    resolved = resolve.resolve(cfg.checkpoint, cfg.select, cfg.skeleton)
    result = cards.find_eval_json(resolved, cfg.eval_json)
    config = cards.find_config_yaml(resolved)
    init = cards._get(config, "model.name_or_path")
    origin = find_origin(resolved.skeleton_dir or resolved.model_dir, init, trained=bool(config))
    license = (cfg.license or origin.license or "").lower()
    if not license:
        if origin.base_model:
            raise ConfigError(
                f"the licence of the init {origin.base_model} is not known (no PROVENANCE.json, no cached "
                "card); pass --license with its Hub identifier"
            )
        log.warning("the origin of %s's weights is not recorded; the card says licence mit (the project's): "
                    "pass --license if that is wrong", cfg.checkpoint)  # fmt: skip
        license = "mit"
    teacher = cards.teacher_result(cards._get(config, "data.shards"), cfg.teacher_eval_json)
    encoder = resolve.load_encoder(resolved, pooling=cfg.pooling, prefix=cfg.prefix)
    whitening = add_whitening(encoder, cfg) if cfg.whitening else None
    calibration = add_calibration(encoder, cfg) if cfg.calibrate else None
    dims = cards.matryoshka_dims(config, cfg.matryoshka_dims, encoder.dim, whitening is not None)
    prompts = folder_prompts(encoder, origin)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx = None
    try:
        write_sentence_transformers_folder(encoder, tmp, prompts)
        if cfg.onnx:
            from pipeline.evaluate.run import corpus_sentences
            from pipeline.export.onnx_export import write_onnx

            onnx = write_onnx(encoder, tmp, cfg.onnx_int8, corpus_sentences(cfg.onnx_sentences, cfg.seed))
        inputs = cards.CardInputs(
            encoder, resolved, config, result, license, cfg.push_to_hub, origin, prompts, whitening,
            calibration, dims, onnx, teacher, unrelated_cosines(encoder, cfg.seed),
        )  # fmt: skip
        text = cards.model_card(inputs)
        hub.check_card(text)  # the Hub's own parser, offline: a card it would reject fails the export
        if calibration is not None:
            from pipeline.evaluate.calibration import CALIBRATION_FILE

            calibration.save(tmp / CALIBRATION_FILE)
        (tmp / "README.md").write_text(text, encoding="utf-8")
        if cfg.verify:
            error = verify_folder(encoder, tmp)
            log.info("reloaded export matches the encoder (max |diff| %.1e)", error)
        for weights in tmp.rglob("*.safetensors"):
            weights.chmod(0o644)  # safetensors writes owner-only files; an export is meant to be shared
        for weights in tmp.rglob("*.safetensors"):
            weights.chmod(0o644)  # safetensors writes owner-only files; an export is meant to be shared
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    whitened = ", whitened" if whitening else ""
    nested = f", Matryoshka dims {','.join(map(str, dims))}" if dims else ""
    print(
        f"wrote sentence-transformers folder {out} ({encoder.pooling} pooling{whitened}, dim {encoder.dim}"
        f"{nested}; licence {license}{', base model ' + origin.base_model if origin.base_model else ''})"
    )
    if onnx is not None:
        for entry in onnx["files"]:
            print(f"onnx: {entry['file']} ({entry['bytes'] / 1e6:.1f} MB): min cosine to PyTorch "
                  f"{entry['min_cosine']:.6f} on {onnx['sentences']} sentences")  # fmt: skip
    if calibration is not None:
        held = calibration.info["held_out"]
        print(f"calibration: held-out {held['file']}: Brier {held['brier']:.4f}, ECE {held['ece']:.4f}")
    if cfg.push_to_hub and cfg.dry_run:
        print(hub.dry_run(out, cfg.push_to_hub, cfg.private))
    elif cfg.push_to_hub:
        url = hub.push_folder(out, cfg.push_to_hub, token, cfg.private)
        print(f"pushed {out} to {url}")
    return 0
