"""Data for the training scripts: text corpora and tokenizers for pretraining, GLUE / IMDB tasks for fine-tuning.

Every loader takes either a Hub dataset name or local files and returns the same `datasets` objects, so the code
after loading is one path. Bad input (missing files, unknown formats, misnamed columns, unknown labels) raises
`UsageError` with a message that says what is wrong and how to fix it.
"""

import codecs
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from datasets import ClassLabel, Dataset, DatasetDict, Value, load_dataset
from tokenizers import AddedToken, ByteLevelBPETokenizer, pre_tokenizers
from tokenizers.processors import RobertaProcessing, TemplateProcessing
from transformers import PreTrainedTokenizerFast

from .errors import UsageError


def refuse_sources_inside(output_dir, sources: dict) -> None:
    """An error when a local input ({flag: path}) is output_dir or inside it: replacing output_dir
    (--overwrite_output_dir) would delete it before it is read."""
    target = Path(output_dir).resolve()
    for flag, source in sources.items():
        if source and Path(source).exists():
            path = Path(source).resolve()
            if path == target or target in path.parents:
                raise UsageError(f"{flag} {source} lies inside --output_dir {output_dir}, which "
                                    "--overwrite_output_dir empties first: copy it elsewhere or choose another "
                                    "--output_dir")


def refuse_same_file(train_file, validation_file) -> None:
    """An error when the validation file is the training file: its scores would measure memorisation, not what the
    model learnt (and the run would report them as validation results without a word)."""
    if train_file and validation_file and Path(train_file).exists() and Path(validation_file).exists():
        if Path(train_file).resolve() == Path(validation_file).resolve():
            raise UsageError(f"--validation_file {validation_file} is the training file: validating on the training "
                             "rows measures memorisation; pass another file, or leave --validation_file out to hold "
                             "out --validation_split_percentage of train")


TEXT_BUILDERS = {".txt": "text", ".tokens": "text", ".raw": "text", ".json": "json", ".jsonl": "json",
                 ".parquet": "parquet", ".tsv": "csv", ".csv": "csv"}


def _builder_for(path: str, allowed: tuple[str, ...]) -> tuple[str, dict]:
    """The `datasets` builder and its options for a local file, chosen by extension."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"file not found: {path}")
    builder = TEXT_BUILDERS.get(file.suffix.lower())
    if builder not in allowed:
        known = sorted(ext for ext, b in TEXT_BUILDERS.items() if b in allowed)
        raise UsageError(f"cannot read {path}: unknown file type {file.suffix!r}; use one of {known}")
    options = {}
    if builder == "csv":
        # GLUE TSVs hold stray double quotes: default quoting merges rows (QNLI dev: 5,267 rows instead of 5,463);
        # "NA" / "null" are real questions in QQP, not missing values.
        options = {"delimiter": "\t" if file.suffix.lower() == ".tsv" else ",", "quoting": csv.QUOTE_NONE,
                   "keep_default_na": False, "na_filter": False}
    return builder, options


def describe_error(error: BaseException) -> str:
    """The innermost cause of an exception chain ("An error occurred while generating the dataset" says nothing)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {error}"


