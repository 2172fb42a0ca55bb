"""Paper projection for the full nlp_chinese_corpus: CPU hours to preprocess and augment it, GPU hours per
LUSE epoch. A projection, not a measurement at scale: it combines figures measured on this project's
2-core reference machine with stated assumptions, and labels every number as one or the other.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/projection.py            # markdown report on stdout
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/projection.py --json     # the same, machine-readable
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/projection.py --mfu 0.2 --nodes 1,8 --augment-rate 4000
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/projection.py --measure-padding [--padding-model DIR]

What it measures here (about 40 s of one core, most of it counting the base model's FLOPs):
  * sentence lengths of the bundled corpus after preprocessing (runs/sample/shards, or a fresh
    `preprocess` of pipeline/resources in a temporary directory) and of its EDA variants (the project's
    own augmenter on a random subset), hence mean tokens per sequence = chars + [CLS] + [SEP], capped at
    max_length, and the padded length the training collator produces (it pads a rank's batch to its
    longest text);
  * FLOPs of one forward+backward of a randomly initialised transformers BERT on CPU with
    torch.utils.flop_counter.FlopCounterMode (4 sentences x n views), scaled linearly per sequence.
What it takes from elsewhere (arguments, defaults from README.md "Measured figures" or assumed):
  per-core preprocess and augment rates, the shard/text byte ratio, parallel efficiency, GPU peaks, MFU,
  and the padded/real token ratios of length-bucketed and of random batches (defaults printed by
  --measure-padding, which counts one epoch of runs/sample/augmented per scenario with
  benchmarks/padding.py's functions and a char-level tokenizer built from the shards, or with
  --padding-model's tokenizer: about 40 s more, no model needed by default).

Three length scenarios: "mean" (no padding at all), "bucketed" (mean x the bucketed padded/real ratio:
data.length_bucketing) and "padded" (random batches, each rank's batch padded to its longest text).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _common import fmt
from torch.utils.flop_counter import FlopCounterMode

from pipeline.resources import SAMPLE_CORPUS
from pipeline.shards import read_manifest, read_shard, sentence_id, shard_paths

REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)

# Where the defaults come from: README.md "Measured figures" names the command that printed each one.
PREPROCESS_CMD = ".venv/bin/python benchmarks/preprocess.py"
AUGMENT_CMD = ".venv/bin/python benchmarks/augment.py"
CORPUS_SOURCE = (
    'README.md ("110M sentences in five JSON-lines collections") and docs/preprocess.md ("110M '
    'sentences, ~15 GB of JSON, ~940 partitions"; "~1,100 shards" at 100k sentences per shard). '
    "/work/shared/data/README.md describes only the bundled sample (People's Daily 1998-01, 19,484 "
    "lines, about 45k sentences, 5.5 MB) and gives no size for the full corpus; the 110M figure is not "
    "re-measured here"
)
A100_SOURCE = "NVIDIA A100 datasheet: SXM BF16 Tensor Core 312 TFLOPS dense (624 with sparsity)"
H100_SOURCE = "NVIDIA H100 datasheet: SXM BF16 Tensor Core 1,979 TFLOPS with sparsity = 989 dense"
HF_CONFIG_SOURCE = "the model's published config.json (not downloaded: built from transformers.BertConfig)"
# The padded/real defaults were printed by this command (benchmarks/padding.py's counting, a char-level
# tokenizer, this projection's max_length, batch, world and views); e5 word pieces: --padding-model.
PADDING_CMD = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/projection.py --measure-padding"
BUCKETED_PADDING, RANDOM_PADDING = 1.062, 1.665  # window 50; random batches: the same run
PADDING_SETTINGS = {
    "max_length": 64,
    "per_gpu_batch": 64,
    "gpus": 8,
    "augment_variants": 4,
    "bucket_window": 50,
}


@dataclass(frozen=True)
class Fig:
    """One number of the report: its value, whether it was measured, assumed or projected, and how."""

    value: float
    kind: str  # "measured" | "assumed" | "projected"
    source: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    source: str


# --------------------------------------------------------------------------------------------- corpus
@dataclass
class LengthStats:
    """Per-sentence sizes of the preprocessed corpus and its EDA variants (all measured here)."""

    sentences: int
    mean_chars: float
    mean_text_bytes: float  # UTF-8 bytes of the text column per sentence
    shard_text_ratio: float  # shard bytes / UTF-8 text bytes of these (small) shards
    truncated_share: float  # share of originals longer than max_length tokens
    mean_tokens_original: float
    mean_tokens_variant: float  # variant slots (a missing variant is the original again), corpus-scaled
    mean_tokens_per_view: float  # over all n views, as the collator builds them
    mean_variant_bytes: float  # UTF-8 bytes of a made variant, corpus-scaled like the tokens
    padded_length: float  # mean over sampled batches of the longest text of a rank's batch
    variant_sample: int  # sentences augmented here to measure variants
    source: str


def token_length(text: str, max_length: int) -> int:
    """Tokens of a Chinese sentence under a char-level BERT tokenizer: chars + [CLS] + [SEP], truncated.

    An upper bound for bert-base-chinese's vocabulary, which folds runs of Latin letters and digits
    into word pieces; exact for the CJK characters that make up most of the corpus.
    """
    return min(len(text) + 2, max_length)


def read_sentences(shards: Path | None, work: Path) -> tuple[list[str], int, str]:
    """Texts of a preprocessed shard directory and its total shard bytes; preprocess the sample if absent."""
    if shards is None or not (shards / "manifest.json").is_file():
        from pipeline.stages.preprocess.run import Config, run

        shards = work / "preprocessed"
        log.info("no preprocessed shards given: running `preprocess` on %s into %s", SAMPLE_CORPUS, shards)
        run(Config(inputs=[SAMPLE_CORPUS], out=shards))
        source = f"`preprocess` of {SAMPLE_CORPUS.relative_to(REPO)} run by this script"
    else:
        source = f"{shards} (the bundled corpus after `preprocess`)"
    texts = [
        t for p in shard_paths(shards) for block in read_shard(p) for t in block.column("text").to_pylist()
    ]
    shard_bytes = read_manifest(shards)["totals"]["bytes"]
    return texts, shard_bytes, source


def eda_variants(texts: list[str], num_variants: int, work: Path) -> list[list[str]]:
    """The project's EDA variants (default augment options, Cilin synonyms) of ``texts``."""
    from pipeline.stages.augment.run import Config, build_augmenter

    augmenter = build_augmenter(Config(shards=work, out=work / "unused", num_variants=num_variants))
    return [augmenter.augment(sentence_id(t), t)[0] for t in texts]


