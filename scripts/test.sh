#!/usr/bin/env bash
# Set up .venv (scripts/bootstrap.sh) and run the test suite, offline. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two worker processes (pytest-xdist), a test file per worker at a time: most tests wait on a subprocess's imports
# or a small model that leaves a core idle. Files stay whole so tests that share a port never run at once.
# TEST_PROCESSES=0 runs everything in this process.
# One torch (OpenMP) thread per process: two workers of two threads each on two cores leave every small operation
# waiting at an OpenMP barrier for a thread the scheduler has parked. Measured on AMD EPYC, 2 idle cores, flags: avx2
# avx512_bf16:
# tests/training/test_tokenizer_mask.py, tests/conversion/test_conversion.py and tests/models/test_decoders.py on two
# workers: 285 s with torch's default threads, 83 s with one. Set OMP_NUM_THREADS to override.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -n "${TEST_PROCESSES:-2}" --dist loadfile "$@"
