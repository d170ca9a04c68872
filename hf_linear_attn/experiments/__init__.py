"""Experiments on the models: benchmarks, the paper reproduction, long-range tasks and the Linformer projection
report, behind the scripts of the same names. Each writes its results into a folder of results/."""
