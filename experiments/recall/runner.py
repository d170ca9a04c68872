"""The recall runner (scripts/recall.py): a preset's MQAR grid as resumable stages, then the report.

A preset (configs/recall/NAME.json) names sequence lengths, pair counts, model widths and models; every model of a
width has the same depth, head size and feed-forward multiple, the same optimizer, schedule, steps, batch and seed.
Each (length, pairs, width, model) is one stage, recorded by the long-range suite's stage runner (resumable, refuses a
finished stage run with other arguments). Pair counts that do not fit a length (4 x pairs > n) are left out of the
plan and listed in the report. A preset with "checkpoint_every" saves each stage's training every that many steps
(into output_dir/checkpoints/, dropped once the stage is recorded), so a stage killed mid-way goes on from there.
"""

import json
import math
import shlex
import sys
import time
from pathlib import Path

from experiments.long_range.models import Dims
from experiments.long_range.training import PRECISIONS, Checkpointing, check_device, device_name
from experiments.long_range.stages import (Stage, checkpoint_file, load_records, run_or_reload, stage_machines,
                                           whole_command, write_atomic)
from hf_linear_attn.training.errors import UsageError

from .models import LABELS, build_recall_model, check_models, decoding_state_bytes
from .tasks import check_mqar, mqar_batch, mqar_vocab_size

PRESET_KEYS = {"description", "seed", "optimizer", "num_keys", "num_values", "lengths", "pairs", "widths", "num_layers",
               "head_size", "ffn_multiple", "steps", "batch_size", "log_every", "eval_batches", "models"}
OPTIONAL_KEYS = {"description", "checkpoint_every", "precision"}
LOOKUP_BATCHES = 2  # batches of fresh sequences the trained model's lookup is read on (64 pairs: 4,096 queries at 32)


def read_preset(path: Path, keys: set, optional: set = frozenset({"description"})) -> dict:
    """A preset file whose keys are exactly `keys` (those in `optional` may be left out), or a UsageError naming the
    odd ones."""
    preset = json.loads(Path(path).read_text())
    unknown, missing = set(preset) - keys, keys - set(optional) - set(preset)
    if unknown or missing:
        raise UsageError(f"{Path(path).name}: " + "; ".join(
            part for part in (f"unknown keys {sorted(unknown)}" if unknown else "",
                              f"missing keys {sorted(missing)}" if missing else "") if part) + ": fix the preset")
    return preset


def load_preset(path: Path) -> dict:
    """Read and check a preset: every key known and present, every model known, every task setting possible."""
    preset = read_preset(path, PRESET_KEYS | OPTIONAL_KEYS, OPTIONAL_KEYS)
    check_models(preset["models"])
    every = preset.get("checkpoint_every")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise UsageError(f"'checkpoint_every' must be a positive number of steps (or absent: no checkpoints), got "
                         f"{every!r}: fix the preset")
    if preset.get("precision", "float32") not in PRECISIONS:
        raise UsageError(f"unknown precision {preset['precision']!r}: use 'float32' or 'bf16' (bfloat16 autocast of "
                         "the training forward; float32 weights, and the score in float32)")
    for width in preset["widths"]:
        if width % preset["head_size"]:
            raise UsageError(f"width {width} is not a multiple of head_size {preset['head_size']}: fix the preset")
    if not any(4 * p <= n for n in preset["lengths"] for p in preset["pairs"]):
        raise UsageError("no pair count fits any length (each needs 4 x pairs <= length): fix the preset")
    for p in preset["pairs"]:
        check_mqar(4 * p, p, preset["num_keys"], preset["num_values"])  # the vocabulary holds the largest pair count
    return preset


def at_seed(preset: dict, seed: int | None) -> dict:
    """The preset at another seed (--seed), or as it is for None; a seed that is not a whole number >= 0 refused."""
    if seed is None:
        return preset
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"--seed {seed!r}: give a whole number >= 0")
    return {**preset, "seed": seed}


def dims_for(preset: dict, width: int) -> dict:
    return {"hidden_size": width, "num_layers": preset["num_layers"], "num_heads": width // preset["head_size"],
            "intermediate_size": preset["ffn_multiple"] * width}


