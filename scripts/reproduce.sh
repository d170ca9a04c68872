#!/usr/bin/env bash
# Set up .venv (scripts/bootstrap.sh), then the main job. With no arguments it runs two small comparisons:
#   1. the Linformer paper's Table 2 protocol at toy scale (scripts/reproduce.py, demo preset, about 6 minutes on 2
#      CPU cores): a softmax RoBERTa and a Linformer pretrained here on WikiText-2, fine-tuned on SST-2;
#   2. a real pretrained encoder (all-MiniLM-L6-v2) against two of its Linformer conversions, fine-tuned on SST-2 with
#      three seeds (scripts/pretrained.py, slice preset; results/pretrained/slice/results.md gives its time).
# With arguments, only scripts/reproduce.py runs, with them:
#   bash scripts/reproduce.sh                    # both -> outputs/reproduce/demo/ and outputs/pretrained/slice/
#   bash scripts/reproduce.sh --preset cpu       # every variant and task (93 stages, ~12 h on 2 cores:
#                                                  several sittings, see --records)
#   bash scripts/reproduce.sh --help
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
if [ "$#" -eq 0 ]; then
    .venv/bin/python scripts/reproduce.py
    exec .venv/bin/python scripts/pretrained.py --preset slice
fi
exec .venv/bin/python scripts/reproduce.py "$@"
