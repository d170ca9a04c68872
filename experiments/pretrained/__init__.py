"""A real pretrained encoder against its conversions (scripts/pretrained.py, configs/pretrained/*.json).

Stock all-MiniLM-L6-v2 (transformers' own BERT classes, softmax attention) against the same weights converted with
scripts/convert.py into Linformers and linear attention (hedgehog distilled before fine-tuning), each fine-tuned
with the same recipe and seeds on SST-2, QNLI, QQP (subset) and IMDB, or on cloze QA and next-sentence multiple
choice built from WikiText-2 (built_tasks.py), and scored beside each task's majority class (or trivial baseline)
and the spread over seeds. The run is a list of stages, each an ordinary subprocess writing its own folder:

    wikitext_tasks/                    the built tasks' data (built_tasks.py), where the preset has them
    convert/<model>[-multiple-choice]/ scripts/convert.py: the converted checkpoint (+ distillation figures)
    finetune/<model>/<task>-seed<S>/   scripts/finetune.py on the stock folder or the converted one
    logs/<stage>.log                   each stage's full output
    results.json, .md, .png            written from the finished stages after every stage
    records.json                       every finished stage's record (arguments, input digests, result; no weights)

With --results_dir (the committed copy) records.json is written there too, and a later run takes from it every
stage finished with the same arguments and inputs, so a fresh clone goes on where the last sitting stopped instead
of running the preset again. A converted model known only from the records is converted again here when one of its
fine-tunes still has to run; its weights must then have the recorded digest.

Stages run seed by seed, task by task (every model's SST-2 at the first seed comes first), so the table fills in
a useful order; a finished stage with the same arguments and inputs is reused, so rerunning the same command goes
on where the last sitting stopped.
"""

import importlib.util
import json
import os
import re
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path

from . import built_tasks
from .reproduction_api import (
    TASK_TITLES, ReproductionError, Stage, describe_machine, describe_machines, finetune_stage, flags, load_records,
    majority_share, merged_config, rerun_upstream, resolve, run_stage, slug, with_outcome, write_records,
)

PRESET_KEYS = {"description", "output_dir", "source", "seeds", "models", "baseline", "convert", "finetune",
               "wikitext_tasks"}
TASK_ORDER = ("sst2", "qnli", "qqp", "imdb", *built_tasks.BUILT_TASKS)
# The head a conversion is written with, by task type: BERT's pooler becomes the sequence classifier's dense layer
# (RoBERTa's head reads it there), while multiple choice scores the encoder's own pooler output, so it needs the
# pooler kept as the pooler. Question answering reads neither (its span head is drawn new at fine-tuning), so it
# shares the multiple-choice conversion: one conversion (one distillation) serves both tasks.
CONVERT_HEADS = {"sequence_classification": "sequence-classification", "question_answering": "multiple-choice",
                 "multiple_choice": "multiple-choice"}
# A model entry: "stock" (the source as it is) or "target" with convert.py's "args" ("distill": with the preset's
# distillation settings); "tasks" limits it to some tasks and "finetune_args" overrides the tasks' fine-tuning
# arguments for it (a model extended past 512 positions fine-tuned at n = 1,024, say). "teacher" names an earlier
# model of the preset: the conversion's source is then that model's own fine-tune at the same task and seed, not the
# pretrained checkpoint (Hedgehog's recipe for a task model: convert the fine-tuned model, distil on the task's
# inputs, fine-tune again), so there is one conversion per task and seed.
# "distill_from_teacher": fine-tune it against the teacher's fine-tune as well (finetune.py --distill_from).
MODEL_KEYS = {"stock", "target", "args", "distill", "tasks", "finetune_args", "teacher", "distill_from_teacher"}


def source_folder(source: dict, root: Path) -> Path:
    """The pretrained checkpoint: a folder (`path`) or the folder inside an installed package (`package`, `folder`);
    an error naming the install command when the package is missing."""
    if "path" in source:
        folder = resolve(source["path"], root)
    else:
        spec = importlib.util.find_spec(source["package"])
        if spec is None or spec.origin is None:
            raise ReproductionError(f"the pretrained checkpoint is not installed: {source['install']}")
        folder = Path(spec.origin).parent / source.get("folder", "")
    if not (folder / "config.json").is_file():
        raise ReproductionError(f"{folder} holds no config.json: install the checkpoint with {source.get('install')}")
    return folder