def plan(preset: dict, models=None, pairs=None, widths=None) -> tuple[list[Stage], list[str]]:
    """Every stage, shortest sequences and fewest pairs first (a partial run already holds whole comparisons), and the
    settings left out because the pairs do not fit the length; `models` / `pairs` / `widths` keep only those (a
    slice)."""
    models = models or preset["models"]
    check_models(models)
    for flag, chosen, key in (("--pairs", pairs, "pairs"), ("--widths", widths, "widths")):
        if chosen and (unknown := sorted(set(chosen) - set(preset[key]))):
            raise UsageError(f"{flag} {' '.join(map(str, unknown))}: not among the preset's {key} "
                             f"({', '.join(map(str, preset[key]))}); name some of those, or add them to the preset")
    stages, left_out = [], []
    # checkpointing is how a stage runs, not what it computes: an option, so stages recorded without it are reused
    options = {"checkpoint_every": preset["checkpoint_every"]} if preset.get("checkpoint_every") else {}
    for n in preset["lengths"]:
        for count in preset["pairs"]:
            if pairs and count not in pairs:
                continue
            if 4 * count > n:
                left_out.append(f"n = {n}, {count} pairs (needs n >= {4 * count})")
                continue
            for width in preset["widths"]:
                if widths and width not in widths:
                    continue
                for model in models:
                    stages.append(Stage(f"mqar-n{n}-p{count}-w{width}/{model}", "mqar", {
                        "model": model, "length": n, "pairs": count, "width": width, "dims": dims_for(preset, width),
                        "num_keys": preset["num_keys"], "num_values": preset["num_values"], "steps": preset["steps"],
                        "batch_size": preset["batch_size"], "optimizer": preset["optimizer"], "seed": preset["seed"],
                        "log_every": preset["log_every"], "eval_batches": preset["eval_batches"],
                        # only where a preset names it, so stages recorded before the option keep their arguments
                        **({"precision": preset["precision"]} if "precision" in preset else {})},
                        options=dict(options)))
    return stages, left_out


def stage_runner(output_dir: Path | None, log=print, device: str = "cpu"):
    """run_stage(stage) -> metrics, checkpointing into output_dir/checkpoints/ where the stage's options say so;
    each stage trains on `device`."""

    def run_stage(stage: Stage) -> dict:
        every = stage.options.get("checkpoint_every")
        checkpointing = (Checkpointing(checkpoint_file(output_dir, stage.key), every, stage.args,
                                       log=lambda s, key=stage.key: log(f"    {key}: {s}"))
                         if every and output_dir is not None else None)
        return run_mqar_stage(stage, checkpointing, device,
                              save_to=None if output_dir is None else Path(output_dir) / "models" / stage.key)

    return run_stage


def task_of(args: dict) -> dict:
    """The MQAR task of a stage's arguments."""
    return {key: args[key] for key in ("length", "pairs", "num_keys", "num_values")}


def read_trained(model, args: dict) -> dict:
    """A trained model's readings, on batches of their own seeds: where it looks up (`lookup_attention`) and how long
    its states keep what they hold (`memory_spans`). The stage records them; --probe_saved reads a saved model again."""
    from .training import lookup_attention

    return {"lookup": lookup_attention(model, task_of(args), args["batch_size"], LOOKUP_BATCHES, args["seed"] + 20_000),
            "memory": memory_reading(model, args)}


def initial_model(args: dict, device: str = "cpu"):
    """A stage's model as it starts, before any step: the stage's seed, then the build (the same weights on every
    CPU, so a probe can read a finished stage's start again)."""
    import torch

    torch.manual_seed(args["seed"])
    vocab = mqar_vocab_size(args["num_keys"], args["num_values"])
    return build_recall_model(args["model"], Dims(**args["dims"]), args["length"], vocab).to(device)


def memory_reading(model, args: dict) -> dict | None:
    """`memory_spans` of a stage's model on the stage's reading batch: of the trained model (`read_trained`), and of
    the model at its start, where each decaying head began (a head that starts forgetting within a few tokens may
    never learn to hold a pair)."""
    from .training import memory_spans

    return memory_spans(model, task_of(args), args["batch_size"], args["seed"] + 30_000)


