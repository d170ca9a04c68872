"""The arguments of scripts/finetune.py besides TrainingArguments' own (`FinetuneArguments`, every field a --flag),
and what can be checked of them before any data is read or anything written."""

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainingArguments

from .data.tasks import parse_text_columns
from .errors import UsageError
from .model_cards import DEFAULT_TEMPLATE, check_template


@dataclass
class FinetuneArguments:
    """Model and data arguments of scripts/finetune.py (Trainer's own arguments come from TrainingArguments)."""

    model_name_or_path: str = field(metadata={"help": "pretrained checkpoint: a folder of this package or a Hub id"})
    task_name: str | None = field(default=None, metadata={
        "help": "a preset: sst2, qnli, qqp or imdb (columns, labels, metric); leave out for any other data and name "
                "its columns with --text_columns and --label_column"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "default: the model's folder"})
    dataset_name: str | None = field(default=None, metadata={
        "help": "Hub dataset: nyu-mll/glue (the task is its config) or stanfordnlp/imdb"})
    dataset_config_name: str | None = field(default=None)
    train_file: str | None = field(default=None, metadata={"help": "local GLUE TSV, JSON lines, CSV or parquet"})
    validation_file: str | None = field(default=None, metadata={"help": "without it, a split of train is held out"})
    test_file: str | None = field(default=None, metadata={
        "help": "rows to predict with --do_predict (labels optional: with labels, predict metrics too)"})
    text_columns: str | None = field(default=None, metadata={
        "help": "without --task_name: the text column, or two separated by a comma for pairs (e.g. "
                "question,sentence). Question answering: the question and context columns (default "
                "question,context); multiple choice: the context and ending-prefix columns (default sent1,sent2; "
                "one column for no prefix)"})
    label_column: str | None = field(default=None, metadata={
        "help": "without --task_name: the label column (default 'label'); text or integer labels are classes, "
                "float labels mean regression. Token classification: the column of per-word labels (default "
                "'ner_tags'); its words are the one column --text_columns names (default 'tokens'). Question "
                "answering: the answers column (default 'answers'); multiple choice: the index of the right "
                "ending (default 'label')"})
    task_type: str = field(default="sequence_classification", metadata={
        "help": "sequence_classification: a label (or a number) per text; token_classification: a label per word "
                "(NER, POS, chunking) from rows of a word list and a label list, as run_ner.py; "
                "question_answering: extractive answers from SQuAD-format rows (id, question, context, answers), as "
                "run_qa.py; multiple_choice: the right ending among ending0..endingN of SWAG-style rows (sent1, "
                "sent2, label), as run_swag.py",
        "choices": ["sequence_classification", "token_classification", "question_answering", "multiple_choice"]})
    label_list: str | None = field(default=None, metadata={
        "help": "token classification: every label name in id order, comma-separated (e.g. O,B-PER,I-PER): names "
                "integer labels and fixes the ids; default: the names of a ClassLabel column, else the train "
                "labels sorted"})
    label_all_tokens: bool = field(default=False, metadata={
        "help": "token classification: train every sub-token of a word on its label (B-X as I-X after the "
                "first) instead of the first sub-token only; evaluation and predictions stay one label per word"})
    return_entity_level_metrics: bool = field(default=False, metadata={
        "help": "token classification: report precision / recall / F1 / number of each entity type too"})
    doc_stride: int | None = field(default=None, metadata={
        "help": "question answering: a context longer than a window is split into windows of --max_seq_length "
                "tokens that share this many tokens (default: a third of --max_seq_length, run_qa.py's 128 at its "
                "384)"})
    n_best_size: int | None = field(default=None, metadata={
        "help": "question answering: the best start and end tokens of each window paired into candidate answers "
                "(default 20)"})
    max_answer_length: int | None = field(default=None, metadata={
        "help": "question answering: the longest answer, in tokens, a prediction may have (default 30)"})
    validation_split_percentage: float = field(default=10.0)
    max_seq_length: int = field(default=128)
    head_fraction: float = field(default=0.25, metadata={
        "help": "for single texts longer than max_seq_length: the share of tokens kept from the start (the rest "
                "from the end)"})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "train on N rows: the first N of a local file, a seeded random N of a Hub split (Hub splits can "
                "be sorted by label, as IMDB's are)"})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "evaluate on N rows, chosen as for --max_train_samples"})
    max_predict_samples: int | None = field(default=None, metadata={
        "help": "predict N rows, chosen as for --max_train_samples"})
    eval_length_split: int | None = field(default=None, metadata={
        "help": "sequence classification: also score the evaluation rows up to N tokens and those beyond N apart "
                "(their length before truncation, special tokens included), e.g. 512 to see what a model that "
                "reads longer inputs gains on the long ones; adds <metric>_within_N / _beyond_N and rows_beyond_N"})
    metric_source: str = field(default="auto", metadata={
        "help": "evaluate modules from the Hub, the local offline copies, or auto (local when HF_HUB_OFFLINE=1)",
        "choices": ["auto", "hub", "local"]})
    model_card_template: str = field(default=str(DEFAULT_TEMPLATE))
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace what output_dir holds"})
    allow_inexact_resume: bool = field(default=False, metadata={
        "help": "with --resume_from_checkpoint: accept a checkpoint without its RNG states (the continuation then "
                "differs from an uninterrupted run) instead of stopping"})
    trust_remote_code: bool = field(default=False)
    config_overrides: str | None = field(default=None, metadata={
        "help": "settings of the checkpoint's config to change for this run, as run_mlm.py takes them: "
                "'attention_probs_dropout_prob=0,hidden_dropout_prob=0.2' (each key must be in the config)"})
    distill_from: str | None = field(default=None, metadata={
        "help": "sequence classification: a teacher fine-tuned on the same task (a folder or Hub id) whose class "
                "probabilities the student also learns (knowledge distillation; e.g. the model a converted student "
                "was converted from): loss = (1 - alpha) CE(labels) + alpha T^2 KL(teacher_T || student_T); "
                "evaluation reports the plain loss"})
    distill_alpha: float = field(default=0.5, metadata={"help": "with --distill_from: the teacher term's weight"})
    distill_temperature: float = field(default=2.0, metadata={"help": "with --distill_from: the softmax temperature T"})


