#!/usr/bin/env bash
# Set up .venv (scripts/bootstrap.sh), then reproduce the Linformer paper's Table 2 comparison and the
# decoder comparison with scripts/reproduce.py (default: the demo preset, about 6 minutes on 2 CPU cores).
#   bash scripts/reproduce.sh                    # demo preset -> outputs/reproduce/demo/results.{md,json,png}
#   bash scripts/reproduce.sh --preset cpu       # every variant and task (93 stages, ~12 h on 2 cores:
#                                                  several sittings, see --records)
#   bash scripts/reproduce.sh --help
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
exec .venv/bin/python scripts/reproduce.py "$@"
