"""MQAR across seeds (scripts/recall.py --combine): one table from the folders of runs that differ only in their seed.

One seed cannot rank two rules whose training sits on a plateau: at lr 1e-2 the delta rule and Gated DeltaNet each
learnt the lookup at one seed of three (docs/recall.md). Each seed runs into its own folder (`--seed`), and this
module reads their records, groups the stages whose arguments agree in everything but the seed, and writes each
group's accuracy per seed, mean and spread, how many seeds learnt the lookup, and when. Stages that differ in more
than the seed (another learning rate, say) are separate rows, labelled by what differs.
"""

import json
import shlex
import statistics
import time
from pathlib import Path

from experiments.long_range.stages import load_records, write_atomic
from hf_linear_attn.training.errors import UsageError

from .models import LABELS
from .runner import lookup_began, summarise

LEARNT = 0.9  # a seed "learnt" the lookup at this accuracy or above: the bar of issue 42's state table


def _flat(args: dict, prefix: str = "") -> dict:
    """{"optimizer.lr": 0.01, "steps": 2000, ...}: nested arguments on one level, to name what settings differ in."""
    flat = {}
    for key, value in args.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _longest(memory: dict) -> list:
    """Per layer, the share of a write its longest-keeping head keeps across the pairs (`memory_spans`' reading);
    None for a layer without a decay."""
    return [None if heads is None else max(h["kept"] for h in heads) for heads in memory["layers"]]


def combine(folders: list[Path]) -> list[dict]:
    """One row per setting (every stage argument but the seed) found in the folders' records: its model, cell and
    learning rate, and per seed the accuracy, eval loss, the folder and the first step below ln(pairs). Refuses a
    folder without records and a seed recorded twice for one setting."""
    if len(folders) < 2:
        raise UsageError("--combine reads two or more run folders (one per seed): name them all")
    groups = {}
    for folder in folders:
        folder = Path(folder)
        records = load_records(folder)
        if not records:
            raise UsageError(f"{folder}: no finished MQAR stages (no records.json, no stages/): run its preset there "
                             "first, or name another folder")
        for key, record in records.items():
            if record.get("kind") != "mqar":
                raise UsageError(f"{folder}: stage {key} is not an MQAR stage: --combine reads MQAR runs only")
            seed, flat = record["args"]["seed"], _flat(record["args"])
            # stages whose arguments agree in all but the seed are one setting
            setting = {k: v for k, v in flat.items() if k != "seed"}
            group = groups.setdefault(json.dumps(setting, sort_keys=True), {"record": record, "setting": setting,
                                                                           "seeds": {}})
            if seed in group["seeds"]:
                raise UsageError(f"{key} at seed {seed} is in both {group['seeds'][seed]['folder']} and {folder}: "
                                 "name each seed's folder once")
            row = summarise({key: record})[0]
            group["seeds"][seed] = {"accuracy": row["accuracy"], "loss": row["loss"], "folder": str(folder),
                                    "began": lookup_began(row), "machine": record.get("machine"),
                                    "hardware": record.get("hardware"),
                                    **{reading: _longest(row[reading]) for reading in ("memory", "memory_init")
                                       if row.get(reading)}}
    rows = []
    for group in groups.values():
        a = group["record"]["args"]
        rows.append({"model": a["model"], "length": a["length"], "pairs": a["pairs"], "width": a["width"],
                     "lr": a["optimizer"]["lr"], "steps": a["steps"],
                     "setting": {k: v for k, v in group["setting"].items()
                                 if k not in ("model", "length", "pairs", "width")},
                     "seeds": {seed: group["seeds"][seed] for seed in sorted(group["seeds"])}})
    return sorted(rows, key=lambda r: (r["length"], r["pairs"], r["width"], r["model"], -r["lr"], r["steps"]))


def _value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value)


