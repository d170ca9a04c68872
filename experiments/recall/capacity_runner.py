"""The capacity probe's runner (scripts/recall.py with a preset whose "task" is "capacity"): one stage per (memory,
key and value tokens, pairs, heads), each recorded by the long-range suite's stage runner (a rerun reuses finished
stages), then the report: accuracy against the bytes of the state, with the trained decoders' accuracy on MQAR at
the same heads per layer beside it, read from the MQAR results files the preset names (linked, not copied).
"""

import json
import shlex
import sys
import time
from pathlib import Path

from experiments.long_range.stages import Stage, run_or_reload, stage_machines, whole_command, write_atomic
from hf_linear_attn.training.errors import UsageError

from .capacity import MEMORIES, check_capacity, state_bytes, train_capacity

KEYS = {"task", "seed", "head_size", "settings", "memories", "steps", "batch_size", "lr", "eval_batches", "log_every"}
SETTING_KEYS = {"num_keys", "num_values", "pairs", "heads"}
LABELS = {"elu": "elu + 1, normalised (linear_gpt2's read)", "elu_unnormalized": "elu + 1, no normaliser",
          "identity": "no feature map, no normaliser (q S)", "softmax": "softmax over the stored pairs (a cache)",
          "hedgehog": "hedgehog, normalised (2 x 32 features)",
          "hedgehog_narrow": "hedgehog at elu + 1's width (2 x 16 features), normalised",
          "delta": "delta rule (DeltaNet), written in order, no normaliser"}
DECODER = "linear_gpt2_conv"  # the trained decoder whose state the probe isolates


def load_preset(path: Path) -> dict:
    """The preset, its every setting checked (with the fix named) before any stage runs."""
    preset = json.loads(Path(path).read_text())
    missing = KEYS - set(preset)
    unknown = set(preset) - KEYS - {"description"}
    if missing or unknown:
        raise UsageError(f"capacity preset {path}: " + "; ".join(
            ([f"missing {', '.join(sorted(missing))}"] if missing else [])
            + ([f"unknown {', '.join(sorted(unknown))}"] if unknown else [])) + f" (it takes {', '.join(sorted(KEYS))}"
            ", description; each setting takes num_keys, num_values, pairs, heads and optionally compare)")
    for setting in preset["settings"]:
        if not SETTING_KEYS <= set(setting) <= SETTING_KEYS | {"compare"}:
            raise UsageError(f"capacity preset {path}: a setting needs exactly {', '.join(sorted(SETTING_KEYS))} "
                             f"(and optionally compare), got {', '.join(sorted(setting))}")
        for memory in preset["memories"]:
            for heads in setting["heads"]:
                check_capacity(memory, setting["num_keys"], setting["num_values"], setting["pairs"], heads,
                               preset["head_size"])
    return preset


def stage_key(memory: str, setting: dict, heads: int) -> str:
    return f"{memory}/k{setting['num_keys']}-v{setting['num_values']}-p{setting['pairs']}-h{heads}"


def plan(preset: dict, memories=None) -> list[Stage]:
    if memories:
        unknown = [m for m in memories if m not in preset["memories"]]
        if unknown:
            raise UsageError(f"--models {' '.join(unknown)}: not a memory of this preset; choose from "
                             f"{', '.join(preset['memories'])}")
    common = {k: preset[k] for k in ("seed", "head_size", "steps", "batch_size", "lr", "eval_batches", "log_every")}
    stages = []
    for setting in preset["settings"]:
        for heads in setting["heads"]:
            for memory in preset["memories"]:
                if memories and memory not in memories:
                    continue
                args = {**common, "memory": memory, "heads": heads,
                        **{k: setting[k] for k in ("num_keys", "num_values", "pairs")}}
                stages.append(Stage(stage_key(memory, setting, heads), "capacity", args))
    return stages


def run_stage(stage: Stage) -> dict:
    a = stage.args
    return train_capacity(a["memory"], a["num_keys"], a["num_values"], a["pairs"], a["heads"], a["head_size"],
                          a["steps"], a["batch_size"], a["lr"], a["seed"], a["eval_batches"], a["log_every"])


