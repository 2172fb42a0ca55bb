#!/usr/bin/env bash
# The README's main job on the bundled sample (People's Daily, Jan 1998), on CPU in minutes:
#   preprocess -> augment (EDA variants) -> LUSE pretraining of a small from-scratch BERT -> evaluation.
# Rerunning continues where it stopped: finished stages are skipped, training resumes from its
# newest checkpoint. Extra arguments go to the training command, e.g. --train.max_steps=100.
#   NPROC=2 bash launch/run_sample.sh      # two training processes (gloo) instead of one
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/sample}
NPROC=${NPROC:-1}
export TOKENIZERS_PARALLELISM=false

if [ ! -f "$OUT/shards/manifest.json" ]; then
  "$PY" -m pipeline preprocess --out "$OUT/shards" --sentences_per_shard 8000 --rows_per_block 1000
fi
# Augmented shards of an older sample job with another variant count (20 s to redo) are replaced.
if [ -f "$OUT/augmented/manifest.json" ] && ! grep -qs '"num_variants": 4,' "$OUT/augmented/manifest.json"; then
  echo "run_sample: $OUT/augmented caches another number of EDA variants; augmenting again" >&2
  rm -rf "$OUT/augmented"
fi
if [ ! -f "$OUT/augmented/manifest.json" ]; then
  "$PY" -m pipeline augment --shards "$OUT/shards" --out "$OUT/augmented" --num_variants 4 --workers 2
fi

TRAIN_ARGS=(--config launch/configs/default.yaml --data.shards="$OUT/augmented" --run_dir="$OUT/train" "$@")
if [ "$NPROC" -gt 1 ]; then
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ACCELERATE_USE_CPU=1 \
    "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" launch/pretrain.py "${TRAIN_ARGS[@]}"
else
  "$PY" launch/pretrain.py "${TRAIN_ARGS[@]}"
fi

# STS on at most 2000 pairs per set keeps the sample job in minutes (drop --max_pairs for the full
# suite), with the char TF-IDF floor on the same pairs beside it. Results go beside the run (not into
# model/, which is what gets exported).
"$PY" -m pipeline eval "$OUT/train/model" --suite "[sts, tfidf]" --max_pairs 2000 --out "$OUT/train/eval"
# Loss/eval curves and the cosine-per-label picture of the exported (best) checkpoint, embedded in
# $OUT/train/report/report.md.
"$PY" -m pipeline report "$OUT/train" --select best