def measure_lengths(
    shards: Path | None,
    num_variants: int,
    num_dropout_views: int,
    max_length: int,
    per_gpu_batch: int,
    variant_sample: int,
    seed: int,
) -> LengthStats:
    with tempfile.TemporaryDirectory(prefix="projection-") as tmp:
        texts, shard_bytes, source = read_sentences(shards, Path(tmp))
        rng = random.Random(seed)
        subset = rng.sample(texts, min(variant_sample, len(texts)))
        variants = eda_variants(subset, num_variants, Path(tmp)) if num_variants else [[] for _ in subset]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    mean_tokens_original = sum(token_length(t, max_length) for t in texts) / len(texts)
    # A sentence with fewer than k variants repeats its original in the missing slots (ViewCollator).
    slots = [(v + [t] * num_variants)[:num_variants] for t, v in zip(subset, variants)]
    views = [[t, *s, *([t] * num_dropout_views)] for t, s in zip(subset, slots)]
    longest = [max(token_length(x, max_length) for x in v) for v in views]
    batches = [max(rng.sample(longest, min(per_gpu_batch, len(longest)))) for _ in range(200)]
    # Variants are measured as a ratio to their own originals, applied to the whole corpus's mean:
    # far less sampling noise than the subset's absolute mean.
    slot_tokens = sum(token_length(x, max_length) for s in slots for x in s)
    subset_tokens = sum(token_length(t, max_length) for t in subset) * max(num_variants, 1)
    mean_tokens_variant = mean_tokens_original * slot_tokens / subset_tokens if num_variants else 0.0
    made = [(x, t) for t, v in zip(subset, variants) for x in v]
    byte_ratio = sum(len(x.encode()) for x, _ in made) / max(sum(len(t.encode()) for _, t in made), 1)
    n_views = 1 + num_variants + num_dropout_views
    return LengthStats(
        sentences=len(texts),
        mean_chars=sum(len(t) for t in texts) / len(texts),
        mean_text_bytes=text_bytes / len(texts),
        shard_text_ratio=shard_bytes / text_bytes,
        truncated_share=sum(len(t) + 2 > max_length for t in texts) / len(texts),
        mean_tokens_original=mean_tokens_original,
        mean_tokens_variant=mean_tokens_variant,
        mean_tokens_per_view=(
            (1 + num_dropout_views) * mean_tokens_original + num_variants * mean_tokens_variant
        )
        / n_views,
        mean_variant_bytes=byte_ratio * text_bytes / len(texts),
        padded_length=sum(batches) / len(batches),
        variant_sample=len(subset),
        source=source,
    )


# --------------------------------------------------------------------------------------------- padding
@dataclass(frozen=True)
class PaddingRatios:
    """Padded/real tokens of real training batches (the trainer's collator), random and length-bucketed."""

    random: float
    bucketed: float
    window: int  # data.bucket_window the bucketed ratio was measured at
    source: str


def char_tokenizer(shards: Path) -> Any:
    """A character-level BERT tokenizer over every character of ``shards``' texts and variants.

    This projection's token model (chars + [CLS] + [SEP], as bert-base-chinese and RBT3 cut CJK text)
    as a real tokenizer, so that padding is measured on the same lengths the FLOPs are counted at.
    """
    from transformers import BertTokenizerFast

    chars: set[str] = set()
    for path in shard_paths(shards):
        for block in read_shard(path):
            chars.update(*block.column("text").to_pylist())
            if "variants" in block.column_names:
                chars.update(*(x for v in block.column("variants").to_pylist() for x in v))
    pieces = sorted(c for c in chars if not c.isspace())
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *pieces, *(f"##{c}" for c in pieces)]
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=False)


