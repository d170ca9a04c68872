"""Training around the models (layer 4: the public API only), behind scripts/pretrain.py and scripts/finetune.py.

data: corpora, tokenizers, packing, GLUE / IMDB tasks; pretraining: the accelerate MLM / CLM loop with exact
resume; finetuning: Trainer on a task; metrics: `evaluate` modules (Hub or offline copies); hub: model cards and
uploads; checkpoints: whole-or-skipped checkpoint files and full-disk reports; errors: `UsageError`, the
one error a bad flag or file raises (`DiskFullError` for a full disk). Checkpoints never import this package.
"""
