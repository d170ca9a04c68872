"""Fine-tuning with the Transformers Trainer at run_glue.py's conventions: --do_train / --do_eval / --do_predict,
train / validation / test files or a Hub dataset, the four paper tasks (SST-2, QNLI, QQP, IMDB) as presets or any
text and label columns (classification with any number of labels, or regression); results files as Transformers'
examples write them, predictions, model card, Hub push (checked before training). `--task_type
token_classification` trains a label per word instead, at run_ner.py's conventions (CoNLL-style rows: a list of
words and a list of labels; entity precision / recall / F1)."""

import json
import math
import platform
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from dataclasses import replace as replace_task
from pathlib import Path

import numpy as np
import torch
from datasets import ClassLabel, Value
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import hf_linear_attn  # noqa: F401  (registers the package's models with the Auto classes)
from hf_linear_attn import MODEL_FAMILIES, family_of

from .checkpoints import disk_full_error, fsync_tree, is_disk_full, missing_pieces, remove_folder, replace_folder
from .data import (
    TokenTask, custom_task, encode_task, encode_token_task, get_task, load_task_data, load_token_data,
    parse_text_columns, prepare_tokenizer_for_words, read_task_files, read_token_files, refuse_sources_inside,
    require_split_sources, token_label_names,
)
from .errors import UsageError
from .hub import DEFAULT_TEMPLATE, check_push_target, check_template, push_folder, write_model_card
from .metrics import load_task_metric
from .sources import check_model_source, check_tokenizer_source
from .metrics.entities import has_entity_scheme
from .pretraining import max_model_length


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
                "question,sentence)"})
    label_column: str | None = field(default=None, metadata={
        "help": "without --task_name: the label column (default 'label'); text or integer labels are classes, "
                "float labels mean regression. Token classification: the column of per-word labels (default "
                "'ner_tags'); its words are the one column --text_columns names (default 'tokens')"})
    task_type: str = field(default="sequence_classification", metadata={
        "help": "sequence_classification: a label (or a number) per text; token_classification: a label per word "
                "(NER, POS, chunking) from rows of a word list and a label list, as run_ner.py",
        "choices": ["sequence_classification", "token_classification"]})
    label_list: str | None = field(default=None, metadata={
        "help": "token classification: every label name in id order, comma-separated (e.g. O,B-PER,I-PER): names "
                "integer labels and fixes the ids; default: the names of a ClassLabel column, else the train "
                "labels sorted"})
    label_all_tokens: bool = field(default=False, metadata={
        "help": "token classification: train every sub-token of a word on its label (B-X as I-X after the "
                "first) instead of the first sub-token only; evaluation and predictions stay one label per word"})
    return_entity_level_metrics: bool = field(default=False, metadata={
        "help": "token classification: report precision / recall / F1 / number of each entity type too"})
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
    metric_source: str = field(default="auto", metadata={
        "help": "evaluate modules from the Hub, the local offline copies, or auto (local when HF_HUB_OFFLINE=1)",
        "choices": ["auto", "hub", "local"]})
    model_card_template: str = field(default=str(DEFAULT_TEMPLATE))
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace what output_dir holds"})
    allow_inexact_resume: bool = field(default=False, metadata={
        "help": "with --resume_from_checkpoint: accept a checkpoint without its RNG states (the continuation then "
                "differs from an uninterrupted run) instead of stopping"})
    trust_remote_code: bool = field(default=False)


CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
INTERRUPTED_SAVE = (".partial-", ".stale-", ".deleting-")  # temporary folders a killed save can leave