def measure_padding(
    shards: Path,
    model: str,
    max_length: int,
    per_gpu_batch: int,
    gpus: int,
    num_variants: int,
    window: int,
) -> PaddingRatios:
    """One epoch of the real BatchStream per scenario, counted with benchmarks/padding.py's functions at
    this projection's batch, world size and views (1 + k + 1 dropout)."""
    from transformers import AutoTokenizer

    from pipeline.data.collate import ViewCollator
    from pipeline.data.stream import index_shards

    spec = importlib.util.spec_from_file_location("padding", Path(__file__).with_name("padding.py"))
    padding = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(padding)
    if model == "chars":
        tokenizer, prefix, tokens = char_tokenizer(shards), "", "a character-level BERT tokenizer"
    else:
        encoder = Path(model) / "encoder.json"
        prefix = json.loads(encoder.read_text()).get("prefix", "") if encoder.exists() else ""
        tokenizer, tokens = AutoTokenizer.from_pretrained(model), f"the tokenizer of {model}"
    counts = padding.TokenCounts(ViewCollator(tokenizer, max_length, num_variants, 1, prefix))
    blocks = index_shards(shards)
    global_batch = per_gpu_batch * gpus
    log.info("measuring padding: one epoch of %s, random then bucketed (window %d)", shards, window)
    random_ratio, _ = padding.epoch_ratio(blocks, counts, global_batch, gpus, 0)
    bucketed_ratio, steps = padding.epoch_ratio(blocks, counts, global_batch, gpus, window)
    source = (
        f"measured by this run: benchmarks/padding.py's epoch_ratio, one epoch ({steps} steps) of {shards} "
        f"with {tokens} (prefix {prefix!r}), global batch {global_batch} over {gpus} ranks, max_length "
        f"{max_length}, 1 + {num_variants} + 1 views"
    )
    return PaddingRatios(random_ratio, bucketed_ratio, window, source)


def given_padding(args: argparse.Namespace) -> PaddingRatios:
    """The ratios of --bucketed-padding / --random-padding: measured by PADDING_CMD unless changed."""
    if (args.bucketed_padding, args.random_padding) == (BUCKETED_PADDING, RANDOM_PADDING):
        differs = [k for k, v in PADDING_SETTINGS.items() if getattr(args, k) != v]
        if differs:
            log.warning(
                "the default padding ratios were measured at %s; this run changes %s: pass "
                "--measure-padding, or --bucketed-padding/--random-padding",
                PADDING_SETTINGS,
                ", ".join(differs),
            )
        source = f"`{PADDING_CMD}` (one epoch of runs/sample/augmented, char-level tokenizer)"
    else:
        source = "given with --bucketed-padding / --random-padding"
    return PaddingRatios(args.random_padding, args.bucketed_padding, args.bucket_window, source)


def scenario_lengths(stats: LengthStats, padding: PaddingRatios) -> dict[str, float]:
    """Tokens each sequence pays for: no padding, length-bucketed batches, random batches.

    'bucketed' applies the measured padded/real ratio of real (tokenised) batches to this projection's
    mean; 'padded' is the projection's own sampled estimate on the char-level lengths.
    """
    return {
        "mean": stats.mean_tokens_per_view,
        "bucketed": stats.mean_tokens_per_view * padding.bucketed,
        "padded": stats.padded_length,
    }


# --------------------------------------------------------------------------------------------- CPU stages
def parallel_seconds(sentences: float, rate_per_worker: float, workers: int, efficiency: float) -> float:
    """Wall seconds for ``sentences`` at ``rate_per_worker`` per core on ``workers`` cores.

    Linear scaling with cores, times a parallel efficiency.
    """
    if rate_per_worker <= 0 or workers < 1 or not 0 < efficiency <= 1:
        raise ValueError("rate_per_worker > 0, workers >= 1 and 0 < efficiency <= 1 are required")
    return sentences / (rate_per_worker * workers * efficiency)


def preprocess_seconds(
    sentences: float,
    rate: float,
    split_rate: float,
    workers: int,
    efficiency: float,
    split_pieces: int,
    merge_pieces: int,
) -> float:
    """The split pass, then dedup+shards+finalize, each using at most as many workers as it has pieces.

    The whole-run rate and the split-pass rate are both measured, so the per-sentence cost of the later
    phases is the difference of their inverses.
    """
    rest_rate = 1.0 / (1.0 / rate - 1.0 / split_rate)
    return parallel_seconds(sentences, split_rate, min(workers, split_pieces), efficiency) + parallel_seconds(
        sentences, rest_rate, min(workers, merge_pieces), efficiency
    )


