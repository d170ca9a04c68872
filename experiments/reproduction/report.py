"""The reproduction's results: collected from the stage records, as results.md (the Linformer paper's Table 2 shape)
and results.png. A difference from the baseline no bigger than the seeds' spread is called that."""

import math
import re
import statistics
from collections import Counter
from pathlib import Path

from hf_linear_attn.training.data import get_task, load_task_data

from .preset import TASK_TITLES, TASKS, ReproductionError, _merged_config

# Linformer paper (Wang et al. 2020), Table 2: dev accuracy (%), RoBERTa-base size, n = 512, 250k pretraining updates
# on BookCorpus + Wikipedia. Only the figures checked against the paper are listed (see ../shared/DESIGN.md).
PAPER_TABLE2 = {
    "RoBERTa-base (Liu et al. 2019)": {"sst2": 93.1, "imdb": 94.1, "qnli": 90.9, "qqp": 90.9, "average": 92.25},
    "Linformer k = 128": {"average": 91.75},
    "Linformer k = 256, shared kv, layerwise": {"average": 92.30},
}


def majority_share(entry: dict, seed: int, root) -> tuple[float, int]:
    """Share of the most frequent label in the evaluation rows a fine-tune of `entry` scores on, and their number."""
    merged = _merged_config(entry, root)
    task = get_task(merged["task_name"])
    data, _ = load_task_data(task, merged.get("dataset_name"), merged.get("dataset_config_name"),
                             merged.get("train_file"), merged.get("validation_file"),
                             merged.get("validation_split_percentage", 10.0), seed)
    rows = data["validation"]
    if merged.get("max_eval_samples") is not None:
        rows = rows.select(range(min(int(merged["max_eval_samples"]), len(rows))))
    labels = list(rows["label"])
    return max(labels.count(value) for value in set(labels)) / len(labels), len(labels)


def _accuracy(metrics: dict) -> float:
    for key in ("eval_accuracy", "accuracy"):
        if key in metrics:
            return 100.0 * metrics[key]
    raise ReproductionError(f"no accuracy among the fine-tune's metrics {sorted(metrics)}")


