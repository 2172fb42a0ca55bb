"""``python -m pipeline eval MODEL_OR_CHECKPOINT``: the evaluation suite.

Suites: ``sts`` (Spearman on the five bundled sets and any ``--pairs`` file, optionally whitened),
``align`` (alignment/uniformity on the same embeddings), ``probe`` (frozen-encoder logistic regression
on the sentiment reviews), ``tfidf`` (the char TF-IDF floor, scored by the same code). Writes
``eval.json`` and ``eval.md`` and prints the tables.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline.config import option, to_dict
from pipeline.errors import ConfigError
from pipeline.evaluate.sts import STS_SETS, PairSet, load_sts_sets, read_pair_file, spearman100
from pipeline.precision import CPU_PRECISIONS, CpuPrecision, resolve_precision_for

log = logging.getLogger(__name__)

SUITES = ("sts", "align", "probe", "tfidf")


def check_precision(precision: str, device: str) -> None:
    """``--precision`` (eval, report): auto, fp32, or bf16 autocast, which is a CPU option."""
    if precision not in CPU_PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: choose one of {', '.join(CPU_PRECISIONS)}")
    if precision == "bf16" and not device.startswith("cpu"):
        raise ConfigError(f"--precision bf16 is CPU autocast; with --device {device} use auto or fp32")


def resolve_encode_precision(precision: str, device: str) -> tuple[str, str]:
    """``(fp32 | bf16, why)`` for ``--precision`` on ``device``: auto is bf16 autocast on a CPU with
    native bf16 and fp32 anywhere else (pipeline/precision.py)."""
    return resolve_precision_for(precision, device, "--precision")


@dataclass
class Config:
    model: str = option(
        "", "MODEL_OR_CHECKPOINT: model folder, checkpoint, run dir, DeepSpeed checkpoint or Hub name."
    )
    suite: list[str] = option(list(SUITES), "Which parts to run: any of sts, align, probe, tfidf.")
    sets: list[str] = option(list(STS_SETS), "Bundled STS sets to score (avg5 needs all five).")
    pairs: list[Path] = option(
        factory=list,
        help="Extra pair files (sentence1<TAB>sentence2<TAB>label, or JSONL) scored like the sets.",
    )
    max_pairs: int | None = option(
        None, "Subsample every pair set and the probe data to this many examples (seeded); empty = all."
    )
    seed: int = option(0, "Seed of subsampling, the probe split and the uniformity pairs.")
    batch_size: int = option(
        64, "Sentences per encoding batch (texts are tokenised once and batched by token count)."
    )
    precision: CpuPrecision = option(
        "auto",
        "CPU compute precision of the encoder: auto (bf16 on a CPU with native bf16, AMX-BF16 or "
        "AVX512-BF16; fp32 elsewhere, where bf16 is emulated and several times slower), fp32, or bf16 = "
        "bfloat16 autocast (weights stay fp32, rows re-normalised in fp32). Measured on the five STS sets: "
        "within 0.1 Spearman of fp32 for the sample student and e5-small (docs/evaluate.md). The precision "
        "used is logged and written to eval.json.",
    )
    threads: int | None = option(
        None,
        "torch CPU threads for encoding (empty = torch's default, one per core). 1 is faster when other "
        "processes load the cores (2 threads on 2 busy cores wait on each other at every op).",
    )
    whitening: bool = option(False, "Also report BERT-whitened Spearman beside the raw score.")
    whitening_source: Literal["corpus", "eval"] = option(
        "corpus",
        "Sentences the whitening is fitted on: 'corpus' = a sample of the bundled training corpus (no eval "
        "text seen); 'eval' = each set's own sentences (transductive, as in Su et al. 2021; optimistic).",
    )
    whitening_sentences: int = option(10000, "How many corpus sentences to fit the whitening on.")
    whitening_dim: int | None = option(None, "Keep this many whitened dimensions (empty = all).")
    uniformity_pairs: int = option(100_000, "Random sentence pairs per set for the uniformity estimate.")
    probe_test_size: float = option(0.2, "Held-out share of the stratified probe split.")
    checkpoint: Literal["latest", "best"] = option("latest", "For a run directory: which checkpoint to use.")
    skeleton: Path | None = option(
        None,
        "DeepSpeed checkpoint: model folder with config/tokenizer/encoder.json (default: found beside it).",
    )
    out: Path | None = option(
        None, "Output directory (default: CHECKPOINT/eval, MODEL/eval, or ./eval_out for a Hub name)."
    )
    device: str = option("cpu", "torch device to encode on (cpu, cuda, cuda:1).")
    pooling: Literal["cls", "mean", "first_last_avg"] | None = option(
        None, "Override the model's pooling (empty = the folder's rule; needed for a folder without one)."
    )
    prefix: str | None = option(
        None, "Override the text prefix put before every sentence (empty = the folder's rule)."
    )
    progress: bool = option(True, "Show progress bars while encoding.")
    retrieval: list[Path] = option(
        factory=list,
        help="Query -> document pair files scored as retrieval (recall@10, nDCG@10, MRR@10; the distinct "
        "documents are the corpus): JSON lines (.gz allowed) with --retrieval-fields, or query<TAB>document.",
    )
    retrieval_fields: str = option("query,desc", "QUERY_FIELD,DOCUMENT_FIELD of --retrieval JSON lines.")
    document_prefix: str | None = option(
        None,
        "Prompt before the documents of --retrieval (empty = the folder's document prompt, e5's 'passage: ', "
        "else the query prefix); queries get the query prefix.",
    )
    # `--dims 384,256,128,64` arrives as one string and `--dims 128` as an int: parsed in __post_init__
    dims: list[int | str] | int = option(
        factory=list,
        help="Also score these Matryoshka widths (e.g. 384,256,128,64): STS and the probe on each "
        "re-normalised prefix, from the same encoding.",
    )

    def __post_init__(self) -> None:
        unknown = [s for s in self.suite if s not in SUITES]
        if unknown or not self.suite:
            raise ConfigError(f"--suite {unknown or '[]'} is not valid; choose from {', '.join(SUITES)}")
        bad_sets = [s for s in self.sets if s not in STS_SETS]
        if bad_sets:
            raise ConfigError(f"--sets: unknown {bad_sets}; choose from {', '.join(STS_SETS)}")
        if not self.model and set(self.suite) != {"tfidf"}:
            raise ConfigError("name a MODEL_OR_CHECKPOINT (or run only --suite tfidf)")
        if self.max_pairs is not None and self.max_pairs < 10:
            raise ConfigError("--max-pairs must be >= 10 (Spearman on fewer pairs is noise)")
        if self.batch_size < 1:
            raise ConfigError("--batch-size must be >= 1")
        check_precision(self.precision, self.device)
        if self.threads is not None and self.threads < 1:
            raise ConfigError("--threads must be >= 1 (or empty for torch's default)")
        if self.whitening_dim is not None and self.whitening_dim < 1:
            raise ConfigError("--whitening-dim must be >= 1 (or empty for all dimensions)")
        if self.whitening_sentences < 2:
            raise ConfigError("--whitening-sentences must be >= 2")
        if not 0.0 < self.probe_test_size < 1.0:
            raise ConfigError("--probe-test-size must be in (0, 1)")
        if self.uniformity_pairs < 1:
            raise ConfigError("--uniformity-pairs must be >= 1")
        self.dims = parse_dims(self.dims, "--dims")
        if len(self.retrieval_fields.split(",")) != 2:
            raise ConfigError(
                f"--retrieval-fields {self.retrieval_fields!r}: give QUERY_FIELD,DOCUMENT_FIELD"
            )
        if self.retrieval and not self.model:
            raise ConfigError("--retrieval needs a MODEL_OR_CHECKPOINT")


def parse_dims(values: list[int | str] | int, flag: str) -> list[int]:
    """Widths from ``[384, 128]``, ``["384,128"]``, ``128`` or repeated flags: distinct, largest first."""
    dims: list[int] = []
    for value in values if isinstance(values, list) else [values]:
        for part in str(value).split(","):
            if not part.strip().isdigit() or int(part) < 1:
                raise ConfigError(
                    f"{flag}: {part.strip()!r} is not a width; give integers >= 1, e.g. 384,128,64"
                )
            dims.append(int(part))
    if len(set(dims)) != len(dims):
        raise ConfigError(f"{flag}: {dims} repeats a width")
    return sorted(dims, reverse=True)


def corpus_sentences(limit: int, seed: int) -> list[str]:
    """A seeded sample of sentences of the bundled corpus (paragraphs split at 。！？)."""
    from pipeline.evaluate.tfidf import corpus_lines

    sentences = [s for line in corpus_lines() for s in re.split(r"(?<=[。！？])", line) if len(s) >= 5]
    if len(sentences) <= limit:
        return sentences
    pick = np.random.default_rng(seed).choice(len(sentences), size=limit, replace=False)
    return [sentences[i] for i in np.sort(pick)]


def load_pair_sets(cfg: Config) -> list[PairSet]:
    sets = load_sts_sets(cfg.sets) + [read_pair_file(p) for p in cfg.pairs]
    return [s.subsample(cfg.max_pairs, cfg.seed) for s in sets]


def _with_avg(scores: dict[str, float], names: list[str]) -> dict[str, float]:
    if all(n in scores for n in STS_SETS):  # the mean is over exactly the five bundled sets
        scores["avg5"] = float(np.mean([scores[n] for n in STS_SETS]))
    return {k: scores[k] for k in [*names, "avg5"] if k in scores}


def evaluate_model(
    encode: Callable[[list[str], str], np.ndarray],
    sets: list[PairSet],
    cfg: Config,
    cosines: dict[str, np.ndarray] | None = None,
) -> dict:
    """STS (raw and whitened) and alignment/uniformity from one encoding of each set; each set's raw
    per-pair cosines go into ``cosines`` when given."""
    from pipeline.evaluate.alignment import alignment, uniformity
    from pipeline.evaluate.sts import embed_pair_set

    names = [s.name for s in sets]
    whitener = None
    if cfg.whitening and cfg.whitening_source == "corpus":
        whitener = _fit_whitening(
            encode(corpus_sentences(cfg.whitening_sentences, cfg.seed), "whitening"), cfg
        )
    raw, white, align = {}, {}, {}
    for pairs in sets:
        embedded = embed_pair_set(lambda texts, name=pairs.name: encode(texts, name), pairs)
        pair_cosines = embedded.cosines()
        raw[pairs.name] = spearman100(pair_cosines, pairs.labels)
        if cosines is not None:
            cosines[pairs.name] = np.asarray(pair_cosines, dtype=np.float32)
        if cfg.whitening:
            w = whitener or _fit_whitening(embedded.vectors, cfg)
            white[pairs.name] = spearman100(embedded.cosines(w.apply), pairs.labels)
        if "align" in cfg.suite:
            positive = pairs.positive_mask()
            vectors = embedded.vectors
            align[pairs.name] = {
                "align": alignment(vectors[embedded.index1[positive]], vectors[embedded.index2[positive]])
                if positive.any()
                else None,
                "uniform": uniformity(vectors, cfg.uniformity_pairs, seed=cfg.seed),
                "positives": int(positive.sum()),
            }
    out: dict[str, Any] = {}
    if "sts" in cfg.suite:
        out["model"] = _with_avg(raw, names)
        if cfg.whitening:
            out["model_whitened"] = _with_avg(white, names)
    if align:
        out["align"] = align
    return out


def _fit_whitening(vectors: np.ndarray, cfg: Config) -> Any:
    from pipeline.evaluate.whitening import fit_whitening

    if len(vectors) < vectors.shape[1]:
        log.warning(
            "whitening fitted on %d sentences for %d dimensions: the covariance is rank-deficient",
            len(vectors),
            vectors.shape[1],
        )
    dim = None if cfg.whitening_dim is None else min(cfg.whitening_dim, vectors.shape[1])
    return fit_whitening(vectors, dim)


def cached(encode: Callable[[list[str], str], np.ndarray]) -> Callable[[list[str], str], np.ndarray]:
    """``encode`` that encodes each (texts, desc) once: the prefixes of every width share one encoding."""
    memo: dict[tuple[str, int, int], np.ndarray] = {}

    def encode_once(texts: list[str], desc: str = "encode") -> np.ndarray:
        key = (desc, len(texts), hash(tuple(texts)))
        if key not in memo:
            memo[key] = encode(texts, desc)
        return memo[key]

    return encode_once


def check_dims(dims: list[int], width: int) -> None:
    wide = [d for d in dims if d > width]
    if wide:
        raise ConfigError(f"--dims {wide}: the model's embeddings are {width}-d; keep every width <= {width}")


def evaluate_dims(
    encode: Callable[[list[str], str], np.ndarray], sets: list[PairSet], cfg: Config, width: int
) -> dict[str, dict[str, Any]]:
    """STS (raw) and the probe on the re-normalised first k dimensions, for each k of ``cfg.dims``."""
    from pipeline.evaluate.probe import linear_probe, read_labelled_tsv
    from pipeline.evaluate.sts import embed_pair_set
    from pipeline.model.encoder import truncate_normalise

    check_dims(cfg.dims, width)
    out: dict[str, dict[str, Any]] = {}
    for dim in cfg.dims:

        def short(texts: list[str], desc: str = "encode", dim: int = dim) -> np.ndarray:
            return truncate_normalise(encode(texts, desc), dim)

        entry: dict[str, Any] = {}
        if "sts" in cfg.suite:
            scores = {
                s.name: spearman100(embed_pair_set(lambda t, n=s.name: short(t, n), s).cosines(), s.labels)
                for s in sets
            }
            entry["sts"] = _with_avg(scores, [s.name for s in sets])
        if "probe" in cfg.suite:
            entry["probe"] = linear_probe(
                lambda texts: short(texts, "probe"),
                read_labelled_tsv(),
                cfg.probe_test_size,
                cfg.seed,
                cfg.max_pairs,
            )
        out[str(dim)] = entry
    return out


def evaluate_tfidf(sets: list[PairSet]) -> dict[str, float]:
    from pipeline.evaluate.sts import score_pairs
    from pipeline.evaluate.tfidf import CharTfidf, corpus_lines

    corpus = corpus_lines()
    # each set gets its own IDF (corpus + its sentences), so a set's score does not depend on --sets
    scores = {s.name: score_pairs(CharTfidf(corpus + s.sentences()), s)[0] for s in sets}
    return _with_avg(scores, [s.name for s in sets])


def set_compute(cfg: Config) -> str:
    """Apply --threads, resolve --precision and say how the encoder computes (logged: a bf16 score is
    never silent). Returns the precision, fp32 or bf16 (autocast)."""
    import torch

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    precision, why = resolve_encode_precision(cfg.precision, cfg.device)
    log.info("encoding on %s in %s (%s) with %d torch thread(s), batches of %d sentences by token count",
             cfg.device, precision, why, torch.get_num_threads(), cfg.batch_size)  # fmt: skip
    return precision


def default_out(resolved: Any) -> Path:
    if resolved is None or resolved.kind == "hub":
        return Path("eval_out")
    if resolved.checkpoint_dir is not None:
        return resolved.checkpoint_dir / "eval"
    return Path(resolved.model_dir) / "eval"


def run(cfg: Config) -> int:
    from pipeline.evaluate import resolve
    from pipeline.evaluate.tables import result_markdown

    start = time.perf_counter()
    sets = load_pair_sets(cfg)
    resolved = resolve.resolve(cfg.model, cfg.checkpoint, cfg.skeleton) if cfg.model else None
    out_dir = cfg.out or default_out(resolved)
    result: dict[str, Any] = {
        "model": resolve.describe(resolved) if resolved else None,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": to_dict(cfg),
    }
    sts: dict[str, Any] = {"sets": [s.name for s in sets], "pairs": {s.name: len(s) for s in sets}}
    needs_model = bool({"sts", "align", "probe"} & set(cfg.suite)) or bool(cfg.retrieval)
    if needs_model and resolved is not None:
        encoder = resolve.load_encoder(resolved, cfg.device, cfg.pooling, cfg.prefix)
        result["model"].update(
            pooling=encoder.pooling, max_length=encoder.max_length, prefix=encoder.prefix, dim=encoder.dim
        )

        precision = set_compute(cfg)
        result["model"]["precision"] = precision
        bf16 = precision == "bf16"

        def encode(texts: list[str], desc: str = "encode") -> np.ndarray:
            return encoder.encode(
                texts, batch_size=cfg.batch_size, progress=cfg.progress, desc=desc, bf16=bf16
            )

        if cfg.dims:  # every width reads the same vectors: encode each set once
            check_dims(cfg.dims, encoder.dim)
            encode = cached(encode)

        if {"sts", "align"} & set(cfg.suite):
            cosines: dict[str, np.ndarray] = {}
            found = evaluate_model(encode, sets, cfg, cosines)
            if "sts" in cfg.suite and not cfg.pairs:  # the bundled sets: a report can plot them from these
                result["cosines"] = save_cosines(cosines, out_dir, resolved, precision, cfg)
            if "align" in found:
                result["align"] = found.pop("align")
            sts.update(found)
            if cfg.whitening:
                result["whitening"] = {
                    "source": cfg.whitening_source,
                    "dim": cfg.whitening_dim or encoder.dim,
                    "sentences": cfg.whitening_sentences
                    if cfg.whitening_source == "corpus"
                    else "each set's own",
                }
        if "probe" in cfg.suite:
            from pipeline.evaluate.probe import linear_probe, read_labelled_tsv

            result["probe"] = {"data": "sentiment_reviews"} | linear_probe(
                lambda texts: encode(texts, "probe"),
                read_labelled_tsv(),
                cfg.probe_test_size,
                cfg.seed,
                cfg.max_pairs,
            )
        if cfg.dims and {"sts", "probe"} & set(cfg.suite):
            result["dims"] = evaluate_dims(encode, sets, cfg, encoder.dim)
        if cfg.retrieval:
            result["retrieval"] = evaluate_retrieval(encoder, resolved, cfg, bf16)
    if "tfidf" in cfg.suite:
        sts["tfidf"] = evaluate_tfidf(sets)
    if any(k in sts for k in ("model", "tfidf")):
        result["sts"] = sts
    result["seconds"] = round(time.perf_counter() - start, 1)
    write_result(result, out_dir)
    print(result_markdown(result))
    for name, scores in (result.get("retrieval") or {}).items():
        print(f"retrieval {name}: recall@10 {scores['recall@10']:.2f}, nDCG@10 {scores['ndcg@10']:.2f} "
              f"({scores['queries']} queries, {scores['documents']} documents)")  # fmt: skip
    print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval.md'} in {result['seconds']} s")
    return 0


def evaluate_retrieval(encoder: Any, resolved: Any, cfg: Config, bf16: bool) -> dict[str, Any]:
    """Each --retrieval file: queries with the query prefix against documents with the document prompt
    (under bf16 autocast with ``bf16``, the resolved --precision)."""
    from pipeline.evaluate.retrieval import make_set, read_pairs, score_retrieval
    from pipeline.model.rules import read_rule

    if cfg.document_prefix is not None:
        document_prefix = cfg.document_prefix
    elif cfg.prefix is not None:  # an explicit prefix replaces the folder's rule, both sides
        document_prefix = encoder.prefix
    else:
        folder = resolved.skeleton_dir or resolved.model_dir or resolved.spec
        found = read_rule(folder).document_prefix if folder else None
        document_prefix = encoder.prefix if found is None else found
    query_prefix = encoder.prefix
    query_field, document_field = cfg.retrieval_fields.split(",")
    out: dict[str, Any] = {}
    for path in cfg.retrieval:
        data = read_pairs(path, query_field.strip(), document_field.strip())
        if cfg.max_pairs is not None and len(data.queries) > cfg.max_pairs:  # seeded, as the pair sets
            keep = np.sort(
                np.random.default_rng(cfg.seed).choice(len(data.queries), cfg.max_pairs, replace=False)
            )
            data = make_set(data.name, [(data.queries[i], data.documents[data.gold[i]]) for i in keep])

        def encode_with(prefix: str, desc: str) -> Any:
            def encode(texts: Any) -> np.ndarray:
                own, encoder.prefix = encoder.prefix, prefix
                try:
                    return encoder.encode(
                        list(texts),
                        batch_size=cfg.batch_size,
                        progress=cfg.progress,
                        desc=desc,
                        bf16=bf16,
                    )
                finally:
                    encoder.prefix = own

            return encode

        scores = score_retrieval(
            encode_with(query_prefix, "queries"), encode_with(document_prefix, "documents"), data
        )
        out[data.name] = {**scores, "query_prefix": query_prefix, "document_prefix": document_prefix}
    return out


COSINES_FILE = "cosines.npz"


def save_cosines(
    cosines: dict[str, np.ndarray], out_dir: Path, resolved: Any, precision: str, cfg: Config
) -> dict[str, Any]:
    """OUT/cosines.npz: each scored set's per-pair cosines in file order, and what they were computed
    with, so that ``report`` plots the same model's similarities without encoding the sets again."""
    from pipeline.evaluate.resolve import weights_digest

    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez(out_dir / COSINES_FILE, **cosines)
    pairs = {name: len(values) for name, values in cosines.items()}
    return {"file": COSINES_FILE, "weights_sha256": weights_digest(resolved), "precision": precision,
            "max_pairs": cfg.max_pairs, "seed": cfg.seed, "pairs": pairs}  # fmt: skip


def write_result(result: dict[str, Any], out_dir: Path) -> None:
    from pipeline.evaluate.tables import result_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(
        json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    model = (result.get("model") or {}).get("spec", "(TF-IDF only)")
    text = f"# Evaluation of `{model}`\n\n{result_markdown(result)}\nTook {result['seconds']} s.\n"
    (out_dir / "eval.md").write_text(text, encoding="utf-8")
