#!/usr/bin/env bash
# The copy task at the paper's settings on one lent GPU (issue 42): several copy-paper stages train at once, one
# process each (a 4 x 256 model leaves most of an H100 idle), until a deadline; the CUDA tests run beside them.
#
#   bash scripts/gpu_copy.sh [OUT]     # there, with .whl/ carried (bash scripts/gpu_check.sh --download here)
#
# Settings (environment): COPY_STAGES (MODEL:LENGTH ..., default "gpt2_sdpa:128 linear_gpt2_hedgehog:128
# linear_gpt2:512 gpt2_sdpa:512"), COPY_DEADLINE_S (training stops then, default 420; a stage cut off keeps its
# checkpoint there, too large to come back), COPY_SCORE_EVERY_S (the running checkpoints are scored this often, as
# `--report_only --eval_running` scores them; default 150), COPY_TESTS (1: the CUDA tests of gpu_check.sh beside
# the training, on 4 workers; 0: none), COPY_PRESET (default copy-paper), COPY_DEVICE (default cuda; cpu runs the
# script's own paths on a machine without a GPU).
# Back in OUT: copy.tgz (each stage's output folder: records, finished stages, the report with the running stages'
# curves and scored checkpoints; checkpoints left out), one log per stage, tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-outputs/gpu_copy}}
STAGES=${COPY_STAGES:-gpt2_sdpa:128 linear_gpt2_hedgehog:128 linear_gpt2:512 gpt2_sdpa:512}
DEADLINE=${COPY_DEADLINE_S:-420}
SCORE_EVERY=${COPY_SCORE_EVERY_S:-150}
PRESET=${COPY_PRESET:-copy-paper}
DEVICE=${COPY_DEVICE:-cuda}
mkdir -p "$OUT_DIR"
if [ "$DEVICE" = cuda ]; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: no wheels in .whl/: run 'bash scripts/gpu_check.sh --download' here first and carry .whl/" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1
fi
PY=${PYTHON:-python3}
# fla's Triton kernels autotune for minutes at each new shape in each process: the copy stages take the torch bf16
# forms (the same function; docs/gpu.md), so the lease's minutes go to training.
export HF_LINEAR_ATTN_FLA=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
# checkpoints (about 40 MB each, every 100 steps) go to memory where there is a /dev/shm: the disk's fsync would
# stall the GPU's steps
WORK=/dev/shm/gpu_copy
[ -d /dev/shm ] && [ -w /dev/shm ] || WORK=/tmp/gpu_copy
mkdir -p "$WORK"
start=$SECONDS

pids=()
for stage in $STAGES; do
  model=${stage%%:*}; length=${stage##*:}
  timeout -s INT "$DEADLINE" "$PY" scripts/long_range.py --preset "$PRESET" --tasks copy --models "$model" \
    --lengths "$length" --device "$DEVICE" --output_dir "$WORK/$model-$length" > "$OUT_DIR/$model-$length.log" 2>&1 &
  pids+=($!)
done

if [ "${COPY_TESTS:-1}" = 1 ] && [ "$DEVICE" = cuda ]; then
  timeout 240 "$PY" -m pytest -v -rf -p no:cacheprovider -p no:benchmark -n 4 --timeout 200 -k cuda tests/attention \
    tests/models/test_short_conv.py tests/experiments/test_copy_task.py tests/experiments/test_recall.py \
    > "$OUT_DIR/tests.log" 2>&1
  echo "CUDA tests exit $?: $(grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT_DIR/tests.log" | tail -8)"
  pkill -9 -f "sys.stdin.readline" 2>/dev/null  # xdist workers a timeout left behind
fi

score() {  # the running stages' checkpoints, scored as their finished stages will be (float32, on DEVICE)
  local scorers=()
  for stage in $STAGES; do
    model=${stage%%:*}; length=${stage##*:}
    "$PY" scripts/long_range.py --preset "$PRESET" --tasks copy --models "$model" --lengths "$length" \
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
