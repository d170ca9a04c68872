"""Fine-tuning scores across runs (scripts/pretrained.py --combine): one table of the seeds several folders hold.

A table covers the stages of its own folder. Seeds added later run into folders of their own (`--results_dir
results/pretrained/cpu-sst2-seed2 --seeds 2`), often on another machine, so the figure a goal is judged by (a model's
mean over every seed, against the baseline's) was joined by hand. This module reads each folder's results.json,
joins every model's scores on every task by seed, and writes per task each seed's score, the mean and spread, the
difference to the baseline with its seed noise (as the preset's own table computes them) and the gap seed by seed
where both models ran the same seed, with the folders and machines the seeds came from. It refuses folders of
another preset or source checkpoint, and a seed whose two folders disagree on its score: one seed has one score.
"""

import json
import shlex
import statistics
from pathlib import Path

from hf_linear_attn.training.errors import UsageError

from . import TASK_ORDER, _average_and_noise, load_preset, machines_of, plot
from .reproduction_api import TASK_TITLES, find_preset

SAME = 1e-9  # two folders' scores for one seed agree when they differ by less (the runs write them identically)


def _read(folder: Path) -> dict:
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise UsageError(f"{folder}: no results.json: --combine reads folders written by scripts/pretrained.py "
                         "--results_dir (e.g. results/pretrained/cpu); name another folder")
    written = json.loads(path.read_text())
    if "meta" not in written or "models" not in written:
        raise UsageError(f"{path} is not a pretrained results file (no 'meta' / 'models'): name another folder")
    return written


def combine(folders: list[Path]) -> tuple[dict, list[dict], dict]:
    """(models, sources, meta): `models` in collect()'s shape ({model: {"tasks": {task: {"scores", "seeds", "mean",
    "std", "folders"}}}}), each task's seeds in the order first met; `sources` per folder its machine, instruction
    sets, command and what it added; `meta` the first folder's preset, source and majority classes."""
    if len(folders) < 2:
        raise UsageError("--combine joins two or more results folders (e.g. results/pretrained/cpu "
                         "results/pretrained/cpu-sst2-seed2): name them all")
    models, sources, first = {}, [], None
    for folder in map(Path, folders):
        written = _read(folder)
        meta = written["meta"]
        if first is None:
            first = meta
        for key in ("preset", "source"):
            if meta.get(key) != first.get(key):
                raise UsageError(f"{folder} is of {key} {meta.get(key)!r}, {folders[0]} of {first.get(key)!r}: "
                                 "scores of other recipes or checkpoints are not seeds of one model; combine the "
                                 "folders of one preset")
        added, again = {}, {}
        for name, entry in written["models"].items():
            for task, cell in entry.get("tasks", {}).items():
                if cell.get("metric") == "f1":
                    raise UsageError(f"{folder}: {name} on {task} is scored by F1 with an exact match: --combine "
                                     "joins the classification tasks' accuracies only")
                joined = models.setdefault(name, {"tasks": {}})["tasks"].setdefault(
                    task, {"scores": [], "seeds": [], "folders": []})
                for seed, score in zip(cell["seeds"], cell["scores"]):
                    if seed in joined["seeds"]:
                        at = joined["seeds"].index(seed)
                        if abs(joined["scores"][at] - score) > SAME:
                            raise UsageError(
                                f"{name} on {TASK_TITLES.get(task, task)} at seed {seed}: {joined['scores'][at]:.2f} "
                                f"in {joined['folders'][at]}, {score:.2f} in {folder}. One seed has one score: leave "
                                "out one of the folders (or rerun the seed in one place)")
                        # the same score again: the seed rerun elsewhere (a check that the machines agree), or a
                        # stage a folder reused; it counts once, and the sources table says where it agreed
                        again.setdefault(name, {}).setdefault(task, []).append(seed)
                        continue
                    joined["scores"].append(score)
                    joined["seeds"].append(seed)
                    joined["folders"].append(str(folder))
                    added.setdefault(name, {}).setdefault(task, []).append(seed)
        records = Path(folder) / "records.json"  # each machine beside its own instruction sets, where recorded
        machines = meta.get("machines") or (machines_of(json.loads(records.read_text())["stages"])
                                            if records.is_file() else [])
        sources.append({"folder": str(folder), "machine": meta.get("machine", "unknown"),
                        "stage_machines": meta.get("stage_machines", []), "machines": machines,
                        "cpu_features": meta.get("cpu_features", "unknown"), "command": meta.get("command", ""),
                        "written": meta.get("written", ""), "added": added, "again": again})
    for entry in models.values():
        for cell in entry["tasks"].values():
            cell["mean"] = statistics.fmean(cell["scores"])
            cell["std"] = statistics.stdev(cell["scores"]) if len(cell["scores"]) > 1 else None
    return models, sources, {"preset": first.get("preset"), "source": first.get("source"),
                             "majority": first.get("majority", {})}


def paired_gap(cell: dict, baseline: dict):
    """(mean, standard deviation, seeds) of the model's score minus the baseline's, seed by seed, over the seeds
    both ran: the same data order and the same new head's start on both sides, so the seed's own luck cancels.
    (None, None, []) where they share no seed."""
    shared = [seed for seed in cell["seeds"] if seed in baseline["seeds"]]
    gaps = [cell["scores"][cell["seeds"].index(s)] - baseline["scores"][baseline["seeds"].index(s)] for s in shared]
    if not gaps:
        return None, None, []
    return statistics.fmean(gaps), statistics.stdev(gaps) if len(gaps) > 1 else None, shared


