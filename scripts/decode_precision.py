"""bf16 decoding against float32 for the causal block Linformer, linear attention and GPT-2: see
benchmarks/decode_precision.py.

    python scripts/decode_precision.py --output_dir results/benchmarks/decode-precision-<machine>
"""

import sys

import _checkout  # noqa: F401  (benchmarks/ is beside scripts/, outside the package)

from benchmarks.decode_precision import main

if __name__ == "__main__":
    sys.exit(main())
