"""Long-range presets (configs/long_range/NAME.json): reading and checking one, narrowing it to some tasks and models,
and the stages it plans, in the order they run; `task_notes` says in a line what each task ran with."""

import json
from pathlib import Path

from hf_linear_attn.training.errors import UsageError

from .models import DECODER_ACTIVATIONS, DECODERS, ENCODERS, POOLINGS, Dims, check_length, check_model_names
from .stages import Stage
from .tasks import BYTES_VOCAB_SIZE, check_copy_length, copy_paper_lengths
from .training import PRECISIONS, check_optimizer

TASKS = ("listops", "text", "copy", "efficiency")
DIM_KEYS = {"hidden_size", "num_layers", "num_heads", "intermediate_size"}


def load_preset(path: Path) -> dict:
    """Read and check a preset: known tasks and models, one set of dims per task, nothing that mixes dimensions."""
    try:
        preset = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"no preset file {path}") from None
    for task, entry in preset["tasks"].items():
        if task not in TASKS:
            raise UsageError(f"unknown task {task!r} in the preset: use {', '.join(TASKS)}")
        stray = DIM_KEYS & set(entry)
        for model in entry.get("models", []):
            if not isinstance(model, str):
                stray |= DIM_KEYS & set(model)
        if stray or (task != "efficiency" and "dims" not in entry):
            raise UsageError(f"preset mixes dimensions in task {task!r}: give one 'dims' block for the whole task "
                             f"({sorted(DIM_KEYS)}) and plain model names, no per-model {sorted(stray) or 'dims'}")
        if not all(isinstance(m, str) for m in entry.get("models", [])):
            raise UsageError(f"task {task!r}: models must be plain names")
        if "dims" in entry:
            Dims.from_preset(entry["dims"], f"task {task}")
        if "pooling" in entry and (task not in ("listops", "text") or entry["pooling"] not in POOLINGS):
            raise UsageError(f"task {task!r}: 'pooling' {entry['pooling']!r} is not allowed; ListOps and Text take "
                             f"one of {', '.join(POOLINGS)}")
        check_model_names(entry.get("models", []), "copy" if task == "copy" else "encoder")
        if task == "copy":
            check_copy_entry(entry)
    check_optimizer(preset["optimizer"])
    eff = preset["tasks"].get("efficiency")
    if eff and eff.get("dims_from") not in preset["tasks"] and "dims" not in eff:
        raise UsageError("efficiency: give 'dims' or 'dims_from' naming a task of the preset")
    return preset


def check_copy_entry(entry: dict) -> None:
    """Refuse copy-task settings the generator or the loop cannot run, naming the fix."""
    variant = entry.get("variant", "fixed")
    for setting in entry["settings"]:
        check_copy_length(variant, setting["length"])
        for key in ("steps", "batch_size"):
            if not isinstance(setting.get(key), int) or setting[key] < 1:
                raise UsageError(f"copy setting {setting}: {key!r} must be a positive integer")
    if entry.get("precision", "float32") not in PRECISIONS:
        raise UsageError(f"copy: unknown precision {entry['precision']!r}: use 'float32' or 'bf16' (bfloat16 autocast "
                         "of the forward, float32 weights)")
    if entry.get("activation", "gelu_new") not in DECODER_ACTIVATIONS:
        raise UsageError(f"copy: unknown activation {entry['activation']!r}: use one of "
                         f"{', '.join(DECODER_ACTIVATIONS)} (the GPT-2-style decoders' activation_function)")
    every = entry.get("checkpoint_every")
    if every is not None and (not isinstance(every, int) or every < 1):
        raise UsageError(f"copy: 'checkpoint_every' must be a positive number of steps (or absent: no checkpoints), "
                         f"got {every!r}")
    dropout = entry.get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UsageError(f"copy: 'dropout' must lie in [0, 1), got {dropout!r}")


