"""Multiple choice data at run_swag.py's conventions: SWAG-style rows of a context (`sent1`), the start of the
sentence that follows it (`sent2`, the ending prefix; optional), the candidate endings `ending0` ... `endingN-1` and
the index of the right one (`label`). Each row becomes N (context, prefix + ending) pairs that the model scores
together; the choice with the highest score is its answer."""

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict

from ..errors import UsageError
from .files import hold_out_validation, load_hub, load_local, require_text, select_splits, split_files

ENDING_COLUMN = re.compile(r"^ending(\d+)$")


@dataclass(frozen=True)
class ChoiceTask:
    """Multiple choice: a context column, an optional ending-prefix column, the ending columns (ending0, ending1,
    ...) and a label column holding the index of the right ending."""

    name: str
    context_column: str = "sent1"
    prefix_column: str | None = "sent2"
    ending_columns: tuple[str, ...] = ()
    label_column: str = "label"
    hub_dataset: str | None = None
    hub_config: str | None = None
    hub_eval_split: str = "validation"
    metric: str = "accuracy"  # an `evaluate` metric: the share of rows whose chosen ending is the right one
    label_names: tuple[str, ...] = ()  # none: the labels are ending indices
    regression: bool = False

    @property
    def text_columns(self) -> tuple[str, ...]:
        return (self.context_column,) + ((self.prefix_column,) if self.prefix_column else ())


def read_choice_files(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                      test_file=None) -> DatasetDict:
    """The raw splits of a Hub dataset or of local CSV (SWAG's format, standard quoting), JSON lines or parquet."""
    if dataset_name is not None:
        return load_hub(dataset_name, dataset_config_name)
    files = split_files(train_file, validation_file, test_file,
                        "CSV, JSON lines or parquet: sent1, sent2, ending0..endingN, label per row")
    return load_local(files, allowed=("json", "parquet", "csv"), quoting=csv.QUOTE_MINIMAL)


def ending_columns_of(columns) -> tuple[str, ...]:
    """The ending columns of a split: ending0, ending1, ... without a gap, or an error naming what is there."""
    numbers = sorted(int(m.group(1)) for m in map(ENDING_COLUMN.match, columns) if m)
    if len(numbers) < 2 or numbers != list(range(len(numbers))):
        raise UsageError(f"multiple choice reads the candidate endings from columns ending0, ending1, ... (at least "
                         f"two, numbered from 0 without a gap, as SWAG's); the columns are {list(columns)}")
    return tuple(f"ending{i}" for i in numbers)


def resolve_choice_task(columns: tuple[str, ...] | None, label_column: str | None, raw: DatasetDict,
                        dataset_name=None, dataset_config_name=None) -> ChoiceTask:
    """The task over `columns` (context, or context and ending prefix; default SWAG's sent1, sent2), the ending
    columns found in the first split, and `label_column` (default label)."""
    context, prefix = (columns[0], columns[1] if len(columns) > 1 else None) if columns else ("sent1", "sent2")
    first = next(iter(raw.values()))
    name = f"{dataset_name} multiple choice" if dataset_name else "multiple choice"
    return ChoiceTask(name, context, prefix, ending_columns_of(first.column_names), label_column or "label",
                      dataset_name, dataset_config_name)


def _labels(part: Dataset, task: ChoiceTask, split: str, source: str) -> list[int] | None:
    """The labels of a split as ending indices (None when it has none, or only SWAG's -1 of unlabelled rows)."""
    if task.label_column not in part.column_names:
        return None
    values = list(part[task.label_column])
    if values and all(str(v).strip() == "-1" for v in values):
        return None
    labels = []
    for row, value in enumerate(values):
        text = str(value).strip() if value is not None and not isinstance(value, (bool, float)) else ""
        if not text.lstrip("-").isdigit() or not 0 <= int(text) < len(task.ending_columns):
            raise UsageError(f"row {row + 1} of the {split} data ({source}) has the label {value!r}: a label is the "
                             f"index of the right ending, 0 to {len(task.ending_columns) - 1} for "
                             f"{list(task.ending_columns)} (--label_column names the column)")
        labels.append(int(text))
    return labels


