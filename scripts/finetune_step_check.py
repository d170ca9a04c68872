"""A fine-tuning step on this CPU, float32 against bf16 autocast, attention dropout on and off: see
benchmarks/finetune_step.py.

    python scripts/finetune_step_check.py --help
"""

import sys

import _checkout  # noqa: F401  (benchmarks/ is beside scripts/, outside the package)

from benchmarks.finetune_step import main

if __name__ == "__main__":
    sys.exit(main())
