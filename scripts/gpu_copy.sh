#!/usr/bin/env bash
# The copy task at the paper's settings on one lent GPU (issue 42): several copy-paper stages train at once, one
# process each (a 4 x 256 model leaves most of an H100 idle), until a deadline; the CUDA tests run beside them.
#
#   bash scripts/gpu_copy.sh [OUT]     # there, with .whl/ carried (bash scripts/gpu_check.sh --download here)
#
# Settings (environment):
#   COPY_STAGES         MODEL:LENGTH ..., default "gpt2_sdpa:128"
#   COPY_DEADLINE_S     training stops then, default 480; a stage cut off keeps its checkpoint on that machine (too
#                       large to come back), so only a call on the same warm machine resumes it
#   COPY_SCORE_EVERY_S  the running checkpoints are scored this often, as `--report_only --eval_running` scores them
#                       (default 150)
#   COPY_TESTS          1 (default): the CUDA tests of gpu_check.sh beside the training, on 4 workers; 0: none
#   COPY_PRESET         default copy-paper
#   COPY_DEVICE         default cuda; cpu runs the script's own paths on a machine without a GPU
# Measured on an H200 (results/long_range/copy-paper-gpu-h200-2026-11-28): alone, GPT-2 at n = 128 trains 55 steps/s
# (a 20,000-step stage in about 6 minutes), linear_gpt2 at n = 512 32 steps/s (10.5 minutes); four stages at once
# 23-28 steps/s each.
# Back in OUT: copy.tgz (each stage's output folder: records, finished stages, the report with the running stages'
# curves and scored checkpoints; checkpoints left out), one log per stage, tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-outputs/gpu_copy}}
STAGES=${COPY_STAGES:-gpt2_sdpa:128}
DEADLINE=${COPY_DEADLINE_S:-480}
SCORE_EVERY=${COPY_SCORE_EVERY_S:-150}
PRESET=${COPY_PRESET:-copy-paper}
DEVICE=${COPY_DEVICE:-cuda}
mkdir -p "$OUT_DIR"
source scripts/gpu_lib.sh
if [ "$DEVICE" = cuda ]; then
  install_wheels .whl || exit $?
  nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1
fi
PY=${PYTHON:-python3}
# fla's Triton kernels autotune for minutes at each new shape in each process: the copy stages (and their scoring)
# take the torch bf16 forms (the same function; docs/gpu.md), so the lease's minutes go to training. The tests keep
# fla where it is installed.
NO_FLA=HF_LINEAR_ATTN_FLA=0
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
# checkpoints (about 40 MB each, every 100 steps) go to memory where there is a /dev/shm: the disk's fsync would
# stall the GPU's steps. A second call on the same warm machine finds them and resumes (COPY_WORK_DIR: elsewhere).
WORK=${COPY_WORK_DIR:-/dev/shm/gpu_copy}
[ -n "${COPY_WORK_DIR:-}" ] || { [ -d /dev/shm ] && [ -w /dev/shm ]; } || WORK=/tmp/gpu_copy
mkdir -p "$WORK"
start=$SECONDS

pids=()
for stage in $STAGES; do
  model=${stage%%:*}; length=${stage##*:}
  env $NO_FLA timeout -s INT "$DEADLINE" "$PY" scripts/long_range.py --preset "$PRESET" --tasks copy --models "$model" \
    --lengths "$length" --device "$DEVICE" --output_dir "$WORK/$model-$length" > "$OUT_DIR/$model-$length.log" 2>&1 &
  pids+=($!)
done

if [ "${COPY_TESTS:-1}" = 1 ] && [ "$DEVICE" = cuda ]; then
  run_cuda_tests 240 4 200 "$OUT_DIR/tests.log"
  echo "CUDA tests exit $?: $(grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT_DIR/tests.log" | tail -8)"
fi

score() {  # the running stages' checkpoints, scored as their finished stages will be (float32, on DEVICE)
  local scorers=()
  for stage in $STAGES; do
    model=${stage%%:*}; length=${stage##*:}
    env $NO_FLA "$PY" scripts/long_range.py --preset "$PRESET" --tasks copy --models "$model" --lengths "$length" \
      --device "$DEVICE" --output_dir "$WORK/$model-$length" --report_only --eval_running \
      >> "$OUT_DIR/score.log" 2>&1 &
    scorers+=($!)
  done
  wait "${scorers[@]}"
  echo "[$((SECONDS - start)) s]"
  for stage in $STAGES; do
    echo "  $stage: $(grep -a "steps/s\|finished\|Error" "$OUT_DIR/${stage%%:*}-${stage##*:}.log" | tail -1)"
  done
}
alive() { for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
next=$SCORE_EVERY
while alive; do
  sleep 5
  if [ $((SECONDS - start)) -ge "$next" ]; then score; next=$((next + SCORE_EVERY)); fi
done
wait
score
tar -C "$WORK" --exclude="*.pt" --exclude="*.tmp" -czf "$OUT_DIR/copy.tgz" .
echo "[$((SECONDS - start)) s] done: $(ls "$WORK"/*/stages/*.json 2>/dev/null | wc -l) stage(s) finished"