def cpu_projection(args: argparse.Namespace, stats: LengthStats) -> list[dict[str, Any]]:
    """One row per node count: hours and the shared-filesystem traffic they imply."""
    s = args.sentences
    shard_per_sentence = stats.mean_text_bytes * args.shard_ratio
    # Augmented shards keep the text and add the variants; assume variants compress like the text.
    aug_per_sentence = args.shard_ratio * (
        stats.mean_text_bytes + args.augment_variants * stats.mean_variant_bytes
    )
    json_per_sentence = args.json_bytes / s
    rows = []
    for nodes in args.nodes:
        workers = nodes * args.cores_per_node
        pre = preprocess_seconds(
            s,
            args.preprocess_rate,
            args.split_rate,
            workers,
            args.efficiency,
            args.split_pieces,
            args.merge_pieces,
        )
        aug = parallel_seconds(s, args.augment_rate, min(workers, args.augment_shards), args.efficiency)
        pre_bytes = s * (json_per_sentence + shard_per_sentence)  # read JSON, write shards
        aug_bytes = s * (shard_per_sentence + aug_per_sentence)  # read shards, write augmented shards
        rows.append(
            {
                "nodes": nodes,
                "workers": workers,
                "preprocess_hours": pre / 3600,
                "preprocess_fs_gb_per_s": pre_bytes / pre / 1e9,
                "preprocess_io_floor_hours": pre_bytes / (args.fs_gbs * 1e9) / 3600,
                "augment_hours": aug / 3600,
                "augment_fs_gb_per_s": aug_bytes / aug / 1e9,
                "augment_io_floor_hours": aug_bytes / (args.fs_gbs * 1e9) / 3600,
                "preprocess_capped": workers > args.merge_pieces,
                "augment_capped": workers > args.augment_shards,
            }
        )
    return rows