def decoder_accuracies(compare: dict | None, pairs: int, root: Path) -> dict[int, float]:
    """The trained decoder's MQAR accuracy by width at this pair count, from the results file `compare` names."""
    path = root / compare["results"] / "results.json" if compare else None
    if path is None or not path.is_file():
        return {}
    return {row["width"]: row["accuracy"] for row in json.loads(path.read_text())["rows"]
            if (row["model"], row["length"], row["pairs"]) == (DECODER, compare["length"], pairs)}


def summarise(preset: dict, records: dict, root: Path) -> list[dict]:
    rows = []
    for setting in preset["settings"]:
        decoder = decoder_accuracies(setting.get("compare"), setting["pairs"], root)
        for heads in setting["heads"]:
            width = heads * preset["head_size"]
            row = {k: setting[k] for k in ("num_keys", "num_values", "pairs")}
            row.update(heads=heads, width=width, memories={})
            for memory in preset["memories"]:
                record = records.get(stage_key(memory, setting, heads))
                if record is not None:
                    m = record["metrics"]
                    row["memories"][memory] = {"accuracy": m["accuracy"], "loss": m["loss"],
                                               "state_bytes": m["state_bytes"],
                                               "final_train_loss": m["loss_curve"][-1][1]}
            if width in decoder:
                compare = setting["compare"]
                row["decoder"] = {"model": DECODER, "accuracy": decoder[width], "results": compare["results"],
                                  "length": compare["length"]}
            rows.append(row)
    return rows


def below(rows: list[dict], memory: str, num_keys: int, pairs: int, threshold: float = 0.9) -> str:
    """The largest state (bytes) of `memory` below `threshold` and the smallest at or above it, in words."""
    points = sorted((r["memories"][memory]["state_bytes"], r["memories"][memory]["accuracy"]) for r in rows
                    if (r["num_keys"], r["pairs"]) == (num_keys, pairs) and memory in r["memories"])
    if not points:
        return "not run"
    reached = [b for b, a in points if a >= threshold]
    missed = [b for b, a in points if a < threshold]
    if not reached:
        return f"below {threshold:.0%} at every state run (up to {points[-1][0] / 1024:g} KiB)"
    if not missed:
        return f"at or above {threshold:.0%} at every state run (from {points[0][0] / 1024:g} KiB)"
    return f"below {threshold:.0%} up to {max(missed) / 1024:g} KiB, at or above from {min(reached) / 1024:g} KiB"


def render(rows: list[dict], preset: dict, meta: dict) -> str:
    hardware = "".join(f"; {t}" for t in meta.get("hardware", []))
    out = ["# How much a linear attention state holds: MQAR's pairs stored directly", "",
           (f"{meta['machine']}{hardware}. Preset: {meta['preset']}, {meta['finished']} of {meta['total']} stages "
            f"finished. {meta['notes']}"), "",
           (f"Command: `{meta['command']}` ({meta['date']}). What the probe is: experiments/recall/capacity.py; "
            "the reading: docs/recall.md."), ""]
    memories = preset["memories"]
    out += ["Accuracy reading every stored key back (held-out pairings), and the state's bytes per sequence:", "",
            "| key / value tokens | pairs | heads x 32 (width) | " + " | ".join(LABELS[m] for m in memories)
            + " | trained decoder, linear_gpt2 + conv, one layer's state of these heads |",
            "|---|---:|---|" + "---:|" * len(memories) + "---|"]
    for r in rows:
        cells = []
        for m in memories:
            got = r["memories"].get(m)
            cells.append(f"{got['accuracy']:.1%} ({got['state_bytes'] / 1024:g} KiB)" if got else "not run")
        dec = r.get("decoder")
        dec_text = (f"{dec['accuracy']:.1%} at n = {dec['length']} ([results](../../{dec['results']}/results.md))"
                    if dec else "")
        out.append(f"| {r['num_keys']} / {r['num_values']} | {r['pairs']} | {r['heads']} ({r['width']}) | "
                   + " | ".join(cells) + f" | {dec_text} |")
    out += ["", "Where each memory falls below 90% (state bytes per sequence; one layer):", ""]
    for setting in preset["settings"]:
        for m in memories:
            out.append(f"- {setting['num_keys']} keys, {setting['pairs']} pairs, {LABELS[m]}: "
                       + below(rows, m, setting["num_keys"], setting["pairs"]))
    out += ["", "Final training loss (mean of the last logged steps) beside the held-out loss, to show convergence:",
            "", "| key / value tokens | pairs | heads | " + " | ".join(m for m in memories) + " |",
            "|---|---:|---:|" + "---|" * len(memories)]
    for r in rows:
        cells = [f"{r['memories'][m]['final_train_loss']:.3g} / {r['memories'][m]['loss']:.3g}"
                 if m in r["memories"] else "" for m in memories]
        out.append(f"| {r['num_keys']} / {r['num_values']} | {r['pairs']} | {r['heads']} | " + " | ".join(cells)
                   + " |")
    out += ["", ("Plot: capacity.png (accuracy against state bytes, one panel per setting). Records of every stage: "
                 "records.json."), ""]
    return "\n".join(out)