def load_preset(path: Path, root: Path) -> dict:
    """Read and check a preset: known keys, the baseline among the models, known tasks, existing config files."""
    try:
        preset = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ReproductionError(f"cannot read the preset {path}: {error}") from error
    unknown = set(preset) - PRESET_KEYS
    if unknown:
        raise ReproductionError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(PRESET_KEYS)}")
    if preset.get("baseline") not in preset.get("models", {}):
        raise ReproductionError(f"{path}: the baseline {preset.get('baseline')!r} is not one of its models")
    for task, entry in preset["finetune"].items():
        if task not in TASK_ORDER:
            raise ReproductionError(f"{path}: unknown task {task!r}; use {', '.join(TASK_ORDER)}")
        if not resolve(entry["config"], root).is_file():
            raise ReproductionError(f"{path}: the {task} config {entry['config']} does not exist")
        if task in built_tasks.BUILT_TASKS:
            continue  # its data is built into the output folder (checked below)
        for key in ("train_file", "validation_file"):  # before hours of stages, not at the first fine-tune
            data = merged_config(entry, root).get(key)
            if data is not None and not Path(data).is_file():
                raise ReproductionError(f"{path}: the {task} {key} {data} does not exist; see ../shared/data/README.md "
                                        "or point the config at your copy")
    built_tasks.check_settings(preset, path, root)
    for key in ("train_file", "validation_file"):
        data = preset.get("convert", {}).get(key)
        if data is not None and not resolve(data, root).is_file():
            raise ReproductionError(f"{path}: the distillation {key} {data} does not exist")
    for name, model in preset["models"].items():
        if "target" not in model and not model.get("stock"):
            raise ReproductionError(f"{path}: model {name!r} needs 'target' (linformer, linear_roberta) or 'stock'")
        unknown_keys = set(model) - MODEL_KEYS
        if unknown_keys:
            raise ReproductionError(f"{path}: model {name!r} has unknown keys {sorted(unknown_keys)}; known: "
                                    f"{sorted(MODEL_KEYS)}")
        earlier = list(preset["models"])[: list(preset["models"]).index(name)]
        if model.get("distill_from_teacher") and "teacher" not in model:
            raise ReproductionError(f"{path}: model {name!r} has distill_from_teacher but no 'teacher' to distil from")
        if "teacher" in model and (model["teacher"] not in earlier or "target" not in model):
            raise ReproductionError(f"{path}: model {name!r} has teacher {model['teacher']!r}, which must be a model "
                                    "listed before it (its fine-tunes are the conversion's source), and a 'target'; "
                                    f"the models before it: {earlier}")
        missing = [task for task in model.get("tasks", []) if task not in preset["finetune"]]
        if missing:
            raise ReproductionError(f"{path}: model {name!r} lists tasks {missing} that the preset does not fine-tune; "
                                    f"use some of {', '.join(preset['finetune'])}")
    return preset


def plan(preset: dict, source: Path, output_dir: Path, root: Path, seeds=None, tasks=None, models=None) -> list:
    """Every stage in running order: for each seed, for each task, for each model (its conversion first, one per model
    and conversion head: see CONVERT_HEADS)."""
    seeds = list(seeds or preset["seeds"])
    tasks = [task for task in TASK_ORDER if task in preset["finetune"] and (not tasks or task in tasks)]
    names = [name for name in preset["models"] if not models or name in models or name == preset["baseline"]]
    stages, converted, finetuned = [], {}, {}
    for seed in seeds:
        for task in tasks:
            entry = built_tasks.with_data(task, preset["finetune"][task], output_dir)
            head = CONVERT_HEADS[built_tasks.task_type(task)]
            for name in names:
                model = preset["models"][name]
                if task not in model.get("tasks", [task]):
                    continue
                folder = source
                if model.get("teacher"):  # from the teacher's fine-tune at this task and seed
                    teacher = finetuned.get((model["teacher"], task, seed))
                    if teacher is not None:
                        teacher.info["upstream"] = True  # its record keeps its weights' digest (with_outcome)
                    else:
                        raise ReproductionError(f"model {name!r} converts {model['teacher']!r}'s {task} fine-tune at "
                                                f"seed {seed}, which this run does not plan; add it to --models")
                    folder, key = output_dir / "convert" / slug(name) / f"{task}-seed{seed}", (name, head, task, seed)
                    title, conversion_source = f"convert {name} on {TASK_TITLES[task]} (seed {seed})", teacher.folder
                elif not model.get("stock"):
                    # the sequence-classification conversion keeps its first name and folder (the committed runs')
                    default = head == CONVERT_HEADS["sequence_classification"]
                    folder = output_dir / "convert" / (slug(name) if default else f"{slug(name)}-{head}")
                    key, conversion_source = (name, head), source
                    title = f"convert {name}" + ("" if default else f" ({head} head)")
                if not model.get("stock") and key not in converted:
                    given = {**(preset.get("convert", {}) if model.get("distill") else {}), **model.get("args", {})}
                    args = {flag: value for flag, value in given.items() if value is not None}
                    held_in = _held_in_rows(name, model, args, task, entry, seed, output_dir, root)
                    if held_in is not None:
                        args["train_file"] = str(held_in["path"])
                    argv = ["--model_name_or_path", str(conversion_source), "--target", model["target"],
                            "--head", head, "--output_dir", str(folder), *flags(args)]  # null: the preset's left out
                    converted[key] = Stage(title, "scripts/convert.py", folder, argv, "conversion_report.json",
                                           output_dir, root, {"kind": "convert", "model": name,
                                                              **({"task": task, "seed": seed} if model.get("teacher")
                                                                 else {}),
                                                              **({"held_in": held_in} if held_in else {})})
                    stages.append(converted[key])
                    if model.get("teacher"):  # how much of the teacher's task the conversion alone keeps
                        stages.append(_evaluate_stage(name, task, entry, folder, seed, output_dir, root))
                tuned = {**entry, "args": {**entry.get("args", {}), **model.get("finetune_args", {})}}
                if model.get("distill_from_teacher"):  # the teacher's class probabilities as well as the labels
                    tuned["args"]["distill_from"] = str(teacher.folder)
                stages.append(finetune_stage(name, task, tuned, folder, seed, output_dir, root))
                finetuned[name, task, seed] = stages[-1]
    return stages


