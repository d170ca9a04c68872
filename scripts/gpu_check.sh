#!/usr/bin/env bash
# The GPU check (issue 40): one prepared command for a lent GPU machine (H100 / H200) that has torch, triton and
# accelerate but not this project's transformers, nor flash-linear-attention, nor a package registry.
#
#   bash scripts/gpu_check.sh --download   # here, with a registry: fetch the wheels it carries into .whl/
#   bash scripts/gpu_check.sh [OUT]        # there: install .whl/ into /tmp/site, run the CUDA tests, then the
#                                          # GPU benchmark rows; logs and results go to OUT (default $OUT, else
#                                          # outputs/gpu_check)
#
# Time: under 8 minutes on an H200 (the tests about 1, the benchmark sections, preset GPU_BENCH_PRESET (default
# 'lease'), stop starting after GPU_BENCH_DEADLINE_S, default 300 s). Results: OUT/tests.log, OUT/tests.xml,
# OUT/nvidia-smi.txt, OUT/bench/results.{json,md}.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
# What the GPU image lacks, for CPython 3.12 on x86-64 (its python3): this project's transformers, the regex it
# needs (the image's may be older), fla's kernels (pure Python; Triton comes with the image's torch).
PACKAGES=(transformers==5.23.0 "regex>=2025.10.22" fla-core==0.6.0)

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi

if [ "${1:-}" = "--download" ]; then
  mkdir -p "$WHEELS"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$WHEELS" "${PACKAGES[@]}" || exit 1
  ls -1 "$WHEELS"
  exit 0
fi

OUT_DIR=${1:-${OUT:-outputs/gpu_check}}
mkdir -p "$OUT_DIR/bench"
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: torch sees no CUDA device here. Run this on a GPU machine; on a CPU the same tests run in" \
       "'bash scripts/test.sh' and the benchmark's code paths in 'python scripts/gpu_benchmark.py --preset smoke" \
       "--device cpu --output_dir DIR'." >&2
  exit 2
fi
source scripts/gpu_lib.sh
install_wheels "$WHEELS" || exit $?
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1
# Triton's cache (compiled kernels, and fla's autotuning results: fla autotunes with cache_results): a lease's first
# call spends 2-3 minutes compiling and autotuning fla's kernels. The cache this call leaves comes back as
# OUT/triton-cache.tgz; saved as .triton-cache.tgz in the checkout (ignored) and carried, the next call starts with it.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .triton-cache.tgz ]; then
  tar -C "$TRITON_CACHE_DIR" -xzf .triton-cache.tgz && echo "Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files carried"
fi
save_triton_cache() {
  # the whole cache if it fits what a call brings back (16 MB a file), else only the autotuning results
  tar -C "$TRITON_CACHE_DIR" -czf "$OUT_DIR/triton-cache.tgz" . 2>/dev/null
  if [ "$(stat -c %s "$OUT_DIR/triton-cache.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
    (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" -print0 | tar --null -czf "$OUT_DIR/triton-cache.tgz" -T -)
  fi
}
python3 - <<'EOF' 2>&1 | tee "$OUT_DIR/versions.txt"
import torch, transformers, triton, fla, hf_linear_attn
from hf_linear_attn.linear_attention import fla_chunk_kernel
print("torch", torch.__version__, "cuda", torch.version.cuda, "| transformers", transformers.__version__,
      "| triton", triton.__version__, "| fla", fla.__version__, "|", torch.cuda.get_device_name(0))
print("fla kernel dispatched by 'auto':", fla_chunk_kernel("cuda") is not None)
EOF

# 1. the tests whose math depends on the device, on CUDA (their [cuda] instances; the [cpu] ones run in CI), over
#    GPU_TEST_WORKERS processes (pytest-xdist is in the GPU image; 0 runs them in this process); their xdist
#    workers are stopped before anything is timed (gpu_lib.sh)
run_cuda_tests "${GPU_TEST_TIMEOUT_S:-180}" "${GPU_TEST_WORKERS:-12}" "${GPU_TEST_EACH_S:-120}" "$OUT_DIR/tests.log" \
  --junitxml="$OUT_DIR/tests.xml"
tests_rc=$?
grep -E "FAILED|ERROR|passed|failed" "$OUT_DIR/tests.log" | tail -25

# 2. the benchmark rows, side by side in one run
timeout "${GPU_BENCH_TIMEOUT_S:-420}" python3 scripts/gpu_benchmark.py --output_dir "$OUT_DIR/bench" \
  --preset "${GPU_BENCH_PRESET:-lease}" --deadline_s "${GPU_BENCH_DEADLINE_S:-300}" \
  ${GPU_BENCH_SECTIONS:+--sections "$GPU_BENCH_SECTIONS"} \
  > "$OUT_DIR/bench.log" 2>&1
bench_rc=$?
tail -c 6000 "$OUT_DIR/bench/results.md" 2>/dev/null || tail -40 "$OUT_DIR/bench.log"
save_triton_cache
echo "tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