def collect(preset: dict, stages: list, records: dict) -> dict:
    """The results of every finished stage (missing ones stay None): the table's numbers, seeds and wall times.
    A task's accuracy is the mean over its seeds, once every planned seed has finished."""
    results = {"encoders": {}, "decoders": {}, "tasks": {}, "conversions": {}}
    planned = Counter((s.info["model"], s.info["task"]) for s in stages if s.info["kind"] == "finetune")
    splits = {}
    for stage in stages:
        record = records.get(stage.name)
        kind, model = stage.info["kind"], stage.info["model"]
        if kind in ("conversion", "conversion_train"):
            entry = results["conversions"].setdefault(model, {"from": stage.info["from"], "convert": None})
            if kind == "conversion_train":
                entry["train"] = None if record is None else {
                    "perplexity": record["result"].get("perplexity"), "steps": record["result"].get("steps"),
                    "seconds": record["seconds"]}
            elif record is not None:
                distillation = record["result"].get("distillation") or {}
                entry["convert"] = {"distillation": distillation, "seconds": record["seconds"],
                                    "new_parameters": record["result"].get("new_parameters"),
                                    **{key: (distillation.get(key) or {}).get("perplexity")
                                       for key in ("teacher", "converted", "distilled")}}
            continue
        if kind in ("pretrain", "decoder"):
            group = results["encoders" if kind == "pretrain" else "decoders"]
            entry = group.setdefault(model, {"tasks": {}} if kind == "pretrain" else {})
            if record is None:
                entry["pretrain"] = None
                continue
            train = record["result"]
            entry["pretrain"] = {"perplexity": train.get("perplexity"), "eval_loss": train.get("eval_loss"),
                                 "steps": train.get("steps"), "validation": train.get("validation"),
                                 "parameters": record["parameters"], "seconds": record["seconds"],
                                 "folder": str(stage.folder)}
        else:
            task = stage.info["task"]
            runs = results["encoders"][model]["tasks"].setdefault(task, {"per_seed": {}})
            if record is None:
                continue
            metrics = record["result"]
            runs["per_seed"][str(stage.info["seed"])] = {
                "accuracy": _accuracy(metrics), "f1": 100.0 * metrics["eval_f1"] if "eval_f1" in metrics else None,
                "seconds": record["seconds"]}
            results["tasks"][task] = {"split": metrics.get("eval_split"), "eval_samples": metrics.get("eval_samples"),
                                      "train_samples": metrics.get("train_samples")}
            splits.setdefault(task, {})[metrics.get("eval_split")] = stage.info["seed"]
    for task, names in splits.items():  # rows held out with the seed: one split per seed, the same for every model
        if len(names) > 1:
            results["tasks"][task]["split"] = re.sub(r"\(seed \d+\)", "(a split per fine-tuning seed: "
                                                     + ", ".join(map(str, names.values())) + ")", next(iter(names)))
    for model, entry in results["encoders"].items():
        for task, runs in entry["tasks"].items():
            values = [run["accuracy"] for run in runs["per_seed"].values()]
            runs["accuracy"] = statistics.fmean(values) if len(values) == planned[model, task] else None
            runs["std"] = statistics.stdev(values) if len(values) > 1 and runs["accuracy"] is not None else None
        scores = [entry["tasks"].get(task, {}).get("accuracy") for task in preset["finetune"]]
        entry["average"] = statistics.fmean(scores) if scores and None not in scores else None
        finished = [run["seconds"] for runs in entry["tasks"].values() for run in runs["per_seed"].values()]
        entry["seconds"] = (entry["pretrain"] or {}).get("seconds", 0) + sum(finished)
    base_entry = results["encoders"].get(preset.get("baseline"), {})
    baseline = base_entry.get("average")
    for entry in results["encoders"].values():
        entry["vs_baseline"] = (entry["average"] - baseline
                                if entry.get("average") is not None and baseline is not None else None)
        if entry is not base_entry:
            entry["noise"], entry["one_seed"] = seed_noise(entry, base_entry, list(preset["finetune"]))
    base_ppl = ((results["decoders"].get(preset.get("decoder_baseline")) or {}).get("pretrain") or {}).get("perplexity")
    for entry in results["decoders"].values():
        ppl = (entry.get("pretrain") or {}).get("perplexity")
        entry["vs_baseline"] = ppl / base_ppl if ppl is not None and base_ppl else None
    for entry in results["conversions"].values():
        convert = entry["convert"] or {}
        entry["distilled_vs_teacher"] = (convert["distilled"] / convert["teacher"]
                                         if convert.get("distilled") and convert.get("teacher") else None)
        teacher = ((results["decoders"].get(entry["from"]) or {}).get("pretrain") or {}).get("perplexity")
        trained = (entry.get("train") or {}).get("perplexity")
        entry["trained_vs_teacher"] = trained / teacher if trained and teacher else None
    return results


def seed_noise(entry: dict, baseline: dict, tasks: list[str]) -> tuple[float | None, list[str]]:
    """(noise, tasks with one seed): twice the standard error of (this model's average - the baseline's), from the
    spread of each task's seeds, so that a difference inside it is within seed noise; None, with the tasks that have
    fewer than two seeds on either side, where some spread and so the noise is unknown."""
    variance, single = 0.0, []
    for task in tasks:
        for runs in (entry["tasks"].get(task, {}), baseline.get("tasks", {}).get(task, {})):
            if runs.get("std") is None:
                single.append(task)
                break
            variance += runs["std"] ** 2 / len(runs["per_seed"])
    return (None if single else 2 * math.sqrt(variance) / len(tasks)), single


def _versus(delta, noise, single: list[str]) -> str:
    """The 'vs baseline' cell: the difference, and whether it lies within the seeds' noise."""
    if delta is None:
        return "pending"
    if noise is None:
        return f"{delta:+.2f} pt (noise unknown: one seed on {', '.join(TASK_TITLES[t] for t in single)})"
    return f"{delta:+.2f} pt ({'within' if abs(delta) <= noise else 'beyond'} seed noise ±{noise:.2f})"


def _cell(value, digits=1, suffix="", sign="") -> str:
    return "pending" if value is None else f"{value:{sign}.{digits}f}{suffix}"


def _minutes(seconds) -> str:
    return "pending" if not seconds else f"{seconds / 60:.1f} min"


SPLIT_NAMES = {
    "sst2": "official dev set", "qnli": "official dev set (fine-tuned on a real ~10% train subset)",
    "qqp": "QQP (train subset): 3,000 real train rows held apart (the official dev set is not offline)",
    "imdb": "IMDB has no test split offline: rows of train held out with the seed",
}


