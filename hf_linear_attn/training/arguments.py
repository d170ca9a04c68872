"""Command-line parsing shared by the scripts: HfArgumentParser dataclasses, a JSON config file, CLI overrides."""

import json
import sys
from pathlib import Path

from transformers import HfArgumentParser, TrainingArguments

from .errors import UsageError

SECRET_ARGUMENTS = ("hub_token",)  # never written to a card, a run record or a tracker

# 0 steps means something else to each layer: TrainingArguments.__post_init__ turns an --eval_steps of 0 into
# --logging_steps (every 500 steps by default) without a word, Trainer saves no checkpoint at all for a --save_steps
# of 0, and TrainingArguments refuses a --logging_steps of 0 without naming the fix. So the three are checked on the
# parsed flags, before the dataclass is built: {flag: (what it counts, how to have none)}.
TRAINER_INTERVALS = {
    "eval_steps": ("evaluations", "--eval_strategy no (with --do_eval, the model is evaluated once after training)"),
    "save_steps": ("checkpoints", "--save_strategy no (the model is still saved once after training)"),
    "logging_steps": ("logged losses", "--logging_strategy no"),
}


def check_trainer_intervals(namespace) -> None:
    """Refuse a zero or negative --eval_steps / --save_steps / --logging_steps, naming the flag and the fix, whatever
    the strategy: 0 is never a number of steps, and TrainingArguments would replace some of them without a word."""
    for flag, (what, off) in TRAINER_INTERVALS.items():
        value = getattr(namespace, flag, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{flag} must be positive (got {value:g}): the number of update steps between "
                             f"{what}, or a share of all steps if below 1 (0.1: every tenth of the run); to have "
                             f"none during training pass {off}")


def parse_arguments(dataclass_types, argv=None):
    """Parse argv into the dataclasses; `--config FILE.json` supplies defaults that later flags override.

    Keys of the config file that no dataclass knows are an error (a misspelt key would otherwise be ignored).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(dataclass_types)
    config_path = None
    if "--config" in argv:
        where = argv.index("--config")
        if where + 1 >= len(argv):
            raise UsageError("--config needs a JSON file")
        config_path = argv[where + 1]
        del argv[where: where + 2]
    if config_path is not None:
        try:
            defaults = json.loads(Path(config_path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise UsageError(f"cannot read the config file {config_path}: {error}") from error
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise UsageError(f"{config_path} has keys that are not arguments of this script: {unknown}")
        # Parse the file as if its values were flags, so types and choices are checked as on the command line.
        file_args = []
        for key, value in defaults.items():
            if isinstance(value, bool):
                file_args += [f"--{key}", str(value)]
            elif isinstance(value, list):
                file_args += [f"--{key}", *map(str, value)]
            elif value is not None:
                file_args += [f"--{key}", str(value)]
        argv = file_args + argv
    if any(isinstance(t, type) and issubclass(t, TrainingArguments) for t in dataclass_types):
        check_trainer_intervals(parser.parse_known_args(args=argv)[0])  # before __post_init__ rewrites them
    try:
        *parsed, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except UsageError:
        raise
    except ValueError as error:  # a dataclass refusing a value (TrainingArguments: "--logging_steps 0")
        raise UsageError(f"invalid arguments: {error}") from error
    if rest:
        raise UsageError(f"unknown arguments: {rest}")
    return (*parsed, config_path)


def flags_given(argv, config_path) -> set[str]:
    """The argument names set on the command line or in the --config file (whatever their values), so a script can
    tell a flag left at its default from one given (TrainingArguments turns do_eval on by itself, for one)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    if config_path is not None:
        given |= set(json.loads(Path(config_path).read_text()))
    return given
