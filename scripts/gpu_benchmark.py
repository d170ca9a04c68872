"""GPU benchmark rows side by side in one run (issue 40): see benchmarks/gpu.py and docs/gpu.md.

    python scripts/gpu_benchmark.py --help
"""

import sys

import _checkout  # noqa: F401  (benchmarks/ is beside scripts/, outside the package)

from benchmarks.gpu import main

if __name__ == "__main__":
    sys.exit(main())