def load_choice_data(task: ChoiceTask, raw: DatasetDict, dataset_name=None, train_file=None, validation_file=None,
                     test_file=None, validation_split_percentage=10.0, seed=42,
                     splits=("train", "validation")) -> tuple[DatasetDict, str]:
    """Rows of "context", "prefix", "endings" (a list) and, where the split has labels, "label" for each of `splits`,
    and the name of the evaluation split (carved from train with the seed when there is no validation data)."""
    parts, sources, eval_split = select_splits(raw, dataset_name, task.hub_eval_split, splits, train_file,
                                               validation_file, test_file)
    data = {}
    for split, part in parts.items():
        needed = [*task.text_columns, *task.ending_columns] + ([task.label_column] if split != "test" else [])
        missing = [c for c in needed if c not in part.column_names]
        if missing:
            raise UsageError(f"the {split} data ({sources[split]}) has no column {missing} for multiple choice "
                             f"(context and ending prefix: --text_columns, default 'sent1,sent2'; labels: "
                             f"--label_column, default 'label'; endings: {list(task.ending_columns)}, as in the "
                             f"first split); its columns are {part.column_names}")
        require_text(part, [*task.text_columns, *task.ending_columns], split,
                     "every row needs its context, ending prefix and endings (an empty prefix is \"\"); fix or "
                     "remove those rows")
        labels = _labels(part, task, split, sources[split])
        if labels is None and split != "test":
            raise UsageError(f"the {split} data ({sources[split]}) has no labels in {task.label_column!r} (only -1): "
                             "training and evaluation need the index of each row's right ending")
        columns = {"context": list(part[task.context_column]),
                   "prefix": list(part[task.prefix_column]) if task.prefix_column else [""] * len(part),
                   "endings": [list(row) for row in zip(*(part[c] for c in task.ending_columns))]}
        if labels is not None:
            columns["label"] = labels
        data[split] = Dataset.from_dict(columns)
    data = DatasetDict(data)
    if "validation" in splits and "validation" not in data:
        source = Path(train_file).name if train_file else f"{dataset_name} train"
        eval_split = hold_out_validation(data, validation_split_percentage, seed, source)
    return data, eval_split


def second_sentence(prefix: str, ending: str) -> str:
    """The second text of a choice: the ending prefix, a space and the ending (the ending alone without a prefix)."""
    return f"{prefix} {ending}" if prefix.strip() else ending


def encode_choice_task(data: DatasetDict, tokenizer, max_length: int) -> DatasetDict:
    """For each row, N encoded pairs (context, prefix + ending): input_ids / attention_mask are lists of N token
    lists, at most max_length tokens each (pairs truncated longest-first, as run_swag.py); "labels" where labelled."""
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    if max_length < specials + 2:
        raise UsageError(f"--max_seq_length {max_length} leaves no room for both texts of a choice ({specials} "
                         f"special tokens): use at least {specials + 2}, e.g. 128")

    def encode(batch):
        counts = [len(endings) for endings in batch["endings"]]
        firsts = [context for context, n in zip(batch["context"], counts) for _ in range(n)]
        seconds = [second_sentence(prefix, ending) for prefix, endings in zip(batch["prefix"], batch["endings"])
                   for ending in endings]
        flat = tokenizer(firsts, seconds, truncation="longest_first", max_length=max_length, verbose=False)
        out, at = {key: [] for key in flat}, 0
        for n in counts:
            for key, values in flat.items():
                out[key].append(values[at:at + n])
            at += n
        if "label" in batch:
            out["labels"] = batch["label"]
        return out

    return DatasetDict({split: part.map(encode, batched=True, remove_columns=part.column_names, desc="tokenizing")
                        for split, part in data.items()})


class ChoiceCollator:
    """Pads every choice of a batch to one length: (batch, choices, n) tensors, with "labels" where the rows have
    them (Transformers' DataCollatorForMultipleChoice requires labels, which a test split may lack)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, rows):
        labels = [row["labels"] for row in rows] if "labels" in rows[0] else None
        choices = len(rows[0]["input_ids"])
        flat = [{key: value[i] for key, value in row.items() if key != "labels"}
                for row in rows for i in range(choices)]
        batch = self.tokenizer.pad(flat, padding=True, return_tensors="pt")
        batch = {key: value.view(len(rows), choices, -1) for key, value in batch.items()}
        if labels is not None:
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch
