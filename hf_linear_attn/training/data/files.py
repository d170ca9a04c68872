"""Reading the scripts' data: local files (text, JSON lines, CSV / TSV, parquet) or a Hub dataset, into `datasets`
objects, with the checks every loader shares (UTF-8, text columns, a validation split carved from train).

Every loader takes either a Hub dataset name or local files and returns the same `datasets` objects, so the code
after loading is one path. Bad input (missing files, unknown formats, misnamed columns, unknown labels) raises
`UsageError` with a message that says what is wrong and how to fix it.
"""

import codecs
import csv
import math
from pathlib import Path

from datasets import Dataset, DatasetDict, Value, load_dataset

from ..errors import UsageError


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


def select_splits(raw, dataset_name, hub_eval_split, splits, train_file, validation_file, test_file):
    """(parts, sources, eval_split) of the task readers: each wanted split of ``raw`` (a Hub dataset's own splits,
    the evaluation split by ``hub_eval_split``, or the local files given), where each came from, and the name of the
    evaluation split (None: it will be carved from train). Local files: a split asked for without its file is an
    error, and a validation file that is the training file a warning."""
    if dataset_name is not None:
        chosen, eval_name = hub_splits(raw, dataset_name, hub_eval_split, splits)
        parts = {s: raw[name] for s, name in chosen.items()}
        return parts, {s: f"{dataset_name} {name}" for s, name in chosen.items()}, f"{dataset_name} {eval_name}"
    require_split_sources(splits, train_file, validation_file, test_file)
    parts = {s: raw[s] for s in splits if s in raw}
    given = {"train": train_file, "validation": validation_file, "test": test_file}
    if "train" in splits and "validation" in splits:
        warn_same_file(train_file, validation_file)
    return parts, {s: str(given[s]) for s in parts}, Path(validation_file).name if validation_file else None


def warn_same_file(train_file, validation_file) -> None:
    """A warning when the validation file is the training file: its scores then measure memorisation, not what the
    model learnt, and used to be reported as validation results without a word. Not an error: a smoke test may
    want exactly that."""
    if train_file and validation_file and Path(train_file).exists() and Path(validation_file).exists():
        if Path(train_file).resolve() == Path(validation_file).resolve():
            print(f"warning: --validation_file {validation_file} is the training file: its scores measure "
                  "memorisation, not generalisation; pass another file, or leave --validation_file out to hold out "
                  "--validation_split_percentage of train", flush=True)


TEXT_BUILDERS = {".txt": "text", ".tokens": "text", ".raw": "text", ".json": "json", ".jsonl": "json",
                 ".parquet": "parquet", ".tsv": "csv", ".csv": "csv"}


def builder_for(path: str, allowed: tuple[str, ...], quoting: int = csv.QUOTE_NONE) -> tuple[str, dict]:
    """The `datasets` builder and its options for a local file, chosen by extension. CSV / TSV are read with
    `quoting` (none by default, for GLUE's files; SWAG's CSV files quote fields that hold commas)."""
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
        options = {"delimiter": "\t" if file.suffix.lower() == ".tsv" else ",", "quoting": quoting,
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


def load_local(files: dict[str, str], allowed: tuple[str, ...], quoting: int = csv.QUOTE_NONE) -> DatasetDict:
    """Load local files (one builder for all splits) into a DatasetDict, wrapping parse errors with the file name."""
    kinds = {split: builder_for(path, allowed, quoting) for split, path in files.items()}
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


def load_hub(name: str, config: str | None) -> DatasetDict:
    try:
        return load_dataset(name, config)
    except Exception as error:
        raise UsageError(
            f"could not load the Hub dataset {name!r} (config {config!r}): {describe_error(error)}. Offline, pass "
            "local files with --train_file / --validation_file instead."
        ) from error


def require_columns(dataset: DatasetDict, columns: tuple[str, ...], what: str) -> None:
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


def split_files(train_file, validation_file, test_file, formats: str) -> dict[str, str]:
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


def hub_splits(raw, dataset_name: str, hub_eval_split: str, splits) -> tuple[dict[str, str], str]:
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
