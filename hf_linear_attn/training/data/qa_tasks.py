"""Extractive question answering data at run_qa.py's conventions: SQuAD-format rows (`id`, `question`, `context`,
`answers` {"text": [...], "answer_start": [...]}), checked before training, and encoded as windows over the context
(`--max_seq_length` tokens, consecutive windows sharing `--doc_stride` tokens), each labelled with the token span of
its answer, or with the CLS token where the answer is not wholly inside the window.

SQuAD v1 only: every question of a training or evaluation split has an answer in its context (SQuAD v2's
unanswerable questions are refused, naming the row)."""

import json
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, DatasetDict

from ..errors import UsageError
from .files import (
    TEXT_BUILDERS, check_utf8, describe_error, hold_out_validation, load_hub, load_local, require_text, select_splits,
    split_files,
)


@dataclass(frozen=True)
class QATask:
    """Extractive question answering: a question column, a context column and an answers column (SQuAD's
    {"text": [...], "answer_start": [...]}, the character offsets of each answer in the context)."""

    name: str
    question_column: str = "question"
    context_column: str = "context"
    answers_column: str = "answers"
    hub_dataset: str | None = None
    hub_config: str | None = None
    hub_eval_split: str = "validation"
    metric: str = "squad"  # an `evaluate` metric: SQuAD v1.1 exact match and F1, in percent
    label_names: tuple[str, ...] = ()  # none: read by code shared with the classification tasks
    regression: bool = False

    @property
    def text_columns(self) -> tuple[str, ...]:
        return (self.question_column, self.context_column)


QA_FILE_BUILDERS = ("json", "parquet")  # formats that hold the nested answers; CSV / TSV cannot


def flatten_squad(document: dict) -> list[dict]:
    """The rows of the official SQuAD JSON layout ({"data": [{"title", "paragraphs": [{"context", "qas": [{"id",
    "question", "answers": [{"text", "answer_start"}]}]}]}]}) in the `datasets` squad format, one row a question."""
    rows = []
    for article in document["data"]:
        for paragraph in article.get("paragraphs", []):
            for qa in paragraph.get("qas", []):
                answers = qa.get("answers", [])
                rows.append({"id": str(qa.get("id", "")), "title": article.get("title", ""),
                             "context": paragraph["context"], "question": qa["question"],
                             "answers": {"text": [a["text"] for a in answers],
                                         "answer_start": [a["answer_start"] for a in answers]}})
    return rows


def _read_json_document(path: str) -> Dataset | None:
    """A .json file holding one document: the official SQuAD layout (flattened), {"data": [rows]} (run_qa.py's
    field="data") or a list of rows. None for JSON lines, which `datasets`' json builder reads."""
    check_utf8(path)
    text = Path(path).read_text(encoding="utf-8")
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return None  # JSON lines (or broken JSON: the json builder names the error)
    try:
        if isinstance(document, dict) and isinstance(document.get("data"), list):
            first = document["data"][0] if document["data"] else {}
            rows = flatten_squad(document) if isinstance(first, dict) and "paragraphs" in first else document["data"]
        elif isinstance(document, list):
            rows = document
        else:
            return None
        return Dataset.from_list(rows)
    except Exception as error:  # noqa: BLE001  (a key missing from the nested layout, mixed types, ...)
        raise UsageError(f"could not read {path} as SQuAD JSON: {describe_error(error)}") from error


def read_qa_files(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                  test_file=None) -> DatasetDict:
    """The raw splits of a Hub dataset (e.g. rajpurkar/squad) or of local files: JSON lines or parquet in the
    `datasets` squad format, or a .json file in the official SQuAD layout."""
    if dataset_name is not None:
        return load_hub(dataset_name, dataset_config_name)
    files = split_files(train_file, validation_file, test_file,
                        "SQuAD JSON, JSON lines or parquet: id, question, context, answers per row")
    splits = {}
    for split, path in files.items():
        if TEXT_BUILDERS.get(Path(path).suffix.lower()) not in QA_FILE_BUILDERS:
            if not Path(path).is_file():
                raise UsageError(f"file not found: {path}")
            raise UsageError(f"cannot read {path} for question answering: each row's answers are lists (their texts "
                             "and character offsets), which CSV / TSV / text files cannot hold; write it as JSON "
                             'lines ({"id": "1", "question": "...", "context": "...", "answers": {"text": ["..."], '
                             '"answer_start": [12]}}), parquet, or the official SQuAD JSON')
        document = _read_json_document(path) if Path(path).suffix.lower() == ".json" and Path(path).is_file() else None
        splits[split] = document if document is not None else load_local({split: path}, QA_FILE_BUILDERS)[split]
    return DatasetDict(splits)