def plot(rows: list[dict], preset: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = preset["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        picked = [r for r in rows if (r["num_keys"], r["pairs"]) == (setting["num_keys"], setting["pairs"])]
        for m in preset["memories"]:
            points = sorted((r["memories"][m]["state_bytes"], r["memories"][m]["accuracy"]) for r in picked
                            if m in r["memories"])
            if points:
                ax.plot([b / 1024 for b, _ in points], [a for _, a in points], marker="o", label=LABELS[m])
        decoders = [(r["memories"].get("elu", {}).get("state_bytes"), r["decoder"]["accuracy"]) for r in picked
                    if "decoder" in r and "elu" in r["memories"]]
        if decoders:
            ax.scatter([b / 1024 for b, _ in decoders], [a for _, a in decoders], marker="*", s=140, color="black",
                       label="trained decoder (linear_gpt2 + conv), MQAR", zorder=5)
        ax.axhline(0.9, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("state bytes per sequence, one layer (KiB)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{setting['pairs']} pairs of {setting['num_keys']} keys, {setting['num_values']} values")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(preset_path: Path, output_dir: Path, memories=None, dry_run=False, report_only=False, argv=None,
        log=print) -> dict:
    from benchmarks.measuring import hardware_of_records

    preset = load_preset(preset_path)
    stages, whole = plan(preset, memories), plan(preset)
    if dry_run:
        for stage in stages:
            log(f"{stage.key}: {json.dumps(stage.args)}")
        log(f"{len(stages)} stages")
        return {}
    records, machine = run_or_reload(stages, run_stage, Path(output_dir), report_only, log)
    keys = {s.key for s in whole}
    finished = {k: r for k, r in records.items() if k in keys}
    root = Path(__file__).resolve().parents[2]
    rows = summarise(preset, finished, root)
    meta = {"preset": Path(preset_path).stem, "machine": stage_machines(finished, machine),
            "finished": len(finished), "total": len(whole), "hardware": hardware_of_records(finished.values()),
            "date": time.strftime("%Y-%m-%d"),
            "command": "python scripts/recall.py " + shlex.join(whole_command(sys.argv[1:] if argv is None else argv,
                                                                                ("--models",))),
            "notes": (f"One layer, heads of {preset['head_size']}; {preset['steps']} steps x batch "
                      f"{preset['batch_size']} of fresh random pairings, AdamW lr {preset['lr']} (no weight decay), "
                      f"5% warm-up then cosine decay, seed {preset['seed']}; scored on {preset['eval_batches']} "
                      "batches from another seed.")}
    output_dir = Path(output_dir)
    write_atomic(output_dir / "results.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_atomic(output_dir / "results.md", render(rows, preset, meta))
    plot(rows, preset, output_dir / "capacity.png")
    return {"meta": meta, "rows": rows}


__all__ = ["MEMORIES", "load_preset", "plan", "run", "state_bytes"]
