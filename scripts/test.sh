#!/usr/bin/env bash
# Set up .venv (scripts/bootstrap.sh) and run the test suite, offline. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two worker processes (pytest-xdist), a test file per worker at a time: most tests wait on a subprocess's imports
# or a small model that leaves a core idle. Files stay whole so tests that share a port never run at once.
# TEST_PROCESSES=0 runs everything in this process.
exec .venv/bin/python -m pytest -q -n "${TEST_PROCESSES:-2}" --dist loadfile "$@"