def select(preset: dict, tasks=None, models=None, lengths=None) -> dict:
    """The preset narrowed to some tasks, models and sequence lengths (names checked; lengths: the copy task's
    settings, the efficiency lengths, ListOps' and Text's length; a slice that leaves no stage is refused)."""
    if tasks:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise UsageError(f"unknown task {unknown[0]!r}: use {', '.join(TASKS)}")
    if models:
        unknown = [m for m in models if m not in ENCODERS + DECODERS]
        if unknown:
            raise UsageError(f"unknown model {unknown[0]!r}: encoders {', '.join(ENCODERS)}; decoders {', '.join(DECODERS)}")
    out = {**preset, "tasks": {}}
    for task, entry in preset["tasks"].items():
        if tasks and task not in tasks:
            continue
        chosen = [m for m in entry["models"] if not models or m in models]
        if chosen:
            out["tasks"][task] = {**entry, "models": chosen}
    if lengths:
        kept = {}
        for task, entry in out["tasks"].items():
            if task == "copy":
                entry = {**entry, "settings": [s for s in entry["settings"] if s["length"] in lengths]}
                keep = bool(entry["settings"])
            elif task == "efficiency":
                entry = {**entry, "lengths": [n for n in entry["lengths"] if n in lengths]}
                keep = bool(entry["lengths"])
            else:
                keep = entry["length"] in lengths
            if keep:
                kept[task] = entry
        if not kept:
            raise UsageError(f"--lengths {' '.join(map(str, lengths))}: no stage of the chosen tasks and models has "
                             f"that length; the preset's lengths are {', '.join(map(str, preset_lengths(out)))}")
        out["tasks"] = kept
    for task, entry in out["tasks"].items():  # a task left out may still lend its dims (`--tasks efficiency`)
        if "dims_from" in entry and entry["dims_from"] not in out["tasks"]:
            entry["dims"] = task_dims(preset, task)
    return out


def preset_lengths(preset: dict) -> list[int]:
    """Every sequence length the preset's tasks train or measure at."""
    found = set()
    for task, entry in preset["tasks"].items():
        found |= ({s["length"] for s in entry["settings"]} if task == "copy" else set(entry["lengths"])
                  if task == "efficiency" else {entry["length"]})
    return sorted(found)


def task_dims(preset: dict, task: str) -> dict:
    entry = preset["tasks"][task]
    return entry["dims"] if "dims" in entry else preset["tasks"][entry["dims_from"]]["dims"]


def plan(preset: dict) -> list[Stage]:
    """Every stage of the preset, in the order they run."""
    stages = []
    common = {"seed": preset["seed"], "optimizer": preset["optimizer"], "dropout": preset.get("dropout", 0.1)}
    tasks = preset["tasks"]
    # efficiency first (cheapest, and the goals need it), then the copy task, then ListOps and Text model by model,
    # so that a partial run already holds comparable pairs
    if "efficiency" in tasks:
        entry = tasks["efficiency"]
        for n in entry["lengths"]:
            for model in entry["models"]:
                check_length(model, n, entry.get("position_table"))
                stages.append(Stage(f"efficiency/{model}-n{n}", "efficiency",
                                    {"model": model, "n": n, "dims": task_dims(preset, "efficiency"),
                                     "batch_size": entry["batch_size"], "repeats": entry["repeats"],
                                     "budget": entry.get("budget"), "vocab_size": BYTES_VOCAB_SIZE,
                                     "dropout": preset.get("dropout", 0.1), "seed": preset["seed"],
                                     "timeout": entry.get("timeout", 1800),
                                     **({"retries": entry["retries"]} if "retries" in entry else {})}))
    if "copy" in tasks:
        entry = tasks["copy"]
        # the paper's variant, bf16 and the activation enter the arguments only where a preset names them, so that
        # the stages of presets without them keep the arguments they were recorded with; checkpointing changes no
        # result
        extra = {k: entry[k] for k in ("variant", "precision", "activation") if k in entry}
        options = {"checkpoint_every": entry["checkpoint_every"]} if entry.get("checkpoint_every") else {}
        for setting in entry["settings"]:
            for model in entry["models"]:
                stages.append(Stage(f"copy-n{setting['length']}/{model}", "copy",
                                    {**common, "dropout": entry.get("dropout", 0.0), "task": "copy", "model": model,
                                     "dims": entry["dims"], **setting, "log_every": entry.get("log_every", 10),
                                     **extra},
                                    options=dict(options)))
    models = list(dict.fromkeys(m for task in ("listops", "text") if task in tasks for m in tasks[task]["models"]))
    for model in models:
        for task in ("listops", "text"):
            entry = tasks.get(task)
            if entry and model in entry["models"]:
                data = {k: v for k, v in entry.items() if k not in ("models", "dims")}
                check_length(model, entry["length"], entry.get("position_table"))
                stages.append(Stage(f"{task}/{model}", "classify",
                                    {**common, "task": task, "model": model, "dims": entry["dims"], **data}))
    return stages


