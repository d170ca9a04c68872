"""Benchmarks against softmax attention (PyTorch SDPA and eager): encoder inference (the Linformer paper's Table 3
shape), decoder training steps, generation latency and cache size, linear-attention kernel efficiency, and the
decoding suites: whole-image sampling in the shape of "Transformers are RNNs" Table 1 (`images`), assisted and
prompt-lookup decoding (`assisted`), and the compiled against the eager decoding step (`compiled_step`).

    python scripts/benchmark.py --preset quick                  # about the smaller sizes
    python scripts/benchmark.py --preset full --output_dir results/benchmarks/cpu-2core
    python scripts/benchmark.py --only encoder generation       # some suites only
    python scripts/benchmark.py --only images assisted compiled_step   # the decoding suites (docs/benchmarks.md)

Each configuration runs in a fresh process (forked from one that has done the imports); writes results.json,
results.md (tables) and PNG plots.
"""

import _checkout  # noqa: F401  (benchmarks/ is beside scripts/, outside the package)

from benchmarks.suites import main

if __name__ == "__main__":
    main()