def run_mqar_stage(stage: Stage, checkpointing=None, device: str = "cpu", save_to: Path | None = None) -> dict:
    """One MQAR stage on `device` (the batches are drawn on the CPU, so every device sees the same sequences; a GPU
    stage's record names the GPU), with where the trained model looks up (`lookup_attention`); the model is saved to
    `save_to` where given (not committed: a later probe reads it without training again)."""
    import torch

    from .training import train_mqar

    a = stage.args
    task = task_of(a)
    vocab = mqar_vocab_size(a["num_keys"], a["num_values"])
    # the stage's data, as a digest: the first training batch (a different generator state means other data)
    ids, _ = mqar_batch(2, generator=torch.Generator().manual_seed(a["seed"]), **task)
    stage.digests = {"first_batch_sum": int(ids.sum())}
    model = initial_model(a, device)
    start = memory_reading(model, a)  # reads only: no random draw, so training sees the same model and batches
    metrics = train_mqar(model, task, a["steps"], a["batch_size"], a["optimizer"], a["seed"], a["log_every"],
                         a["eval_batches"], checkpointing=checkpointing, precision=a.get("precision", "float32"))
    metrics["state_bytes"] = decoding_state_bytes(model, a["length"], vocab)
    metrics["parameters"] = sum(p.numel() for p in model.parameters())
    metrics.update(read_trained(model, a))
    if start is not None:
        metrics["memory_init"] = start
    if save_to is not None:
        model.save_pretrained(save_to)
    if device != "cpu":  # CPU records (all of them before --device) name no device
        metrics["device"] = device_name(device)
    return metrics


# ------------------------------------------------------------------------------------------------------- report

def summarise(records: dict) -> list[dict]:
    rows = []
    for record in records.values():
        a, m = record["args"], record["metrics"]
        rows.append({"model": a["model"], "length": a["length"], "pairs": a["pairs"], "width": a["width"],
                     "accuracy": m["eval_accuracy"], "state_bytes": m.get("state_bytes"), "loss": m["eval_loss"],
                     "steps_per_second": m["steps_per_second"], "num_values": a["num_values"],
                     **({"loss_curve": m["loss_curve"]} if m.get("loss_curve") else {}),
                     **({"resumed_at": m["resumed_at"]} if m.get("resumed_at") else {}),
                     **({"lookup": m["lookup"]} if m.get("lookup") else {}),
                     **{key: m[key] for key in ("memory", "memory_init") if m.get(key)}})
    return sorted(rows, key=lambda r: (r["length"], r["width"], r["model"], r["pairs"]))


def recalled_at(rows: list[dict], model: str, length: int, width: int, threshold: float = 0.9) -> int | None:
    """The largest pair count at which a model stays at or above `threshold` at every pair count up to it."""
    best = None
    for r in sorted((r for r in rows if (r["model"], r["length"], r["width"]) == (model, length, width)),
                    key=lambda r: r["pairs"]):
        if r["accuracy"] < threshold:
            break
        best = r["pairs"]
    return best


def _state_points(rows: list[dict], model: str, length: int, pairs: int) -> list[tuple[int, float]]:
    """(state bytes, accuracy) of a model at (length, pairs), one per width measured, smallest state first."""
    return sorted((r["state_bytes"], r["accuracy"]) for r in rows
                  if (r["model"], r["length"], r["pairs"]) == (model, length, pairs) and r["state_bytes"])


def state_threshold(rows: list[dict], model: str, length: int, pairs: int, threshold: float = 0.9):
    """Where a model's accuracy at (length, pairs) crosses `threshold` along the state sizes measured (its widths):
    (the smallest state from which every larger one measured stays at or above it, the largest state below it), each
    None where no measured state is such; None when fewer than two states were measured (no crossing to read)."""
    points = _state_points(rows, model, length, pairs)
    if len(points) < 2:
        return None
    holds, below = None, None
    for state, accuracy in reversed(points):  # from the largest state down to the first one under the threshold
        if accuracy < threshold:
            below = state
            break
        holds = state
    return holds, below


def _kib(state) -> str:
    return f"{state / 1024:,.0f} KiB"


def render_thresholds(rows: list[dict], models: list[str], threshold: float = 0.9) -> list[str]:
    """Per length and pair count measured at two widths or more: the state size at which each model falls below
    `threshold` (issue 42's question), read from its widths."""
    out = []
    for n, p in sorted({(r["length"], r["pairs"]) for r in rows}):
        lines = []
        for model in models:
            found = state_threshold(rows, model, n, p, threshold)
            if found is None:
                continue
            holds, below = found
            states = [state for state, _ in _state_points(rows, model, n, p)]
            lines.append(f"| {LABELS.get(model, model)} | {', '.join(_kib(x) for x in states)} | "
                         f"{_kib(holds) if holds else 'none measured'} | "
                         f"{_kib(below) if below else 'none measured'} |")
        if lines:
            out += [f"## n = {n:,}, {p} pairs: the state at which each model falls below {threshold:.0%}", "",
                    f"| model | states measured | holds >= {threshold:.0%} from | falls below at |", "|---|---|---|---|",
                    *lines, ""]
    return out


