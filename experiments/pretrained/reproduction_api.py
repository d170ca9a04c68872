"""The one place this experiment imports the reproduction machinery (hf_linear_attn.experiments.*).

That package is moving to the top-level benchmarks/ and experiments/ folders; when it has moved, only these imports
change. What is used: the stage runner (a subprocess per stage, reused when finished with the same arguments and
inputs, a launch record so an interrupted run resumes), the majority-class share of a task's evaluation rows, the
machine description and the preset lookup.
"""

from hf_linear_attn.experiments import find_preset
from hf_linear_attn.experiments.benchmarks import describe_machine
from hf_linear_attn.experiments.reproduction.preset import (
    TASK_TITLES, ReproductionError, _flags as flags, _merged_config as merged_config, resolve, slug,
)
from hf_linear_attn.experiments.reproduction.report import majority_share
from hf_linear_attn.experiments.reproduction.stages import Stage, run_stage

__all__ = ["TASK_TITLES", "ReproductionError", "Stage", "describe_machine", "find_preset", "flags", "majority_share",
           "merged_config", "resolve", "run_stage", "slug"]
