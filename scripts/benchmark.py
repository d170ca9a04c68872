"""Benchmarks against softmax attention (PyTorch SDPA and eager): encoder inference (the Linformer paper's Table 3
shape), decoder training steps, generation latency and cache size, and linear-attention kernel efficiency.

    python scripts/benchmark.py --preset quick                  # about the smaller sizes
    python scripts/benchmark.py --preset full --output_dir results/benchmarks/cpu-2core
    python scripts/benchmark.py --only encoder generation       # some suites only

Each configuration runs in a fresh process; writes results.json, results.md (tables) and PNG plots.
"""

from hf_linear_attn.experiments.benchmarks import main

if __name__ == "__main__":
    main()