def _held_in_rows(name: str, model: dict, args: dict, task: str, entry: dict, seed: int, output_dir: Path,
                  root: Path) -> dict | None:
    """Where a conversion distils on the very file whose held-out rows score the task (IMDB: 10% of train.jsonl held
    out by the fine-tuning seed), the file it reads instead: the task's training rows without those held-out rows,
    written by `write_held_in_rows` before the stages run. Distilling on the held-out texts would fit the student to
    the teacher on the very rows it is scored on (no labels, but the teacher's view of them). A conversion shared by
    every seed cannot leave out each seed's rows: refused, with the fix."""
    train_file = args.get("train_file")
    if not train_file:
        return None
    config = merged_config(entry, root)
    carved = not config.get("validation_file") and not config.get("dataset_name")
    if not carved or resolve(train_file, root).resolve() != resolve(config["train_file"], root).resolve():
        return None
    if not model.get("teacher"):
        raise ReproductionError(
            f"model {name!r} distils on {train_file}, the file {TASK_TITLES[task]}'s evaluation rows are held out "
            "of (by each fine-tuning seed), in a conversion shared by every seed: it would distil on the rows it is "
            "scored on. Give it a 'teacher' (one conversion per task and seed, which leaves that seed's held-out rows "
            "out), or distil on another text (train_file).")
    return {"path": output_dir / "distill-data" / f"{task}-seed{seed}-train-rows.jsonl", "seed": seed,
            "config": config}


def write_held_in_rows(stages: list) -> None:
    """The files `_held_in_rows` names, each written once: the task's training rows as the fine-tune splits them at
    that seed (load_task_data, the same hold-out), as JSON lines of the task's text columns."""
    from hf_linear_attn.training.data.tasks import get_task, load_task_data

    for stage in stages:
        spec = stage.info.get("held_in")
        if spec is None or spec["path"].is_file():
            continue
        config = spec["config"]
        task = get_task(config["task_name"])
        data, _ = load_task_data(task, None, None, config["train_file"], None,
                                 config.get("validation_split_percentage", 10.0), spec["seed"])
        spec["path"].parent.mkdir(parents=True, exist_ok=True)
        partial = spec["path"].with_suffix(".partial")
        with partial.open("w") as out:
            for row in data["train"]:
                out.write(json.dumps({column: row[column] for column in task.text_columns}) + "\n")
        partial.replace(spec["path"])  # whole or absent: a stopped write is not taken as the file


def _evaluate_stage(name: str, task: str, entry: dict, model_folder: Path, seed: int, output_dir: Path,
                    root: Path) -> Stage:
    """Scores the converted model as it is, before fine-tuning (finetune.py --do_eval with the task's settings): for
    a model converted from its teacher's fine-tune the head is the teacher's, so this is what conversion and
    distillation alone keep of the teacher's score."""
    tuned = finetune_stage(name, task, entry, model_folder, seed, output_dir, root)
    folder = output_dir / "evaluate" / slug(name) / f"{task}-seed{seed}"
    argv = [*tuned.argv[: tuned.argv.index("--output_dir")], "--output_dir", str(folder), "--do_eval", "True",
            *tuned.argv[tuned.argv.index("--output_dir") + 2:]]
    return Stage(f"evaluate {name} before fine-tuning on {TASK_TITLES[task]} (seed {seed})", "scripts/finetune.py",
                 folder, argv, "eval_results.json", output_dir, root,
                 {"kind": "evaluate", "model": name, "task": task, "seed": seed})


def _scores(result: dict, task: str) -> dict:
    """A fine-tune's scores in percent, the table's figure first: {"accuracy"}, or for question answering SQuAD's
    {"f1", "exact_match"} (finetune.py writes those in percent already). By the task, not by the keys: QQP's GLUE
    metric writes an F1 (of the duplicate class) beside its accuracy."""
    if built_tasks.task_type(task) == "question_answering":
        return {"f1": float(result["eval_f1"]), "exact_match": float(result["eval_exact_match"])}
    return {"accuracy": 100 * float(result.get("eval_accuracy", result.get("accuracy")))}


def _length_split(result: dict):
    """(N, accuracy within N tokens, beyond N, (rows within, rows beyond)) from a fine-tune's results written with
    --eval_length_split N; None without it. Accuracies in percent; a part with no rows has None."""
    found = [re.fullmatch(r"eval_rows_beyond_(\d+)", key) for key in result]
    split = next((int(m.group(1)) for m in found if m), None)
    if split is None:
        return None
    score = [result.get(f"eval_accuracy_{part}_{split}") for part in ("within", "beyond")]
    return (split, *(None if x is None else 100 * float(x) for x in score),
            (int(result[f"eval_rows_within_{split}"]), int(result[f"eval_rows_beyond_{split}"])))


def collect(preset: dict, stages: list, records: dict) -> dict:
    """{model: {"tasks": {task: {"scores", "seeds", "mean", "std"}}, "conversion": ..., "seconds"}} from records.
    Scores are accuracies, or F1 for question answering, whose cells also hold "metric": "f1" and the exact match
    ("exact_match": a score per seed, "exact_match_mean")."""
    results = {name: {"tasks": {}, "conversion": None, "seconds": 0.0} for name in preset["models"]}
    for stage in stages:
        record = records.get(stage.name)
        if record is None:
            continue
        entry = results[stage.info["model"]]
        entry["seconds"] += record.get("seconds", 0.0)
        if stage.info["kind"] == "evaluate":
            entry.setdefault("before_finetuning", {}).setdefault(stage.info["task"], []).append(
                next(iter(_scores(record["result"], stage.info["task"]).values())))
            continue
        if stage.info["kind"] == "convert":
            report = record["result"]
            if entry["conversion"] is not None:  # converted per task and seed (a teacher): the others' figures too
                entry["conversion"].setdefault("more", []).append(
                    {"task": stage.info.get("task"), "seed": stage.info.get("seed"),
                     "distillation": report.get("distillation")})
                continue
            entry["conversion"] = {"new_parameters": report["new_parameters"],
                                   "copied_parameters": report["copied_parameters"],
                                   "distillation": report.get("distillation"),
                                   "task": stage.info.get("task"), "seed": stage.info.get("seed")}
            continue
        task = entry["tasks"].setdefault(stage.info["task"], {"scores": [], "seeds": []})
        scores = _scores(record["result"], stage.info["task"])
        task["scores"].append(next(iter(scores.values())))
        task["seeds"].append(stage.info["seed"])
        if record.get("curve") and built_tasks.task_type(stage.info["task"]) == "sequence_classification":
            task.setdefault("curves", {})[stage.info["seed"]] = [
                (point["step"], 100 * point["eval_accuracy"], point["eval_loss"]) for point in record["curve"]
                if "eval_accuracy" in point]
        split = _length_split(record["result"])
        if split is not None:  # finetune.py --eval_length_split: the long rows scored apart
            parts = task.setdefault("by_length", {"split": split[0], "within": [], "beyond": [], "rows": []})
            for key, value in zip(("within", "beyond", "rows"), split[1:]):
                parts[key].append(value)  # per seed: the held-out rows, and so the counts, can differ by seed
        if "exact_match" in scores:
            task.update(metric="f1", exact_match=[*task.get("exact_match", []), scores["exact_match"]])
    for entry in results.values():
        for task in entry["tasks"].values():
            task["mean"] = statistics.fmean(task["scores"])
            task["std"] = statistics.stdev(task["scores"]) if len(task["scores"]) > 1 else None
            if "exact_match" in task:
                task["exact_match_mean"] = statistics.fmean(task["exact_match"])
    return results