def _seed_list(seeds_of: dict) -> str:
    """'MiniLM: SST-2 seeds 42, 1; IMDB seed 42': which seeds of which model and task a folder holds."""
    return "; ".join(f"{name}: " + ", ".join(f"{TASK_TITLES.get(task, task)} seed{'s' if len(seeds) > 1 else ''} "
                                             f"{', '.join(map(str, seeds))}" for task, seeds in tasks.items())
                     for name, tasks in seeds_of.items())


def render_markdown(models: dict, sources: list[dict], meta: dict, baseline: str, command: str) -> str:
    tasks = [task for task in TASK_ORDER if any(task in entry["tasks"] for entry in models.values())]
    lines = [f"# A real pretrained encoder and its conversions, seeds joined: preset `{meta['preset']}`", "",
             "Every seed's score that the folders below hold, joined by model, task and seed (a seed two folders "
             "both hold counts once: their scores agree, or the join is refused). Source checkpoint: "
             + str(meta["source"]) + ".", "", f"Command: `{command}`", ""]
    for task in tasks:
        majority = meta["majority"].get(task, {})
        floor = f"; majority class {100 * majority['share']:.1f}" if majority.get("share") else ""
        rows = f"{majority['rows']} rows" if majority.get("rows") else "rows not recorded"
        lines += [f"## {TASK_TITLES.get(task, task)} accuracy (%) ({rows}{floor})", "",
                  "| Model | seeds | each seed's score | mean ± sd | vs baseline (seed noise) | paired gap (seeds both "
                  "ran) |", "|---|---|---|---:|---|---|"]
        base = models.get(baseline, {}).get("tasks", {}).get(task)
        for name, entry in models.items():
            cell = entry["tasks"].get(task)
            if cell is None:
                continue
            scores = ", ".join(f"{score:.1f}" for score in cell["scores"])
            spread = f" ± {cell['std']:.1f}" if cell["std"] is not None else ""
            versus, paired = "", ""
            if name == baseline:
                versus = "baseline"
            elif base is not None:
                _, delta, noise = _average_and_noise({"tasks": {task: cell}}, {"tasks": {task: base}}, [task])
                versus = f"{delta:+.2f} pt " + (f"(± {noise:.2f}: {'beyond' if abs(delta) > noise else 'within'})"
                                                if noise is not None else "(noise unknown: one seed)")
                if set(cell["seeds"]) != set(base["seeds"]):  # each mean over its own seeds: the paired gap is fairer
                    versus += "; other seeds than the baseline's"
                gap, sd, shared = paired_gap(cell, base)
                if gap is not None:
                    paired = (f"{gap:+.2f}" + (f" ± {sd:.2f}" if sd is not None else "")
                              + f" ({len(shared)} seed{'s' if len(shared) > 1 else ''})")
            lines.append(f"| {name} | {', '.join(map(str, cell['seeds']))} | {scores} | {cell['mean']:.1f}{spread} "
                         f"({len(cell['scores'])}) | {versus} | {paired} |")
        lines.append("")
    lines += ["± is the standard deviation over seeds. Seed noise is twice the standard error of the difference of "
              "the two means, from their spreads (the preset's own tables use the same): a difference inside it is "
              "not a finding. The paired gap is the model's score minus the baseline's at each seed both ran, its "
              "mean ± standard deviation: where the two ran other seeds, the difference of means also holds those "
              "seeds' own luck, and the paired gap is the fairer figure.", "", "## Where the seeds ran", "",
              "| folder | machine (its instruction sets) | what it adds | its command |", "|---|---|---|---|"]
    for source in sources:
        added = _seed_list(source["added"]) or "nothing new"
        if source["again"]:
            added += "; the same score again for " + _seed_list(source["again"])
        if source["machines"]:  # from the stages' own records
            machines = "; and ".join(source["machines"])
        else:  # a folder without records: its report's machines, and the sets of the machine that wrote it
            machines = (f"{'; '.join(source['stage_machines']) or source['machine']} ({source['cpu_features']}, "
                        "the sets of the machine that wrote its report)")
        lines.append(f"| {source['folder']} | {machines} | {added} | `{source['command']}` |")
    lines += ["", "Plot: results.png (each model's mean score per task, one standard deviation over seeds, every "
              "seed's score as a dot, the majority class dashed)."]
    return "\n".join(lines)


def run(folders: list[Path], results_dir: Path, root: Path, argv: list[str], preset=None) -> str:
    """Write results.md / results.json / results.png of the joined seeds into `results_dir`; returns the table.
    `preset`: a name or JSON file, default the one the folders name (its baseline and tasks)."""
    models, sources, meta = combine(folders)
    results_dir = Path(results_dir)
    if any(results_dir.resolve() == Path(folder).resolve() for folder in folders):
        raise UsageError(f"--results_dir {results_dir} is one of the folders joined: write the joined table into a "
                         "folder of its own (e.g. results/pretrained/cpu-seeds)")
    path = find_preset(preset or meta["preset"], root / "configs" / "pretrained")
    if path.stem != meta["preset"]:
        raise UsageError(f"--preset {preset} is not the folders' preset {meta['preset']!r}: leave --preset out, or "
                         "name theirs")
    preset = load_preset(path, root)
    command = "python scripts/pretrained.py " + shlex.join(argv)
    markdown = render_markdown(models, sources, meta, preset["baseline"], command)
    results_dir.mkdir(parents=True, exist_ok=True)
    written = {"meta": {**meta, "command": command, "sources": sources, "baseline": preset["baseline"]},
               "models": models}
    (results_dir / "results.json").write_text(json.dumps(written, indent=2) + "\n")
    (results_dir / "results.md").write_text(markdown + "\n")
    plot(preset, models, meta, results_dir / "results.png")
    return markdown