def _layer_header(depth: int, extra: list[str] = ()) -> list[str]:
    """The header of a per-layer table of trained models."""
    columns = ["model", "n", "pairs", "width", "accuracy", *(f"layer {i + 1}" for i in range(depth)), *extra]
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def _layer_row(r: dict, cells: list[str], depth: int, extra: list[str] = ()) -> str:
    """A model's row of such a table: its stage, then one cell per layer ("-" past its depth), then ``extra``."""
    cells = [*cells, *["-"] * (depth - len(cells)), *extra]
    return (f"| {LABELS.get(r['model'], r['model'])} | {r['length']:,} | {r['pairs']} | {r['width']} | "
            f"{r['accuracy']:.1%} | " + " | ".join(cells) + " |")


def render_lookup(rows: list[dict]) -> list[str]:
    """Where each trained model looks up (stages recorded with `lookup_attention`'s reading): per layer, the head with
    the most attention weight on the queried pair; and, for the stages recorded with it, the head with the largest
    share of its row's absolute weight there (the reading for signed weights, such as the delta rule's)."""
    probed = [r for r in rows if r.get("lookup")]
    if not probed:
        return []
    depth = max(len(r["lookup"]["layers"]) for r in probed)
    header = _layer_header(depth, ["even weights"])

    def table(key: str) -> list[str]:
        lines = []
        for r in (r for r in probed if key in r["lookup"]):
            cells = []
            for heads in r["lookup"][key]:
                best = max(range(len(heads)), key=heads.__getitem__)
                cells.append(f"{heads[best]:.1%} (head {best + 1} of {len(heads)})")
            lines.append(_layer_row(r, cells, depth, [f"{r['lookup']['uniform']:.1%}"]))
        return header + lines if lines else []

    out = ["## Where the lookup is: attention on the queried pair", "",
           "At each query (the queried key's position, where the value is predicted), each layer's attention weight "
           "on the queried pair: its value's position and the two after it, the positions whose short-convolution "
           "window still holds the key and the value. Mean over the queries of fresh sequences; per layer the head "
           "that puts the most there. Even weights over the positions a query sees would put the last column's share "
           "there. A head that recalls by attention puts most of its weight on the pair.", "", *table("layers"), ""]
    shares = table("layers_abs")
    if shares:
        out += ["The same, as the share of each row's absolute weight that lies on the pair (stages recorded since "
                "this reading was added). For softmax and normalised linear attention, whose rows are positive and "
                "sum to 1, it is the weight above; the delta rule's rows are signed and unnormalised, so there a sum "
                "of weights can cancel what this share still shows.", "", *shares, ""]
    return out


def render_memory(rows: list[dict]) -> list[str]:
    """How long each decayed state keeps what it holds (stages recorded with `memory_spans`' reading), trained and,
    where recorded or probed, at the start."""
    probed = [r for r in rows if r.get("memory")]
    if not probed:
        return []
    depth = max(len(r["memory"]["layers"]) for r in probed)

    def table(key):
        lines = _layer_header(depth)
        for r in (r for r in rows if r.get(key)):
            cells = ["-" if heads is None else " / ".join(
                f"{h['kept']:.2f} ({h['alpha']:.3f}" + (f"; {h['features_kept']:.0%}" if "features_kept" in h else "")
                + ")" for h in heads) for heads in r[key]["layers"]]
            lines.append(_layer_row(r, cells, depth))
        return lines

    out = ["## How long each decaying state keeps what it holds", "",
           "Per layer and head of the trained model, on a fresh sequence: the share of the state a token's write keeps "
           "across the context's pairs (2 x pairs tokens, the product of the decays; median over positions), and the "
           "mean decay per token in brackets; with one decay per feature, their geometric mean, and after it (stages "
           "recorded since 2026-12-07) the share of the head's features that keep at least half a write across the "
           "pairs, each on its own: the geometric mean is ruled by the features that forget, so a head reading 0.00 "
           "may still keep most of its features. A head that is to answer the first query from the first pair must "
           "keep most of it. \"-\": a layer without a decay.", "",
           *table("memory"), ""]
    if any(r.get("memory_init") for r in rows):
        out += ["The same at the start, the model as its stage's seed built it, before any step (accuracy: the "
                "trained model's). A head the gate's init starts forgetting within a few tokens gets almost no "
                "gradient from a pair 2 x pairs tokens back.", "", *table("memory_init"), ""]
    return out


