"""Token classification data at run_ner.py's conventions: CoNLL-style rows (a list of words and a list of labels),
their label names, the tokenizer set up for pre-split words, and each word's label on its first sub-token."""

import json
from dataclasses import dataclass
from pathlib import Path

from datasets import ClassLabel, Dataset, DatasetDict
from tokenizers import pre_tokenizers

from ..errors import UsageError
from .files import TEXT_BUILDERS, hold_out_validation, load_hub, load_local, select_splits, split_files


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
        return load_hub(dataset_name, dataset_config_name)
    files = split_files(train_file, validation_file, test_file,
                         "JSON lines or parquet, one sentence a row: a list of words and a list of labels")
    for path in files.values():
        if TEXT_BUILDERS.get(Path(path).suffix.lower()) not in TOKEN_FILE_BUILDERS:
            raise UsageError(f"cannot read {path} for token classification: each row needs a list of words and a "
                             "list of labels, which CSV / TSV / text files cannot hold; write it as JSON lines "
                             '(.json / .jsonl: {"tokens": ["EU", "rejects"], "ner_tags": ["B-ORG", "O"]}) or parquet')
    return load_local(files, allowed=TOKEN_FILE_BUILDERS)


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
    parts, sources, eval_split = select_splits(raw, dataset_name, task.hub_eval_split, splits, train_file,
                                               validation_file, test_file)
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
