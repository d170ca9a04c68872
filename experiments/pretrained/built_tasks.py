"""The pretrained experiment's tasks built here from real WikiText-2 text (experiments/wikitext_tasks.py): cloze
question answering (SQuAD format, scored by SQuAD exact match / F1) and next-sentence multiple choice (SWAG columns,
four endings, scored by accuracy). Synthetic tasks over real text, not SQuAD or SWAG.

A preset fine-tunes them like the GLUE tasks, through a `configs/finetune/` file that names the task type; their
data is built into the run's output folder (never into the checkout: the text is ../shared/data's), with the
preset's "wikitext_tasks" settings, and the fine-tunes read it from there. Since the stages digest the files they
read, other settings (more rows, another seed) give other data and so rerun the fine-tunes that used it.

Each has a trivial baseline beside the models, the counterpart of the GLUE tasks' majority class: chance (one over
the number of endings) for multiple choice, and for question answering the first name or number of the context (a
run of capitalised words or a number, as the builder picks answers), scored like the models.
"""

import csv
import json
from dataclasses import fields
from pathlib import Path

from experiments.wikitext_tasks import SOURCES, answer_candidates, build_sets
from hf_linear_attn.training.data.choice_tasks import ending_columns_of
from hf_linear_attn.training.errors import UsageError
from hf_linear_attn.training.finetuning_arguments import FinetuneArguments, check_task_type
from hf_linear_attn.training.metrics.squad_scores import squad_scores

from .reproduction_api import ReproductionError, merged_config, resolve

# task -> its task type and where build_sets writes its data (folder and file suffix under the data folder)
BUILT_TASKS = {
    "cloze_qa": {"task_type": "question_answering", "folder": "qa", "suffix": "jsonl"},
    "next_sentence": {"task_type": "multiple_choice", "folder": "choice", "suffix": "csv"},
}
# the preset's "wikitext_tasks" settings and their defaults (build_sets' own)
DEFAULTS = {"data_dir": "../shared/data/wikitext-2", "seed": 0, "qa_rows": [2000, 300], "choice_rows": [2000, 300]}


def task_type(task: str) -> str:
    """The finetune.py --task_type of a preset task (the GLUE tasks classify sequences)."""
    return BUILT_TASKS.get(task, {}).get("task_type", "sequence_classification")


def settings(preset: dict) -> dict:
    """The preset's "wikitext_tasks" settings over the defaults."""
    return {**DEFAULTS, **preset.get("wikitext_tasks", {})}


def check_settings(preset: dict, path, root: Path) -> None:
    """An error naming the fix for bad "wikitext_tasks" settings or a built task's finetune entry, before any stage."""
    given = preset.get("wikitext_tasks", {})
    built = [task for task in preset["finetune"] if task in BUILT_TASKS]
    if given and not built:
        raise ReproductionError(f"{path}: 'wikitext_tasks' builds data for {', '.join(BUILT_TASKS)}, but the preset "
                                "fine-tunes neither; drop it or add those tasks")
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ReproductionError(f"{path}: 'wikitext_tasks' has unknown keys {unknown}; known: {sorted(DEFAULTS)}")
    wanted = settings(preset)
    for key in ("qa_rows", "choice_rows"):
        rows = wanted[key]
        if not (isinstance(rows, list) and len(rows) == 2 and all(isinstance(n, int) and n >= 1 for n in rows)):
            raise ReproductionError(f"{path}: 'wikitext_tasks' {key} must be [training rows, validation rows], two "
                                    f"positive integers (got {rows!r})")
    if not isinstance(wanted["seed"], int):
        raise ReproductionError(f"{path}: 'wikitext_tasks' seed must be an integer (got {wanted['seed']!r})")
    if built:
        data_dir = resolve(wanted["data_dir"], root)
        missing = [name for name in SOURCES.values() if not (data_dir / name).is_file()]
        if missing:
            raise ReproductionError(f"{path}: WikiText-2 not found: {data_dir} lacks {', '.join(missing)} (see "
                                    "../shared/data/README.md, or set 'wikitext_tasks' data_dir)")
    for task in built:
        entry = preset["finetune"][task]
        merged = merged_config(entry, root)
        if merged.get("task_type") != task_type(task):
            raise ReproductionError(f"{path}: the {task} config {entry['config']} must set \"task_type\": "
                                    f"\"{task_type(task)}\" (got {merged.get('task_type')!r})")
        files = [key for key in ("train_file", "validation_file", "dataset_name", "task_name") if key in merged]
        if files:
            raise ReproductionError(f"{path}: {task} is built from WikiText-2 into the output folder, so its entry "
                                    f"and config must not name {', '.join(files)}; set the rows with "
                                    "'wikitext_tasks'")
        # finetune.py's own checks of QA windows and choice columns, now rather than at the task's first stage
        known = {item.name for item in fields(FinetuneArguments)} - {"model_name_or_path"}
        for name, model in preset["models"].items():
            if task not in model.get("tasks", [task]):
                continue
            given = {**merged, **model.get("finetune_args", {})}
            try:
                check_task_type(FinetuneArguments(model_name_or_path=name,
                                                  **{key: value for key, value in given.items() if key in known}))
            except UsageError as error:
                raise ReproductionError(f"{path}: {task} fine-tuning of {name!r}: {error}") from error


