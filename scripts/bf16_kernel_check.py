"""bf16 causal linear attention on a native-bf16 CPU against fla's torch form (issue 37): see benchmarks/bf16_kernel.py.

    python scripts/bf16_kernel_check.py --help
"""

import sys

import _checkout  # noqa: F401  (benchmarks/ is beside scripts/, outside the package)

from benchmarks.bf16_kernel import main

if __name__ == "__main__":
    sys.exit(main())
