"""Training around the models (layer 4: the public API only), behind scripts/pretrain.py and scripts/finetune.py.

Shared by both scripts: arguments (command-line parsing, --config files), errors (`UsageError`, the one error a bad
flag or file raises; `DiskFullError` for a full disk), sources (local model / config / tokenizer paths checked),
data/ (files, pretraining corpus, tasks, token tasks), checkpoints (whole-or-skipped files, full-disk reports),
model_cards and hub (cards, uploads), metrics/ (`evaluate` modules, Hub or offline copies), launch and fsdp.

Pretraining (accelerate): pretraining_arguments, accelerator (precision, trackers, FSDP), pretraining_setup (config,
tokenizer, model, packed corpus), run_state (run folder, checkpoints, exact resume), pretraining (the loop).
Fine-tuning (Trainer): finetuning_arguments, finetuning_setup (task, config, tokenizer), trainer_checkpoints (atomic
checkpoints, resume), finetuning (the run). Checkpoints never import this package.
"""