class AtomicCheckpointTrainer(Trainer):
    """A Trainer whose checkpoint-N folders are whole or absent: each is written into a temporary folder
    (.partial-checkpoint-N/checkpoint-N, which Trainer's own `get_last_checkpoint` does not match) and renamed into
    place when complete; a full disk is reported as such, the older checkpoints untouched."""

    def _save_checkpoint(self, model, trial):
        run_dir = Path(self._get_output_dir(trial=trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_dir / f".partial-{name}"
        final = run_dir / name
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        get_output_dir = self._get_output_dir
        self._get_output_dir = lambda trial=None: str(staging)  # Trainer's save (and rotation) happen in staging
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every process's RNG state is in staging
            if self.args.should_save:
                if self.state.best_model_checkpoint and Path(self.state.best_model_checkpoint).parent == staging:
                    self.state.best_model_checkpoint = str(run_dir / Path(self.state.best_model_checkpoint).name)
                    self.state.save_to_json(str(staging / name / "trainer_state.json"))
                fsync_tree(staging)
                replace_folder(staging / name, final)
                shutil.rmtree(staging, ignore_errors=True)
                self._keep_newest_checkpoints(run_dir, final)
        except Exception as error:  # noqa: BLE001  (safetensors raises SafetensorError, no OSError)
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            if is_disk_full(error):
                raise disk_full_error(run_dir, f"the checkpoint {name}", error) from error
            raise
        finally:
            self._get_output_dir = get_output_dir
        self.accelerator.wait_for_everyone()

    def _keep_newest_checkpoints(self, run_dir: Path, saved: Path) -> None:
        """Keep the --save_total_limit newest whole checkpoints (and the one just saved, and the best one).

        Not Trainer's rotate_checkpoints: it orders by modification time and deletes in place, so a kill during a
        deletion left a half-deleted checkpoint-N whose folder was now the newest by time; the next rotation kept
        it and deleted whole, newer ones. Here the order is the step (as for resuming), incomplete folders are
        neither counted nor deleted (they are skipped by name and kept), and each deletion is atomic."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        whole = [p for p in checkpoint_folders(run_dir) if not trainer_checkpoint_problems(p, self.args.world_size)]
        protected = {saved}
        if self.state.best_model_checkpoint:
            protected.add(Path(self.state.best_model_checkpoint))
        excess = len(whole) - max(limit, len(protected))
        for folder in whole:  # oldest first
            if excess <= 0:
                break
            if folder not in protected:
                remove_folder(folder)
                excess -= 1


def trainer_checkpoint_problems(folder: Path, world_size: int, read_content: bool = False) -> dict[str, str]:
    """{piece of state: what is wrong} for a Trainer checkpoint; empty when an exact resume can start from it.
    `read_content`: also load the torch files as Trainer will (a resume; the rotation checks headers only)."""
    pieces = {"step and trainer state": ["trainer_state.json"],
              "model weights": ["model.safetensors", "pytorch_model.bin"],
              "optimizer state": ["optimizer.pt", "optimizer.bin"], "learning-rate scheduler": ["scheduler.pt"]}
    if world_size == 1:
        pieces["RNG state"] = ["rng_state.pth"]
    else:
        pieces.update({f"RNG state of process {i}": [f"rng_state_{i}.pth"] for i in range(world_size)})
    return missing_pieces(folder, pieces, read_content)


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """The checkpoint-N folders of output_dir, oldest step first (temporary .partial- / .stale- / .deleting- folders
    are not matched; whether a folder is whole is `trainer_checkpoint_problems`' question)."""
    found = [p for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and CHECKPOINT_NAME.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.match(p.name).group(1)))


def resolve_resume(value: str | None, output_dir: Path, world_size: int, allow_inexact: bool) -> str | None:
    """The checkpoint --resume_from_checkpoint means: a folder (checked whole), or with True / latest the newest
    whole checkpoint-N of output_dir, each incomplete one skipped by name (and kept). An error names what a
    checkpoint lacks and --allow_inexact_resume, which accepts one lacking only RNG states."""
    if value is None or str(value).lower() in ("", "false", "none"):
        return None
    if str(value).lower() in ("true", "latest"):
        candidates = checkpoint_folders(output_dir)[::-1]
        if not candidates:
            # A run killed before its first checkpoint was whole leaves nothing, or only the temporary folder of
            # that save: the same command then starts the run (so one command serves a first try and every retry).
            # A folder holding anything else is another run's.
            present = sorted(p.name for p in output_dir.iterdir()) if output_dir.is_dir() else []
            others = [name for name in present if not name.startswith(INTERRUPTED_SAVE)]
            if others:
                raise UsageError(f"--resume_from_checkpoint {value}: {output_dir} holds no {PREFIX_CHECKPOINT_DIR}-N "
                                 f"folder to resume from, but other files ({', '.join(others[:5])}): another run's "
                                 "output? Choose another --output_dir, or --overwrite_output_dir without "
                                 "--resume_from_checkpoint to replace it")
            print(f"warning: --resume_from_checkpoint {value}: {output_dir} holds no checkpoint yet; training from "
                  "the start")
            return None
    else:
        candidates = [Path(value)]
        if not candidates[0].is_dir():
            raise UsageError(f"--resume_from_checkpoint {value}: no such checkpoint folder")
    damaged = []
    for folder in candidates:
        problems = trainer_checkpoint_problems(folder, world_size, read_content=True)
        if not problems or (allow_inexact and all(p.startswith("RNG state") for p in problems)):
            for skipped, why in damaged:
                print(f"warning: skipping the incomplete checkpoint {skipped} ({why}); it is left in place")
            if problems:
                print(f"warning: resuming from {folder} without its {', '.join(problems)} "
                      f"({'; '.join(problems.values())}; --allow_inexact_resume): the continuation differs from an "
                      "uninterrupted run")
            return str(folder)
        damaged.append((folder, "; ".join(f"{piece}: {what}" for piece, what in problems.items())))
    listing = "\n  ".join(f"{folder}: {why}" for folder, why in damaged)
    raise UsageError(f"no checkpoint to resume from holds every piece of state an exact resume needs:\n  {listing}\n"
                     "--allow_inexact_resume accepts one without its RNG states; without weights, optimizer or "
                     "scheduler choose another --resume_from_checkpoint folder or start again")


def _occupied(output_dir: Path, args: FinetuneArguments, training: TrainingArguments) -> bool:
    """Whether output_dir holds another run to replace (an error unless --overwrite_output_dir)."""
    if not output_dir.exists() or not any(output_dir.iterdir()) or training.resume_from_checkpoint:
        return False
    if not args.overwrite_output_dir:
        raise UsageError(f"{output_dir} is not empty (it holds another run): pass --overwrite_output_dir to "
                            "replace it, --resume_from_checkpoint to continue it, or choose another --output_dir")
    refuse_sources_inside(output_dir, {"--model_name_or_path": args.model_name_or_path,
                                       "--tokenizer_name_or_path": args.tokenizer_name_or_path,
                                       "--train_file": args.train_file, "--validation_file": args.validation_file,
                                       "--test_file": args.test_file,
                                       "--model_card_template": args.model_card_template})
    return True


def _check_arguments(args: FinetuneArguments, training: TrainingArguments) -> None:
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
    if not 0.0 <= args.head_fraction <= 1.0:
        raise UsageError(f"--head_fraction must be between 0 and 1 (got {args.head_fraction}): the share of a long "
                            "text's tokens kept from its start")
    for flag, value in (("--max_train_samples", args.max_train_samples), ("--max_eval_samples", args.max_eval_samples),
                        ("--max_predict_samples", args.max_predict_samples)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if not Path(args.model_card_template).is_file():
        raise UsageError(f"model card template not found: {args.model_card_template} (--model_card_template)")
    check_template(Path(args.model_card_template))


def _subset(rows, count: int | None, hub: bool, seed: int):
    """At most `count` rows: the first ones of a local file, a seeded random choice from a Hub split (whose order
    is the publisher's: IMDB's train and test are sorted by label, so their first rows are all negative)."""
    if count is None or count >= len(rows):
        return rows
    return (rows.shuffle(seed=seed) if hub else rows).select(range(count))


def read_model_config(args: FinetuneArguments, **overrides):
    """--model_name_or_path's config (with `overrides`), or an error naming the folder and why it cannot be read."""
    check_model_source(args.model_name_or_path, "--model_name_or_path")
    try:
        return AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code,
                                          **overrides)
    except Exception as error:
        raise UsageError(f"cannot read a model config from {args.model_name_or_path}: {error}") from error


def _load_tokenizer_and_config(args: FinetuneArguments, task, train: bool = True):
    """The tokenizer and the model config: with a new head sized for `task` when training, the checkpoint's own
    (checked against the task) when only evaluating or predicting."""
    num_labels, label_names = (1, ()) if task.regression else (len(task.label_names), task.label_names)
    source = args.tokenizer_name_or_path or args.model_name_or_path
    if train:
        labels = {} if task.regression else {"id2label": dict(enumerate(label_names)),
                                             "label2id": {n: i for i, n in enumerate(label_names)}}
        if not isinstance(task, TokenTask):  # a sequence head's loss reads it; a token head's is cross-entropy
            labels["problem_type"] = "regression" if task.regression else "single_label_classification"
        config = read_model_config(args, num_labels=num_labels, **labels)
    else:
        config = read_model_config(args)
    if not train and config.num_labels != num_labels:
        raise UsageError(f"{args.model_name_or_path} has a head of {config.num_labels} output(s) but {task.name} "
                         f"needs {num_labels}: evaluate or predict with the fine-tuned checkpoint (or add --do_train)")
    check_tokenizer_source(source, "--tokenizer_name_or_path" if args.tokenizer_name_or_path
                           else "--model_name_or_path (its tokenizer; or pass --tokenizer_name_or_path)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot load a tokenizer from {source}: {error} (pass --tokenizer_name_or_path)") from error
    if len(tokenizer) > config.vocab_size:
        raise UsageError(f"the tokenizer from {source} has {len(tokenizer)} tokens but the model's embedding has "
                            f"{config.vocab_size} rows: it is not this model's tokenizer")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UsageError("the tokenizer has neither a pad nor an eos token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2's tokenizer has no pad token; pad with eos, masked out
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = max_model_length(config)
    if args.max_seq_length > max_model_length(config):
        raise UsageError(f"--max_seq_length {args.max_seq_length} is longer than the model allows "
                            f"({max_model_length(config)})")
    return tokenizer, config


def _resolve_task(args: FinetuneArguments, raw, train: bool):
    """The preset named by --task_name, or a task over --text_columns / --label_column: its labels are the train
    split's (a ClassLabel's names, or the distinct values; float labels mean regression) when training, the
    checkpoint's own (config.id2label) when only evaluating or predicting."""
    if args.task_name is not None:
        task = get_task(args.task_name)
        if args.text_columns or args.label_column:
            raise UsageError(f"--text_columns / --label_column are for data without a preset: --task_name "
                             f"{task.name} reads the columns {list(task.text_columns)} and "
                             f"{' or '.join(task.label_columns)}; leave out one or the other")
        return task
    if not args.text_columns:
        raise UsageError("no task: pass --task_name (sst2, qnli, qqp or imdb) or name the columns of your data with "
                         "--text_columns (one, or two for pairs, comma-separated) and --label_column")
    columns = parse_text_columns(args.text_columns)
    label = args.label_column or "label"
    if not train:
        config = read_model_config(args)
        regression = config.problem_type == "regression" or config.num_labels == 1
        names = [] if regression else [str(config.id2label[i]) for i in range(config.num_labels)]
        return custom_task(columns, label, names, regression, args.dataset_name, args.dataset_config_name)
    source = raw["train"]
    if label not in source.column_names:
        raise UsageError(f"the train data has no label column {label!r} (--label_column); its columns are "
                         f"{source.column_names}")
    feature = source.features[label]
    if isinstance(feature, ClassLabel):
        return replace_task(custom_task(columns, label, feature.names, False, args.dataset_name,
                                        args.dataset_config_name), accept_label_ids=True)
    regression = isinstance(feature, Value) and feature.dtype.startswith("float")
    return custom_task(columns, label, source.unique(label), regression, args.dataset_name, args.dataset_config_name)


# ------------------------------------------------------------------------------------------ token classification

TOKEN_FLAGS = ("label_list", "label_all_tokens", "return_entity_level_metrics")


def _parse_label_names(value: str | None) -> tuple[str, ...]:
    """--label_list "O,B-PER,I-PER" -> ("O", "B-PER", "I-PER")."""
    if value is None:
        return ()
    names = tuple(n.strip() for n in value.split(","))
    if not names or any(not n for n in names) or len(set(names)) != len(names):
        raise UsageError(f"--label_list must list distinct, non-empty label names in id order, comma-separated "
                         f"(got {value!r}), e.g. --label_list O,B-PER,I-PER,B-LOC,I-LOC")
    return names


def _check_task_type(args: FinetuneArguments) -> None:
    """Flags that belong to the other task type are refused (rather than ignored), before any data is read."""
    if args.task_type != "token_classification":
        given = [f"--{flag}" for flag in TOKEN_FLAGS if getattr(args, flag) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} apply to token classification: add --task_type "
                             "token_classification, or leave them out")
        return
    if args.task_name is not None:
        raise UsageError(f"--task_name {args.task_name} is a sequence-classification preset; for token "
                         "classification name the columns of your data with --text_columns (the words, default "
                         "'tokens') and --label_column (default 'ner_tags'), or leave out --task_type")
    if args.text_columns and len(parse_text_columns(args.text_columns)) != 1:
        raise UsageError(f"token classification reads one column of words (a list of strings per row), not "
                         f"{args.text_columns!r}: pass --text_columns tokens (or your column's name)")
    _parse_label_names(args.label_list)


def _require_token_head(args: FinetuneArguments) -> None:
    """An error, before any data is read, for a model without a token-classification head (this package's
    decoders have none: a causal model sees no word after the one it labels)."""
    config = read_model_config(args)
    family = family_of(config)
    encoders = sorted(t for t, f in MODEL_FAMILIES.items() if "AutoModelForTokenClassification" in f.models)
    if family is not None:
        has_head = "AutoModelForTokenClassification" in family.models
    else:
        has_head = (type(config) in AutoModelForTokenClassification._model_mapping
                    or "AutoModelForTokenClassification" in (getattr(config, "auto_map", None) or {}))
    if not has_head:
        kind = f"a {family.kind} ({config.model_type})" if family is not None else f"a {config.model_type} model"
        raise UsageError(f"{args.model_name_or_path} is {kind} without a token-classification head: token "
                         f"classification needs an encoder of this package ({', '.join(encoders)}) or a "
                         "Transformers model with one (RoBERTa, BERT)")


def _resolve_token_task(args: FinetuneArguments, raw, train: bool) -> TokenTask:
    """The token-classification task: its words and labels columns, and its label names: --label_list, a
    ClassLabel's names or the train labels when training; the checkpoint's own (config.id2label) otherwise."""
    tokens_column = parse_text_columns(args.text_columns)[0] if args.text_columns else "tokens"
    label_column = args.label_column or "ner_tags"
    given = _parse_label_names(args.label_list)
    name = f"{args.dataset_name} token classification" if args.dataset_name else "token classification"
    task = TokenTask(name, tokens_column, label_column, (), args.dataset_name, args.dataset_config_name)
    if not train:
        config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        heads = [a for a in (config.architectures or []) if a.endswith("ForTokenClassification")]
        if not heads:
            raise UsageError(f"{args.model_name_or_path} is not fine-tuned for token classification (its "
                             f"architectures: {config.architectures}): its head would be random; train it with "
                             "--do_train, or evaluate a checkpoint that fine-tuning wrote")
        names = tuple(str(config.id2label[i]) for i in range(config.num_labels))
        if given and given != names:
            raise UsageError(f"--label_list {list(given)} differ from the labels {list(names)} that "
                             f"{args.model_name_or_path} was trained with: leave --label_list out")
        return replace_task(task, label_names=names)
    source = raw["train"]
    for column, flag in ((tokens_column, "--text_columns"), (label_column, "--label_column")):
        if column not in source.column_names:
            raise UsageError(f"the train data has no column {column!r} ({flag}) for token classification; its "
                             f"columns are {source.column_names}")
    names, ids = token_label_names(source, label_column, given)
    if not names:
        raise UsageError(f"the train column {label_column!r} holds no labels")
    if not ids and names and all(n.lstrip("-").isdigit() for n in names):
        print(f"note: the labels of {label_column!r} are integers without names, so they are scored as plain "
              "tags; pass --label_list (e.g. O,B-PER,I-PER, in id order) for entity scores")
    return replace_task(task, label_names=names, accept_label_ids=ids)


def _token_metric_function(task: TokenTask, metric, entity_level: bool):
    """compute_metrics for Trainer: the words' predicted and true labels (the positions whose label is not -100:
    one per word, see `encode_token_task`) scored by the seqeval metric; run_ner.py's keys (precision, recall,
    f1, accuracy) and with `entity_level` those of each entity type. Labels without a B- / I- / E- / S- scheme
    (POS tags) are scored as one-word entities, so precision / recall / F1 count words."""
    schemed = has_entity_scheme(task.label_names)
    names = [n if schemed or n == "O" else f"B-{n}" for n in task.label_names]

    def compute_metrics(prediction):
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        guesses, labels = np.argmax(logits, axis=-1), prediction.label_ids
        kept = [row != -100 for row in labels]
        predictions = [[names[i] for i in guess[keep]] for guess, keep in zip(guesses, kept)]
        references = [[names[i] for i in label[keep]] for label, keep in zip(labels, kept)]
        scores = metric.compute(predictions=predictions, references=references)
        result = {k: float(scores[f"overall_{k}"]) for k in ("precision", "recall", "f1", "accuracy")}
        if entity_level:
            for kind, values in scores.items():
                if isinstance(values, dict):
                    result.update({f"{kind}_{k}": v for k, v in values.items()})
        return result

    return compute_metrics


def _write_token_predictions(path: Path, logits: np.ndarray, word_starts, task: TokenTask) -> None:
    """run_ner.py's predict_results.txt: for each input row one line, its words' predicted labels separated by
    spaces (the label of each word's first sub-token; words cut by --max_seq_length have none)."""
    guesses = np.argmax(logits, axis=-1)
    lines = [" ".join(task.label_names[int(guesses[row, p])] for p in starts) for row, starts in enumerate(word_starts)]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _warn_cut_rows(data, encoded, max_seq_length: int) -> None:
    """A warning naming how many evaluated / predicted rows are longer than --max_seq_length (their last words
    are neither scored nor predicted)."""
    for split in ("validation", "test"):
        if split in encoded:
            cut = sum(len(s) < len(w) for s, w in zip(encoded[split]["word_starts"], data[split]["tokens"]))
            if cut:
                print(f"warning: {cut} of {len(encoded[split])} {split} rows are longer than --max_seq_length "
                      f"{max_seq_length} tokens: their last words are neither scored nor predicted (raise "
                      "--max_seq_length)")


def _regression_metrics(predictions, references) -> dict:
    predictions, references = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
    pearson = float(np.corrcoef(predictions, references)[0, 1]) if len(references) > 1 else float("nan")
    return {"mse": float(np.mean((predictions - references) ** 2)), "pearson": pearson}


def _write_predictions(path: Path, predictions: np.ndarray, task) -> None:
    """run_glue.py's predict_results file: a header, then `index<TAB>prediction` (a label name, or a number)."""
    lines = ["index\tprediction"]
    for index, value in enumerate(predictions):
        lines.append(f"{index}\t{value:3.3f}" if task.regression else f"{index}\t{task.label_names[int(value)]}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_finetuning(args: FinetuneArguments, training: TrainingArguments, argv=None, modes_given: bool = True) -> dict:
    """Train (--do_train), evaluate (--do_eval) and predict (--do_predict), as run_glue.py does; without any of the
    three flags (modes_given False), train and evaluate. Writes {train,eval,predict}_results.json, all_results.json,
    trainer_state.json, predict_results.txt, and after training the model and README.md; pushes when
    --push_to_hub (checked before anything else). Returns the metrics."""
    if not modes_given:
        training.do_train = training.do_eval = True
    do_train, do_eval, do_predict = training.do_train, training.do_eval, training.do_predict
    if not (do_train or do_eval or do_predict):
        raise UsageError("nothing to do: pass --do_train, --do_eval and / or --do_predict")
    token_level = args.task_type == "token_classification"
    _check_task_type(args)
    if args.task_name is not None:
        get_task(args.task_name)
    _check_arguments(args, training)
    if token_level:
        _require_token_head(args)
    output_dir = Path(training.output_dir)
    push, repo_id = training.push_to_hub, training.hub_model_id or output_dir.name
    if push:
        if not do_train:
            raise UsageError("--push_to_hub uploads a fine-tuned model: add --do_train (evaluation and prediction "
                             "alone write no model)")
        repo_id = check_push_target(repo_id, training.hub_token)  # token, reachability, name: before any work
    replace = _occupied(output_dir, args, training) if do_train else False
    resume_from = (resolve_resume(training.resume_from_checkpoint, output_dir, training.world_size,
                                  args.allow_inexact_resume) if do_train else None)
    splits = [s for s, on in (("train", do_train), ("validation", do_eval), ("test", do_predict)) if on]
    hub = args.dataset_name is not None
    if not hub:
        require_split_sources(splits, args.train_file, args.validation_file, args.test_file)
    preset = get_task(args.task_name) if args.task_name is not None else None
    hub_config = args.dataset_config_name if args.dataset_config_name is not None or preset is None else preset.hub_config
    wanted = {s: f for s, f in (("train", args.train_file), ("validation", args.validation_file),
                                ("test", args.test_file)) if s in splits}
    read = read_token_files if token_level else read_task_files
    raw = read(args.dataset_name, hub_config, wanted.get("train"), wanted.get("validation"), wanted.get("test"))
    if token_level:
        task = _resolve_token_task(args, raw, do_train)
        data, eval_split = load_token_data(task, raw, args.dataset_name, args.train_file, args.validation_file,
                                           args.test_file, args.validation_split_percentage, training.seed, splits)
    else:
        task = _resolve_task(args, raw, do_train)
        data, eval_split = load_task_data(task, args.dataset_name, hub_config, args.train_file, args.validation_file,
                                          args.validation_split_percentage, training.seed, test_file=args.test_file,
                                          splits=splits, raw=raw)
    for split, count in (("train", args.max_train_samples), ("validation", args.max_eval_samples),
                         ("test", args.max_predict_samples)):
        if split in data:
            data[split] = _subset(data[split], count, hub, training.seed)
    if do_train and not task.regression:
        seen = {i for row in data["train"]["labels"] for i in row} if token_level else set(data["train"]["label"])
        if len(seen) < 2:
            raise UsageError(f"every training row of {task.name} has the same label: a classifier cannot learn "
                             "from them (a local file sorted by label, cut by --max_train_samples? shuffle the file)")

    tokenizer, config = _load_tokenizer_and_config(args, task, train=do_train)
    if token_level:
        tokenizer = prepare_tokenizer_for_words(tokenizer, args.tokenizer_name_or_path or args.model_name_or_path)
    # The classification head is new: seed before it is drawn (torch's own start seed is random), so a seed
    # names one run, as in Trainer's model_init path
    set_seed(training.seed)
    auto_class = AutoModelForTokenClassification if token_level else AutoModelForSequenceClassification
    try:
        model = auto_class.from_pretrained(args.model_name_or_path, config=config,
                                           trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot load {args.model_name_or_path} for {args.task_type.replace('_', ' ')}: "
                         f"{error}") from error
    metric = None if task.regression else load_task_metric(task, args.metric_source)
    if token_level:
        encoded = encode_token_task(data, task, tokenizer, args.max_seq_length, args.label_all_tokens)
        _warn_cut_rows(data, encoded, args.max_seq_length)
        word_starts = encoded["test"]["word_starts"] if "test" in encoded else None
        encoded = encoded.remove_columns("word_starts")  # only for reading predictions back per word
        compute_metrics = _token_metric_function(task, metric, args.return_entity_level_metrics)
        collator = DataCollatorForTokenClassification(tokenizer)  # pads labels with -100
    else:
        encoded = encode_task(data, task, tokenizer, args.max_seq_length, args.head_fraction)
        collator = DataCollatorWithPadding(tokenizer)

        def compute_metrics(prediction):
            logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
            if task.regression:
                return _regression_metrics(np.squeeze(logits, -1), prediction.label_ids)
            return metric.compute(predictions=np.argmax(logits, axis=-1), references=prediction.label_ids)

    if replace and training.process_index == 0:  # every input is valid: only now is the old run removed
        shutil.rmtree(output_dir)
    training.push_to_hub = False  # one upload at the end (model, code, card), not Trainer's per-save pushes
    trainer = AtomicCheckpointTrainer(model=model, args=training, train_dataset=encoded.get("train"),
                                      eval_dataset=encoded.get("validation"), processing_class=tokenizer,
                                      data_collator=collator, compute_metrics=compute_metrics)
    metrics = {}
    if do_train:
        if resume_from is not None and trainer.is_world_process_zero():
            print(f"resuming from {resume_from}")  # Trainer says so only at INFO level
        train_result = trainer.train(resume_from_checkpoint=resume_from)
        try:
            trainer.save_model(str(output_dir))  # weights, config, model code (save_pretrained) and tokenizer
        except Exception as error:  # noqa: BLE001  (safetensors raises SafetensorError, no OSError)
            if is_disk_full(error):
                raise disk_full_error(output_dir, "the fine-tuned model", error) from error
            raise
        train_metrics = {**train_result.metrics, "train_samples": len(encoded["train"])}
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)  # train_results.json and all_results.json
        trainer.save_state()  # trainer_state.json: log_history, steps, best checkpoint
        metrics.update(train_metrics)
    if do_eval:
        eval_metrics = trainer.evaluate()
        eval_metrics.update({"eval_samples": len(encoded["validation"]), "eval_split": eval_split, "task": task.name})
        if do_train:
            eval_metrics.update({"train_samples": len(encoded["train"]),
                                 "train_runtime": train_result.metrics["train_runtime"]})
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)  # eval_results.json and all_results.json
        metrics.update(eval_metrics)
    if do_predict:
        test = encoded["test"]
        labelled = bool({"label", "labels"} & set(test.column_names))
        output = trainer.predict(test, metric_key_prefix="predict")
        logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
        predict_metrics = {k: v for k, v in output.metrics.items()
                           if labelled or not k.startswith("predict_loss")}
        predict_metrics["predict_samples"] = len(test)
        trainer.log_metrics("predict", predict_metrics)
        trainer.save_metrics("predict", predict_metrics)  # predict_results.json and all_results.json
        if trainer.is_world_process_zero() and token_level:
            _write_token_predictions(output_dir / "predict_results.txt", logits, word_starts, task)
        elif trainer.is_world_process_zero():
            predictions = np.squeeze(logits, -1) if task.regression else np.argmax(logits, axis=-1)
            _write_predictions(output_dir / "predict_results.txt", predictions, task)
        metrics.update(predict_metrics)
    if not do_train:
        return metrics

    data_description = (f"{task.name} from the Hub ({args.dataset_name})" if args.dataset_name else
                        f"{task.name} from {Path(args.train_file).name}") + f", {len(encoded['train'])} training rows"
    single = len(task.text_columns) == 1
    rule = (f"Longer texts keep their first {args.head_fraction:.0%} of tokens and their last tokens (head + tail)."
            if single else "Longer pairs are truncated longest-first.")
    if token_level:
        rule = ("Each word is labelled on its first sub-token; the words of longer sentences past the limit are cut "
                "(neither trained on nor labelled).")
    command = "python scripts/finetune.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    hyper = {"learning rate": training.learning_rate, "epochs": training.num_train_epochs,
             "batch size": training.per_device_train_batch_size * training.gradient_accumulation_steps,
             "warmup (steps, or a share of all steps if < 1)": training.warmup_steps,
             "weight decay": training.weight_decay, "seed": training.seed}
    if token_level:
        hyper["label all sub-tokens"] = args.label_all_tokens
    machine = f"{platform.machine()} {'CUDA' if torch.cuda.is_available() else 'CPU'}, torch {torch.__version__}"
    if trainer.is_world_process_zero():
        dataset_id = args.dataset_name or task.hub_dataset
        write_model_card(output_dir, repo_id=repo_id, config=model.config, base_model=args.model_name_or_path,
                         task=task, metrics=metrics, eval_split=eval_split or "none", dataset_id=dataset_id,
                         command=command, data_description=data_description, truncation_rule=rule,
                         max_seq_length=args.max_seq_length, hyperparameters=hyper, machine=machine,
                         template=Path(args.model_card_template),
                         pipeline_tag="token-classification" if token_level else "text-classification")
        if push:  # uploads the card and the results files with the model
            metrics["hub_commit"] = push_folder(output_dir, repo_id, token=training.hub_token,
                                                private=training.hub_private_repo)
            if do_eval:
                results = json.loads((output_dir / "eval_results.json").read_text())
                results["hub_commit"] = metrics["hub_commit"]
                (output_dir / "eval_results.json").write_text(json.dumps(results, indent=4, sort_keys=True))
    return metrics
