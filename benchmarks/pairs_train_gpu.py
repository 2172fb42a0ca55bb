"""Training on pair shards on a GPU (docs/pairs.md, "Training on pairs"): the pairs term's cost at large
global batches, and a short bf16 train on the bundled real pairs, one source per batch and mixed.

1. Forward + backward of the pairs term (both directions, group and text masks, fp32 unit vectors of
   width 384, one process: the (B x N) logits of the whole global batch) and of the distill term, at
   global batches of 1,024, 4,096 and 16,384.
2. ``pipeline pairs`` over pipeline/resources/corpus/pairs, a tiny character teacher (tests/_tiny_models)
   over both sides, then 40 steps of 128 pairs of launch/configs/debug.yaml's tiny student with
   ``loss: [{distill: {}}, {pairs: {temperature: 0.05}, weight: 0.1}]`` in bf16, one source per global
   batch and mixed; and distillation + 0.01 x LUSE on the pairs with one dropout view and a momentum
   queue (docs/pairs.md, "LUSE on pairs"); prints the logged losses and masked-candidate counts.

    PYTHONPATH=. python3 benchmarks/pairs_train_gpu.py [--out results.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def term_cost(batches: tuple[int, ...] = (1024, 4096, 16384), width: int = 384) -> dict[str, float]:
    from pipeline.losses.distill import embedding_loss
    from pipeline.losses.pairs import compute_loss

    out = {}
    for b in batches:
        a = F.normalize(torch.randn(b, width, device="cuda"), dim=-1).requires_grad_(True)
        p = F.normalize(torch.randn(b, width, device="cuda"), dim=-1).requires_grad_(True)
        groups = torch.randint(0, b // 2, (b,), device="cuda")
        hashes = [torch.randint(0, 10**9, (b,), device="cuda") for _ in range(2)]
        terms = {
            "pairs": lambda: compute_loss(a, p, 0.05, True, False, groups, *hashes),
            "distill": lambda: embedding_loss(a, p),
        }
        for name, fn in terms.items():
            for _ in range(3):
                fn().backward()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(20):
                fn().backward()
            torch.cuda.synchronize()
            out[f"{name}_fwd_bwd_ms_B{b}"] = round((time.perf_counter() - started) / 20 * 1e3, 3)
    return out


def short_train(root: Path) -> dict[str, object]:
    sys.path.insert(0, str(REPO / "tests"))
    from _tiny_models import build_char_encoder

    from pipeline.config import load_config
    from pipeline.resources import ROOT
    from pipeline.stages.pairs.run import Config as PairsConfig
    from pipeline.stages.pairs.run import run as pairs_run
    from pipeline.stages.teacher.run import Config as TeacherConfig
    from pipeline.stages.teacher.run import run as teacher_run
    from pipeline.train.config import Config
    from pipeline.train.run import run

    bundle = ROOT / "corpus" / "pairs"
    texts = []
    for path in sorted(bundle.glob("*.gz")):
        for line in gzip.open(path, "rt", encoding="utf-8"):
            texts += [v for v in json.loads(line).values() if isinstance(v, str)][:6]
    teacher = build_char_encoder(root / "teacher", texts, 24, 48, 260, max_length=64)
    options = {"pairs_per_shard": 2000, "rows_per_block": 128, "progress": False}
    assert pairs_run(PairsConfig(inputs=[bundle], out=root / "pairs", **options)) == 0
    taught = root / "taught"
    cfg = TeacherConfig(shards=root / "pairs", out=taught, model=str(teacher), batch_size=256, progress=False)
    assert teacher_run(cfg) == 0
    pairs = [{"distill": {}}, {"pairs": {"temperature": 0.05}, "weight": 0.1}]
    # LUSE on pairs (docs/pairs.md): anchor, partner and one dropout view, a momentum queue of 256
    luse = {"temperature": 0.05, "queue_size": 256, "momentum": 0.995, "false_negatives": {"same_text": True}}
    cases = {
        "one_source_per_batch=True": (True, 0, pairs),
        "one_source_per_batch=False": (False, 0, pairs),
        "luse_pairs_dropout_view": (True, 1, [{"distill": {}}, {"luse": luse, "weight": 0.01}]),
    }
    out: dict[str, object] = {}
    for name, (one_source, dropout_views, loss) in cases.items():
        run_dir = root / name.replace("=", "-")
        overrides = {
            "data.shards": str(taught), "run_dir": str(run_dir), "data.num_variants": 0,
            "data.num_dropout_views": dropout_views, "data.length_bucketing": False,
            "data.one_source_per_batch": one_source, "train.device": "cuda", "train.mixed_precision": "bf16",
            "train.global_batch_size": 128, "train.max_steps": 40, "train.log_every": 10, "loss": loss,
        }  # fmt: skip
        cfg = load_config(Config, REPO / "launch" / "configs" / "debug.yaml", overrides)
        started = time.perf_counter()
        assert run(cfg) == 0
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        keys = ("step", "loss", "distill_loss", "contrastive_loss", "false_negatives_count")
        out[name] = {
            "wall_s": round(time.perf_counter() - started, 1),
            "steps": [{k: r.get(k) for k in keys} for r in records if "distill_loss" in r],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    result: dict[str, object] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    result.update(term_cost())
    with tempfile.TemporaryDirectory() as tmp:
        result.update(short_train(Path(tmp)))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
