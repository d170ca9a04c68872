"""Fine-tuning tasks of a label (or a number) per text: the GLUE / IMDB presets or any text and label columns,
their splits read and checked, and the texts encoded for the model (head + tail truncation of long single texts)."""

from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, DatasetDict, Value

from ..errors import UsageError
from .files import (
    hold_out_validation, hub_splits, load_hub, load_local, warn_same_file, require_some_text, require_split_sources,
    require_text, split_files,
)


@dataclass(frozen=True)
class Task:
    """A classification (or regression) task: its text columns, label names in GLUE's ClassLabel order, metric and
    Hub location. The four paper tasks are presets (TASKS); `custom_task` builds one from --text_columns /
    --label_column for any other data."""

    name: str
    text_columns: tuple[str, ...]
    label_names: tuple[str, ...]
    label_columns: tuple[str, ...]  # accepted names of the label column; the first is the canonical one
    metric: str  # an `evaluate` metric: "glue" (with the task as config), "accuracy", or "regression" (no module)
    hub_dataset: str | None
    hub_config: str | None
    hub_eval_split: str
    accept_label_ids: bool = True  # labels may be given as 0..n-1 besides their names (presets)
    regression: bool = False  # one real-valued output (MSE loss); label_names is empty


TASKS = {
    "sst2": Task("sst2", ("sentence",), ("negative", "positive"), ("label",), "glue", "nyu-mll/glue", "sst2",
                 "validation"),
    "qnli": Task("qnli", ("question", "sentence"), ("entailment", "not_entailment"), ("label",), "glue",
                 "nyu-mll/glue", "qnli", "validation"),
    "qqp": Task("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), ("label", "is_duplicate"), "glue",
                "nyu-mll/glue", "qqp", "validation"),
    "imdb": Task("imdb", ("text",), ("neg", "pos"), ("label",), "accuracy", "stanfordnlp/imdb", None, "test"),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UsageError(f"unknown task {name!r}: choose one of {sorted(TASKS)}, or leave --task_name out and name "
                         "the columns with --text_columns and --label_column")
    return TASKS[name]


def parse_text_columns(value: str | None) -> tuple[str, ...]:
    """--text_columns "question,sentence" -> ("question", "sentence"): one column, or two for pairs."""
    columns = tuple(c.strip() for c in (value or "").split(",") if c.strip())
    if not 1 <= len(columns) <= 2 or len(set(columns)) != len(columns):
        raise UsageError(f"--text_columns must name one text column or two distinct ones for pairs, separated by "
                         f"a comma (got {value!r}), e.g. --text_columns sentence or --text_columns question,sentence")
    return columns


def custom_task(text_columns: tuple[str, ...], label_column: str, labels, regression: bool,
                dataset_name: str | None = None, dataset_config_name: str | None = None) -> Task:
    """A task over any data: its label names are the distinct values of the label column (sorted: numbers by
    value, text alphabetically), or none for regression."""
    if regression:
        names = ()
    else:
        values = sorted({v for v in labels if v is not None}, key=lambda v: (isinstance(v, str), v))
        names = tuple(str(v) for v in values)
    return Task(dataset_name or "custom", tuple(text_columns), names, (label_column,),
                "regression" if regression else "accuracy", dataset_name, dataset_config_name, "validation",
                accept_label_ids=False, regression=regression)


def _column(dataset: Dataset, name: str) -> list:
    """One column as a list, in one read: iterating ``dataset[name]`` formats row by row (datasets 4+: 3.7 s against
    0.03 s for 70,000 labels, measured), which made every reproduction stage that reads SST-2 pay seconds."""
    return dataset.select_columns([name])[:][name]


def _normalise_labels(dataset: Dataset, task: Task, split: str) -> Dataset:
    """The label column renamed to "label" and mapped to class indices (label names or integers accepted); for
    regression cast to float. Labels all -1 (GLUE's unlabelled test splits) are dropped."""
    column = next(c for c in task.label_columns if c in dataset.column_names)
    if column != "label":
        dataset = dataset.rename_column(column, "label")
    if len(dataset) and all(str(v) == "-1" for v in dataset.unique("label")) and "-1" not in task.label_names:
        return dataset.remove_columns("label")
    if task.regression:
        try:
            values = [float(v) for v in _column(dataset, "label")]
        except (TypeError, ValueError) as error:
            raise UsageError(f"the {split} labels must be numbers for regression: {error}") from error
        return dataset.remove_columns("label").add_column("label", values, feature=Value("float32"))
    lookup = {name: i for i, name in enumerate(task.label_names)}
    if task.accept_label_ids:
        lookup.update({str(i): i for i in range(len(task.label_names))})
    unknown = sorted({str(v) for v in dataset.unique("label")} - set(lookup))
    if unknown:
        accepted = f"0..{len(task.label_names) - 1} nor " if task.accept_label_ids else ""
        raise UsageError(f"the {split} data of {task.name} has labels {unknown[:5]} that are neither "
                            f"{accepted}{list(task.label_names)}")
    labels = [lookup[str(v)] for v in _column(dataset, "label")]
    return dataset.remove_columns("label").add_column("label", labels, feature=Value("int64"))


def read_task_files(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                    test_file=None) -> DatasetDict:
    """The raw splits (train / validation / test, those given) of a Hub dataset or of local files."""
    if dataset_name is not None:
        return load_hub(dataset_name, dataset_config_name)
    files = split_files(train_file, validation_file, test_file, "CSV, TSV, JSON lines or parquet")
    return load_local(files, allowed=("json", "parquet", "csv"))


def load_task_data(task: Task, dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                   validation_split_percentage=10.0, seed=42, test_file=None, splits=("train", "validation"),
                   raw=None) -> tuple[DatasetDict, str]:
    """Rows of `task` (its text columns + "label") for each of `splits` and the name of the evaluation split.

    Hub: `dataset_name` (e.g. nyu-mll/glue with the task as config, stanfordnlp/imdb). Local: GLUE TSV as
    distributed (quoting disabled), JSON lines, CSV or parquet. Without a validation file (and with train among
    the splits) the evaluation split is carved from train with a fixed seed, and the returned name says so. The
    test split may lack labels (then only predictions are written). `raw`: the splits already read.
    """
    if dataset_name is not None:
        hub_config = dataset_config_name if dataset_config_name is not None else task.hub_config
        raw = raw if raw is not None else load_hub(dataset_name, hub_config)
        chosen, eval_name = hub_splits(raw, dataset_name, task.hub_eval_split, splits)
        raw = DatasetDict({s: raw[name] for s, name in chosen.items()})
        eval_split = f"{dataset_name} {eval_name}"
    else:
        given = {"train": train_file, "validation": validation_file, "test": test_file}
        require_split_sources(splits, train_file, validation_file, test_file)
        if raw is None:
            raw = read_task_files(None, None, *(given[s] if s in splits else None
                                                for s in ("train", "validation", "test")))
        raw = DatasetDict({s: raw[s] for s in splits if s in raw})
        eval_split = Path(validation_file).name if validation_file else None
    for split, part in raw.items():
        missing = [c for c in task.text_columns if c not in part.column_names]
        has_label = any(c in part.column_names for c in task.label_columns)
        if missing or (not has_label and split != "test"):
            raise UsageError(
                f"the {split} data of {task.name} needs the columns {list(task.text_columns)} and a label column "
                f"({' or '.join(task.label_columns)}); it has {part.column_names}"
                + ("" if task.accept_label_ids else " (set --text_columns / --label_column)")
            )
    for split, part in raw.items():
        require_text(part, task.text_columns, split, "every row needs its text; fix or remove those rows")
        require_some_text(part, task.text_columns, split)
    if dataset_name is None and "train" in splits and "validation" in splits:
        warn_same_file(train_file, validation_file)
    raw = DatasetDict({s: _normalise_labels(d, task, s) if any(c in d.column_names for c in task.label_columns)
                       else d for s, d in raw.items()})
    raw = DatasetDict({s: d.select_columns([*task.text_columns, *(["label"] if "label" in d.column_names else [])])
                       for s, d in raw.items()})
    if "validation" in splits and "validation" not in raw:
        source = Path(train_file).name if train_file else f"{dataset_name} train"
        eval_split = hold_out_validation(raw, validation_split_percentage, seed, source)
    return raw, eval_split


def source_lengths(rows, task: Task, tokenizer) -> list[int]:
    """Each row's length in tokens before any truncation, special tokens included (what --max_seq_length cuts)."""
    texts = [list(rows[c]) for c in task.text_columns]
    return [len(ids) for ids in tokenizer(*texts, verbose=False)["input_ids"]]


def encode_task(dataset: DatasetDict, task: Task, tokenizer, max_length: int, head_fraction: float = 0.25):
    """Token ids for each row, at most max_length tokens with the tokenizer's special tokens.

    Truncation rule: a single text longer than the budget keeps its first `head_fraction` of the budget and its
    last tokens for the rest (head + tail, Sun et al. 2019: the best rule for long IMDB reviews; a review's verdict
    is often at its end). A pair is truncated longest-first, as in the GLUE baselines.
    """
    probe = tokenizer("a", add_special_tokens=False)["input_ids"]
    framed = tokenizer("a")["input_ids"]
    start = next(i for i in range(len(framed)) if framed[i: i + len(probe)] == probe)
    prefix, suffix = framed[:start], framed[start + len(probe):]
    budget = max_length - len(prefix) - len(suffix)
    if len(task.text_columns) == 2:
        specials = len(tokenizer("a", "a")["input_ids"]) - 2 * len(probe)
        if max_length < specials + 2:
            raise UsageError(f"--max_seq_length {max_length} leaves no room for both texts of a {task.name} pair "
                             f"({specials} special tokens): use at least {specials + 2}, e.g. 128")
    elif budget < 1:
        raise UsageError(f"--max_seq_length {max_length} leaves no room for text ({len(prefix) + len(suffix)} special "
                         f"tokens): use at least {len(prefix) + len(suffix) + 1}, e.g. 128")
    head = int(budget * head_fraction)

    def single(batch):
        rows = tokenizer(batch[task.text_columns[0]], add_special_tokens=False, verbose=False)["input_ids"]
        ids = [prefix + (r if len(r) <= budget else r[:head] + r[len(r) - (budget - head):]) + suffix for r in rows]
        return {"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}

    def pair(batch):
        return tokenizer(batch[task.text_columns[0]], batch[task.text_columns[1]], truncation="longest_first",
                         max_length=max_length)

    encode = single if len(task.text_columns) == 1 else pair
    return dataset.map(encode, batched=True, remove_columns=list(task.text_columns), desc="tokenizing")
