"""Student surgery: keep some transformer layers of a BERT-family folder and trim its vocabulary.

``python -m pipeline student models/e5-small --out models/e5-student --keep_layers 3 --shards DIR``

*Layers.* The first k layers (``--keep_layers 3``) or a listed subset (``--layers 0,4,8,11``, the
DistilBERT-style every-n-th cut) stay; works for anything with ``encoder.layer`` and
``config.num_hidden_layers`` (BertModel, RoBERTa, XLM-R).

*Vocabulary.* multilingual-e5-small spends 96M of its 117.5M parameters on 250k word embeddings, most
of them for scripts a Chinese corpus never uses. We keep the pieces that tokenising the training corpus
produces, every special token, and every single-character piece (``c``, ``▁c``, ``##c``) whose character
lies in a Unicode block seen in the corpus (Basic Latin, CJK Unified Ideographs, ...), so that an unseen
character of a seen block still has its own piece instead of ``<unk>``. Evaluation
text never enters the choice.

Why covered text tokenises exactly as before: WordPiece takes the longest known piece at each position;
removing pieces the original segmentation did not use cannot change that choice. Unigram takes the
highest-scoring segmentation (Viterbi); the original best one is still available with the same scores,
and every other one is a subset of the old candidates. The unknown-token score is derived from the
lowest piece score, so the lowest-scoring piece is kept too. The command checks both claims on a sample
of the corpus (identical pieces, allclose embeddings) before the folder is published.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline import __version__
from pipeline.config import option
from pipeline.errors import ConfigError, InputError
from pipeline.model.layers import encoder_layers, keep_layers, resolve_layers
from pipeline.model.rules import ENCODER_FILE, POOLING_HELP, ST_CONFIG, ST_MODULES, read_rule

log = logging.getLogger(__name__)
SURGERY_KEY = "student_surgery"  # in config.json; the same dict is "surgery" in encoder.json
SPECIAL_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id")
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


@dataclass
class Config:
    model: str = option("", "Source model folder (a BertModel / RoBERTa / XLM-R folder with tokenizer.json).")
    out: Path | None = option(None, "Output folder of the student (written whole, then renamed into place).")
    keep_layers: int | None = option(None, "Keep the first k transformer layers.")
    layers: list[int] | str | None = option(
        None, "Keep these layers, e.g. 0,4,8,11 (DistilBERT-style); excludes --keep_layers."
    )
    shards: list[Path] = option(
        [], "Shard directories whose text and variants columns choose the vocabulary."
    )
    texts: list[Path] = option([], "Plain text files (one sentence a line) that choose the vocabulary.")
    trim_vocab: bool = option(True, "Trim the vocabulary to the corpus; false keeps it whole (layers only).")
    max_sentences: int = option(0, "Read at most this many corpus sentences (0 = all).")
    verify_sentences: int = option(512, "Corpus sentences re-tokenised and re-embedded to check the trim.")
    pooling: str | None = option(
        None, "Pooling for a source folder without a rule (cls, mean, first_last_avg)."
    )
    overwrite: bool = option(False, "Replace an existing, different output folder.")
    seen_char_pieces: bool = option(
        False,
        "Also keep every piece made only of characters the corpus contains (e5 + bundled corpus: ~76k "
        "pieces, not ~16k): more unseen words keep their pieces, at ~4x the embedding rows.",
    )

    def __post_init__(self) -> None:
        if isinstance(self.layers, str):  # "0,4,8,11" on the command line
            try:
                self.layers = [int(x) for x in self.layers.replace(" ", "").strip("[]").split(",") if x]
            except ValueError:
                raise ConfigError(
                    f"layers: expected layer indices like 0,4,8,11, got {self.layers!r}"
                ) from None
        if not self.model:
            raise ConfigError(
                "model: name the source model folder (python -m pipeline student FOLDER --out DIR)"
            )
        if self.out is None:
            raise ConfigError("out: set --out DIR, the folder to write the student to")
        if self.keep_layers is not None and self.layers is not None:
            raise ConfigError("set either --keep_layers or --layers, not both")
        if self.keep_layers is not None and self.keep_layers < 1:
            raise ConfigError(f"keep_layers must be >= 1, got {self.keep_layers}")
        if self.trim_vocab and not (self.shards or self.texts):
            raise ConfigError(
                "trim_vocab needs a corpus: set --shards DIR and/or --texts FILE (or --trim_vocab false)"
            )
        if self.verify_sentences < 1:
            raise ConfigError("verify_sentences must be >= 1")


# ------------------------------------------------------------------------------------------------ corpus
def corpus_texts(shards: Iterable[Path], text_files: Iterable[Path], max_sentences: int = 0) -> list[str]:
    """Sentences of shard directories (``text`` and every ``variants`` entry) and text files."""
    from pipeline.shards import read_shard, shard_paths

    out: list[str] = []
    full = max_sentences > 0

    for directory in shards:
        if not Path(directory).is_dir():
            raise InputError(
                f"--shards {directory} is not a directory; point it to a preprocess/augment output"
            )
        for path in shard_paths(directory):
            for table in read_shard(path):
                out.extend(table.column("text").to_pylist())
                if "variants" in table.column_names:
                    for variants in table.column("variants").to_pylist():
                        out.extend(variants or ())
                if full and len(out) >= max_sentences:
                    return out[:max_sentences]
    for file in text_files:
        if not Path(file).is_file():
            raise InputError(f"--texts {file} does not exist; give plain text files, one sentence a line")
        out.extend(line for line in Path(file).read_text(encoding="utf-8").splitlines() if line.strip())
        if full and len(out) >= max_sentences:
            return out[:max_sentences]
    return out


def block_of(char: str) -> str | None:
    """The Unicode block of a character (Basic Latin, CJK Unified Ideographs, Hiragana, ...).

    The table comes with fontTools, which matplotlib (a dependency) requires.
    """
    from fontTools.unicodedata import block

    name = block(char)
    return None if name == "No_Block" else name


# ------------------------------------------------------------------------------------------------ vocab
def _pieces(model: dict[str, Any]) -> list[str]:
    """The model's pieces in id order."""
    if model["type"] == "Unigram":
        return [piece for piece, _ in model["vocab"]]
    if model["type"] == "WordPiece":
        by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
        return [piece for piece, _ in by_id]
    raise InputError(
        f"tokenizer model {model['type']} is not supported for vocabulary trimming (Unigram and WordPiece "
        "are); use --trim_vocab false"
    )


def _char_core(piece: str, model_type: str, data: dict[str, Any]) -> str:
    """The character(s) a piece stands for, without the word-start / continuation marker."""
    if model_type == "WordPiece":
        prefix = data["model"].get("continuing_subword_prefix") or "##"
        return piece[len(prefix) :] if piece.startswith(prefix) and len(piece) > len(prefix) else piece
    return piece[1:] if piece.startswith("▁") and len(piece) > 1 else piece


@dataclass
class VocabChoice:
    kept: list[int]  # old ids, increasing
    from_corpus: int
    special: int
    single_char: int
    blocks: list[str]  # Unicode blocks seen in the corpus


def choose_pieces(
    backend: Any, texts: Sequence[str], seen_char_pieces: bool = False, batch_size: int = 8192
) -> VocabChoice:
    """Old ids to keep: pieces the corpus produces, special/added tokens, single chars of seen blocks."""
    data = json.loads(backend.to_str())
    model = data["model"]
    pieces = _pieces(model)
    used: set[int] = set()
    for start in range(0, len(texts), batch_size):
        for enc in backend.encode_batch(list(texts[start : start + batch_size]), add_special_tokens=False):
            used.update(enc.ids)
    from_corpus = len(used)

    special = {t["id"] for t in data.get("added_tokens", [])}
    if model["type"] == "Unigram":
        special.add(model["unk_id"])
        # the unknown-token score is (lowest piece score - 10): keep that piece so unk scoring is unchanged
        special.add(min(range(len(pieces)), key=lambda i: model["vocab"][i][1]))
        if model.get("byte_fallback"):
            special.update(i for i, p in enumerate(pieces) if _BYTE_PIECE.fullmatch(p))
        if "▁" in pieces:
            special.add(pieces.index("▁"))
    else:
        special.add(model["vocab"][model["unk_token"]])

    chars = set().union(*map(set, texts)) if texts else set()
    blocks = {b for b in map(block_of, chars) if b}
    singles = set()
    for i, piece in enumerate(pieces):
        core = _char_core(piece, model["type"], data)
        if len(core) == 1 and block_of(core) in blocks:
            singles.add(i)
    if seen_char_pieces:
        for i, piece in enumerate(pieces):
            core = _char_core(piece, model["type"], data)
            if set(core) <= chars:
                singles.add(i)
    kept = sorted(used | special | singles)
    return VocabChoice(
        kept=kept,
        from_corpus=from_corpus,
        special=len(special),
        single_char=len(singles - used - special),
        blocks=sorted(blocks),
    )


