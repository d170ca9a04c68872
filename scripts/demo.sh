#!/usr/bin/env bash
# Set up .venv (scripts/bootstrap.sh) and run the main job on its small default: the encoder demo, then the
# decoder demo. `bash scripts/demo.sh encoders ARGS...` or `decoders ARGS...` runs one of them with its own options
# (see `bash scripts/demo.sh encoders --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-all}" in
  encoders) shift; exec .venv/bin/python scripts/demo_encoders.py "$@" ;;
  decoders) shift; exec .venv/bin/python scripts/demo_decoders.py "$@" ;;
  all)
    if [ "$#" -gt 0 ]; then shift; fi
    if [ "$#" -gt 0 ]; then
      echo "demo.sh: options go to one demo: bash scripts/demo.sh encoders|decoders OPTIONS" >&2
      exit 2
    fi
    .venv/bin/python scripts/demo_encoders.py
    exec .venv/bin/python scripts/demo_decoders.py ;;
  *)
    echo "demo.sh: unknown demo '$1'; use 'encoders', 'decoders' or nothing for both" >&2
    exit 2 ;;
esac