def _average_and_noise(entry: dict, baseline: dict, tasks: list[str]):
    """(average over `tasks`, its difference to the baseline, seed noise): twice the standard error of the difference
    of the two averages, from each task's spread over seeds; noise None where a task has a single seed."""
    if not all(task in entry["tasks"] and task in baseline["tasks"] for task in tasks) or not tasks:
        return None, None, None
    average = statistics.fmean(entry["tasks"][task]["mean"] for task in tasks)
    delta = average - statistics.fmean(baseline["tasks"][task]["mean"] for task in tasks)
    variance = 0.0
    for task in tasks:
        for side in (entry, baseline):
            cell = side["tasks"][task]
            if cell["std"] is None:
                return average, delta, None
            variance += cell["std"] ** 2 / len(cell["scores"])
    return average, delta, 2 * (variance ** 0.5) / len(tasks)


def _load_note(loads: dict) -> str:
    """Whether other work shared the cores: the 5-minute load average when each stage ended, against the threads the
    stage ran with (`{"load": x, "threads": t}`; a bare number, as older runs wrote, against every core: their stages
    ran one thread per core). A stage of one thread beside another job's ends at a load of about 2 on 2 cores, which
    the cores alone would not tell apart from a stage of two threads on idle cores."""
    if not loads:
        return "load not recorded"
    cores = os.cpu_count() or 1
    entries = [(x["load"], x["threads"]) if isinstance(x, dict) else (x, cores) for x in loads.values()]
    low, high = min(load for load, _ in entries), max(load for load, _ in entries)
    shared = "shared with other work" if any(load > threads + 0.5 for load, threads in entries) else "otherwise idle"
    threads = sorted({t for _, t in entries})
    return (f"{shared} (5-minute load average {low:.1f}-{high:.1f} at the stages' ends, {cores} cores, "
            f"{'/'.join(map(str, threads))} torch thread{'s' if threads != [1] else ''} a stage)")


def stage_threads(record: dict | None) -> int:
    """The torch threads a stage ran with, from its record's machine line ("..., 1 torch threads, ..."); every core
    where the record does not say."""
    match = re.search(r"(\d+) torch threads", (record or {}).get("machine", ""))
    return int(match.group(1)) if match else (os.cpu_count() or 1)


def _cell(cell: dict, exact_match=None) -> str:
    """A score (mean over seeds, ± their spread, how many); question answering's F1 with its exact match."""
    spread = f" ± {cell['std']:.1f}" if cell.get("std") is not None else ""
    seeds = len(cell.get("scores", []))
    if exact_match is None:
        return f"{cell['mean']:.1f}{spread}" + (f" ({seeds} seeds)" if seeds > 1 else "")
    return f"{cell['mean']:.1f}{spread} (EM {exact_match:.1f}" + (f"; {seeds} seeds)" if seeds > 1 else ")")


def _floor(task: str, majority: dict) -> str:
    """The trivial baseline's cell: the majority class or chance (%), question answering's F1 with exact match."""
    if task not in majority:
        return ""
    figure = majority[task]
    return _cell({"mean": 100 * figure["share"]},
                 100 * figure["exact_match"] if "exact_match" in figure else None)


def _distillation_cell(d: dict) -> str:
    """A conversion's distillation in one table cell: the distance before, after calibrating a window's factor (where
    it was), after distilling; the steps; the last hidden state's cosine with the source (where recorded)."""
    distances = [f"{d['distance_before']:.4f}"]
    if d.get("distance_calibrated") is not None:
        distances.append(f"{d['distance_calibrated']:.4f} (window factor calibrated)")
    distances.append(f"{d['distance_after']:.4f}")
    steps = f"{d['steps']} steps" + (f", then {d['output_steps']} end to end" if d.get("output_steps") else "")
    cell = f"{d['mode']}: {' -> '.join(distances)} ({steps}, {d['seconds']:.0f} s)"
    if d.get("output_cosine_before") is not None:
        cell += (f"; last hidden state's cosine with the source {d['output_cosine_before']:.3f} -> "
                 f"{d['output_cosine_after']:.3f}")
    return cell


