"""What a fine-tuning run reads before Trainer starts: the task (a preset, data columns, or a label per word) with
its labels, the model config with a head sized for it, and the tokenizer that fits the model."""

from dataclasses import replace as replace_task

from datasets import ClassLabel, Value
import transformers
from transformers import AutoConfig, AutoTokenizer

from hf_linear_attn import MODEL_FAMILIES, family_of
from hf_linear_attn.families import max_model_length

from .data.choice_tasks import ChoiceTask, resolve_choice_task
from .data.qa_tasks import QATask
from .data.tasks import custom_task, get_task, parse_text_columns
from .data.token_tasks import TokenTask, token_label_names
from .errors import UsageError
from .finetuning_arguments import FinetuneArguments, parse_config_overrides, parse_label_names
from .sources import check_model_source, check_tokenizer_source


def subset(rows, count: int | None, hub: bool, seed: int):
    """At most `count` rows: the first ones of a local file, a seeded random choice from a Hub split (whose order
    is the publisher's: IMDB's train and test are sorted by label, so their first rows are all negative)."""
    if count is None or count >= len(rows):
        return rows
    return (rows.shuffle(seed=seed) if hub else rows).select(range(count))


def read_model_config(args: FinetuneArguments, **overrides):
    """--model_name_or_path's config (with `overrides`, then --config_overrides), or an error naming the folder and
    why it cannot be read."""
    check_model_source(args.model_name_or_path, "--model_name_or_path")
    try:
        config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code,
                                            **overrides)
    except Exception as error:
        raise UsageError(f"cannot read a model config from {args.model_name_or_path}: {error}") from error
    given = parse_config_overrides(args.config_overrides)
    if not given:
        return config
    unknown = [key for key in given if not hasattr(config, key)]
    if unknown:
        raise UsageError(f"--config_overrides names {', '.join(unknown)}, not in {args.model_name_or_path}'s "
                         f"{type(config).__name__}: a misspelt key would change nothing (its dropout settings: "
                         f"{', '.join(k for k in config.to_dict() if 'dropout' in k) or 'none'})")
    try:  # typed as the config's own value (int, float, bool, str), as run_mlm.py's overrides are
        config.update_from_string(",".join(f"{key}={value}" for key, value in given.items()))
    except (ValueError, TypeError) as error:  # a value of the wrong type; a field that is not a number or a word
        raise UsageError(f"--config_overrides: {error}") from error
    return config


def load_tokenizer_and_config(args: FinetuneArguments, task, train: bool = True):
    """The tokenizer and the model config: with a new head sized for `task` when training, the checkpoint's own
    (checked against the task) when only evaluating or predicting."""
    num_labels, label_names = (1, ()) if task.regression else (len(task.label_names), task.label_names)
    source = args.tokenizer_name_or_path or args.model_name_or_path
    if isinstance(task, (QATask, ChoiceTask)):
        # a span head has two outputs (start and end logits), whatever a classification fine-tune left in the
        # config; a choice head has one score per choice, whatever num_labels says
        num_labels = 2 if isinstance(task, QATask) else None
        config = read_model_config(args, num_labels=2) if train and num_labels else read_model_config(args)
    elif train:
        labels = {} if task.regression else {"id2label": dict(enumerate(label_names)),
                                             "label2id": {n: i for i, n in enumerate(label_names)}}
        if not isinstance(task, TokenTask):  # a sequence head's loss reads it; a token head's is cross-entropy
            labels["problem_type"] = "regression" if task.regression else "single_label_classification"
        config = read_model_config(args, num_labels=num_labels, **labels)
    else:
        config = read_model_config(args)
    if not train and num_labels is not None and config.num_labels != num_labels:
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


def resolve_task(args: FinetuneArguments, raw, train: bool):
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


HEADS = {  # --task_type -> (Auto class, the head's name in messages, the architectures' suffix)
    "token_classification": ("AutoModelForTokenClassification", "token-classification", "ForTokenClassification"),
    "question_answering": ("AutoModelForQuestionAnswering", "question-answering", "ForQuestionAnswering"),
    "multiple_choice": ("AutoModelForMultipleChoice", "multiple-choice", "ForMultipleChoice"),
}


def require_head(args: FinetuneArguments) -> None:
    """An error, before any data is read, for a model without the head --task_type needs (this package's decoders
    have no token, span or choice head: a causal model does not see the text after a position)."""
    auto_name, head, _ = HEADS[args.task_type]
    config = read_model_config(args)
    family = family_of(config)
    encoders = sorted(t for t, f in MODEL_FAMILIES.items() if auto_name in f.models)
    if family is not None:
        has_head = auto_name in family.models
    else:
        has_head = (type(config) in getattr(transformers, auto_name)._model_mapping
                    or auto_name in (getattr(config, "auto_map", None) or {}))
    if not has_head:
        kind = f"a {family.kind} ({config.model_type})" if family is not None else f"a {config.model_type} model"
        raise UsageError(f"{args.model_name_or_path} is {kind} without a {head} head: "
                         f"{args.task_type.replace('_', ' ')} needs an encoder of this package "
                         f"({', '.join(encoders)}) or a Transformers model with one (RoBERTa, BERT)")


def require_token_head(args: FinetuneArguments) -> None:
    """`require_head` for token classification (its old name)."""
    require_head(replace_task(args, task_type="token_classification"))


def require_fine_tuned_head(args: FinetuneArguments) -> None:
    """When only evaluating or predicting: an error unless --model_name_or_path was fine-tuned with the head of
    --task_type (a pretrained checkpoint's new head would be random)."""
    _, head, suffix = HEADS[args.task_type]
    config = read_model_config(args)
    if not any(a.endswith(suffix) for a in (config.architectures or [])):
        raise UsageError(f"{args.model_name_or_path} is not fine-tuned for {args.task_type.replace('_', ' ')} (its "
                         f"architectures: {config.architectures}): its {head} head would be random; train it with "
                         "--do_train, or evaluate a checkpoint that fine-tuning wrote")


def resolve_qa_task(args: FinetuneArguments) -> QATask:
    """The question answering task: the question and context columns (--text_columns, default question,context)
    and the answers column (--label_column, default answers)."""
    question, context = parse_text_columns(args.text_columns) if args.text_columns else ("question", "context")
    name = f"{args.dataset_name} question answering" if args.dataset_name else "question answering"
    return QATask(name, question, context, args.label_column or "answers", args.dataset_name,
                  args.dataset_config_name)


def resolve_choice(args: FinetuneArguments, raw) -> ChoiceTask:
    """The multiple choice task: context and ending prefix (--text_columns, default sent1,sent2), the ending
    columns of the data (ending0, ending1, ...) and the label column (--label_column, default label)."""
    columns = parse_text_columns(args.text_columns) if args.text_columns else None
    return resolve_choice_task(columns, args.label_column, raw, args.dataset_name, args.dataset_config_name)


def resolve_token_task(args: FinetuneArguments, raw, train: bool) -> TokenTask:
    """The token-classification task: its words and labels columns, and its label names: --label_list, a
    ClassLabel's names or the train labels when training; the checkpoint's own (config.id2label) otherwise."""
    tokens_column = parse_text_columns(args.text_columns)[0] if args.text_columns else "tokens"
    label_column = args.label_column or "ner_tags"
    given = parse_label_names(args.label_list)
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