def data_folder(output_dir: Path) -> Path:
    return Path(output_dir) / "wikitext_tasks"


def with_data(task: str, entry: dict, output_dir: Path) -> dict:
    """A finetune entry with the built task's train and validation files added to its arguments (others as given)."""
    if task not in BUILT_TASKS:
        return entry
    folder = data_folder(output_dir) / BUILT_TASKS[task]["folder"]
    suffix = BUILT_TASKS[task]["suffix"]
    files = {"train_file": str(folder / f"train.{suffix}"), "validation_file": str(folder / f"validation.{suffix}")}
    return {**entry, "args": {**files, **entry.get("args", {})}}


def build(preset: dict, output_dir: Path, root: Path) -> None:
    """Write the built tasks' data into the output folder, unless it already holds data built with these settings
    (its provenance.json says so): building reads all of WikiText-2, seconds on idle cores."""
    if not any(task in BUILT_TASKS for task in preset["finetune"]):
        return
    wanted = settings(preset)
    data_dir, folder = resolve(wanted["data_dir"], root), data_folder(output_dir)
    provenance = folder / "provenance.json"
    rows = {split: {"qa": wanted["qa_rows"][i], "choice": wanted["choice_rows"][i]} for i, split in enumerate(SOURCES)}
    sources = {split: str(data_dir / name) for split, name in SOURCES.items()}
    if provenance.is_file():
        built = json.loads(provenance.read_text())
        if (built.get("seed"), built.get("rows"), built.get("sources")) == (wanted["seed"], rows, sources):
            return
    print(f"building the WikiText-2 question answering and multiple choice sets into {folder} ...", flush=True)
    build_sets(data_dir, folder, tuple(wanted["qa_rows"]), tuple(wanted["choice_rows"]), wanted["seed"])


def first_candidate(context: str) -> str:
    """The first name or number of a context (a run of capitalised words or a number; its first word aside, as the
    builder never asks for a sentence's first word), or "" where it has none."""
    words = context.split()
    found = answer_candidates(words)
    return " ".join(words[found[0][0]:found[0][1]]) if found else ""


def baseline(task: str, entry: dict, root: Path) -> dict:
    """The trivial baseline of a built task on its validation rows (`entry` with its data files, see `with_data`):
    {"share" (the table's figure, 0-1), "rows", "baseline" (what it is)} and for question answering the exact match
    too; for multiple choice the commonest right position's share of the rows as well (chance is not always hit)."""
    validation = Path(merged_config(entry, root)["validation_file"])
    if BUILT_TASKS[task]["task_type"] == "question_answering":
        rows = [json.loads(line) for line in validation.read_text(encoding="utf-8").splitlines() if line.strip()]
        scores = squad_scores({row["id"]: first_candidate(row["context"]) for row in rows},
                              {row["id"]: row["answers"]["text"] for row in rows})
        return {"share": scores["f1"] / 100, "exact_match": scores["exact_match"] / 100, "rows": len(rows),
                "baseline": "the context's first name or number"}
    with open(validation, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        endings = ending_columns_of(tuple(reader.fieldnames))
        labels = [int(row["label"]) for row in reader]
    return {"share": 1 / len(endings), "rows": len(labels), "baseline": f"chance (1 in {len(endings)})",
            "commonest_position": max(labels.count(value) for value in set(labels)) / len(labels)}
