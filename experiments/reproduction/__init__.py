"""The Linformer paper's Table 2 comparison, reproduced end to end at a chosen scale (scripts/reproduce.py).

A preset (configs/reproduce/*.json) names the encoders and decoders to compare, the pretraining and fine-tuning
configs they share, and per-preset overrides. The run is a list of stages, each an ordinary subprocess of
scripts/pretrain.py or scripts/finetune.py (under `python` or `accelerate launch`) writing its own folder:

    tokenizer-mlm/, tokenizer-clm/     one byte-level BPE per objective, trained once, shared by every model
    pretrain/<model>/                  masked-LM pretraining of each encoder (identical data, steps, seed)
    finetune/<model>/<task>-seed<S>/   each pretrained encoder fine-tuned on SST-2, IMDB, QNLI, QQP
    decoders/<model>/                  causal-LM pretraining of each decoder (validation perplexity)
    logs/<stage>.log                   each stage's full output
    results.json, results.md, results.png

A stage whose folder holds its finished result (train_results.json / eval_results.json) and a stage.json with the
same arguments and inputs (a digest of the config files, models and tokenizer it read) is reused, so a rerun only
does what is missing; a finished stage run with other arguments or inputs is an error, never silently mixed into the
table. An interrupted pretraining resumes from its newest checkpoint.

preset.py reads and checks presets, stages.py plans, runs and records the stages, report.py turns the records into
the table and the plot; runner.py runs the three in order (`reproduce`).
"""

from .preset import TASKS, ReproductionError, load_preset
from .report import PAPER_TABLE2
from .runner import reproduce
from .stages import Stage, load_records, plan

__all__ = ["PAPER_TABLE2", "TASKS", "ReproductionError", "Stage", "load_preset", "load_records", "plan", "reproduce"]