def lookup_began(row: dict) -> int | None:
    """The first logged step whose mean training loss is below ln(pairs): about the loss of a model that knows the
    answer is one of the context's pair values but picks among them at chance. MQAR's plateau sits above it, at
    ln(value tokens) (chance among every value; the failed stages here stay there); below it the lookup has begun to
    work. None if the loss never got there."""
    bar = math.log(min(row["pairs"], row["num_values"]))
    return next((step for step, loss in row.get("loss_curve", []) if loss < bar), None)


def loss_cells(rows: list[dict]) -> dict:
    """{(n, pairs, width): the rows with a loss curve} for the cells where more than one model has one: the cells the
    lookup table and mqar_loss.png compare."""
    cells = {}
    for r in rows:
        if r.get("loss_curve"):
            cells.setdefault((r["length"], r["pairs"], r["width"]), []).append(r)
    return {cell: group for cell, group in sorted(cells.items()) if len(group) > 1}


def render_lookup_began(rows: list[dict], points: int = 8) -> list[str]:
    """Per cell (n, pairs, width) that more than one model has finished: each model's training loss at evenly spaced
    logged steps and the step at which its lookup began to work (`lookup_began`), so a model that fails can be told
    from one that learns later."""
    out = []
    for (n, p, width), group in loss_cells(rows).items():
        logged = sorted({int(step) for r in group for step, _ in r["loss_curve"]})
        marks = sorted({logged[math.ceil(len(logged) * (i + 1) / points) - 1] for i in range(points)})
        if not out:
            out += ["## When each lookup began", "",
                    "Training loss (mean over the logged window) at evenly spaced steps. The plateau is ln(value "
                    "tokens), chance among every value; ln(pairs) is about the loss of picking one of the context's "
                    "pair values at chance, so the last column, the first logged step below it, is where the lookup "
                    "began to work. A model that never got there may fail or may only need more steps: compare where "
                    "the others began.", ""]
        out += [f"n = {n:,}, {p} pairs, width {width} (plateau ln {group[0]['num_values']} = "
                f"{math.log(group[0]['num_values']):.2f}; ln {p} = {math.log(p):.2f}):", "",
                "| model | accuracy | " + " | ".join(f"step {s:,}" for s in marks) + f" | below ln {p} from |",
                "|---" * (len(marks) + 3) + "|"]
        began_at = [(lookup_began(r), r) for r in group]
        for began, r in sorted(began_at, key=lambda t: (t[0] is None, t[0] or 0, t[1]["model"])):
            curve = dict((int(step), loss) for step, loss in r["loss_curve"])
            out.append(f"| {LABELS.get(r['model'], r['model'])} | {r['accuracy']:.1%} | "
                       + " | ".join(f"{curve[s]:.2f}" if s in curve else "-" for s in marks)
                       + f" | {f'step {began:,}' if began is not None else 'never'} |")
        out.append("")
    return out