def describe_seeds(seeds: dict[str, list[int]]) -> str:
    """'42, 1, 2 (IMDB, QQP); 42 (SST-2, QNLI)', or '42' where every task has the same seeds."""
    groups = {}
    for task, values in seeds.items():
        groups.setdefault(", ".join(map(str, values)), []).append(TASK_TITLES[task])
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{values} ({', '.join(tasks)})" for values, tasks in groups.items())


def describe_machines(meta: dict) -> str:
    """This machine, or every machine the stages ran on where some came from the records of another."""
    machines = meta.get("stage_machines") or [meta["machine"]]
    return machines[0] if len(machines) == 1 else "the stages ran on " + "; ".join(machines)


def render_markdown(preset_name: str, preset: dict, results: dict, meta: dict) -> str:
    tasks = list(preset.get("finetune", {}))
    lines = [f"# Reproduction: preset `{preset_name}`", "", preset.get("description", ""), "",
             f"Command: `{meta['command']}`  ", f"Machine: {describe_machines(meta)}  ",
             *([f"Hardware of the stages: {'; and '.join(meta['hardware'])}  "] if meta.get("hardware") else []),
             (f"Seeds (fine-tuning): {describe_seeds(meta['seeds'])}; pretraining seed: {meta['pretrain_seed']}  "
              if tasks else f"Pretraining seed: {meta['pretrain_seed']}  "),
             f"Wall time of the stages: {_minutes(meta['seconds'])} ({meta['stages_done']}/{meta['stages']} stages "
             "finished)", ""]
    if results["encoders"]:
        title = " | ".join(TASK_TITLES[t] for t in tasks)
        lines += ["## Encoders: accuracy (%) after fine-tuning, in the shape of the Linformer paper's Table 2", "",
                  f"| Model | params | pretrain val MLM ppl | {title} | Average | vs baseline | wall time |",
                  "|---|---:|---:|" + "---:|" * len(tasks) + "---:|---:|---:|"]
        majority = meta.get("majority", {})
        unlearned = False
        if majority:
            shares = [majority[t]["share"] * 100 for t in tasks]
            lines.append("| majority class | | | " + " | ".join(f"{s:.1f}" for s in shares)
                         + f" | {statistics.fmean(shares):.1f} | | |")
        for model, entry in results["encoders"].items():
            pre = entry.get("pretrain") or {}
            cells = []
            for task in tasks:
                runs = entry["tasks"].get(task, {})
                cell = _cell(runs.get("accuracy"))
                if runs.get("std") is not None:
                    cell += f" ± {runs['std']:.1f}"
                share = majority.get(task, {}).get("share")
                if runs.get("accuracy") is not None and share is not None and runs["accuracy"] < share * 100 + 2:
                    cell += " †"
                    unlearned = True
                cells.append(cell)
            lines.append(f"| {model} | {_cell(pre.get('parameters') and pre['parameters'] / 1e6, 2, ' M')} | "
                         f"{_cell(pre.get('perplexity'))} | "
                         + " | ".join(cells) + f" | {_cell(entry.get('average'), 2)} | "
                         + ("baseline" if model == preset["baseline"]
                            else _versus(entry.get("vs_baseline"), entry.get("noise"), entry.get("one_seed", [])))
                         + f" | {_minutes(entry.get('seconds'))} |")
        lines += ["", "± is the standard deviation over fine-tuning seeds; seed noise is twice the standard error of the "
                  "difference of averages, from those spreads: a difference inside it is not a finding."]
        if unlearned:
            lines += ["† less than 2 points above the majority class: at this budget the model has not learned the "
                      "task, and its score says nothing about its attention."]
        lines += ["", "Paper (Table 2: RoBERTa-base size, n = 512, 250k pretraining updates on BookCorpus + Wikipedia, "
                  "dev accuracy; cells not listed are in the paper):", "",
                  "| Paper model | SST-2 | IMDB | QNLI | QQP | Average |", "|---|---:|---:|---:|---:|---:|"]
        for model, row in PAPER_TABLE2.items():
            lines.append(f"| {model} | " + " | ".join(f"{row[t]:.1f}" if t in row else "" for t in TASKS)
                         + f" | {row['average']:.2f} |")
        lines += ["", "Evaluation rows:", ""]
        for task in tasks:
            info = results["tasks"].get(task, {})
            lines.append(f"- {TASK_TITLES[task]}: {SPLIT_NAMES[task]}; evaluated on "
                         f"{info.get('eval_samples', '?')} rows ({info.get('split', '?')}), trained on "
                         f"{info.get('train_samples', '?')} rows")
        lines.append("")
    if results["decoders"]:
        lines += ["## Decoders: causal-LM perplexity on WikiText-2 validation (same size, data, steps and seed)", "",
                  "| Model | params | val perplexity | vs baseline | wall time |", "|---|---:|---:|---:|---:|"]
        for model, entry in results["decoders"].items():
            pre = entry.get("pretrain") or {}
            ratio = ("baseline" if model == preset["decoder_baseline"] else _cell(entry.get("vs_baseline"), 3, "x"))
            lines.append(f"| {model} | {_cell(pre.get('parameters') and pre['parameters'] / 1e6, 2, ' M')} | "
                         f"{_cell(pre.get('perplexity'), 2)} | "
                         f"{ratio} | {_minutes(pre.get('seconds'))} |")
        lines.append("")
    if results.get("conversions"):
        lines += ["## Decoders converted from a pretrained one (scripts/convert.py), then distilled", "",
                  "Perplexities before training further are on the distillation's held-out rows (the teacher's, the "
                  "converted model's before and after distillation, all on the same rows); after training further, on "
                  "the whole validation split, as the decoders above.", "",
                  "| Conversion | from (teacher) | distillation | teacher ppl | converted | distilled | distilled / "
                  "teacher | trained further: ppl | / teacher | wall time |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for model, entry in results["conversions"].items():
            convert, train = entry["convert"] or {}, entry.get("train") or {}
            d = convert.get("distillation") or {}
            budget = (f"{d['steps']} steps x {d['batch_size']} rows of {d['rows']} tokens ({d['mode']})" if d else
                      ("none" if entry["convert"] else ""))
            seconds = (convert.get("seconds") or 0) + (train.get("seconds") or 0)
            steps = f" ({train['steps']} steps)" if train.get("steps") else ""
            trained = _cell(train.get("perplexity"), 2) + steps if "train" in entry else "not asked"
            lines.append(f"| {model} | {entry['from']} | {budget} | {_cell(convert.get('teacher'), 2)} | "
                         f"{_cell(convert.get('converted'), 2)} | {_cell(convert.get('distilled'), 2)} | "
                         f"{_cell(entry.get('distilled_vs_teacher'), 3, 'x')} | {trained} | "
                         f"{_cell(entry.get('trained_vs_teacher'), 3, 'x') if 'train' in entry else ''} | "
                         f"{_minutes(seconds)} |")
        lines.append("")
    return "\n".join(lines)


def plot(preset: dict, results: dict, meta: dict, path: Path) -> bool:
    """Grouped bars: accuracy per task and model (majority class dashed), and decoder perplexities."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    panels = [bool(results["encoders"]), bool(results["decoders"])]
    figure, axes = plt.subplots(1, sum(panels), figsize=(6 * sum(panels) + 2, 4.5), squeeze=False)
    axes = list(axes[0])
    if results["encoders"]:
        axis = axes.pop(0)
        columns = [*preset["finetune"], "average"]
        width = 0.8 / len(results["encoders"])
        for i, (model, entry) in enumerate(results["encoders"].items()):
            values = [entry["tasks"].get(t, {}).get("accuracy") or 0 for t in preset["finetune"]]
            values.append(entry.get("average") or 0)
            axis.bar([c + i * width for c in range(len(columns))], values, width, label=model)
        for c, task in enumerate(preset["finetune"]):
            share = meta.get("majority", {}).get(task, {}).get("share")
            if share:
                axis.hlines(share * 100, c - 0.1, c + 0.9, colors="black", linestyles="dashed")
        axis.set_xticks([c + 0.4 - width / 2 for c in range(len(columns))],
                        [TASK_TITLES.get(c, "Average") for c in columns])
        axis.set_ylim(40, 100)
        axis.set_ylabel("accuracy (%) (dashed: majority class)")
        axis.legend(fontsize=7, loc="upper right")
        axis.set_title("Fine-tuned encoders")
    if results["decoders"]:
        axis = axes.pop(0)
        names = list(results["decoders"])
        values = [((results["decoders"][n].get("pretrain") or {}).get("perplexity") or 0) for n in names]
        axis.bar(range(len(names)), values, color="tab:gray")
        axis.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
        axis.set_ylabel("validation perplexity (lower is better)")
        axis.set_title("Decoders, WikiText-2")
    figure.suptitle(f"{meta['preset']} preset — {meta['machine']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
