"""Speed and memory of the models against softmax attention, behind scripts/benchmark.py (docs/benchmarks.md).

Outside the installed package, beside scripts/, as Transformers keeps benchmark/ and flash-linear-attention keeps
benchmarks/: the suites need the checkout (configs, ../shared/data) and the wheel holds only the library.

- `measuring.py`: what every suite measures with (time, two memory probes, the matmul peak, the machine, one
  configuration in a fresh process); it imports no suite, and experiments/long_range measures with it too.
- `suites.py`: the model suites (encoder, decoder_train, generation, kernel), their presets, and the runner that
  plans every suite's configurations, measures each in a fresh process and writes results.json / results.md / plots.
- `decoding.py`: the decoding suites (images, assisted, compiled_step); `kernel_crossover.py`: the crossover suite.
  Each takes the preset's name from suites.py and imports only measuring.py.
"""