def task_notes(preset: dict) -> str:
    t = preset["tasks"]
    parts = []
    if "listops" in t:
        e = t["listops"]
        parts.append(f"ListOps n = {e['length']} ({e['min_tokens']}-{min(e['max_tokens'], e['length'] - 2)} tokens per "
                     f"expression, generator '{e.get('generator', 'sized')}', {e['train_size']} train / {e['eval_size']} "
                     f"eval, {e['steps']} steps x batch {e['batch_size']}, {POOLINGS[e.get('pooling', 'first')]})")
    if "text" in t:
        e = t["text"]
        parts.append(f"Text n = {e['length']} bytes ({e['steps']} steps x batch {e['batch_size']}, eval "
                     f"{e['eval_size']} rows: IMDB train held-out split with --dataset local, "
                     f"{POOLINGS[e.get('pooling', 'first')]})")
    if "copy" in t:
        e = t["copy"]
        settings = ", ".join(f"n = {s['length']} ({s['steps']} steps x batch {s['batch_size']})" for s in e["settings"])
        if e.get("variant", "fixed") == "paper":
            ranges = ", ".join("{}-{}".format(*copy_paper_lengths(s["length"])) for s in e["settings"])
            settings = (f"{settings}; the paper's generator: x sep x then padding, {ranges} symbols per sequence drawn "
                        "per sequence, loss on the separator and the copy")
        if e.get("precision", "float32") != "float32" or "dropout" in e:
            settings += f"; {e.get('precision', 'float32')}, hidden dropout {e.get('dropout', 0.0)}"
        if "activation" in e:
            settings += f"; feed-forward activation {e['activation']} (GPT-2-style decoders)"
        parts.append("copy " + settings)
    dims = {task: e["dims"] for task, e in t.items() if "dims" in e}
    parts.append("dims " + "; ".join(f"{k}: {v['hidden_size']} wide, {v['num_layers']} layers, {v['num_heads']} heads, "
                                     f"ffn {v['intermediate_size']}" for k, v in dims.items()))
    parts.append(f"{describe_optimizer(preset['optimizer'])}, seed {preset['seed']}, hidden dropout "
                 f"{preset.get('dropout', 0.1)}, attention dropout 0 for every model")
    return "; ".join(parts)


def describe_optimizer(o: dict) -> str:
    """The optimizer and schedule in words, as the report's task line gives them."""
    if o.get("name", "adamw") == "adamw":
        head = f"AdamW lr {o['lr']}, weight decay {o['weight_decay']}"
    else:
        head = (f"RAdam lr {o['lr']}, betas {tuple(o.get('betas', (0.9, 0.999)))}, decoupled weight decay "
                f"{o.get('weight_decay', 0.0)} on every parameter")
    if o.get("schedule", "linear") == "step":
        schedule = f"lr x {o['gamma']} after {', '.join(map(str, o['milestones']))} updates"
    else:
        schedule = f"linear warm-up {o.get('warmup_fraction', 0.1):.0%} then linear decay"
    clip = o.get("grad_clip", 1.0)
    return f"{head}, {schedule}, " + (f"clip {clip}" if clip is not None else "no gradient clipping")