def _remap_ids(node: Any, new_id: dict[int, int]) -> Any:
    """Post-processor / padding JSON with every token id mapped to its new id."""
    if isinstance(node, list):
        return [_remap_ids(x, new_id) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("ids",) and isinstance(value, list):
            out[key] = [new_id[i] for i in value]
        elif key in ("pad_id", "id") and isinstance(value, int) and not isinstance(value, bool):
            out[key] = new_id[value]
        elif key in ("sep", "cls") and isinstance(value, list) and len(value) == 2:  # BertProcessing
            out[key] = [value[0], new_id[value[1]]]
        else:
            out[key] = _remap_ids(value, new_id)
    return out


def trim_tokenizer_json(data: dict[str, Any], kept: Sequence[int]) -> dict[str, Any]:
    """tokenizer.json content restricted to the ``kept`` old ids (new id = position in ``kept``)."""
    new_id = {old: new for new, old in enumerate(kept)}
    model = dict(data["model"])
    if model["type"] == "Unigram":
        model["vocab"] = [model["vocab"][i] for i in kept]  # original order, original scores
        model["unk_id"] = new_id[model["unk_id"]] if model.get("unk_id") is not None else None
    else:
        pieces = _pieces(model)
        model["vocab"] = {pieces[i]: new for new, i in enumerate(kept)}
    out = dict(data)
    out["model"] = model
    out["added_tokens"] = [{**t, "id": new_id[t["id"]]} for t in data.get("added_tokens", [])]
    for key in ("post_processor", "padding"):
        if out.get(key):
            out[key] = _remap_ids(out[key], new_id)
    return out


def trim_embeddings(backbone: nn.Module, kept: Sequence[int]) -> None:
    """Keep the word-embedding rows of ``kept``, in place; vocab_size and special ids follow."""
    old = backbone.get_input_embeddings()
    new_id = {o: n for n, o in enumerate(kept)}
    pad = getattr(backbone.config, "pad_token_id", None)
    index = torch.as_tensor(list(kept), dtype=torch.long)
    new = nn.Embedding(len(kept), old.embedding_dim, padding_idx=new_id.get(pad) if pad is not None else None)
    with torch.no_grad():
        new.weight.copy_(old.weight.index_select(0, index))
    backbone.set_input_embeddings(new)
    config = backbone.config
    config.vocab_size = len(kept)
    for field in SPECIAL_ID_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int):
            setattr(config, field, new_id.get(value))