def check_arguments(args: FinetuneArguments, training: TrainingArguments) -> None:
    """What can be checked before any data is read or anything is written."""
    if args.max_seq_length < 1:
        raise UsageError(f"--max_seq_length must be at least 1 (got {args.max_seq_length}); 128 is usual")
    if training.do_train and training.max_steps <= 0 and training.num_train_epochs <= 0:
        raise UsageError(f"nothing to train: --num_train_epochs {training.num_train_epochs} and --max_steps "
                         f"{training.max_steps}; pass a positive --num_train_epochs or --max_steps")
    strategies = (("--save_steps", training.save_steps, training.save_strategy),
                  ("--eval_steps", training.eval_steps, training.eval_strategy),
                  ("--logging_steps", training.logging_steps, training.logging_strategy))
    for flag, steps, strategy in strategies:
        if str(getattr(strategy, "value", strategy)) == "steps" and steps is not None and steps <= 0:
            raise UsageError(f"{flag} must be positive with the 'steps' strategy (got {steps}): a number of steps, "
                             "or a share of all steps if below 1; or set the strategy to 'no'")
    if training.do_train and not (training.learning_rate > 0 and math.isfinite(training.learning_rate)):
        raise UsageError(f"--learning_rate must be a positive number (got {training.learning_rate}); the presets use "
                         "1e-5 to 5e-5")  # else torch's AdamW raised a bare ValueError once training began
    for flag, value in (("--per_device_train_batch_size", training.per_device_train_batch_size),
                        ("--per_device_eval_batch_size", training.per_device_eval_batch_size),
                        ("--gradient_accumulation_steps", training.gradient_accumulation_steps)):
        if value < 1:  # else the DataLoader raised a bare ValueError after the data was read
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if training.fp16 and not torch.cuda.is_available():
        raise UsageError("--fp16 needs a GPU: on a CPU pass --bf16 (native on CPUs with AVX512-BF16 / AMX) or "
                         "leave it out")
    if training.bf16 and not torch.cuda.is_available():
        from .accelerator import cpu_has_native_bf16  # reads /proc/cpuinfo, as --mixed_precision auto does

        if not cpu_has_native_bf16():  # not an error: bf16 numerics are what was asked for, only slowly
            warnings.warn("--bf16 on a CPU without AVX512-BF16 or AMX: its bf16 products are emulated, about 5x "
                          "slower than float32 on an AVX-512 CPU and far slower on an AVX2-only one "
                          "(docs/benchmarks.md); leave --bf16 out to fine-tune in float32", stacklevel=2)
    if not 0.0 <= args.head_fraction <= 1.0:
        raise UsageError(f"--head_fraction must be between 0 and 1 (got {args.head_fraction}): the share of a long "
                            "text's tokens kept from its start")
    for flag, value in (("--max_train_samples", args.max_train_samples), ("--max_eval_samples", args.max_eval_samples),
                        ("--max_predict_samples", args.max_predict_samples)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if args.eval_length_split is not None:
        if args.eval_length_split < 1:
            raise UsageError(f"--eval_length_split must be at least 1 (got {args.eval_length_split}): a number of "
                             "tokens, e.g. 512")
        if not training.do_eval:
            raise UsageError("--eval_length_split splits the evaluation's score: add --do_eval, or leave it out")
    parse_config_overrides(args.config_overrides)
    if not Path(args.model_card_template).is_file():
        raise UsageError(f"model card template not found: {args.model_card_template} (--model_card_template)")
    check_template(Path(args.model_card_template))


def parse_config_overrides(text: str | None) -> dict[str, str]:
    """--config_overrides as {key: value text}: comma-separated key=value pairs, each key once."""
    if not text:
        return {}
    pairs = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value or key in pairs:
            raise UsageError(f"--config_overrides takes comma-separated key=value pairs, each key once, such as "
                             f"'attention_probs_dropout_prob=0,hidden_dropout_prob=0.2'; got {text!r}")
        pairs[key] = value
    return pairs


TOKEN_FLAGS = ("label_list", "label_all_tokens", "return_entity_level_metrics")
QA_FLAGS = ("doc_stride", "n_best_size", "max_answer_length")
QA_DEFAULTS = {"n_best_size": 20, "max_answer_length": 30}  # run_qa.py's; its doc_stride is 128 at length 384


def parse_label_names(value: str | None) -> tuple[str, ...]:
    """--label_list "O,B-PER,I-PER" -> ("O", "B-PER", "I-PER")."""
    if value is None:
        return ()
    names = tuple(n.strip() for n in value.split(","))
    if not names or any(not n for n in names) or len(set(names)) != len(names):
        raise UsageError(f"--label_list must list distinct, non-empty label names in id order, comma-separated "
                         f"(got {value!r}), e.g. --label_list O,B-PER,I-PER,B-LOC,I-LOC")
    return names


def qa_setting(args: FinetuneArguments, name: str) -> int:
    """--doc_stride / --n_best_size / --max_answer_length, or its default (run_qa.py's; --doc_stride: a third of
    --max_seq_length, as run_qa.py's 128 of 384)."""
    value = getattr(args, name)
    if value is None:
        return args.max_seq_length // 3 if name == "doc_stride" else QA_DEFAULTS[name]
    return value


TASK_TYPE_WORDS = {"token_classification": "token classification", "question_answering": "question answering",
                   "multiple_choice": "multiple choice"}


def check_task_type(args: FinetuneArguments) -> None:
    """Flags that belong to another task type are refused (rather than ignored), before any data is read."""
    for task_type, flags in (("token_classification", TOKEN_FLAGS), ("question_answering", QA_FLAGS)):
        given = [f"--{flag}" for flag in flags if getattr(args, flag) not in (None, False)]
        if args.task_type != task_type and given:
            raise UsageError(f"{', '.join(given)} apply to {TASK_TYPE_WORDS[task_type]}: add --task_type "
                             f"{task_type}, or leave them out")
    if args.eval_length_split is not None and args.task_type != "sequence_classification":
        raise UsageError(f"--eval_length_split scores sequence classification by input length; for "
                         f"{TASK_TYPE_WORDS[args.task_type]} leave it out")
    if args.task_type in ("question_answering", "multiple_choice"):
        check_span_or_choice_arguments(args)
    if args.task_type != "token_classification":
        return
    if args.task_name is not None:
        raise UsageError(f"--task_name {args.task_name} is a sequence-classification preset; for token "
                         "classification name the columns of your data with --text_columns (the words, default "
                         "'tokens') and --label_column (default 'ner_tags'), or leave out --task_type")
    if args.text_columns and len(parse_text_columns(args.text_columns)) != 1:
        raise UsageError(f"token classification reads one column of words (a list of strings per row), not "
                         f"{args.text_columns!r}: pass --text_columns tokens (or your column's name)")
    parse_label_names(args.label_list)


def check_span_or_choice_arguments(args: FinetuneArguments) -> None:
    """Question answering and multiple choice: no preset, two text columns at most, QA's window settings in range."""
    words = TASK_TYPE_WORDS[args.task_type]
    columns = "question,context" if args.task_type == "question_answering" else "sent1,sent2"
    if args.task_name is not None:
        raise UsageError(f"--task_name {args.task_name} is a sequence-classification preset; for {words} name the "
                         f"columns of your data with --text_columns (default {columns!r}) and --label_column, or "
                         "leave out --task_type")
    if args.text_columns:
        given = parse_text_columns(args.text_columns)
        if args.task_type == "question_answering" and len(given) != 2:
            raise UsageError(f"question answering reads two text columns, the question and the context, not "
                             f"{args.text_columns!r}: pass --text_columns question,context (your columns' names)")
    if args.task_type != "question_answering":
        return
    stride, n_best, longest = (qa_setting(args, name) for name in QA_FLAGS)
    if not 0 <= stride < args.max_seq_length:
        raise UsageError(f"--doc_stride {stride} must be at least 0 and below --max_seq_length {args.max_seq_length}: "
                         "it is the number of tokens consecutive windows over a long context share (run_qa.py uses "
                         "128 with --max_seq_length 384); each window also holds the question")
    if n_best < 1:
        raise UsageError(f"--n_best_size must be at least 1 (got {n_best}); 20 is usual")
    if longest < 1:
        raise UsageError(f"--max_answer_length must be at least 1 token (got {longest}); 30 is usual")
