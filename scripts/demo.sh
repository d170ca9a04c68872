#!/usr/bin/env bash
# Set up .venv (scripts/bootstrap.sh) and run the main job on its small default. Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python scripts/demo_encoders.py "$@"