def _conversion_name(conversion: dict) -> str:
    """'IMDB seed 42: ', naming one of a teacher model's conversions (one per task and seed) in its table cell."""
    return f"{TASK_TITLES.get(conversion['task'], conversion['task'])} seed {conversion['seed']}: "


def _finetune_recipe(preset: dict) -> str:
    """What the Machine line says of the fine-tunes' arithmetic: float32, or bf16 autocast for the tasks whose args
    ask for it, and any config changes (--config_overrides) they make."""
    entries = {task: preset["finetune"][task].get("args", {}) for task in TASK_ORDER if task in preset["finetune"]}
    bf16 = [TASK_TITLES[task] for task, args in entries.items() if args.get("bf16")]
    text = "fine-tuning in float32"
    if bf16:
        text = "fine-tuning in bf16 autocast" + ("" if len(bf16) == len(entries)
                                                  else f" ({', '.join(bf16)}; float32 for the other tasks)")
    overrides = sorted({args["config_overrides"] for args in entries.values() if args.get("config_overrides")})
    return text + (f", model config changed for the fine-tune: {'; '.join(overrides)}" if overrides else "")


def _curve_lines(results: dict, tasks: list[str]) -> list[str]:
    """The section of accuracies during fine-tuning (stages that evaluated every eval_steps), or nothing."""
    rows = [(name, task, seed, curve) for name, entry in results.items() for task in tasks
            for seed, curve in entry["tasks"].get(task, {}).get("curves", {}).items()]
    if not rows:
        return []
    steps = sorted({step for *_, curve in rows for step, _, _ in curve})
    lines = ["", "## Accuracy (%) during fine-tuning", "",
             "Each fine-tune's scores on its evaluation rows at every evaluation (eval loss in brackets), from its "
             "trainer_state.json; the learning rate's decay is spread over the whole run, so a score at an earlier "
             "step is not that of a shorter run.", "",
             "| Model | task | seed | " + " | ".join(f"step {step:,}" for step in steps) + " |",
             "|---|---|---|" + "---:|" * len(steps)]
    for name, task, seed, curve in rows:
        at = {step: f"{accuracy:.1f} ({loss:.3f})" for step, accuracy, loss in curve}
        lines.append(f"| {name} | {TASK_TITLES[task]} | {seed} | " + " | ".join(at.get(step, "") for step in steps)
                     + " |")
    return lines


def _by_length_lines(results: dict, tasks: list[str]) -> list[str]:
    """The section of accuracies by input length (stages run with --eval_length_split), or nothing."""
    cells = {(name, task): entry["tasks"][task]["by_length"] for name, entry in results.items() for task in tasks
             if "by_length" in entry["tasks"].get(task, {})}
    if not cells:
        return []

    def mean(scores):
        scores = [x for x in scores if x is not None]
        return f"{statistics.fmean(scores):.1f}" if scores else "(no rows)"

    lines = ["", "## Accuracy (%) by input length", "",
             "The evaluation rows up to N tokens (before truncation, special tokens included) and those beyond N "
             "scored apart (finetune.py --eval_length_split N); a model that reads more than N tokens differs from "
             "one cut at N only on the rows beyond. Mean over the seeds done.", "",
             "| Model | task | rows within N / beyond N | within N | beyond N | all rows |",
             "|---|---|---|---:|---:|---:|"]
    def counts(values):  # one count, or the range over the seeds
        return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"

    for (name, task), parts in cells.items():
        within, beyond = (counts([rows[i] for rows in parts["rows"]]) for i in (0, 1))
        lines.append(f"| {name} | {TASK_TITLES[task]} | {within} / {beyond} (N = {parts['split']:,}) | "
                     f"{mean(parts['within'])} "
                     f"| {mean(parts['beyond'])} | {results[name]['tasks'][task]['mean']:.1f} |")
    return lines