def _answer_problem(answers, context: str, answers_column: str) -> str | None:
    """What is wrong with one row's answers, or None."""
    if not isinstance(answers, dict) or not {"text", "answer_start"} <= set(answers):
        return (f"{answers_column!r} is {answers!r}, not SQuAD's {{'text': [...], 'answer_start': [...]}} (the "
                "answer texts and their character offsets in the context)")
    texts, starts = answers["text"], answers["answer_start"]
    if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
        return f"{answers_column!r} needs as many answer_start offsets as answer texts (got {answers!r})"
    if not texts:
        return ("it has no answer: SQuAD v2's unanswerable questions are not supported (SQuAD v1 only); remove such "
                "rows")
    for text, start in zip(texts, starts):
        if not isinstance(text, str) or not text.strip():
            return f"answer {text!r} is not a non-empty text"
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            return f"answer_start {start!r} of {text!r} is not a character offset (an integer from 0)"
        if context[start:start + len(text)] != text:
            found = context.find(text)
            where = (f"; the text first occurs at character {found}" if found >= 0
                     else "; the text does not occur in the context at all")
            return (f"answer {text!r} does not start at character {start} of the context, which holds "
                    f"{context[start:start + len(text)]!r} there{where} (answer_start counts characters from 0)")
    return None


def normalise_qa_rows(part: Dataset, task: QATask, split: str, source: str, labelled: bool) -> Dataset:
    """The split as "id", "question", "context" and, where labelled, "answers" ({"text", "answer_start"} lists),
    checked row by row: texts present, ids unique, each answer found at its offset in the context. Errors name the
    row (counted from 1) of `source`."""
    require_text(part, [task.question_column, task.context_column], split,
                 "every row needs a question and a context; fix or remove those rows")
    ids = [str(i) for i in part["id"]] if "id" in part.column_names else [str(i + 1) for i in range(len(part))]
    seen = {}
    for row, question_id in enumerate(ids):
        if question_id in seen:
            raise UsageError(f"rows {seen[question_id] + 1} and {row + 1} of the {split} data ({source}) share the id "
                             f"{question_id!r}: predictions are keyed by id, so every question needs its own")
        seen[question_id] = row
    contexts, questions = list(part[task.context_column]), list(part[task.question_column])
    columns = {"id": ids, "question": [q.lstrip() for q in questions], "context": contexts}
    if labelled:
        answers = list(part[task.answers_column])
        for row, (row_answers, context) in enumerate(zip(answers, contexts)):
            problem = _answer_problem(row_answers, context, task.answers_column)
            if problem:
                raise UsageError(f"row {row + 1} (id {ids[row]!r}) of the {split} data ({source}): {problem}")
        columns["answers"] = [{"text": list(a["text"]), "answer_start": list(a["answer_start"])} for a in answers]
    return Dataset.from_dict(columns)


def load_qa_data(task: QATask, raw: DatasetDict, dataset_name=None, train_file=None, validation_file=None,
                 test_file=None, validation_split_percentage=10.0, seed=42,
                 splits=("train", "validation")) -> tuple[DatasetDict, str]:
    """Question answering rows (id, question, context and, where the split has them, answers) for each of `splits`,
    and the name of the evaluation split; without validation data (and with train among the splits) it is carved
    from train with the seed. The test split may lack answers (then only predictions are written)."""
    parts, sources, eval_split = select_splits(raw, dataset_name, task.hub_eval_split, splits, train_file,
                                               validation_file, test_file)
    data = {}
    for split, part in parts.items():
        needed = [task.question_column, task.context_column] + ([task.answers_column] if split != "test" else [])
        missing = [c for c in needed if c not in part.column_names]
        if missing:
            raise UsageError(f"the {split} data ({sources[split]}) has no column {missing} for question answering "
                             f"(question and context: --text_columns, default 'question,context'; answers: "
                             f"--label_column, default 'answers'); its columns are {part.column_names}")
        data[split] = normalise_qa_rows(part, task, split, sources[split], task.answers_column in part.column_names)
    data = DatasetDict(data)
    if "validation" in splits and "validation" not in data:
        source = Path(train_file).name if train_file else f"{dataset_name} train"
        eval_split = hold_out_validation(data, validation_split_percentage, seed, source)
    return data, eval_split


