"""Training pipeline behind scripts/pretrain.py and scripts/finetune.py (layer 4: uses only the public API).

data: corpora, tokenizers, packing, GLUE / IMDB tasks; pretraining: accelerate MLM / CLM loop with exact resume;
finetuning: Trainer on a task; metrics: `evaluate` modules (Hub or offline copies); hub: model cards and uploads.
Model checkpoints never import this package, so it is not copied beside saved weights.
"""
