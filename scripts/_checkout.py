"""Imported first by the scripts that run experiments: puts this checkout at the front of sys.path, so that
`benchmarks` and `experiments` (top-level folders beside scripts/, outside the installed package) import from a
fresh checkout, whatever the working folder, together with this checkout's hf_linear_attn."""

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if str(CHECKOUT) not in sys.path:
    sys.path.insert(0, str(CHECKOUT))