def require_offsets(tokenizer, source: str) -> None:
    """An error for a tokenizer without character offsets (a "slow" Python tokenizer): answers are found in the
    tokens through them, and such a tokenizer ignores return_offsets_mapping=True without a word."""
    if not getattr(tokenizer, "is_fast", False):
        raise UsageError(f"the tokenizer from {source} ({type(tokenizer).__name__}) is a slow (Python) tokenizer "
                         "without character offsets, which question answering needs to find each answer's tokens: "
                         "pass a fast tokenizer (a tokenizer.json, as this package's and RoBERTa's are) with "
                         "--tokenizer_name_or_path")


def check_window_room(data: DatasetDict, tokenizer, max_length: int, doc_stride: int) -> None:
    """An error naming the longest question when a window has no more room for context than --doc_stride tokens
    (the tokenizer would stop with a panic): the window is the question, the special tokens and the context."""
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    for split, part in data.items():
        if not len(part):
            continue
        questions = list(part["question"])
        lengths = [len(ids) for ids in tokenizer(questions, add_special_tokens=False, verbose=False)["input_ids"]]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        room = max_length - specials - lengths[longest]
        if room <= doc_stride:
            raise UsageError(
                f"the {split} question {part[longest]['id']!r} is {lengths[longest]} tokens long: with "
                f"{specials} special tokens a window of --max_seq_length {max_length} leaves {room} tokens of context, "
                f"not more than --doc_stride {doc_stride} (the tokens consecutive windows share); raise "
                f"--max_seq_length, lower --doc_stride (below {max(room, 1)}), or shorten that question")


def answer_token_span(offsets, sequence_ids, start_char: int, end_char: int, context_id: int = 1):
    """The (first, last) token of a window holding the answer characters [start_char, end_char), or None when the
    answer is not wholly inside the window's context tokens (sequence id `context_id`)."""
    context = [i for i, s in enumerate(sequence_ids) if s == context_id]
    if not context or offsets[context[0]][0] > start_char or offsets[context[-1]][1] < end_char:
        return None
    first = max(i for i in context if offsets[i][0] <= start_char)
    if offsets[first][1] <= start_char and first + 1 in context:  # the answer starts in the space after a token
        first += 1
    last = min(i for i in context if i >= first and offsets[i][1] >= end_char)
    return first, last


def encode_qa_split(part: Dataset, tokenizer, max_length: int, doc_stride: int, labelled: bool) -> Dataset:
    """The windows of a split: input_ids, attention_mask, "example_index" (its row), "offset_mapping" (each context
    token's characters in the context, None for question and special tokens) and, where labelled,
    "start_positions" / "end_positions" (the answer's tokens; the CLS token, where the loss reads "no answer
    here", when the answer is not wholly inside the window). Rows with several answers are labelled by the first,
    as run_qa.py does; evaluation scores against all."""
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id

    def encode(batch, indices):
        encoded = tokenizer(batch["question"], batch["context"], truncation="only_second", max_length=max_length,
                            stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                            verbose=False)
        rows = encoded.pop("overflow_to_sample_mapping")
        offsets_out, example_index, starts, ends = [], [], [], []
        for window, row in enumerate(rows):
            ids, offsets, sequence_ids = encoded["input_ids"][window], encoded["offset_mapping"][window], \
                encoded.sequence_ids(window)
            example_index.append(indices[row])
            offsets_out.append([list(o) if s == 1 else None for o, s in zip(offsets, sequence_ids)])
            if labelled:
                answers = batch["answers"][row]
                start = answers["answer_start"][0]
                span = answer_token_span(offsets, sequence_ids, start, start + len(answers["text"][0]))
                cls = ids.index(cls_id) if cls_id in ids else 0
                starts.append(span[0] if span else cls)
                ends.append(span[1] if span else cls)
        encoded["offset_mapping"] = offsets_out
        encoded["example_index"] = example_index
        if labelled:
            encoded["start_positions"], encoded["end_positions"] = starts, ends
        return encoded

    return part.map(encode, batched=True, with_indices=True, remove_columns=part.column_names, desc="tokenizing")