def build_trimmed_tokenizer(tokenizer: Any, data: dict[str, Any]) -> Any:
    """A fast tokenizer over the trimmed tokenizer.json, with the source's special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        model_max_length=tokenizer.model_max_length,
        **special,
    )


# ------------------------------------------------------------------------------------------------ checks
def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def token_strings(tokenizer: Any, texts: Sequence[str]) -> list[list[str]]:
    ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    return [tokenizer.convert_ids_to_tokens(x) for x in ids]


def _check_same_pieces(before: Any, after: Any, texts: Sequence[str]) -> None:
    a, b = token_strings(before, texts), token_strings(after, texts)
    changed = [t for t, x, y in zip(texts, a, b, strict=True) if x != y]
    if changed:
        raise RuntimeError(
            f"vocabulary trim changed the tokenisation of {len(changed)}/{len(texts)} corpus sentences, "
            f"e.g. {changed[0]!r}; please report this with the source model"
        )


# ------------------------------------------------------------------------------------------------ output
def _copy_module_files(source: Path, dest: Path) -> None:
    """Carry sentence-transformers files (modules.json and its Pooling/Normalize folders) through.

    Not sentence_bert_config.json: save_pretrained wrote it for the student (its max length, and no
    pooler for sentence-transformers to build, as the student's weights hold none).
    """
    for name in (ST_MODULES, ST_CONFIG):
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    if (source / ST_MODULES).is_file():
        for entry in json.loads((source / ST_MODULES).read_text(encoding="utf-8")):
            sub = entry.get("path") or ""
            if sub and (source / sub).is_dir():
                shutil.copytree(source / sub, dest / sub, dirs_exist_ok=True)


def _existing_record(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "config.json").read_text(encoding="utf-8")).get(SURGERY_KEY)
    except (OSError, ValueError, AttributeError):
        return None


def _same(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    return a is not None and {k: v for k, v in a.items() if k != "seconds"} == {
        k: v for k, v in b.items() if k != "seconds"
    }


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _publish(partial: Path, out: Path, overwrite: bool) -> None:
    from pipeline.io import fsync_dir, fsync_tree

    fsync_tree(partial)
    if out.exists():
        if not overwrite:
            raise InputError(
                f"{out} exists and holds a different model; pass --overwrite or choose another --out"
            )
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(trash)
        partial.rename(out)
        shutil.rmtree(trash)
    else:
        partial.rename(out)
    fsync_dir(out.parent)


# ------------------------------------------------------------------------------------------------ command
def load_source(folder: Path) -> tuple[nn.Module, Any]:
    from transformers import AutoTokenizer

    from pipeline.model.encoder import load_backbone

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        backbone = load_backbone(folder)  # without the pooler, and without a load report about it
    except OSError as exc:
        raise InputError(f"cannot load model folder {folder}: {exc}".splitlines()[0]) from None
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(
            f"{folder}: the tokenizer is not a fast (tokenizer.json) tokenizer; surgery needs one"
        )
    return backbone.eval(), tokenizer


def make_student(cfg: Config) -> dict[str, Any]:
    """Build, verify and publish the student folder; returns the summary printed by :func:`run`."""
    from pipeline.model.encoder import SentenceEncoder

    start = time.perf_counter()
    source = Path(cfg.model)
    if not source.is_dir():
        raise InputError(f"model folder {source} does not exist; give a local model folder")
    rule = read_rule(source)
    if rule.transformer_dir:
        raise InputError(
            f"{source}: transformer in {rule.transformer_dir}/; point --model at that sub-folder"
        )
    pooling = cfg.pooling or rule.pooling
    if not pooling:
        raise ConfigError(f"{source} has no pooling rule; {POOLING_HELP}")
    texts: list[str] = []
    if cfg.trim_vocab:
        texts = corpus_texts(cfg.shards, cfg.texts, cfg.max_sentences)
        if not texts:
            raise InputError(
                f"the corpus is empty (no sentences in --shards {cfg.shards} / --texts {cfg.texts})"
            )

    declared = json.loads((source / "config.json").read_text()) if (source / "config.json").is_file() else {}
    if isinstance(declared.get("num_hidden_layers"), int):  # fail on a bad layer choice before loading
        resolve_layers(declared["num_hidden_layers"], cfg.keep_layers, cfg.layers)
    backbone, tokenizer = load_source(source)
    num_layers = len(encoder_layers(backbone))
    layers = resolve_layers(num_layers, cfg.keep_layers, cfg.layers)
    params_before = count_parameters(backbone)
    pieces_before = len(tokenizer)
    keep_layers(backbone, layers)
    prefix = rule.prefix or ""
    max_length = rule.max_length or 512

    record: dict[str, Any] = {
        "source": str(source.resolve()),
        "source_layers": num_layers,
        "layers": layers,
        "tool_version": __version__,
        "vocab": None,
    }
    if cfg.trim_vocab:
        backend = tokenizer.backend_tokenizer
        choice = choose_pieces(backend, texts + ([prefix] if prefix else []), cfg.seen_char_pieces)
        digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
        record["vocab"] = {
            "pieces_before": pieces_before,
            "pieces_kept": len(choice.kept),
            "from_corpus": choice.from_corpus,
            "special": choice.special,
            "single_char_added": choice.single_char,
            "seen_char_pieces": cfg.seen_char_pieces,
            "unicode_blocks": len(choice.blocks),
            "corpus": {
                "shards": [str(Path(p).resolve()) for p in cfg.shards],
                "texts": [str(Path(p).resolve()) for p in cfg.texts],
                "sentences": len(texts),
                "sha256": digest,
            },
        }
        trimmed = build_trimmed_tokenizer(
            tokenizer, trim_tokenizer_json(json.loads(backend.to_str()), choice.kept)
        )
        sample = random.Random(0).sample(texts, min(cfg.verify_sentences, len(texts)))
        reference = SentenceEncoder(backbone, tokenizer, pooling, max_length, prefix)
        expected = reference.encode(sample)  # the layer-cut model with the whole vocabulary
        _check_same_pieces(tokenizer, trimmed, [prefix + t for t in sample])
        trim_embeddings(backbone, choice.kept)
        tokenizer = trimmed
    record["parameters_before"] = params_before
    record["parameters_after"] = count_parameters(backbone)

    out = Path(cfg.out)
    if out.exists() and _same(_existing_record(out), record):
        log.info("%s already holds this student; nothing to do", out)
        return {**record, "out": str(out), "bytes": dir_bytes(out), "seconds": 0.0, "unchanged": True}
    if out.exists() and not cfg.overwrite:
        raise InputError(
            f"{out} exists and holds a different model; pass --overwrite or choose another --out"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        backbone.config.update({SURGERY_KEY: record})
        SentenceEncoder(backbone, tokenizer, pooling, max_length, prefix).save_pretrained(partial)
        meta_path = source / ENCODER_FILE
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
        meta = {**meta, "pooling": pooling, "max_length": max_length, "prefix": prefix}
        meta.setdefault("normalize", True)
        meta["surgery"] = record
        (partial / ENCODER_FILE).write_text(
            json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        _copy_module_files(source, partial)
        for weights in partial.glob("*.safetensors"):
            weights.chmod(0o644)  # safetensors creates it owner-only; model folders are shared
        if cfg.trim_vocab:  # reload what was written, as every user of the folder will
            student = SentenceEncoder.from_pretrained(partial)
            _check_same_pieces(reference.tokenizer, student.tokenizer, [prefix + t for t in sample])
            got = student.encode(sample)
            worst = float(abs(got - expected).max())
            if worst > 1e-4:
                raise RuntimeError(f"trimmed student embeddings differ from the source by up to {worst:.2e}")
            record["verified"] = {"sentences": len(sample), "max_abs_diff": worst}
        _publish(partial, out, cfg.overwrite)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return {**record, "out": str(out), "bytes": dir_bytes(out), "seconds": time.perf_counter() - start}


def summary_lines(s: dict[str, Any]) -> list[str]:
    lines = [f"student {s['out']}" + (" (unchanged)" if s.get("unchanged") else "")]
    lines.append(f"  layers kept       {s['layers']} of {s['source_layers']}")
    if s["vocab"]:
        v = s["vocab"]
        lines.append(
            f"  pieces kept       {v['pieces_kept']:,} of {v['pieces_before']:,} "
            f"(corpus {v['from_corpus']:,}, special {v['special']}, "
            f"single characters of {v['unicode_blocks']} Unicode blocks"
            f"{' and pieces of corpus characters' if v.get('seen_char_pieces') else ''} "
            f"+{v['single_char_added']:,})"
        )
    lines.append(f"  parameters        {s['parameters_before']:,} -> {s['parameters_after']:,}")
    if s.get("verified"):
        lines.append(
            f"  verified          {s['verified']['sentences']} corpus sentences: same pieces, "
            f"embeddings max |diff| {s['verified']['max_abs_diff']:.1e}"
        )
    lines.append(f"  disk              {s['bytes'] / 2**20:.1f} MiB")
    lines.append(f"  time              {s['seconds']:.1f} s")
    return lines


def run(cfg: Config) -> int:
    print("\n".join(summary_lines(make_student(cfg))))
    return 0