def render_markdown(preset_name: str, preset: dict, results: dict, meta: dict) -> str:
    tasks = [task for task in TASK_ORDER if task in preset["finetune"]]
    # a preset of classification tasks only keeps its table as it was: accuracy, and the majority class as the floor
    classes_only = all(built_tasks.task_type(task) == "sequence_classification" for task in tasks)
    answers = any(built_tasks.task_type(task) == "question_answering" for task in tasks)
    baseline = results[preset["baseline"]]
    done = [task for task in tasks if all(task in entry["tasks"] for name, entry in results.items()
                                          if task in preset["models"][name].get("tasks", tasks))]
    lines = [
        f"# A real pretrained encoder and its conversions: preset `{preset_name}`", "",
        preset.get("description", ""), "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {_machines_text(meta)}; {_finetune_recipe(preset)}  ",
        f"Cores: {_load_note(meta.get('loads', {}))}  ",
        f"Source checkpoint: {meta['source']}  ",
        f"Seeds (fine-tuning): {', '.join(map(str, meta['seeds']))}  ",
        f"Wall time of the stages: {meta['seconds'] / 60:.1f} min ({meta['stages_done']}/{meta['stages']} stages "
        "finished)", "",
        "## Accuracy (%) after fine-tuning" if not answers else
        "## Scores (%) after fine-tuning: accuracy; question answering: F1 (exact match)", "",
        "| Model | " + " | ".join(TASK_TITLES[t] for t in tasks) + " | Average (tasks every model has) | vs baseline "
        "| wall time |",
        "|---|" + "---:|" * (len(tasks) + 3),
        f"| {'majority class' if classes_only else 'trivial baseline'} | "
        + " | ".join(_floor(t, meta["majority"]) for t in tasks) + " | | | |",
    ]
    for name, entry in results.items():
        cells = []
        for task in tasks:
            cell = entry["tasks"].get(task)
            cells.append("" if cell is None else _cell(cell, cell.get("exact_match_mean")))
        average = _average_and_noise(entry, baseline, done)[0]
        # against the baseline on every task both have finished (a partial run still reads), named where it is not
        # the average's set
        shared = [task for task in tasks if task in entry["tasks"] and task in baseline["tasks"]]
        _, delta, noise = _average_and_noise(entry, baseline, shared)
        if name == preset["baseline"]:
            versus = "baseline"
        elif delta is None:
            versus = ""
        else:
            on = "" if shared == done else f"on {', '.join(TASK_TITLES[t] for t in shared)} "
            versus = f"{delta:+.2f} pt {on}" + (
                f"(seed noise ± {noise:.2f}: {'beyond' if abs(delta) > noise else 'within'})"
                if noise is not None else "(noise unknown: one seed)")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'' if average is None else f'{average:.2f}'} | "
                     f"{versus} | {entry['seconds'] / 60:.1f} min |")
    lines += ["", "± is the standard deviation over fine-tuning seeds; seed noise is twice the standard error of the "
              "difference of averages, from those spreads: a difference inside it is not a finding. The average "
              f"covers the tasks every model has finished ({', '.join(TASK_TITLES[t] for t in done) or 'none yet'}); "
              "the difference to the baseline covers the tasks both have finished (named where they are fewer).",
              *(["", "The trivial baseline, on the same validation rows: " + "; ".join(
                  f"{TASK_TITLES[t]}: {meta['majority'][t].get('baseline', 'the majority class')}"
                  for t in tasks if t in meta["majority"]) + "."
                  + (" Question answering's figure is SQuAD's F1 (its exact match beside it); the average and the "
                     "difference to the baseline take that F1." if answers else "")] if not classes_only else []),
              *_curve_lines(results, tasks),
              *_by_length_lines(results, tasks),
              "", "## Conversions", "",
              "| Model | target options | copied parameters | new parameters | distillation (distance before -> after) |",
              "|---|---|---:|---:|---|"]
    for name, entry in results.items():
        model = preset["models"][name]
        if model.get("stock"):
            continue
        conversion = entry["conversion"]
        options = ", ".join(f"{k}={v}" for k, v in model.get("args", {}).items() if v is not None)
        if conversion is None:
            lines.append(f"| {name} | {model['target']}: {options} | (not yet) | | |")
            continue
        distillation = conversion["distillation"]
        distilled = _distillation_cell(distillation) if distillation else "none"
        if conversion.get("seed") is not None:  # a teacher model: one conversion per task and seed, each named
            distilled = _conversion_name(conversion) + distilled
        for other in conversion.get("more", []):
            if other["distillation"]:
                distilled += "; " + _conversion_name(other) + _distillation_cell(other["distillation"])
        if entry.get("before_finetuning"):
            distilled += "; before fine-tuning: " + ", ".join(
                f"{TASK_TITLES[task]} {statistics.fmean(scores):.1f}" + (f" ({len(scores)} seeds)" if len(scores) > 1
                                                                         else "")
                for task, scores in entry["before_finetuning"].items())
        lines.append(f"| {name} | {model['target']}: {options} | {conversion['copied_parameters']:,} | "
                     f"{conversion['new_parameters']:,} | {distilled} |")
    if meta.get("failed"):
        lines += ["", "Failed stages (rerun the command to retry them; each one's output is in logs/):", ""]
        lines += [f"- {name}: {why}" for name, why in meta["failed"].items()]
    lines += ["", "Evaluation rows:", ""]
    for task in tasks:
        rows = meta["majority"].get(task, {}).get("rows")
        commonest = meta["majority"].get(task, {}).get("commonest_position")
        where = f"; the commonest right position holds {100 * commonest:.1f}% of them" if commonest else ""
        lines.append(f"- {TASK_TITLES[task]}: {rows} rows ({preset['finetune'][task].get('note', '')}{where})")
    lines += ["", "Plot: results.png (each model's mean score per task, one standard deviation over seeds, every "
              f"seed's score as a dot, the {'majority class' if classes_only else 'trivial baseline'} dashed)."]
    return "\n".join(lines)


def plot_points(preset: dict, results: dict) -> list[dict]:
    """What results.png draws, panel by panel: each model's finished score on each task (mean, spread over seeds
    where there are two or more, every seed's own score)."""
    tasks = [task for task in TASK_ORDER if task in preset["finetune"]]
    return [{"task": task, "model": name, "mean": cell["mean"], "std": cell.get("std"), "scores": cell["scores"]}
            for task in tasks for name, entry in results.items()
            if (cell := entry["tasks"].get(task)) is not None and cell.get("mean") is not None]


