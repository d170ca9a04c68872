"""The causal kernels of the linear decoder's variants side by side (issue 41): see benchmarks/state_variants.py.

    python scripts/state_variants_benchmark.py --help
"""

import sys

import _checkout  # noqa: F401  (benchmarks/ is beside scripts/, outside the package)

from benchmarks.state_variants import main

if __name__ == "__main__":
    sys.exit(main())
