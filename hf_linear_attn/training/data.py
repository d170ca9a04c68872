"""Data for the training scripts: text corpora and tokenizers for pretraining, GLUE / IMDB tasks for fine-tuning.

Every loader takes either a Hub dataset name or local files and returns the same `datasets` objects, so the code
after loading is one path. Bad input (missing files, unknown formats, misnamed columns, unknown labels) raises
`UsageError` with a message that says what is wrong and how to fix it.
"""

import codecs
import csv
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, DatasetDict, Value, load_dataset
from tokenizers import AddedToken, ByteLevelBPETokenizer
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
    files = {split: path for split, path in (("train", train_file), ("validation", validation_file),
                                             ("test", test_file)) if path}
    if not files:
        raise UsageError("no data: pass --dataset_name (Hub) or --train_file / --validation_file / --test_file "
                         "(CSV, TSV, JSON lines or parquet)")
    return _load_local(files, allowed=("json", "parquet", "csv"))


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
        eval_name = task.hub_eval_split if task.hub_eval_split in raw else "validation"
        chosen = {"train": "train", "validation": eval_name, "test": "test"}
        missing = [chosen[s] for s in splits if chosen[s] not in raw and not (s == "validation" and "train" in splits)]
        if missing:
            raise UsageError(f"the Hub dataset {dataset_name!r} has no split {missing}; its splits are {list(raw)}")
        raw = DatasetDict({s: raw[chosen[s]] for s in splits if chosen[s] in raw})
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
    raw = DatasetDict({s: _normalise_labels(d, task, s) if any(c in d.column_names for c in task.label_columns)
                       else d for s, d in raw.items()})
    raw = DatasetDict({s: d.select_columns([*task.text_columns, *(["label"] if "label" in d.column_names else [])])
                       for s, d in raw.items()})
    if "validation" in splits and "validation" not in raw:
        carved = carve_validation(DatasetDict(train=raw["train"]), validation_split_percentage, seed)
        raw["train"], raw["validation"] = carved["train"], carved["validation"]
        source = Path(train_file).name if train_file else f"{dataset_name} train"
        eval_split = f"{validation_split_percentage:g}% of {source} held out (seed {seed})"
    return raw, eval_split


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