def plot(preset: dict, results: dict, meta: dict, path: Path) -> bool:
    """results.png: one panel per task, a bar per model at its mean score with the spread over seeds (one standard
    deviation) and each seed's score as a dot, and the task's majority class (or trivial baseline) dashed: the
    table's figures, drawn. Without matplotlib (the 'test' / 'benchmarks' extras) it says so and draws nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no results.png (pip install matplotlib)")
        return False
    points = plot_points(preset, results)
    tasks = list(dict.fromkeys(p["task"] for p in points)) or ["none"]
    models = [name for name in results if any(p["model"] == name for p in points)]  # those with a score
    figure, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks) + 2.5, 1.2 + 0.32 * len(models)),
                                squeeze=False, sharey=True)
    colours = plt.get_cmap("tab10")
    for axis, task in zip(axes[0], tasks):
        rows = {p["model"]: p for p in points if p["task"] == task}
        for y, model in enumerate(models):
            p = rows.get(model)
            if p is None:
                continue
            axis.barh(y, p["mean"], color=colours(y % 10), alpha=0.75,
                      xerr=p["std"] if p["std"] else None, capsize=3)
            axis.plot(p["scores"], [y] * len(p["scores"]), "k.", markersize=4)
        floor = meta.get("majority", {}).get(task, {}).get("share")
        if floor:
            axis.axvline(floor * 100, color="black", linestyle="--", linewidth=1)
        axis.set_yticks(range(len(models)), models, fontsize=6)
        axis.set_ylim(max(len(models), 1) - 0.5, -0.5)  # the first model on top, the same rows in every panel
        axis.set_xlim(40, 100)
        axis.set_title(TASK_TITLES.get(task, task), fontsize=9)
        axis.set_xlabel("score (%); dashed: " + ("majority class" if built_tasks.task_type(task) ==
                                                 "sequence_classification" else "trivial baseline"), fontsize=7)
    figure.subplots_adjust(wspace=0.08)
    figure.savefig(path, dpi=110, bbox_inches="tight")  # the long model names kept whole
    plt.close(figure)
    return True


def machines_of(records: dict) -> list[str]:
    """One text per machine the recorded stages ran on: its name, and the instruction sets and matmul peaks its own
    records hold ("instruction sets not recorded" for stages recorded before they were)."""
    from benchmarks.measuring import hardware_of_records

    by_machine = {}
    for record in records.values():
        if record.get("machine"):
            by_machine.setdefault(record["machine"], []).append(record)
    return [f"{machine} ({'; '.join(hardware_of_records(group)) or 'instruction sets not recorded'})"
            for machine, group in sorted(by_machine.items())]


def _machines_text(meta: dict) -> str:
    """The report's machine line: each machine the stages ran on beside its own instruction sets; a report written
    before the records were grouped so (no "machines") says what it said: the machines, then the sets of the machine
    that wrote it."""
    machines = meta.get("machines")
    if not machines:
        return f"{describe_machines(meta)}; {meta.get('cpu_features', 'unknown')}"
    return ("the stages ran on " if len(machines) > 1 else "") + "; and on ".join(machines)


def cpu_features() -> str:
    """The instruction-set extensions that decide CPU speed here (bf16 / AMX / AVX-512 / AVX2), from /proc/cpuinfo."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    wanted = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
    return ", ".join(flag for flag in wanted if flag in flags) or "none of " + ", ".join(wanted)


def _majority(preset: dict, seeds: list[int], root: Path, cache: Path, output_dir: Path) -> dict:
    """{task: {"share", "rows"}}: the commonest label's share of the evaluation rows, averaged over the seeds (IMDB's
    held-out rows follow the seed); for the tasks built from WikiText-2 their trivial baseline instead
    (built_tasks.baseline, on the data built into `output_dir`). Reading the data takes minutes on busy cores, so it
    is kept in `cache`, keyed by the task entries and seeds it was computed for (and the built data's settings)."""
    keyed = {"finetune": preset["finetune"], "seeds": seeds}
    if any(task in built_tasks.BUILT_TASKS for task in preset["finetune"]):
        keyed["wikitext_tasks"] = built_tasks.settings(preset)
    key = json.dumps(keyed, sort_keys=True)
    if cache.is_file():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["majority"]
    majority = {}
    for task, entry in preset["finetune"].items():
        if task in built_tasks.BUILT_TASKS:  # one validation set whatever the seed
            majority[task] = built_tasks.baseline(task, built_tasks.with_data(task, entry, output_dir), root)
            continue
        shares = [majority_share(entry, seed, root) for seed in seeds]
        majority[task] = {"share": statistics.fmean(share for share, _ in shares), "rows": shares[0][1]}
    cache.write_text(json.dumps({"key": key, "majority": majority}, indent=2))
    return majority