# --------------------------------------------------------------------------------------------- FLOPs
def build_bert(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised BertModel without pooler, as the trainer builds it.

    Eager attention keeps the attention products as plain matmuls that FlopCounterMode always counts
    (CPU SDPA falls back to the same matmuls; a fused GPU kernel does the same arithmetic).
    """
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        intermediate_size=spec.intermediate,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return BertModel(config, add_pooling_layer=False)


def measure_flops(model: torch.nn.Module, sequences: int, length: int) -> tuple[int, int]:
    """(forward, forward+backward) FLOPs of a [CLS]-pooled batch of ``sequences`` x ``length`` tokens."""
    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab, (sequences, length))
    mask = torch.ones_like(ids)
    model.train()
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        cls = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]  # (S, H)
        forward = counter.get_total_flops()
        cls.pow(2).sum().backward()
    return forward, counter.get_total_flops()


def non_embedding_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embeddings."))


def rule_of_thumb(params: int, layers: int, hidden: int, sequences: int, length: int) -> tuple[int, int]:
    """(6·N·T, 6·N·T + attention): 6 FLOPs per parameter per token for forward+backward, plus the
    score and value products, 2·2·L²·H per layer and sequence forward, three times that with backward."""
    tokens = sequences * length
    six_nt = 6 * params * tokens
    return six_nt, six_nt + 12 * layers * length * length * hidden * sequences


def loss_flops(n_views: int, per_gpu: int, world: int, queue: int, hidden: int) -> float:
    """Matmul FLOPs of the LUSE loss per GPU and step: logits against the gathered batch (forward and
    the two gradient products) and against the queue (forward and the anchors' gradient only)."""
    anchors = n_views * per_gpu
    return 2 * anchors * hidden * (3 * world * anchors + 2 * queue)


def flop_table(
    args: argparse.Namespace, specs: list[ModelSpec], lengths: dict[str, float]
) -> list[dict[str, Any]]:
    """Measured FLOPs per sequence for each model at each length scenario, next to the rules of thumb."""
    n_views = 1 + args.augment_variants + 1
    sequences = args.flop_sentences * n_views
    rows = []
    for spec in specs:
        model = build_bert(spec)
        params = non_embedding_params(model)
        total_params = sum(p.numel() for p in model.parameters())
        for scenario, length in lengths.items():
            measured_at = max(1, round(length))
            log.info("counting FLOPs: %s, %d sequences x %d tokens", spec.name, sequences, measured_at)
            forward, total = measure_flops(model, sequences, measured_at)
            six_nt, with_attention = rule_of_thumb(params, spec.layers, spec.hidden, sequences, measured_at)
            scale = length / measured_at / sequences  # per sequence, linear in the fractional remainder
            rows.append(
                {
                    "model": spec.name,
                    "hidden": spec.hidden,
                    "scenario": scenario,
                    "tokens_per_sequence": length,
                    "measured_at": f"{args.flop_sentences} sentences x {n_views} views x {measured_at}",
                    "non_embedding_params": params,
                    "total_params": total_params,
                    "fwd_flops_per_seq": forward * scale,
                    "fwd_bwd_flops_per_seq": total * scale,
                    "six_n_t_per_seq": six_nt * scale,
                    "six_total_n_t_per_seq": 6 * total_params * measured_at * scale * sequences,
                    "six_n_t_attention_per_seq": with_attention * scale,
                }
            )
    return rows


def training_projection(
    args: argparse.Namespace, flops: list[dict[str, Any]], stats: LengthStats
) -> list[dict[str, Any]]:
    """Hours per epoch on ``args.gpus`` GPUs: FLOPs per step per GPU / (peak x MFU), times steps."""
    n_views = 1 + args.augment_variants + 1
    global_batch = args.per_gpu_batch * args.gpus
    steps = math.ceil(args.sentences / global_batch)
    peaks = {"A100 SXM": args.a100_tflops, "H100 SXM": args.h100_tflops}
    rows = []
    for r in flops:
        # The momentum encoder re-encodes view 0 (no graph): the originals' length unpadded; in a padded
        # or bucketed batch view 0's rows are padded to the batch's length like every other view's.
        ratio = 1.0 if r["scenario"] != "mean" else stats.mean_tokens_original / stats.mean_tokens_per_view
        key_forward = r["fwd_flops_per_seq"] * ratio if args.momentum > 0 else 0.0
        encoder = args.per_gpu_batch * (n_views * r["fwd_bwd_flops_per_seq"] + key_forward)
        loss = loss_flops(n_views, args.per_gpu_batch, args.gpus, args.queue_size, r["hidden"])
        step_flops = encoder + loss
        for gpu, tflops in peaks.items():
            step_seconds = step_flops / (tflops * 1e12 * args.mfu)
            rows.append(
                {
                    "model": r["model"],
                    "gpu": gpu,
                    "scenario": r["scenario"],
                    "tokens_per_sequence": r["tokens_per_sequence"],
                    "step_tflops_per_gpu": step_flops / 1e12,
                    "loss_share": loss / step_flops,
                    "key_encoder_share": args.per_gpu_batch * key_forward / step_flops,
                    "step_seconds": step_seconds,
                    "steps": steps,
                    "epoch_hours": steps * step_seconds / 3600,
                }
            )
    return rows


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    small = json.loads(args.small_config.read_text(encoding="utf-8"))
    vocab_file = REPO / "runs/sample/train/tokenizer/vocab.txt"
    if vocab_file.is_file():
        small_vocab = sum(1 for _ in vocab_file.open(encoding="utf-8"))
        vocab_source = f"vocab of {vocab_file.relative_to(REPO)} ({small_vocab:,} lines)"
    else:
        small_vocab, vocab_source = 4152, "4,152 (docs/BENCHMARKS.md; no sample run here)"
    specs = [
        ModelSpec("rbt3", 3, 768, 12, 3072, 21128, f"hfl/rbt3: {HF_CONFIG_SOURCE}"),
        ModelSpec("bert-base-chinese", 12, 768, 12, 3072, 21128, f"bert-base-chinese: {HF_CONFIG_SOURCE}"),
        ModelSpec(
            "model_small",
            small["num_hidden_layers"],
            small["hidden_size"],
            small["num_attention_heads"],
            small["intermediate_size"],
            small_vocab,
            f"{args.small_config.relative_to(REPO)}, {vocab_source}",
        ),
    ]
    return specs


# --------------------------------------------------------------------------------------------- report
def inputs_table(args: argparse.Namespace, stats: LengthStats, padding: PaddingRatios) -> dict[str, Fig]:
    n_views = 1 + args.augment_variants + 1
    padding_kind = "assumed" if padding.source.startswith("given") else "measured"
    pre = f"README.md Measured figures, `{PREPROCESS_CMD}` (5.0M synthetic JSON-lines sentences, 1 worker)"
    return {
        "sentences": Fig(args.sentences, "assumed", CORPUS_SOURCE),
        "preprocess rate, whole run, sentences/s per worker": Fig(args.preprocess_rate, "measured", pre),
        "preprocess split pass alone, sentences/s per worker": Fig(args.split_rate, "measured", pre),
        "augment rate, sentences/s per worker": Fig(
            args.augment_rate,
            "measured",
            f"README.md Measured figures, `{AUGMENT_CMD}` ({args.augment_variants} variants, bundled corpus)",
        ),
        "shard bytes / UTF-8 text bytes": Fig(args.shard_ratio, "measured", pre),
        "raw JSON bytes (whole corpus)": Fig(
            args.json_bytes, "assumed", "docs/preprocess.md: ~15 GB of JSON"
        ),
        "split pieces (JSON / 4 MiB units)": Fig(args.split_pieces, "assumed", "15 GB / chunk_bytes 4 MiB"),
        "dedup partitions / shards (pieces of the later phases)": Fig(
            args.merge_pieces, "assumed", "docs/preprocess.md: ~940 partitions at the full corpus"
        ),
        "augment pieces (shards)": Fig(args.augment_shards, "assumed", "docs/preprocess.md: ~1,100 shards"),
        "cores per node": Fig(args.cores_per_node, "assumed", "the projection's node"),
        "parallel efficiency": Fig(
            args.efficiency,
            "assumed",
            "not demonstrated: 2 workers over 1 measured 0.96x (preprocess) and 0.59x (augment) on a loaded "
            "2-core box (README.md)",
        ),
        "shared-filesystem bandwidth for the I/O floor, GB/s": Fig(args.fs_gbs, "assumed", "set to yours"),
        "views per sentence n": Fig(
            n_views, "assumed", f"1 original + {args.augment_variants} EDA + 1 dropout"
        ),
        "max_length": Fig(args.max_length, "assumed", "training data.max_length"),
        f"padded/real tokens, length-bucketed batches (window {padding.window})": Fig(
            padding.bucketed, padding_kind, padding.source
        ),
        "padded/real tokens, random batches (compared with the sampled estimate, not used)": Fig(
            padding.random, padding_kind, padding.source
        ),
        "GPUs": Fig(args.gpus, "assumed", "one node"),
        "sentences per GPU per step": Fig(
            args.per_gpu_batch, "assumed", f"global batch {args.per_gpu_batch * args.gpus}"
        ),
        "queue size": Fig(args.queue_size, "assumed", "MoCo-style negatives"),
        "momentum": Fig(args.momentum, "assumed", "> 0: one extra no-grad forward of view 0"),
        "A100 SXM bf16 dense peak, TFLOPS": Fig(args.a100_tflops, "assumed", A100_SOURCE),
        "H100 SXM bf16 dense peak, TFLOPS": Fig(args.h100_tflops, "assumed", H100_SOURCE),
        "MFU": Fig(
            args.mfu,
            "assumed",
            "small BERTs at short sequences usually reach a lower MFU than LLMs (small matmuls, "
            "memory-bound layernorm/softmax, launch overhead): a guess, not a measurement",
        ),
    }


def duration(hours: float) -> str:
    """Hours with a readable unit beside them: 0.0133 h (48 s)."""
    seconds = hours * 3600
    unit = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    return f"{hours:.3g} h ({unit})" if hours < 2 else f"{hours:.2f} h"


def render_markdown(report: dict[str, Any]) -> str:
    st, pad = report["lengths"], report["padding"]
    out = [
        "# Projection: nlp_chinese_corpus preprocessing, augmentation and one LUSE epoch",
        "",
        f"Command: `{report['command']}`  ",
        f"torch {report['torch']}; FLOPs counted with torch.utils.flop_counter.FlopCounterMode on CPU.",
        "",
        "Every number is **measured** (how is said), **assumed** (an argument, with its source) or",
        "**projected** (computed from the two). Nothing here ran at scale.",
        "",
        "## Inputs",
        "",
        "| input | value | kind | source |",
        "| --- | --- | --- | --- |",
    ]
    for name, f in report["inputs"].items():
        out.append(f"| {name} | {fmt(f['value'])} | {f['kind']} | {f['source']} |")
    out += [
        "",
        f"## Sentence lengths (measured on {st['source']})",
        "",
        "| quantity | value |",
        "| --- | --- |",
        f"| sentences | {st['sentences']:,} |",
        f"| mean characters per sentence | {st['mean_chars']:.2f} |",
        f"| mean UTF-8 bytes per sentence | {st['mean_text_bytes']:.1f} |",
        f"| shard / text bytes of these shards (1,000-row blocks; cross-check of 0.709) | "
        f"{st['shard_text_ratio']:.3f} |",
        f"| share of sentences truncated at max_length | {st['truncated_share']:.3f} |",
        f"| mean tokens, originals (chars + 2, capped) | {st['mean_tokens_original']:.2f} |",
        f"| mean tokens, EDA variant slots (variant/original ratio on {st['variant_sample']:,} sentences "
        "augmented here, times the originals' mean) | "
        f"{st['mean_tokens_variant']:.2f} |",
        f"| mean UTF-8 bytes per variant | {st['mean_variant_bytes']:.1f} |",
        f"| **mean tokens per sequence over the n views** | **{st['mean_tokens_per_view']:.2f}** |",
        f"| padded length of a rank's batch (longest text of {report['per_gpu_batch']} sentences x n, "
        f"200 sampled batches) | {st['padded_length']:.2f} |",
        f"| the same as padded/real tokens (vs {pad['random']:.3f} measured on real random batches, "
        "see Inputs) | "
        f"{st['padded_length'] / st['mean_tokens_per_view']:.3f} |",
        f"| tokens per sequence, length-bucketed: mean x {pad['bucketed']:.3f} measured padded/real | "
        f"{st['mean_tokens_per_view'] * pad['bucketed']:.2f} |",
        "",
        "## CPU stages: preprocess and augment the full corpus (projected)",
        "",
        "N SLURM array tasks, one node of the stated cores each, one worker per core. Compute =",
        "sentences / (measured rate x usable workers x efficiency); a phase uses at most as many workers",
        "as it has pieces (marked *). FS GB/s = shared-filesystem traffic that compute rate needs",
        "(preprocess: read JSON + write shards, work_dir on node-local scratch as docs/preprocess.md",
        "advises; augment: read shards + write augmented shards). I/O floor = the same bytes at the",
        "assumed bandwidth; projected = the larger of the two. Not modelled: SLURM queue waits, the",
        "barrier between preprocess phases, process start-up (jieba loads in ~1 s per augment worker).",
        "",
        "| stage | nodes | workers | compute | FS GB/s needed | I/O floor | **projected** |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stage in ("preprocess", "augment"):
        for r in report["cpu"]:
            compute, floor = r[f"{stage}_hours"], r[f"{stage}_io_floor_hours"]
            capped = "*" if r[f"{stage}_capped"] else ""
            out.append(
                f"| {stage} | {r['nodes']} | {r['workers']:,}{capped} | {duration(compute)} | "
                f"{r[f'{stage}_fs_gb_per_s']:.2f} | {duration(floor)} | "
                f"**{duration(max(compute, floor))}** ({'I/O' if floor > compute else 'compute'}) |"
            )
    out += [
        "",
        "## FLOPs per sequence, forward + backward (measured)",
        "",
        "Counted on CPU for a random-init BERT (matmuls only: elementwise ops are not counted, as in MFU),",
        "divided by the number of sequences and scaled linearly from the whole-token length it was counted",
        "at to the fractional mean. Rule of thumb: 6 x non-embedding params x tokens, and the same",
        "plus attention 12 x layers x L^2 x hidden. 6·N_total·T also counts the embedding table, which",
        "costs no matmul FLOPs (a lookup): with a 21k vocabulary it overstates small models badly.",
        "",
        "| model | params (non-emb / total) | tokens | measured as (sentences x views x tokens) | "
        "measured fwd+bwd GFLOP | "
        "6·N·T | 6·N·T + attn | 6·N_total·T | measured / (6·N·T + attn) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["flops"]:
        out.append(
            f"| {r['model']} | {r['non_embedding_params'] / 1e6:.2f}M / {r['total_params'] / 1e6:.2f}M | "
            f"{r['tokens_per_sequence']:.2f} ({r['scenario']}) | {r['measured_at']} | "
            f"{r['fwd_bwd_flops_per_seq'] / 1e9:.3f} | {r['six_n_t_per_seq'] / 1e9:.3f} | "
            f"{r['six_n_t_attention_per_seq'] / 1e9:.3f} | {r['six_total_n_t_per_seq'] / 1e9:.3f} | "
            f"{r['fwd_bwd_flops_per_seq'] / r['six_n_t_attention_per_seq']:.3f} |"
        )
    out += [
        "",
        f"## One epoch over {report['sentences'] / 1e6:.0f}M sentences on {report['gpus']} GPUs (projected)",
        "",
        "Step FLOPs per GPU = sentences per GPU x (n views x measured fwd+bwd per sequence + one",
        "measured forward of view 0 for the momentum key encoder) + the LUSE loss matmuls (a formula:",
        "logits against the gathered batch and the queue). Step time = step FLOPs / (peak x MFU), both",
        "assumed. Data parallel: the gradient all-reduce is assumed hidden behind backward (DDP buckets,",
        "NVLink); optimizer and EMA updates (a few FLOPs per parameter) are left out. 'mean' = every",
        "sequence costs the mean length (no padding at all: a floor); 'bucketed' = the mean times the",
        "measured padded/real ratio of length-bucketed batches (data.length_bucketing, the default);",
        "'padded' = random batches (data.length_bucketing=false), a rank's whole batch padded to its",
        "longest text, as estimated here from sampled batches.",
        "",
        "| model | GPU | tokens/seq | TFLOP per GPU-step | loss share | key-encoder share | step s | "
        "steps | **hours per epoch** |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["training"]:
        out.append(
            f"| {r['model']} | {r['gpu']} | {r['tokens_per_sequence']:.2f} ({r['scenario']}) | "
            f"{r['step_tflops_per_gpu']:.2f} | {r['loss_share']:.3f} | {r['key_encoder_share']:.3f} | "
            f"{r['step_seconds']:.4f} | {r['steps']:,} | **{r['epoch_hours']:.2f}** |"
        )
    out += ["", "## Assumptions, stated once more", ""]
    out += [f"- {a}" for a in report["assumptions"]]
    return "\n".join(out) + "\n"


def assumptions(args: argparse.Namespace) -> list[str]:
    return [
        f"Corpus size {args.sentences / 1e6:.0f}M sentences after splitting: {CORPUS_SOURCE}.",
        "Per-core rates scale linearly with cores, times a parallel efficiency of "
        f"{args.efficiency} (our own 2-worker speedups were measured on a loaded 2-core machine and do not "
        "demonstrate scaling). The rates were measured on the bundled People's Daily text (augment) and on a "
        "synthetic JSON-lines blow-up of it (preprocess); the real collections' sentence lengths differ.",
        "Token count = characters + 2 special tokens, capped at max_length: exact for CJK characters under "
        "a character vocabulary, an over-count where bert-base-chinese merges Latin letters or digits.",
        "The padded/real ratio of length-bucketed batches, measured on the 45k-sentence sample (one epoch "
        "is 88 global batches, under two windows), holds for the full corpus: a window is the same "
        f"{args.bucket_window} x {args.per_gpu_batch * args.gpus} sentences at any corpus size, so this "
        "assumes only that the full corpus's lengths spread like the sample's.",
        "The LUSE loss FLOPs are a formula, not counted; they are a small share of a step at these sizes.",
        f"MFU {args.mfu} and the GPU peaks are assumptions (NVIDIA datasheet peaks; MFU of small BERTs at "
        "short sequences is usually lower than the 40-50% reported for large LLM training).",
        "Hours are compute time only: no data-loading stalls (the loader's tokenizer rate is in README.md), "
        "no evaluation, checkpointing or preemption.",
    ]


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    p.add_argument("--sentences", type=float, default=110e6, help="corpus sentences after splitting")
    p.add_argument(
        "--preprocess-rate", type=float, default=89_757, help=f"sentences/s/worker, `{PREPROCESS_CMD}`"
    )
    p.add_argument("--split-rate", type=float, default=147_853, help="split pass alone, same command")
    p.add_argument("--augment-rate", type=float, default=5_218, help=f"sentences/s/worker, `{AUGMENT_CMD}`")
    p.add_argument("--augment-variants", type=int, default=4, help="EDA variants k (the rate's setting)")
    p.add_argument(
        "--shard-ratio", type=float, default=0.709, help="shard bytes / text bytes, preprocess bench"
    )
    p.add_argument("--json-bytes", type=float, default=15e9, help="raw corpus bytes (docs/preprocess.md)")
    p.add_argument("--split-pieces", type=int, default=3576, help="split units: JSON bytes / 4 MiB")
    p.add_argument(
        "--merge-pieces", type=int, default=940, help="dedup partitions (fewest pieces after split)"
    )
    p.add_argument("--augment-shards", type=int, default=1100, help="shards = augment's unit of work")
    p.add_argument("--cores-per-node", type=int, default=32)
    p.add_argument("--nodes", type=ints, default=[1, 4, 16, 64], help="SLURM array sizes, one node per task")
    p.add_argument("--efficiency", type=float, default=0.8, help="assumed parallel efficiency")
    p.add_argument(
        "--fs-gbs", type=float, default=2.0, help="assumed shared-filesystem GB/s for the I/O floor"
    )
    p.add_argument(
        "--shards", type=Path, default=REPO / "runs/sample/shards", help="preprocessed sample shards"
    )
    p.add_argument(
        "--variant-sample", type=int, default=3000, help="sentences to augment for variant lengths"
    )
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--per-gpu-batch", type=int, default=64, help="sentences per GPU per step")
    p.add_argument("--queue-size", type=int, default=16384)
    p.add_argument("--momentum", type=float, default=0.995)
    p.add_argument("--a100-tflops", type=float, default=312.0, help=A100_SOURCE)
    p.add_argument("--h100-tflops", type=float, default=989.0, help=H100_SOURCE)
    p.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilisation")
    p.add_argument(
        "--flop-sentences", type=int, default=4, help="sentences per FLOP-counted batch (x n views)"
    )
    p.add_argument("--small-config", type=Path, default=REPO / "launch/configs/model_small.json")
    p.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=["rbt3", "bert-base-chinese", "model_small"],
        help="models to measure and project (comma-separated)",
    )
    p.add_argument(
        "--bucketed-padding",
        type=float,
        default=BUCKETED_PADDING,
        help=f"padded/real tokens of length-bucketed batches, measured by `{PADDING_CMD}`",
    )
    p.add_argument(
        "--random-padding", type=float, default=RANDOM_PADDING, help="random batches, the same command"
    )
    p.add_argument(
        "--measure-padding",
        action="store_true",
        help="measure both ratios here (one epoch of --padding-shards per scenario, about a minute)",
    )
    p.add_argument("--padding-shards", type=Path, default=REPO / "runs/sample/augmented")
    p.add_argument(
        "--padding-model",
        default="chars",
        help="tokenizer folder (e.g. models/e5-small), or 'chars': a char-level BERT tokenizer, as projected",
    )
    p.add_argument("--bucket-window", type=int, default=50, help="data.bucket_window, global batches")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.bucketed_padding < 1 or args.random_padding < 1 or args.bucket_window < 1:
        p.error("--bucketed-padding and --random-padding must be >= 1 (padded/real), --bucket-window >= 1")
    if args.measure_padding and not (args.padding_shards / "manifest.json").is_file():
        p.error(f"--padding-shards {args.padding_shards}: no manifest.json; give augmented shards")
    if args.measure_padding and args.padding_model != "chars" and not Path(args.padding_model).is_dir():
        p.error(f"--padding-model {args.padding_model}: not a folder; give a tokenizer folder or 'chars'")
    if not 0 < args.efficiency <= 1 or not 0 < args.mfu <= 1:
        p.error("--efficiency and --mfu must be in (0, 1]")
    if args.preprocess_rate >= args.split_rate:
        p.error("--preprocess-rate (whole run) must be below --split-rate (one of its phases)")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    torch.set_num_threads(1)  # a projection, not a speed test: stay off the other jobs' cores
    stats = measure_lengths(
        args.shards if args.shards.exists() else None,
        args.augment_variants,
        1,
        args.max_length,
        args.per_gpu_batch,
        args.variant_sample,
        args.seed,
    )
    if args.measure_padding:
        padding = measure_padding(
            args.padding_shards,
            args.padding_model,
            args.max_length,
            args.per_gpu_batch,
            args.gpus,
            args.augment_variants,
            args.bucket_window,
        )
    else:
        padding = given_padding(args)
    specs = [s for s in model_specs(args) if s.name in args.models]
    flops = flop_table(args, specs, scenario_lengths(stats, padding))
    report = {
        "command": " ".join(
            [
                "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/projection.py",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "torch": torch.__version__,
        "sentences": args.sentences,
        "gpus": args.gpus,
        "per_gpu_batch": args.per_gpu_batch,
        "inputs": {k: asdict(v) for k, v in inputs_table(args, stats, padding).items()},
        "lengths": asdict(stats),
        "padding": asdict(padding),
        "cpu": cpu_projection(args, stats),
        "flops": flops,
        "training": training_projection(args, flops, stats),
        "assumptions": assumptions(args),
    }
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else render_markdown(report), end="")


if __name__ == "__main__":
    main()
