"""Training around the models (layer 4: the public API only), behind scripts/pretrain.py and scripts/finetune.py.

data: corpora, tokenizers, packing, GLUE / IMDB tasks; pretraining: the accelerate MLM / CLM loop with exact
resume; finetuning: Trainer on a task; metrics: `evaluate` modules (Hub or offline copies); hub: model cards and
uploads; errors: `UsageError`, the one error a bad flag or file raises. Checkpoints never import this package.
"""