def run(preset_path: Path, root: Path, output_dir=None, seeds=None, tasks=None, models=None, dry_run=False,
        report_only=False, max_stages=None, argv=None, results_dir=None, records_file=None) -> dict:
    """Run (or reuse) the preset's stages in order, rewriting results.json / results.md after each one (in the
    output folder, and in `results_dir` too when given: the committed copy, e.g. results/pretrained/cpu).

    `seeds`, `tasks` and `models` choose which stages run (a slice); the report always covers every finished stage
    of the whole preset, at its seeds and any others given, so a slice run with --results_dir adds its scores to the
    committed table instead of replacing the table with the slice's. Finished stages are also taken from
    `records_file` (default: results_dir/records.json where it exists), an earlier run's records."""
    preset = load_preset(preset_path, root)
    preset_name = Path(preset_path).stem
    source = source_folder(preset["source"], root)
    output_dir = Path(output_dir or resolve(preset.get("output_dir", f"outputs/pretrained/{preset_name}"), root))
    output_dir = output_dir if output_dir.is_absolute() else Path.cwd() / output_dir
    stages = plan(preset, source, output_dir, root, seeds, tasks, models)
    launcher = [sys.executable]
    if dry_run:
        for stage in stages:
            print(shlex.join([*launcher, stage.script, *stage.argv]))
        return {}
    records_file = records_file or (Path(results_dir) / "records.json" if results_dir else None)
    archive = load_records(records_file) if records_file and Path(records_file).is_file() else {}
    output_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM); rerun the same command to continue"))
    # the command that runs what the table covers: a rerun of the report (--report_only) is the same table
    command = "python scripts/pretrained.py " + shlex.join(
        a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--report_only", "--plot_only"))
    seeds_used = list(dict.fromkeys([*preset["seeds"], *(seeds or [])]))  # the report's: the preset's and any more
    # every stage the report covers: the slice's, and the preset's others at those seeds, finished earlier or not
    whole = plan(preset, source, output_dir, root, seeds_used) if (seeds or tasks or models) else stages
    built_tasks.build(preset, output_dir, root)  # the WikiText-2 tasks' data, before their baseline and fine-tunes
    write_held_in_rows(whole)  # distillation text without the held-out rows, before stages are matched
    majority = _majority(preset, seeds_used, root, output_dir / "majority.json", output_dir)
    records, ran = {}, 0
    loads_file = output_dir / "loads.json"  # stage -> 5-minute load average when it ended: were the cores shared?
    loads = json.loads(loads_file.read_text()) if loads_file.is_file() else {}

    def report() -> dict:
        results = collect(preset, whole, records)
        meta = {"preset": preset_name, "command": command, "machine": describe_machine(),
                "stage_machines": sorted({r["machine"] for r in records.values() if r.get("machine")}),
                "machines": machines_of(records),
                "source": str(preset["source"].get("package", source)), "seeds": seeds_used, "majority": majority,
                "seconds": sum(r.get("seconds", 0.0) for r in records.values()), "stages": len(whole),
                "stages_done": len(records), "failed": failed, "cpu_features": cpu_features(),
                "loads": {name: {"load": load, "threads": stage_threads(records[name])}
                          for name, load in loads.items() if name in records},
                "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        markdown = render_markdown(preset_name, preset, results, meta)
        for folder in [output_dir] + ([Path(results_dir)] if results_dir and keeps_committed(results_dir) else []):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.json").write_text(json.dumps({"meta": meta, "models": results}, indent=2))
            (folder / "results.md").write_text(markdown + "\n")
            plot(preset, results, meta, folder / "results.png")
            # the records of the stages outside this run (other seeds) that the archive holds are kept
            write_records(whole, records, folder, {key: r for key, r in archive.items() if key not in planned})
        return {"meta": meta, "models": results, "markdown": markdown}

    def keeps_committed(folder) -> bool:
        """Whether writing the table into `folder` keeps every finished stage of the table already there: an output
        folder that lacks stages the committed table has (another --output_dir, a fresh clone) must not erase them."""
        committed = Path(folder) / "results.json"
        done = json.loads(committed.read_text())["meta"].get("stages_done", 0) if committed.is_file() else 0
        if done > len(records):
            print(f"not rewriting {committed}: it counts {done} finished stages, {output_dir} holds {len(records)} "
                  "of them; pass the --output_dir the stages ran in", flush=True)
            return False
        return True

    failed = {}  # stage name -> why; its fine-tunes are skipped, the rest go on (a rerun retries them)
    # the stages whose weights a later stage starts from: conversions, and the fine-tunes a teacher's conversion reads
    producers = {str(stage.folder): stage for stage in whole
                 if stage.info["kind"] == "convert" or stage.info.get("upstream")}
    planned = {stage.key for stage in whole}
    known, vouched = {}, set()  # converted folder key -> weight digest known only from the archive; those relied on

    def finished(stage):
        """The stage's record: from its folder here, else from the archive (its upstream digests as recorded)."""
        record = stage.finished()
        if record is not None:
            return with_outcome(stage, record)
        record = stage.recorded(archive, known) if archive else None
        if record is not None:
            vouched.update(key for key in record["inputs"] if key in known)
            if "output_digest" in record and not any(stage.folder.glob("*.safetensors")):
                known[stage.key] = record["output_digest"]
        return record

    def upstreams_of(stage):
        """The stages whose weights `stage` reads: the one it starts from (a conversion, a teacher's fine-tune) and a
        teacher it distils from."""
        return [producers[arg] for arg in stage.argv if arg in producers and producers[arg] is not stage]

    def restore(stage, number):
        """Run again, furthest upstream first, the stages whose weights `stage` needs but this run knows only from
        the records (a teacher's fine-tune, then the conversion of it)."""
        for upstream in upstreams_of(stage):
            if upstream.key not in known:
                continue
            restore(upstream, number)
            print(f"[{number}/{len(stages)}] {upstream.name} again (known here only from the records) ...",
                  flush=True)
            records[upstream.name] = rerun_upstream(
                upstream, launcher, known, vouched,
                "pass another --results_dir (or --records) to run the preset afresh", run=run_stage)

    # every stage's record, read once and in order (a conversion's recorded digest precedes its fine-tunes); every
    # finished stage counts in the report from the start, the slice's own included, so that a slice's first report
    # does not count fewer stages than the committed table and leave it unwritten until the slice's last stage
    found = {stage.name: finished(stage) for stage in whole}
    records.update((name, record) for name, record in found.items() if record is not None)
    for number, stage in enumerate(stages, 1):
        record = found[stage.name]
        if record is None and (report_only or (max_stages is not None and ran >= max_stages)):
            continue
        if record is None and any(upstream.name in failed for upstream in upstreams_of(stage)):
            continue
        if record is None:
            try:
                restore(stage, number)
                print(f"[{number}/{len(stages)}] {stage.name} ...", flush=True)
                record, _ = run_stage(stage, launcher)
            except ReproductionError as error:
                failed[stage.name] = str(error).splitlines()[0]
                print(f"    FAILED: {error}", flush=True)
                continue
            ran += 1
            loads[stage.name] = round(os.getloadavg()[1], 2)
            loads_file.write_text(json.dumps(loads, indent=1))
            print(f"    done ({record['seconds']:.0f} s)", flush=True)
        records[stage.name] = record
        if not report_only:
            report()
    final = report()
    print(final["markdown"])
    print(f"Wrote {output_dir / 'results.json'} and results.md")
    return final
