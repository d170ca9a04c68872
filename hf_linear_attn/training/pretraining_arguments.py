"""The arguments of scripts/pretrain.py (`PretrainArguments`, every field a --flag) and their ranges, checked before
anything is read or written."""

import math
from dataclasses import dataclass, field

from transformers.trainer_utils import SchedulerType

from .errors import UsageError
from .hub import HubArguments


@dataclass
class PretrainArguments(HubArguments):
    """Arguments of scripts/pretrain.py (every field is a --flag; --config FILE.json gives defaults); the
    --push_to_hub flags come from HubArguments."""

    output_dir: str = field(metadata={"help": "where the model, tokenizer, checkpoints and results go"})
    model_config: str | None = field(default=None, metadata={
        "help": "config of a new model: a JSON file (configs/models/...), a folder or a Hub id"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "continue from these weights instead"})
    objective: str = field(default="auto", metadata={
        "help": "mlm (encoders), clm (decoders) or auto (mlm for any model with a masked-LM head)",
        "choices": ["auto", "mlm", "clm"]})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset, e.g. Salesforce/wikitext"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "e.g. wikitext-2-raw-v1"})
    train_file: str | None = field(default=None, metadata={"help": "local text / json(l) / parquet training file"})
    validation_file: str | None = field(default=None, metadata={"help": "local validation file (same format)"})
    text_column: str = field(default="text")
    validation_split_percentage: float = field(default=5.0, metadata={
        "help": "percentage of train held out for validation when there is no validation split"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={
        "help": "tokenizer folder or Hub id; default: --model_name_or_path's, or (new models) a byte-level BPE "
                "trained on the corpus"})
    tokenizer_vocab_size: int = field(default=8000, metadata={"help": "vocabulary of a tokenizer trained here"})
    max_seq_length: int = field(default=128)
    mlm_probability: float = field(default=0.15)
    per_device_train_batch_size: int = field(default=16)
    per_device_eval_batch_size: int = field(default=16)
    gradient_accumulation_steps: int = field(default=1)
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    learning_rate: float = field(default=5e-4)
    weight_decay: float = field(default=0.01)
    adam_beta1: float = field(default=0.9)
    adam_beta2: float = field(default=0.98)
    adam_epsilon: float = field(default=1e-6)
    max_grad_norm: float = field(default=1.0)
    lr_scheduler_type: str = field(default="linear", metadata={"help": "a transformers schedule: linear, cosine, ..."})
    warmup_ratio: float = field(default=0.06)
    mixed_precision: str = field(default="auto", metadata={
        "help": "no, bf16, fp16, or auto (bf16 where the GPU / CPU has native bf16 arithmetic)",
        "choices": ["auto", "no", "bf16", "fp16"]})
    logging_steps: int = field(default=10)
    eval_steps: int = field(default=200, metadata={"help": "validation perplexity every N steps (and at the end)"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "validate on the first N packed rows"})
    save_steps: int = field(default=200, metadata={"help": "checkpoint every N steps"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept (the newest ones)"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint in output_dir"})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "continue from this checkpoint"})
    allow_inexact_resume: bool = field(default=False, metadata={
        "help": "resume from a checkpoint without its RNG states (dropout and data order then differ from an "
                "uninterrupted run) instead of stopping"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace what output_dir holds"})
    report_to: str = field(default="none", metadata={"help": "accelerate tracker: none, tensorboard, wandb, ..."})
    seed: int = field(default=42)
    trust_remote_code: bool = field(default=False)


def check_arguments(args: PretrainArguments, objective: str) -> None:
    """Every numeric flag in its range, before anything is read or written (a bad one used to crash mid-run, or
    worse, train and report NaN)."""
    shortest = 3 if objective == "mlm" else 2  # <s> token </s>; a token and the next one to predict
    if args.max_seq_length < shortest:
        raise UsageError(f"--max_seq_length must be at least {shortest} for {objective} (got {args.max_seq_length}): "
                         + ("a row is <s>, at least one token and </s>" if objective == "mlm"
                            else "a row needs a token and the next one to predict"))
    at_least_one = {"--max_steps": args.max_steps, "--gradient_accumulation_steps": args.gradient_accumulation_steps,
                    "--per_device_train_batch_size": args.per_device_train_batch_size,
                    "--per_device_eval_batch_size": args.per_device_eval_batch_size,
                    "--logging_steps": args.logging_steps, "--eval_steps": args.eval_steps,
                    "--save_steps": args.save_steps}
    if args.max_eval_samples is not None:
        at_least_one["--max_eval_samples"] = args.max_eval_samples
    for flag, value in at_least_one.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})" + (
                "; to skip checkpoints, pass a --save_steps beyond --max_steps" if flag == "--save_steps" else ""))
    if not 0.0 < args.mlm_probability <= 1.0 and objective == "mlm":
        raise UsageError(f"--mlm_probability must be in (0, 1] (got {args.mlm_probability}): with no masked token "
                         "there is no loss (RoBERTa uses 0.15)")
    if not 0.0 <= args.warmup_ratio <= 1.0:
        raise UsageError(f"--warmup_ratio must be between 0 and 1 (got {args.warmup_ratio}): the share of "
                         "--max_steps spent warming up the learning rate")
    if args.learning_rate <= 0 or not math.isfinite(args.learning_rate):
        raise UsageError(f"--learning_rate must be a positive number (got {args.learning_rate})")
    schedules = [kind.value for kind in SchedulerType]
    if args.lr_scheduler_type not in schedules:  # else get_scheduler raised only after the folder was claimed
        raise UsageError(f"--lr_scheduler_type {args.lr_scheduler_type!r} is not a Transformers schedule: choose "
                         f"one of {schedules}")
    if args.save_total_limit < 0:
        raise UsageError(f"--save_total_limit must be 0 (keep all) or more (got {args.save_total_limit})")
    if args.tokenizer_name_or_path is None and args.model_name_or_path is None:
        # a byte-level BPE starts from the 256 byte symbols and the special tokens: below that nothing is learnt
        smallest = 256 + (5 if objective == "mlm" else 2)
        if args.tokenizer_vocab_size < smallest:
            raise UsageError(f"--tokenizer_vocab_size must be at least {smallest} (got {args.tokenizer_vocab_size}): "
                             "a byte-level BPE holds the 256 bytes and the special tokens before any merge")
