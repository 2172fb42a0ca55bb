#!/usr/bin/env bash
# The LUSE trial (docs/BENCHMARKS.md "The LUSE trial"): does pretraining the main job's 4-layer
# e5-small cut with LUSE (or SimCSE, or distillation, or distillation then LUSE) give a better encoder
# to fine-tune? Every arm starts from runs/sample/student and reads runs/sample/teacher (run
# launch/run_sample.sh first, or its stages up to `teacher`), at equal compute: the same number of
# sequences through the encoder with gradients (LUSE: 32 anchors x 6 views per step; SimCSE: 32 x 2;
# distillation: 64 x 1). Each (arm, seed) is pretrained, scored zero-shot on the five STS sets and
# fine-tuned (`finetune --seeds SEED`, TrainBERT and FreezeBERT, every task).
#   bash benchmarks/luse_trial.sh [RUNS_DIR]       # two jobs at a time, one thread each
#   .venv/bin/python benchmarks/luse_trial.py RUNS_DIR --plot RUNS_DIR/luse_trial.png
# LUSE_STEPS (default 150) sets the budget; ARMS / SEEDS choose what runs. A rerun skips finished jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs/luse_trial}
ARMS=${ARMS:-cut cut_cls luse distill distill_luse luse_bce simcse luse_nofn}  # also: luse_gist
SEEDS=${SEEDS:-0 1 2}
export RUNS LUSE_STEPS=${LUSE_STEPS:-150}
mkdir -p "$RUNS/logs"

job() {  # job ARM SEED
  local arm=$1 s=$2 C=benchmarks/luse_trial PY=${PYTHON:-.venv/bin/python} M
  local R=$RUNS/$arm-s$s POOL=()
  [ -f "$R/ft/finetune.json" ] || [ -f "$R/identical.txt" ] && return 0
  export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
  pre() { "$PY" launch/pretrain.py --config "$@" --train.seed="$s"; }
  case $arm in
    cut) M=runs/sample/student ;;
    cut_cls) M=runs/sample/student POOL=(--pooling cls) ;;  # the init as the CLS-pooled LUSE arms read it
    luse|luse_bce|luse_gist)
      pre $C/$arm.yaml --train.max_steps="$LUSE_STEPS" --run_dir="$R" --model.dropout=0.1; M=$R/model ;;
    luse_nofn)  # without false-negative control: where the control masked nothing, the same weights
      pre $C/luse_nofn.yaml --train.max_steps="$LUSE_STEPS" --run_dir="$R" --model.dropout=0.1; M=$R/model
      if cmp -s "$M/model.safetensors" "$RUNS/luse-s$s/model/model.safetensors"; then
        echo "luse_nofn seed $s: model.safetensors is bit-identical to luse's; not scored again" | tee "$R/identical.txt"
        return 0
      fi ;;
    simcse)
      pre $C/simcse.yaml --train.max_steps=$((LUSE_STEPS * 3)) --run_dir="$R" --model.dropout=0.1; M=$R/model ;;
    distill)
      pre $C/distill.yaml --train.max_steps=$((LUSE_STEPS * 3)) --run_dir="$R"; M=$R/model ;;
    distill_luse)  # half the budget each: distillation, then LUSE from it (mean pooling kept)
      pre $C/distill.yaml --train.max_steps=$((LUSE_STEPS * 3 / 2)) --run_dir="$R/distill"
      pre $C/luse.yaml --train.max_steps=$((LUSE_STEPS / 2)) --run_dir="$R/luse" \
        --model.name_or_path="$R/distill/model" --model.pooling=mean --model.dropout=0.1
      M=$R/luse/model ;;
    *) echo "luse_trial: unknown arm $arm" >&2; return 2 ;;
  esac
  [ -f "$R/zs/eval.json" ] || "$PY" -m pipeline eval "$M" "${POOL[@]}" --suite "[sts]" --max_pairs 2000 --out "$R/zs"
  "$PY" -m pipeline finetune "$M" "${POOL[@]}" --out "$R/ft" --seeds "$s" --train_lrs 1e-4 --progress false
}
export -f job
for arm in $ARMS; do for s in $SEEDS; do echo "$arm $s"; done; done |
  xargs -P 2 -L 1 bash -c 'job "$0" "$1" > "$RUNS/logs/$0-$1.log" 2>&1 && echo "done $0 $1" || echo "FAILED $0 $1 (see $RUNS/logs/$0-$1.log)"'
