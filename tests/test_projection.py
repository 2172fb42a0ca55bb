"""benchmarks/projection.py: its FLOP counting agrees with the analytic count, its time model scales."""

from __future__ import annotations

import pytest
from _scripts import benchmark_module


@pytest.fixture(scope="module")
def projection():
    with benchmark_module("projection") as module:
        yield module


def test_measured_flops_match_the_analytic_count(projection):
    # Long sequences on a narrow model make attention ~40% of the work: a counter that missed the
    # attention products, or the backward pass, would fall far outside the tolerance.
    spec = projection.ModelSpec(
        "tiny", layers=2, hidden=32, heads=4, intermediate=128, vocab=100, source="test"
    )
    model = projection.build_bert(spec)
    sequences, length = 6, 128
    forward, total = projection.measure_flops(model, sequences, length)
    params = projection.non_embedding_params(model)
    six_nt, with_attention = projection.rule_of_thumb(params, spec.layers, spec.hidden, sequences, length)
    assert abs(total / with_attention - 1) < 0.25
    assert with_attention - six_nt > 0.3 * with_attention  # the attention term matters at this shape
    assert total == pytest.approx(3 * forward, rel=0.05)  # backward = two matmuls per forward matmul


def test_cpu_time_scales_with_rate_workers_and_pieces(projection):
    base = projection.parallel_seconds(1e8, 5000, 64, 0.8)
    assert projection.parallel_seconds(1e8, 2500, 64, 0.8) == pytest.approx(2 * base)
    assert projection.parallel_seconds(1e8, 5000, 128, 0.8) == pytest.approx(base / 2)
    assert projection.parallel_seconds(1e8, 5000, 64, 0.4) == pytest.approx(2 * base)

    def pre(workers: int, rate: float = 90_000) -> float:
        return projection.preprocess_seconds(1e8, rate, 150_000, workers, 1.0, 3000, 900)

    # One worker: the whole-run rate, whatever the phase split.
    assert pre(1) == pytest.approx(1e8 / 90_000)
    assert pre(1, rate=45_000) > 2 * pre(1) * 0.99  # halving the whole-run rate at least doubles time
    # Past the later phases' 900 pieces only the split pass still speeds up; past 3000 nothing does.
    assert pre(1800) < pre(900) and pre(1800) > pre(900) / 2
    assert pre(6000) == pytest.approx(pre(3000))


def test_epoch_hours_scale_with_mfu_and_peak(projection):
    args = projection.parse_args([])
    flops = [
        {
            "model": "rbt3",
            "hidden": 768,
            "scenario": "mean",
            "tokens_per_sequence": 40.0,
            "fwd_flops_per_seq": 1e9,
            "fwd_bwd_flops_per_seq": 3e9,
        }
    ]
    stats = projection.LengthStats(
        sentences=1,
        mean_chars=38.0,
        mean_text_bytes=114.0,
        shard_text_ratio=0.7,
        truncated_share=0.0,
        mean_tokens_original=40.0,
        mean_tokens_per_view=40.0,
        mean_tokens_variant=40.0,
        mean_variant_bytes=114.0,
        padded_length=64.0,
        variant_sample=1,
        source="test",
    )
    rows = {r["gpu"]: r for r in projection.training_projection(args, flops, stats)}
    args.mfu /= 2
    halved = {r["gpu"]: r for r in projection.training_projection(args, flops, stats)}
    for gpu, row in rows.items():
        assert halved[gpu]["epoch_hours"] == pytest.approx(2 * row["epoch_hours"])
    ratio = rows["A100 SXM"]["epoch_hours"] / rows["H100 SXM"]["epoch_hours"]
    assert ratio == pytest.approx(args.h100_tflops / args.a100_tflops)
    # 64 sentences x (6 views x 3 GFLOP + 1 GFLOP key forward) + the loss formula, per GPU and step
    encoder = 64 * (6 * 3e9 + 1e9)
    loss = projection.loss_flops(6, 64, 8, args.queue_size, 768)
    assert rows["A100 SXM"]["step_tflops_per_gpu"] * 1e12 == pytest.approx(encoder + loss)


def test_bucketed_scenario_lies_between_mean_and_padded_and_scales_with_its_ratio(projection):
    args = projection.parse_args(["--flop-sentences", "1"])
    spec = projection.ModelSpec("tiny", layers=2, hidden=32, heads=4, intermediate=128, vocab=100, source="t")
    stats = projection.LengthStats(
        sentences=1,
        mean_chars=28.0,
        mean_text_bytes=84.0,
        shard_text_ratio=0.7,
        truncated_share=0.0,
        mean_tokens_original=30.0,
        mean_tokens_per_view=30.0,
        mean_tokens_variant=30.0,
        mean_variant_bytes=84.0,
        padded_length=64.0,
        variant_sample=1,
        source="test",
    )

    def project(bucketed: float) -> dict[tuple[str, str], dict]:
        padding = projection.PaddingRatios(random=2.0, bucketed=bucketed, window=50, source="test")
        lengths = projection.scenario_lengths(stats, padding)
        flops = projection.flop_table(args, [spec], lengths)
        return {(r["scenario"], r["gpu"]): r for r in projection.training_projection(args, flops, stats)}

    params = projection.non_embedding_params(projection.build_bert(spec))

    def rule(length: int) -> int:
        return projection.rule_of_thumb(params, spec.layers, spec.hidden, 1, length)[1]

    loss = projection.loss_flops(6, args.per_gpu_batch, args.gpus, args.queue_size, spec.hidden) / 1e12
    low, high, none = project(1.2), project(1.6), project(1.0)
    for gpu in ("A100 SXM", "H100 SXM"):
        mean, bucketed, padded = (low[s, gpu] for s in ("mean", "bucketed", "padded"))
        assert bucketed["tokens_per_sequence"] == pytest.approx(1.2 * mean["tokens_per_sequence"])
        assert mean["epoch_hours"] < bucketed["epoch_hours"] < padded["epoch_hours"]
        # The encoder's FLOPs (step minus the loss formula) grow with the ratio as 6·N·T + attention does
        # from 36 to 48 tokens: more than linearly, since attention is a large share of this narrow model.
        encoder = bucketed["step_tflops_per_gpu"] - loss
        grown = (high["bucketed", gpu]["step_tflops_per_gpu"] - loss) / encoder
        expected = rule(48) / rule(36)
        assert expected > 1.6 / 1.2
        assert grown == pytest.approx(expected, rel=0.02)
        # No padding in the bucketed batches costs exactly what the unpadded mean does.
        assert none["bucketed", gpu]["epoch_hours"] == pytest.approx(none["mean", gpu]["epoch_hours"])


def test_padding_ratios_are_labelled_and_checked(projection):
    stats = projection.LengthStats(1, 1.0, 1.0, 1.0, 0.0, 3.0, 3.0, 3.0, 1.0, 3.0, 1, "t")
    default = projection.parse_args([])
    given = projection.given_padding(default)
    figs = projection.inputs_table(default, stats, given)
    assert figs["padded/real tokens, length-bucketed batches (window 50)"].kind == "measured"
    assert projection.PADDING_CMD in given.source
    changed = projection.parse_args(["--bucketed-padding", "1.5"])
    figs = projection.inputs_table(changed, stats, projection.given_padding(changed))
    bucketed = figs["padded/real tokens, length-bucketed batches (window 50)"]
    assert (bucketed.value, bucketed.kind) == (1.5, "assumed")
    with pytest.raises(SystemExit):
        projection.parse_args(["--bucketed-padding", "0.9"])