def check_utf8(path: str) -> None:
    """An error naming the line of the first byte that is not UTF-8 (datasets raises UnicodeDecodeError later, from
    wherever the text is first read, or keeps the bytes and fails in the tokenizer)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                where = line + chunk[: error.start].count(b"\n")
                raise UsageError(f"{path} is not UTF-8 text: byte {offset + error.start} (line {where}) is "
                                 f"{chunk[error.start:error.start + 1]!r}; convert the file to UTF-8 (e.g. "
                                 "iconv -f latin1 -t utf-8) or remove that line") from None
            line += chunk.count(b"\n")
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text: it ends inside a multi-byte character (truncated?); convert it "
                         "to UTF-8 or remove the last line") from None


def require_text(dataset: Dataset, columns, split: str, fix: str) -> None:
    """An error when a text column holds anything but strings: nulls, numbers, lists (a JSON file mixing types)."""
    for column in columns:
        feature = dataset.features[column]
        if not (isinstance(feature, Value) and feature.dtype in ("string", "large_string")):
            sample = next((v for v in dataset[column] if not isinstance(v, str)), None)
            raise UsageError(f"the {split} column {column!r} must hold text, but it holds {feature} values "
                             f"(e.g. {sample!r}): {fix}")
        nulls = dataset.data.column(column).null_count
        if nulls:
            first = dataset.data.column(column).to_pylist().index(None)
            raise UsageError(f"the {split} column {column!r} is empty (null) in {nulls} row(s), the first at row "
                             f"{first + 1}: {fix}")


def require_some_text(dataset: Dataset, columns, split: str) -> None:
    """An error when every row's text is empty or blank: a classifier would be trained and scored on the special
    tokens alone, and report an accuracy without a word."""
    if len(dataset) and not any(text.strip() for column in columns for text in dataset[column]):
        raise UsageError(f"every one of the {len(dataset)} {split} rows has empty text in {list(columns)}: nothing to "
                         "learn or score; check the file (its delimiter, its columns) or --text_columns")


def _load_local(files: dict[str, str], allowed: tuple[str, ...]) -> DatasetDict:
    """Load local files (one builder for all splits) into a DatasetDict, wrapping parse errors with the file name."""
    kinds = {split: _builder_for(path, allowed) for split, path in files.items()}
    splits = {}
    for split, path in files.items():  # one split at a time: GLUE's QNLI dev has an index column, its train not
        builder, options = kinds[split]
        if builder != "parquet":
            check_utf8(path)
        try:
            splits[split] = load_dataset(builder, data_files=str(path), split="train", **options)
        except Exception as error:  # datasets wraps pandas / pyarrow / json errors in several exception types
            raise UsageError(f"could not read {path} as {builder}: {describe_error(error)}") from error
    return DatasetDict(splits)


def _load_hub(name: str, config: str | None) -> DatasetDict:
    try:
        return load_dataset(name, config)
    except Exception as error:
        raise UsageError(
            f"could not load the Hub dataset {name!r} (config {config!r}): {describe_error(error)}. Offline, pass "
            "local files with --train_file / --validation_file instead."
        ) from error


def _require_columns(dataset: DatasetDict, columns: tuple[str, ...], what: str) -> None:
    for split, part in dataset.items():
        missing = [c for c in columns if c not in part.column_names]
        if missing:
            raise UsageError(f"the {split} data has no column {missing} for {what}; its columns are "
                                f"{part.column_names}")


def carve_validation(dataset: DatasetDict, percentage: float, seed: int) -> DatasetDict:
    """Split `percentage` % of train off as validation, with a fixed seed (for corpora without a validation split)."""
    if not 0 < percentage < 100:
        raise UsageError(f"validation_split_percentage must be in (0, 100), got {percentage}")
    rows = len(dataset["train"])
    held_out = math.ceil(rows * percentage / 100)  # as datasets rounds test_size up
    if rows - held_out < 1 or held_out < 1:
        # datasets' own message ("With n_samples=1, test_size=0.05 ... the resulting train set will be empty")
        # came as a traceback and named neither the file nor the flags
        raise UsageError(f"the training data has {rows} non-empty row(s): too few to hold out "
                         f"{percentage:g}% for validation and train on the rest; add data, or pass a "
                         "--validation_file")
    parts = dataset["train"].train_test_split(test_size=percentage / 100, seed=seed)
    return DatasetDict(train=parts["train"], validation=parts["test"])


def load_text_corpus(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                     text_column="text", validation_split_percentage=5.0, seed=42) -> tuple[DatasetDict, str]:
    """Train / validation text (non-empty rows of `text_column`) from a Hub dataset or local text / json / parquet.

    Returns the DatasetDict (one column "text") and a description of where the validation split came from.
    """
    if dataset_name is None and train_file is None:
        raise UsageError("no data: pass --dataset_name (a Hub dataset) or --train_file (local text / json / parquet)")
    if dataset_name is not None:
        raw = _load_hub(dataset_name, dataset_config_name)
    else:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        raw = _load_local(files, allowed=("text", "json", "parquet"))
    if "train" not in raw:
        raise UsageError(f"the dataset has no train split (splits: {list(raw)})")
    raw = DatasetDict({split: raw[split] for split in ("train", "validation") if split in raw})
    _require_columns(raw, (text_column,), "the text (set --text_column)")
    raw = raw.select_columns([text_column])
    for split, part in raw.items():
        require_text(part, [text_column], split, "give every row a string (empty lines are skipped) or choose "
                                                  "another --text_column")
    refuse_same_file(train_file, validation_file)  # after the files' own checks, which name the worse problem
    if text_column != "text":
        raw = raw.rename_column(text_column, "text")
    raw = raw.filter(lambda batch: [isinstance(t, str) and t.strip() != "" for t in batch["text"]], batched=True)
    if "validation" in raw:
        return raw, "validation"
    return carve_validation(raw, validation_split_percentage, seed), f"{validation_split_percentage}% of train (seed {seed})"


def train_bpe_tokenizer(lines, vocab_size: int, style: str, model_max_length: int,
                        mask_lstrip: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `lines`: RoBERTa's special tokens (style "roberta") or GPT-2's.

    `mask_lstrip` (style "roberta"; GPT-2's has no mask token): `<mask>` takes the space before it, declared as
    RoBERTa's own tokenizer declares it (lstrip, no rstrip, not normalized). Then "in <mask>" is "in" + `<mask>`,
    the two tokens pretraining shows where it masks "Ġthe" after "in"; without it, it is "in" + "Ġ" + `<mask>`, a
    sequence pretraining never shows, and fill-mask predicts off-distribution. False keeps the tokenizer that the
    recorded reproduction presets were trained with (configs/reproduce: "mask_lstrip"): its tokenizer.json, whose
    digest their records check, stays byte for byte the same. Only added-token matching changes: the vocabulary,
    the merges and the ids of any text without a literal "<mask>" are the same either way.
    """
    bpe = ByteLevelBPETokenizer()
    # a plain string when off: exactly the token (and tokenizer.json) of the tokenizers trained before the option
    mask = AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False, special=True) if mask_lstrip else "<mask>"
    if style == "roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>", mask]
    elif style == "gpt2":
        specials = ["<|endoftext|>", "<pad>"]
    else:
        raise UsageError(f"unknown tokenizer style {style!r}: use 'roberta' or 'gpt2'")
    # the trainer adds the special tokens to the backend with their flags: lstrip lands in tokenizer.json
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2, special_tokens=specials, show_progress=False)
    backend = bpe._tokenizer
    if style == "roberta":
        backend.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
        return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="<pad>", mask_token=mask, cls_token="<s>", sep_token="</s>",
                                       model_max_length=model_max_length)
    # GPT-2 adds no special tokens to a single text; a pair is joined by <|endoftext|> so the model sees the boundary.
    backend.post_processor = TemplateProcessing(single="$A", pair="$A <|endoftext|> $B",
                                                special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<pad>", model_max_length=model_max_length)


def pack_corpus(corpus: DatasetDict, tokenizer, seq_len: int, objective: str) -> DatasetDict:
    """Full-sentence packing: each split's lines, joined by the eos token, cut into rows of exactly seq_len tokens.

    Rows may cross line / document boundaries (RoBERTa's FULL-SENTENCES). Masked-LM rows are <s> + seq_len - 2
    tokens + </s>; causal-LM rows are seq_len tokens of the stream. The tail of each batch of 1000 lines that does
    not fill a row is dropped (as in the Transformers example scripts).
    """
    if tokenizer.eos_token_id is None or (objective == "mlm" and tokenizer.bos_token_id is None):
        raise UsageError("the tokenizer has no eos (and, for masked LM, bos) token to separate and frame rows")
    body = seq_len - 2 if objective == "mlm" else seq_len

    def group(batch):
        stream = []
        for ids in tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(tokenizer.eos_token_id)
        rows = [stream[i: i + body] for i in range(0, len(stream) - body + 1, body)]
        if objective == "mlm":
            rows = [[tokenizer.bos_token_id, *row, tokenizer.eos_token_id] for row in rows]
        return {"input_ids": rows}

    packed = corpus.map(group, batched=True, batch_size=1000, remove_columns=["text"], desc="packing")
    for split, part in packed.items():
        if len(part) == 0:
            raise UsageError(f"the {split} text is shorter than one row of {seq_len} tokens; lower --max_seq_length")
    return packed.with_format("torch")


# ---------------------------------------------------------------------------------------------- fine-tuning tasks

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
            values = [float(v) for v in dataset["label"]]
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
    labels = [lookup[str(v)] for v in dataset["label"]]
    return dataset.remove_columns("label").add_column("label", labels, feature=Value("int64"))


def read_task_files(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                    test_file=None) -> DatasetDict:
    """The raw splits (train / validation / test, those given) of a Hub dataset or of local files."""
    if dataset_name is not None:
        return _load_hub(dataset_name, dataset_config_name)
    files = _split_files(train_file, validation_file, test_file, "CSV, TSV, JSON lines or parquet")
    return _load_local(files, allowed=("json", "parquet", "csv"))


def _split_files(train_file, validation_file, test_file, formats: str) -> dict[str, str]:
    """{split: path} of the files given; an error naming the flags and `formats` when none is."""
    files = {split: path for split, path in (("train", train_file), ("validation", validation_file),
                                             ("test", test_file)) if path}
    if not files:
        raise UsageError(f"no data: pass --dataset_name (Hub) or --train_file / --validation_file / --test_file "
                         f"({formats})")
    return files


def require_split_sources(splits, train_file=None, validation_file=None, test_file=None) -> None:
    """An error naming the flag when a split in use has no local file (validation may be carved from train)."""
    given = {"train": train_file, "validation": validation_file, "test": test_file}
    for split in splits:
        if not given[split] and not (split == "validation" and "train" in splits and train_file):
            flag = {"train": "--train_file", "validation": "--validation_file", "test": "--test_file"}[split]
            why = {"train": "--do_train", "validation": "--do_eval", "test": "--do_predict"}[split]
            raise UsageError(f"{why} needs {split} data: pass {flag} or --dataset_name")


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
        raw = raw if raw is not None else _load_hub(dataset_name, hub_config)
        chosen, eval_name = _hub_splits(raw, dataset_name, task.hub_eval_split, splits)
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
        refuse_same_file(train_file, validation_file)
    raw = DatasetDict({s: _normalise_labels(d, task, s) if any(c in d.column_names for c in task.label_columns)
                       else d for s, d in raw.items()})
    raw = DatasetDict({s: d.select_columns([*task.text_columns, *(["label"] if "label" in d.column_names else [])])
                       for s, d in raw.items()})
    if "validation" in splits and "validation" not in raw:
        source = Path(train_file).name if train_file else f"{dataset_name} train"
        eval_split = hold_out_validation(raw, validation_split_percentage, seed, source)
    return raw, eval_split


def _hub_splits(raw, dataset_name: str, hub_eval_split: str, splits) -> tuple[dict[str, str], str]:
    """({split: the Hub dataset's split it reads} for those of `splits` it has, the evaluation split's name); an
    error for a missing one (a missing validation split is carved from train when train is among `splits`)."""
    eval_name = hub_eval_split if hub_eval_split in raw else "validation"
    names = {"train": "train", "validation": eval_name, "test": "test"}
    missing = [names[s] for s in splits if names[s] not in raw and not (s == "validation" and "train" in splits)]
    if missing:
        raise UsageError(f"the Hub dataset {dataset_name!r} has no split {missing}; its splits are {list(raw)}")
    return {s: names[s] for s in splits if names[s] in raw}, eval_name


def hold_out_validation(data: DatasetDict, percentage: float, seed: int, source: str) -> str:
    """Carve a seeded validation split out of data["train"] in place; its description for the results."""
    carved = carve_validation(DatasetDict(train=data["train"]), percentage, seed)
    data["train"], data["validation"] = carved["train"], carved["validation"]
    return f"{percentage:g}% of {source} held out (seed {seed})"


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


# ------------------------------------------------------------------------------------------ token classification

@dataclass(frozen=True)
class TokenTask:
    """Token classification (named entities, POS tags, chunks): a column of words (a list of strings per row, the
    text already split, as CoNLL files are) and a column with one label per word; label names in id order."""

    name: str
    tokens_column: str
    label_column: str
    label_names: tuple[str, ...]
    hub_dataset: str | None = None
    hub_config: str | None = None
    hub_eval_split: str = "validation"
    accept_label_ids: bool = True  # integer labels are ids into label_names (else they are names themselves)
    metric: str = "seqeval"  # an `evaluate` metric: entity precision / recall / F1 and word accuracy
    regression: bool = False  # never: read by code shared with the sequence tasks

    @property
    def text_columns(self) -> tuple[str, ...]:
        return (self.tokens_column,)


TOKEN_FILE_BUILDERS = ("json", "parquet")  # formats that hold a list per row; CSV / TSV cannot


def read_token_files(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                     test_file=None) -> DatasetDict:
    """The raw splits of a Hub dataset (e.g. conll2003) or of local JSON lines / JSON / parquet files whose rows
    hold a list of words and a list of labels."""
    if dataset_name is not None:
        return _load_hub(dataset_name, dataset_config_name)
    files = _split_files(train_file, validation_file, test_file,
                         "JSON lines or parquet, one sentence a row: a list of words and a list of labels")
    for path in files.values():
        if TEXT_BUILDERS.get(Path(path).suffix.lower()) not in TOKEN_FILE_BUILDERS:
            raise UsageError(f"cannot read {path} for token classification: each row needs a list of words and a "
                             "list of labels, which CSV / TSV / text files cannot hold; write it as JSON lines "
                             '(.json / .jsonl: {"tokens": ["EU", "rejects"], "ner_tags": ["B-ORG", "O"]}) or parquet')
    return _load_local(files, allowed=TOKEN_FILE_BUILDERS)


def _label_feature(dataset: Dataset, column: str):
    """The feature of one element of a list column (ClassLabel for Hub NER sets, Value for JSON), or None."""
    return getattr(dataset.features[column], "feature", None)


def token_label_names(train: Dataset, label_column: str, given: tuple[str, ...] = ()) -> tuple[tuple[str, ...], bool]:
    """The label names of token-classification data and whether integer labels are ids into them: `given`
    (--label_list) if any, else the names of a ClassLabel feature (Hub datasets such as conll2003), else the
    distinct labels of the train split, sorted (as run_ner.py does): text labels are names; integer labels without
    names are named by their own values ("0", "1", ...)."""
    if given:
        return tuple(given), True
    feature = _label_feature(train, label_column)
    if isinstance(feature, ClassLabel):
        return tuple(feature.names), True
    values = {v for row in train[label_column] if isinstance(row, list) for v in row if v is not None}
    if any(isinstance(v, str) for v in values):
        return tuple(sorted(str(v) for v in values)), False
    return tuple(str(v) for v in sorted(values)), False


def _row_problem(words, labels, label_column: str, tokens_column: str, labelled: bool) -> str | None:
    """What is wrong with one row of token-classification data, or None."""
    if not isinstance(words, list):
        return f"{tokens_column!r} is {words!r}, not a list of words"
    for index, word in enumerate(words):
        if not isinstance(word, str) or not word.strip():
            return (f"word {index} of {tokens_column!r} is {word!r}: every word must be non-empty text (an empty "
                    "word gets no token, so no label could be trained or predicted for it)")
    if not labelled:
        return None
    if not isinstance(labels, list):
        return f"{label_column!r} is {labels!r}, not a list of labels"
    if len(labels) != len(words):
        return (f"{len(words)} words in {tokens_column!r} but {len(labels)} labels in {label_column!r} (one label "
                f"per word is needed; the row begins {' '.join(words[:8])!r})")
    return None


def normalise_token_labels(dataset: Dataset, task: TokenTask, split: str, source: str) -> Dataset:
    """The split with its words as "tokens" and, where it has labels, their ids as "labels" (one per word).

    Checked before any training, each error naming the row (counted from 1) of `source`: words that are not a list
    of non-empty strings, a number of labels other than the number of words, labels outside the label names."""
    labelled = task.label_column in dataset.column_names
    words_column, labels_column = dataset[task.tokens_column], dataset[task.label_column] if labelled else None
    lookup = {name: i for i, name in enumerate(task.label_names)}
    ids = []
    unknown, first_unknown = set(), None
    for row, words in enumerate(words_column):
        labels = labels_column[row] if labelled else None
        problem = _row_problem(words, labels, task.label_column, task.tokens_column, labelled)
        if problem:
            raise UsageError(f"row {row + 1} of the {split} data ({source}): {problem}")
        if not labelled:
            continue
        row_ids = []
        for label in labels:
            if task.accept_label_ids and isinstance(label, int) and not isinstance(label, bool):
                found = label if 0 <= label < len(task.label_names) else None
            else:
                found = lookup.get(str(label))
            if found is None:
                unknown.add(label)
                first_unknown = row + 1 if first_unknown is None else first_unknown
            row_ids.append(found)
        ids.append(row_ids)
    if unknown:
        shown = sorted(unknown, key=str)[:8]
        ids_note = f" (or their ids 0..{len(task.label_names) - 1})" if task.accept_label_ids else ""
        raise UsageError(f"the {split} data ({source}) has labels {shown} that are not among the label names "
                         f"{list(task.label_names)}{ids_note}, first in row {first_unknown}: fix the data, or name "
                         "every label with --label_list (in id order) when training")
    columns = {"tokens": [list(words) for words in words_column]}
    if labelled:
        columns["labels"] = ids
    return Dataset.from_dict(columns)


def load_token_data(task: TokenTask, raw: DatasetDict, dataset_name=None, train_file=None, validation_file=None,
                    test_file=None, validation_split_percentage=10.0, seed=42,
                    splits=("train", "validation")) -> tuple[DatasetDict, str]:
    """Rows of a token-classification task ("tokens", and "labels" as ids where the split has labels) for each of
    `splits`, and the name of the evaluation split. As `load_task_data`: a Hub dataset's own splits, or local files;
    without validation data (and with train among the splits) the evaluation split is carved from train with the
    seed. The test split may lack labels (then only predictions are written)."""
    if dataset_name is not None:
        chosen, eval_name = _hub_splits(raw, dataset_name, task.hub_eval_split, splits)
        parts = {s: raw[name] for s, name in chosen.items()}
        sources = {s: f"{dataset_name} {name}" for s, name in chosen.items()}
        eval_split = f"{dataset_name} {eval_name}"
    else:
        require_split_sources(splits, train_file, validation_file, test_file)
        parts = {s: raw[s] for s in splits if s in raw}
        given = {"train": train_file, "validation": validation_file, "test": test_file}
        sources = {s: str(given[s]) for s in parts}
        eval_split = Path(validation_file).name if validation_file else None
    for split, part in parts.items():
        needed = [task.tokens_column] + ([task.label_column] if split != "test" else [])
        missing = [c for c in needed if c not in part.column_names]
        if missing:
            raise UsageError(f"the {split} data ({sources[split]}) has no column {missing} for token classification "
                             f"(words: --text_columns, default 'tokens'; labels: --label_column, default "
                             f"'ner_tags'); its columns are {part.column_names}")
    data = DatasetDict({s: normalise_token_labels(part, task, s, sources[s]) for s, part in parts.items()})
    if "validation" in splits and "validation" not in data:
        source = Path(train_file).name if train_file else f"{dataset_name} train"
        eval_split = hold_out_validation(data, validation_split_percentage, seed, source)
    return data, eval_split


SPLIT_WORDS_PROBE = ["The", "dog", "barked", "twice", "."]


def _splits_words_as_text(tokenizer) -> bool:
    """Whether pre-split words get the tokens that the same words get in running text (each after a space)."""
    split = tokenizer(SPLIT_WORDS_PROBE, is_split_into_words=True, add_special_tokens=False)["input_ids"]
    return split == tokenizer(" " + " ".join(SPLIT_WORDS_PROBE), add_special_tokens=False)["input_ids"]


def prepare_tokenizer_for_words(tokenizer, source: str):
    """The tokenizer, set to tokenize pre-split words as it tokenizes them in running text (checked on a probe).

    A byte-level BPE (RoBERTa's, GPT-2's, this package's) encodes the space before a word ("Ġdog"), and without
    add_prefix_space it tokenizes each pre-split word as if it began the text ("dog"): tokens pretraining rarely
    saw. RoBERTa's and GPT-2's tokenizer classes honour add_prefix_space=True, but the generic tokenizer class of
    this package's tokenizer.json files accepts the argument and ignores it (transformers 5.23), so the flag is set
    on the byte-level pre-tokenizer itself; the tokenizer saved with the fine-tuned model keeps it, and a pipeline
    then tokenizes text the way training did."""
    if _splits_words_as_text(tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    members = [pre]
    if isinstance(pre, pre_tokenizers.Sequence):  # e.g. digits split off before the byte-level step
        members = [pre[i] for i in range(len(json.loads(pre.__getstate__())["pretokenizers"]))]
    byte_level = [m for m in members if isinstance(m, pre_tokenizers.ByteLevel)]
    for member in byte_level:
        member.add_prefix_space = True
    if byte_level:
        # RoBERTa's and GPT-2's classes save the attribute in tokenizer_config.json and rebuild their pre-tokenizer
        # from it when loaded; the generic class reads the flag from tokenizer.json
        tokenizer.add_prefix_space = True
    if not _splits_words_as_text(tokenizer):
        split = tokenizer.convert_ids_to_tokens(tokenizer(SPLIT_WORDS_PROBE, is_split_into_words=True,
                                                          add_special_tokens=False)["input_ids"])
        running = tokenizer.tokenize(" " + " ".join(SPLIT_WORDS_PROBE))
        raise UsageError(f"the tokenizer from {source} tokenizes pre-split words differently from running text "
                         f"({split} for the words {SPLIT_WORDS_PROBE}, {running} for the sentence), and it has no "
                         "byte-level pre-tokenizer whose add_prefix_space could fix that: token classification "
                         "needs a tokenizer that takes pre-split words (is_split_into_words=True); pass one with "
                         "--tokenizer_name_or_path")
    return tokenizer


def continuation_label_ids(label_names) -> list[int]:
    """For each label id, the label of a word's later sub-tokens under --label_all_tokens: I-X for B-X where I-X
    exists (a word inside an entity does not begin it again), the label itself otherwise."""
    index = {name: i for i, name in enumerate(label_names)}
    return [index.get("I-" + name[2:], i) if name.startswith("B-") else i for i, name in enumerate(label_names)]


def align_word_labels(word_ids, labels, label_all_tokens: bool = False, continuation=None) -> list[int]:
    """Word labels spread over sub-tokens (run_ner.py's rule): a word's first sub-token takes its label, special
    tokens -100 (ignored by the loss), later sub-tokens -100 too, or with `label_all_tokens` the word's label
    through `continuation` (B-X -> I-X)."""
    aligned, previous = [], None
    for word in word_ids:
        if word is None:
            aligned.append(-100)
        elif word != previous:
            aligned.append(labels[word])
        else:
            aligned.append(continuation[labels[word]] if label_all_tokens else -100)
        previous = word
    return aligned


def encode_token_task(dataset: DatasetDict, task: TokenTask, tokenizer, max_length: int,
                      label_all_tokens: bool = False) -> DatasetDict:
    """input_ids / attention_mask, "labels" aligned to sub-tokens (where the split has labels) and "word_starts"
    (the position of each word's first sub-token, to read predictions back per word) for each row, at most
    max_length tokens: the words of a longer row past that are cut (neither trained on, scored nor predicted).

    `label_all_tokens` applies to train only: evaluation and predictions stay one label per word (its first
    sub-token), so metrics count words whatever the training rule (run_ner.py scores every labelled sub-token)."""
    if max_length - tokenizer.num_special_tokens_to_add() < 1:
        raise UsageError(f"--max_seq_length {max_length} leaves no room for words "
                         f"({tokenizer.num_special_tokens_to_add()} special tokens): use at least "
                         f"{tokenizer.num_special_tokens_to_add() + 1}, e.g. 128")
    continuation = continuation_label_ids(task.label_names)

    def encode(batch, split, all_tokens):
        encoded = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_length,
                            verbose=False)
        starts, labels = [], []
        for i, words in enumerate(batch["tokens"]):
            word_ids = encoded.word_ids(i)
            firsts = [p for p, w in enumerate(word_ids) if w is not None and (p == 0 or word_ids[p - 1] != w)]
            seen = [word_ids[p] for p in firsts]
            cut = len(encoded["input_ids"][i]) >= max_length
            if seen != list(range(len(seen))) or (not cut and len(seen) != len(words)):
                lost = next(w for w in range(len(words)) if w not in seen)
                # (row numbers are no help here: a carved validation split is a shuffled part of the file)
                raise UsageError(f"the tokenizer gives word {lost} ({words[lost]!r}) of a {split} row no token, so "
                                 f"it could get no label; remove or replace that word (the row begins "
                                 f"{' '.join(words[:8])!r})")
            starts.append(firsts)
            if "labels" in batch:
                labels.append(align_word_labels(word_ids, batch["labels"][i], all_tokens, continuation))
        encoded["word_starts"] = starts
        if "labels" in batch:
            encoded["labels"] = labels
        return encoded

    return DatasetDict({split: part.map(encode, batched=True, remove_columns=part.column_names, desc="tokenizing",
                                        fn_kwargs={"split": split, "all_tokens": label_all_tokens and split == "train"})
                        for split, part in dataset.items()})
