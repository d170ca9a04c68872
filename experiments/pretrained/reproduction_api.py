"""The one place this experiment imports the reproduction machinery (experiments.reproduction, benchmarks.measuring).

What is used: the stage runner (a subprocess per stage, reused when finished with the same arguments and
inputs, a launch record so an interrupted run resumes), its records files (records.json: a finished stage taken
on a machine without its folder), its fine-tuning stage, the majority-class share of a task's evaluation rows, the
machine description and the preset lookup.
"""

from benchmarks.measuring import describe_machine
from experiments import find_preset
from experiments.reproduction.preset import (
    TASK_TITLES, ReproductionError, _flags as flags, _merged_config as merged_config, resolve, slug,
)
from experiments.reproduction.report import describe_machines, majority_share
from experiments.reproduction.stages import (
    Stage, finetune_stage, load_records, rerun_upstream, run_stage, with_outcome, write_records,
)

__all__ = ["TASK_TITLES", "ReproductionError", "Stage", "describe_machine", "describe_machines", "find_preset",
           "finetune_stage", "flags", "load_records", "majority_share", "merged_config", "rerun_upstream", "resolve",
           "run_stage", "slug", "with_outcome", "write_records"]