def render(rows: list[dict], meta: dict) -> str:
    """The report: per cell (n, pairs, width), a row per model and setting (a column for each argument the cell's
    settings differ in besides the model, such as the learning rate): each seed's accuracy with the step its loss
    first fell below ln(pairs), mean ± standard deviation over the seeds, how many seeds began the lookup and how
    many reached 90%."""
    out = ["# MQAR across seeds", "",
           f"Command: `{meta['command']}`  ",
           f"Machine: {meta['machine']}  ",
           f"Folders (one run each): {', '.join(meta['folders'])}", "",
           "Each row is one setting (every stage argument equal but the seed) and each seed column a run of it; a "
           "cell reads accuracy on the queried values (the step at which the training loss first fell below "
           "ln(pairs), when the lookup began; \"never\" if it did not). Mean ± standard deviation over the seeds "
           "run; lookup began: seeds whose training loss got below ln(pairs); learnt: seeds at "
           f"{LEARNT:.0%} or above.", ""]
    for cell in sorted({(r["length"], r["pairs"], r["width"]) for r in rows}):
        group = [r for r in rows if (r["length"], r["pairs"], r["width"]) == cell]
        seeds = sorted({s for r in group for s in r["seeds"]})
        # what the settings of this cell differ in besides the model (the learning rate, say): a column each
        keys = sorted({k for r in group for k in r["setting"]})
        extra = [k for k in keys if len({json.dumps(r["setting"].get(k)) for r in group}) > 1]
        many_lrs = "optimizer.lr" in extra
        out += [f"## n = {cell[0]:,}, {cell[1]} pairs, width {cell[2]}"
                + ("" if many_lrs else f" (lr {group[0]['lr']:g})"), "",
                "| model | " + "".join(f"{e} | " for e in extra) + "".join(f"seed {s} | " for s in seeds)
                + "mean ± sd | lookup began | learnt |",
                "|---|" + "---:|" * (len(extra) + len(seeds) + 3)]
        for r in group:
            cells = []
            for s in seeds:
                got = r["seeds"].get(s)
                began = "never" if got is None or got["began"] is None else f"{got['began']:,}"
                cells.append("" if got is None else f"{got['accuracy']:.1%} ({began})")
            accuracies = [got["accuracy"] for got in r["seeds"].values()]
            spread = f" ± {100 * statistics.stdev(accuracies):.1f}" if len(accuracies) > 1 else " (1 seed)"
            learnt = sum(a >= LEARNT for a in accuracies)
            started = sum(got["began"] is not None for got in r["seeds"].values())
            out.append(f"| {LABELS.get(r['model'], r['model'])} | "
                       + "".join(f"{_value(r['setting'].get(k))} | " for k in extra)
                       + "".join(f"{c} | " for c in cells)
                       + f"{100 * statistics.mean(accuracies):.1f}{spread} | {started} of {len(accuracies)} | "
                       f"{learnt} of {len(accuracies)} |")
        out.append("")
    return "\n".join(out + render_memory(rows))


def render_memory(rows: list[dict]) -> list[str]:
    """Per decaying model and seed: what each layer's longest-keeping head keeps of a write across the pairs, at the
    start and trained: whether a seed's gates stayed open or closed beside whether it learnt."""
    runs = [(r, s, got) for r in rows for s, got in r["seeds"].items() if got.get("memory")]
    if not runs:
        return []
    depth = max(len(got["memory"]) for _, _, got in runs)
    out = ["## How long the states keep a write, per seed", "",
           "Per layer, the share of a token's write its longest-keeping head keeps across the context's pairs (2 x "
           "pairs tokens; the runs' own reading, \"How long each decaying state keeps what it holds\" in each folder's "
           "report), as the seed built the model -> trained. With KDA's gate, one decay per key feature, a head's "
           "reading is its features' geometric mean, which the features that forget rule: a head reading 0.00 may "
           "keep most of its features (the gate traces, results/recall/gate-traces, read each feature on its "
           "own).", "",
           "| n | pairs | width | model | lr | seed | accuracy | " + " | ".join(f"layer {i + 1}" for i in range(depth))
           + " |", "|---|---|---|---|---:|---:|---:|" + "---|" * depth]
    for r, s, got in runs:
        start = got.get("memory_init") or [None] * depth
        cells = ["-" if after is None else (f"{before:.2f} -> " if before is not None else "") + f"{after:.2f}"
                 for before, after in zip(start, got["memory"])]
        out.append(f"| {r['length']:,} | {r['pairs']} | {r['width']} | {LABELS.get(r['model'], r['model'])} | "
                   f"{r['lr']:g} | {s} | {got['accuracy']:.1%} | " + " | ".join(cells) + " |")
    return out + [""]


def run(folders: list[Path], output_dir: Path, argv: list[str]) -> dict:
    """Combine the folders' records and write results.md and results.json into output_dir."""
    from benchmarks.measuring import describe_machine, hardware_of_records

    rows = combine(folders)
    runs = [got for r in rows for got in r["seeds"].values()]
    # the machines the stages ran on (each record keeps its own), not the one combining them; one group per machine,
    # so that each one's instruction sets and matmul peaks stand beside its name
    by_machine = {}
    for got in runs:
        by_machine.setdefault(got.get("machine"), []).append(got)
    machines = ["; ".join([machine or describe_machine(), *hardware_of_records(group)])
                for machine, group in by_machine.items()]
    meta = {"command": "python scripts/recall.py " + shlex.join(argv), "folders": [str(f) for f in folders],
            "machine": "; and on ".join(machines), "date": time.strftime("%Y-%m-%d")}
    output_dir = Path(output_dir)
    # each seed's hardware is in the machine line (and its folder's records), not repeated per row
    compact = [{**r, "seeds": {s: {k: v for k, v in got.items() if k != "hardware"} for s, got in r["seeds"].items()}}
               for r in rows]
    write_atomic(output_dir / "results.json", json.dumps({"meta": meta, "rows": compact}, indent=1))
    write_atomic(output_dir / "results.md", render(rows, meta))
    return {"meta": meta, "rows": rows}