def render(rows: list[dict], meta: dict) -> str:
    out = ["# Multi-query associative recall (MQAR)", "", f"Command: `{meta['command']}`.", "",
           f"Machine: {meta['machine']}"
           + "".join(f"; {text}" for text in meta.get("hardware", [])) + f". Preset: {meta['preset']}, "
           f"{meta['finished']} of {meta['total']} stages finished. {meta['notes']}"
           + (f" Stages trained on a GPU: {'; '.join(meta['gpu_stages'])}." if meta.get("gpu_stages") else ""), ""]
    models = list(dict.fromkeys(r["model"] for r in rows))
    for n in sorted({r["length"] for r in rows}):
        pairs = sorted({r["pairs"] for r in rows if r["length"] == n})
        out += [f"## n = {n:,}: accuracy at the queries (state: bytes of one sequence's decoding cache at n)", "",
                "| model | width | state | " + " | ".join(f"{p} pairs" for p in pairs) + " | pairs at >= 90% |",
                "|---" * (len(pairs) + 4) + "|"]
        for width in sorted({r["width"] for r in rows if r["length"] == n}):
            for model in models:
                cells = {r["pairs"]: r for r in rows if (r["model"], r["length"], r["width"]) == (model, n, width)}
                if not cells:
                    continue
                state = next((r["state_bytes"] for r in cells.values() if r["state_bytes"]), None)
                state = _kib(state) if state else "-"
                held = recalled_at(rows, model, n, width)
                out.append(f"| {LABELS.get(model, model)} | {width} | {state} | "
                           + " | ".join(f"{cells[p]['accuracy']:.1%}" if p in cells else "-" for p in pairs)
                           + f" | {held if held is not None else 'none'} |")
        out.append("")
    out += render_thresholds(rows, models)
    out += render_lookup_began(rows)
    out += render_lookup(rows)
    out += render_memory(rows)
    resumed = [f"{LABELS.get(r['model'], r['model'])} at n = {r['length']:,}, {r['pairs']} pairs, width {r['width']}: "
               f"step {', '.join(map(str, r['resumed_at']))}" for r in rows if r.get("resumed_at")]
    if resumed:
        out += ["Resumed from a checkpoint after a stop (the same batches and updates as an unbroken run): "
                + "; ".join(resumed) + ".", ""]
    if meta.get("left_out"):
        out += ["Left out (the pairs do not fit the length): " + "; ".join(meta["left_out"]) + ".", ""]
    out.append("Plot: mqar.png (accuracy against decoding-state bytes, one panel per length and pair count)"
               + ("; mqar_loss.png (training loss against steps, the cells of the table of when each lookup began)"
                  if loss_cells(rows) else "") + ". Records of every stage: records.json.")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = sorted({(r["length"], r["pairs"]) for r in rows}) or [(0, 0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (n, p) in zip(axes[0], panels):
        for model in dict.fromkeys(r["model"] for r in rows):
            pts = sorted((r["state_bytes"], r["accuracy"]) for r in rows
                         if (r["model"], r["length"], r["pairs"]) == (model, n, p) and r["state_bytes"])
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=LABELS.get(model, model))
        ax.set_xscale("log")
        # labels on powers of two in KiB only: the log axis' default minor labels overlap on a narrow panel
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1024:g}"))
        ax.set_ylim(0, 1.02)
        ax.set_title(f"n = {n}, {p} pairs")
        ax.set_xlabel("decoding state (KiB)")
    axes[0][0].set_ylabel("accuracy at queries")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # every model, also those with no point in the first panel
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=min(len(labels), 3) or 1)
    fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 2) // 3), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_losses(rows: list[dict], path: Path) -> bool:
    """Training loss against steps, one panel per cell of `loss_cells` (the lookup table's); False, and no file, when
    there is none."""
    cells = loss_cells(rows)
    if not cells:
        path.unlink(missing_ok=True)  # a plot left from an earlier report would no longer match it
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    most = max(len(group) for group in cells.values())
    # each panel's legend below it, off the curves: the figure grows with the longest legend
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 3.2 + 0.16 * most), squeeze=False)
    for ax, ((n, p, width), group) in zip(axes[0], cells.items()):
        for r in group:
            ax.plot(*zip(*r["loss_curve"]), label=f"{LABELS.get(r['model'], r['model'])} ({r['accuracy']:.0%})",
                    linewidth=1)
        ax.axhline(math.log(group[0]["num_values"]), color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"n = {n}, {p} pairs, width {width}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def probe_saved(preset_path: Path, output_dir: Path, models=None, log=print) -> dict:
    """Read where each trained model looks up and how long its states keep what they hold (`lookup_attention`,
    `memory_spans`; the latter also at the start, rebuilt from the stage's seed) from the models the finished stages
    saved (`<output_dir>/models/<stage>`, not committed), with the same batches as a stage's own reading, without
    training again: for stages recorded before a reading existed. Writes `probes.json` and `probes.md` beside the
    report; a stage whose model is not on this machine is listed as such. Returns {stage: probe}."""
    from transformers import AutoModelForCausalLM

    import hf_linear_attn  # noqa: F401  (registers the families with the Auto classes)

    preset = load_preset(preset_path)
    whole, _ = plan(preset, models)
    records = load_records(Path(output_dir))
    probes, rows, missing = {}, [], []
    for stage in whole:
        record, folder = records.get(stage.key), Path(output_dir) / "models" / stage.key
        if record is None:
            continue
        if not (folder / "config.json").is_file():
            missing.append(stage.key)
            continue
        probes[stage.key] = {**read_trained(AutoModelForCausalLM.from_pretrained(folder), record["args"]),
                             "memory_init": memory_reading(initial_model(record["args"]), record["args"])}
        log(f"{stage.key}: probed")
        row = summarise({stage.key: record})[0]
        rows.append({**row, **{k: v for k, v in probes[stage.key].items() if v}})
    write_atomic(Path(output_dir) / "probes.json", json.dumps(probes, indent=1))
    text = ["# Readings of the saved models", "",
            f"Command: `python scripts/recall.py --preset {Path(preset_path).stem} --output_dir {output_dir} "
            "--probe_saved`. Each finished stage's trained model, as it saved it, read on the batches its stage's "
            "own reading uses (no training). Stages whose model is not on the machine that wrote this: "
            + (", ".join(missing) if missing else "none") + ".", "",
            *render_lookup(rows), *render_memory(rows)]
    write_atomic(Path(output_dir) / "probes.md", "\n".join(text))
    return probes


def run(preset_path: Path, output_dir: Path, models=None, dry_run=False, report_only=False, argv=None,
        log=print, pairs=None, widths=None, device="cpu", seed=None) -> dict:
    """Run the preset's stages (only `models` / `pairs` / `widths` where given: a slice) and report every finished
    stage of the whole preset, so a slice run adds its rows to the committed table instead of replacing it with the
    slice's. `device`: where the stages train ("cuda" needs a GPU). `seed`: the preset's grid at another seed (other
    initial weights and training sequences; each seed in its own output_dir, whose records refuse a finished stage
    run with other arguments)."""
    from benchmarks.measuring import hardware_of_records

    preset = at_seed(load_preset(preset_path), seed)
    stages, _ = plan(preset, models, pairs, widths)
    whole, left_out = plan(preset)
    if dry_run:
        for stage in stages:
            log(f"{stage.key}: {json.dumps(stage.args)}")
        log(f"{len(stages)} stages" + (f"; left out: {'; '.join(left_out)}" if left_out else ""))
        return {}
    output_dir = Path(output_dir)
    if device != "cpu" and not report_only:
        check_device(device)
    records, machine = run_or_reload(stages, stage_runner(output_dir, log, device), output_dir, report_only, log)
    keys = {s.key for s in whole}
    finished = {k: r for k, r in records.items() if k in keys}
    rows = summarise(finished)
    o = preset["optimizer"]
    # the machines the stages ran on (each record keeps its own), not the one writing the report
    meta = {"preset": Path(preset_path).stem, "machine": stage_machines(finished, machine), "finished": len(finished),
            "total": len(whole),
            "hardware": hardware_of_records(finished.values()),
            "left_out": left_out, "date": time.strftime("%Y-%m-%d"),
            "gpu_stages": [f"{k} ({r['metrics']['device']})" for k, r in finished.items()
                           if r["metrics"].get("device")],
            "command": "python scripts/recall.py " + shlex.join(whole_command(sys.argv[1:] if argv is None else argv,
                                                                                ("--models", "--pairs", "--widths"))),
            "notes": (f"{preset['num_layers']} layers, head size {preset['head_size']}, feed-forward "
                      f"{preset['ffn_multiple']}x width; {preset['num_keys']} key and {preset['num_values']} value "
                      f"tokens; {preset['steps']} steps x batch {preset['batch_size']} of fresh sequences, AdamW lr "
                      f"{o['lr']}, warm-up {o.get('warmup_fraction', 0.1):.0%} then linear decay, seed {preset['seed']}; "
                      f"scored on {preset['eval_batches']} batches from another seed"
                      + ("; training forward under bfloat16 autocast (float32 weights), scored in float32"
                         if preset.get("precision") == "bf16" else "") + ".")}
    # the loss curves stay in records.json (80 points a stage); the report's lookup table reads them from the rows
    compact = [{key: value for key, value in r.items() if key != "loss_curve"} for r in rows]
    write_atomic(output_dir / "results.json", json.dumps({"meta": meta, "rows": compact}, indent=1))
    write_atomic(output_dir / "results.md", render(rows, meta))
    plot(rows, output_dir / "mqar.png")
    plot_losses(rows, output_dir / "mqar_loss.png")
    return {"meta": meta, "rows": rows}
