"""The passkey runner (scripts/recall.py with a preset whose "task" is "passkey"): resumable stages, then the report.

Stages, each recorded by the long-range suite's stage runner (a rerun reuses a finished stage and refuses one
finished with other arguments):

    tokenizer          a byte-level BPE trained on the preset's train_file (WikiText-2 train), once for every model,
                       with `train_bpe_tokenizer` (GPT-2's special tokens), as scripts/pretrain.py trains its own
    pretrain/<model>   causal-LM pretraining on WikiText-2 at the longest task length through scripts/pretrain.py's
                       own code path (`run_pretraining`, in this process), into <output_dir>/pretrain/<model>/;
                       left out when the preset's pretrain max_steps is 0 (the model then starts from random init)
    passkey/<model>    a short fine-tune on passkey examples (loss on the key's tokens only; filler from train_file),
                       then exact match and per-digit accuracy at every (length, depth) on examples whose filler is
                       validation_file's (text the model never trained on), and the decoding-state bytes at each length

Every model has the same depth, width, head size and feed-forward multiple (the recall suite's builder), the same
tokenizer, pretraining and fine-tuning budget and seed.
"""

import hashlib
import json
import math
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path

from experiments.long_range.models import Dims
from experiments.long_range.stages import (
    Stage, StageFailed, load_records, run_or_reload, stage_machines, whole_command, write_atomic,
)
from hf_linear_attn.training.errors import UsageError

from .models import LABELS, build_recall_model, check_models
from .passkey import DATA_HELP, check_depth, check_digits, check_key_tokens
from .runner import dims_for, read_preset

REPO = Path(__file__).resolve().parents[2]
PRESET_KEYS = {"description", "task", "seed", "train_file", "validation_file", "tokenizer_vocab_size",
               "filler_max_tokens", "digits", "lengths", "depths", "train_depths", "width", "num_layers", "head_size",
               "ffn_multiple", "pretrain", "finetune", "eval_examples", "eval_batch_size", "models", "key_tokens"}
OPTIONAL_KEYS = {"description", "key_tokens"}  # key_tokens: "bpe" (the default) or "digits" (see passkey.py)
FINETUNE_KEYS = {"steps", "batch_size", "optimizer", "log_every"}
# scripts/pretrain.py's arguments that the runner sets itself (the rest may be given in the preset's "pretrain")
RUNNER_SETS = {"output_dir", "model_config", "model_name_or_path", "tokenizer_name_or_path", "train_file",
               "validation_file", "max_seq_length", "seed", "resume", "resume_from_checkpoint", "overwrite_output_dir",
               "dataset_name", "dataset_config_name", "push_to_hub", "hub_model_id", "hub_token", "hub_private_repo"}
# Reformer's axial position table holds exactly one length; the passkey grid evaluates each model at several
NOT_FOR_PASSKEY = {"reformer_lsh": "its axial position table holds exactly one sequence length, and passkey evaluates "
                                   "every model at each of the preset's lengths"}


def data_path(name: str) -> Path:
    """A preset's data file: absolute, or relative to the project root (where ../shared/data is)."""
    path = Path(name)
    return path if path.is_absolute() else REPO / path


def load_preset(path: Path) -> dict:
    """Read and check a passkey preset: every key known and present, every model known and fit for the task, every
    depth, digit count and model shape possible, the data files there. What needs the tokenizer (a length too short,
    digits split unexpectedly) is checked as soon as it is trained, before any model is."""
    preset = read_preset(path, PRESET_KEYS, OPTIONAL_KEYS)
    check_key_tokens(preset.get("key_tokens", "bpe"))
    if preset["task"] != "passkey":
        raise UsageError(f"{Path(path).name}: task {preset['task']!r} is not 'passkey': fix the preset")
    check_models(preset["models"])
    for name in preset["models"]:
        if name in NOT_FOR_PASSKEY:
            raise UsageError(f"{name} cannot run passkey: {NOT_FOR_PASSKEY[name]}; drop it from the preset's models")
    if preset["width"] % preset["head_size"]:
        raise UsageError(f"width {preset['width']} is not a multiple of head_size {preset['head_size']}: fix the "
                         "preset")
    check_digits(preset["digits"])
    if not preset["lengths"] or any(not isinstance(n, int) or n < 1 for n in preset["lengths"]):
        raise UsageError(f"lengths must be positive whole numbers of tokens, got {preset['lengths']}: fix the preset")
    for depth in preset["depths"]:
        check_depth(depth)
    low, high = preset["train_depths"]
    check_depth(low)
    check_depth(high)
    if low > high:
        raise UsageError(f"train_depths is a range (low, high), got {preset['train_depths']}: swap them")
    wrong = set(preset["finetune"]) ^ FINETUNE_KEYS
    if wrong:
        raise UsageError(f"finetune must give exactly {sorted(FINETUNE_KEYS)} (wrong: {sorted(wrong)}): fix the preset")
    if preset["finetune"]["steps"] < 1 or preset["eval_examples"] < 1:
        raise UsageError("finetune steps and eval_examples must be at least 1: fix the preset")
    from hf_linear_attn.training.pretraining_arguments import PretrainArguments

    known = {f.name for f in fields(PretrainArguments)} - RUNNER_SETS
    if set(preset["pretrain"]) - known:
        raise UsageError(f"pretrain: {sorted(set(preset['pretrain']) - known)} are not scripts/pretrain.py arguments "
                         "this runner leaves to the preset (it sets the model, tokenizer, data, length, seed and "
                         f"folders itself); choose from {sorted(known)}")
    if "max_steps" not in preset["pretrain"]:
        raise UsageError("pretrain must give max_steps (0: no pretraining, every model starts from random init)")
    for key in ("train_file", "validation_file"):
        if not data_path(preset[key]).is_file():
            raise UsageError(f"{key} {preset[key]} not found (at {data_path(preset[key])}): {DATA_HELP}")
    return preset


def pretrained(preset: dict) -> bool:
    return preset["pretrain"]["max_steps"] > 0


def plan(preset: dict, models=None) -> list[Stage]:
    """The tokenizer, then each model's pretraining and passkey stage (a partial run already holds whole models)."""
    models = models or preset["models"]
    check_models(models)
    common = {"train_file": preset["train_file"], "tokenizer_vocab_size": preset["tokenizer_vocab_size"]}
    stages = [Stage("tokenizer", "tokenizer", dict(common))]
    for model in models:
        pretrain = {**common, "model": model, "dims": dims_for(preset, preset["width"]),
                    "length": max(preset["lengths"]),
                    "validation_file": preset["validation_file"], "seed": preset["seed"],
                    "pretrain": preset["pretrain"]}
        if pretrained(preset):
            stages.append(Stage(f"pretrain/{model}", "pretrain", pretrain))
        stages.append(Stage(f"passkey/{model}", "passkey", {
            **pretrain, "start": "pretrained" if pretrained(preset) else "random init",
            **{key: preset[key] for key in ("lengths", "depths", "train_depths", "digits", "finetune", "eval_examples",
                                            "eval_batch_size", "filler_max_tokens")},
            # only where it is not the default, so that the stages recorded before the option are still this one
            **({"key_tokens": preset["key_tokens"]} if preset.get("key_tokens", "bpe") != "bpe" else {})}))
    return stages


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------- stages

def run_tokenizer(stage: Stage, output_dir: Path, preset: dict) -> dict:
    """A byte-level BPE on the train file's text (as scripts/pretrain.py trains one), checked against the task."""
    from hf_linear_attn.training.data import load_text_corpus, train_bpe_tokenizer

    from .passkey import check_passkey_settings, min_passkey_length

    a = stage.args
    corpus, _ = load_text_corpus(train_file=str(data_path(a["train_file"])))
    tokenizer = train_bpe_tokenizer(corpus["train"]["text"], a["tokenizer_vocab_size"], "gpt2",
                                    max(preset["lengths"]))
    # refuse a length too short or digits split unexpectedly now, before any model is trained
    check_passkey_settings(tokenizer, preset["lengths"], [*preset["depths"], *preset["train_depths"]],
                           preset["digits"], seed=preset["seed"])
    folder = output_dir / "tokenizer"
    partial = folder.with_name(folder.name + ".partial")
    tokenizer.save_pretrained(partial)
    if folder.exists():  # an earlier run's, never recorded (interrupted): training is deterministic, replace it
        import shutil

        shutil.rmtree(folder)
    partial.replace(folder)
    stage.digests = {"tokenizer.json": file_digest(folder / "tokenizer.json")}
    return {"vocab_size": len(tokenizer), "shortest_length": min_passkey_length(tokenizer, preset["digits"])}


def pretrain_argv(stage: Stage, output_dir: Path) -> list[str]:
    """scripts/pretrain.py's arguments for a stage (paths absolute), the model config written beside the stages."""
    a = stage.args
    config_file = output_dir / "model_configs" / f"{a['model']}.json"
    argv = ["--model_config", str(config_file), "--tokenizer_name_or_path", str(output_dir / "tokenizer"),
            "--train_file", str(data_path(a["train_file"])), "--validation_file", str(data_path(a["validation_file"])),
            "--max_seq_length", str(a["length"]), "--seed", str(a["seed"]),
            "--output_dir", str(output_dir / "pretrain" / a["model"])]
    for key, value in a["pretrain"].items():
        argv += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv


def run_pretrain(stage: Stage, output_dir: Path) -> dict:
    """Causal-LM pretraining through scripts/pretrain.py's code path; an interrupted run resumes from its newest
    checkpoint, one killed before any checkpoint starts again."""
    from hf_linear_attn.training.arguments import parse_arguments
    from hf_linear_attn.training.pretraining import checkpoints_in, run_pretraining
    from hf_linear_attn.training.pretraining_arguments import PretrainArguments

    a = stage.args
    tokenizer_file = output_dir / "tokenizer" / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise StageFailed(f"no tokenizer in {output_dir / 'tokenizer'}: the tokenizer stage has not finished")
    # the model's config from the suite's builder (the MQAR models' settings); scripts/pretrain.py sets its vocabulary
    # and special ids from the tokenizer
    config = build_recall_model(a["model"], Dims(**a["dims"]), a["length"], a["tokenizer_vocab_size"]).config
    config_file = output_dir / "model_configs" / f"{a['model']}.json"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config.to_json_file(config_file)
    folder = output_dir / "pretrain" / a["model"]
    argv = pretrain_argv(stage, output_dir)
    if folder.is_dir() and any(folder.iterdir()):  # an interrupted attempt
        argv += ["--resume"] if checkpoints_in(folder) else ["--overwrite_output_dir"]
    stage.digests = {"tokenizer.json": file_digest(tokenizer_file)}
    args, _ = parse_arguments((PretrainArguments,), argv)
    started = time.perf_counter()
    results = run_pretraining(args)
    portable = [arg.replace(str(output_dir), "$OUTPUT_DIR").replace(str(REPO) + "/", "") for arg in argv]
    return {"eval_loss": results.get("eval_loss"), "perplexity": results.get("perplexity"),
            "steps": results["steps"], "train_rows": results["train_rows"],
            "mixed_precision": results["mixed_precision"], "seconds": time.perf_counter() - started,
            "command": "python scripts/pretrain.py " + shlex.join(portable)}


def run_passkey(stage: Stage, output_dir: Path) -> dict:
    """Fine-tune on passkey examples, then score every (length, depth) cell and measure the decoding state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_linear_attn  # noqa: F401  (registers the package's models with the Auto classes)

    from .models import decoding_state_bytes
    from .passkey import check_passkey_settings, load_filler, passkey_batch
    from .training import evaluate_passkey, finetune_passkey

    a, f = stage.args, stage.args["finetune"]
    tokenizer_dir = output_dir / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise StageFailed(f"no tokenizer in {tokenizer_dir}: the tokenizer stage has not finished")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    key_tokens = a.get("key_tokens", "bpe")
    check_passkey_settings(tokenizer, a["lengths"], [*a["depths"], *a["train_depths"]], a["digits"], seed=a["seed"],
                           key_tokens=key_tokens)
    train_filler = load_filler(data_path(a["train_file"]), tokenizer, a["filler_max_tokens"])
    eval_filler = load_filler(data_path(a["validation_file"]), tokenizer, a["filler_max_tokens"])
    torch.manual_seed(a["seed"])
    if a["start"] == "pretrained":
        folder = output_dir / "pretrain" / a["model"]
        if not (folder / "config.json").is_file():
            raise StageFailed(f"no pretrained model in {folder}: its pretrain stage has not finished")
        model = AutoModelForCausalLM.from_pretrained(folder)
        weights = folder / "model.safetensors"
        stage.digests = {"model.safetensors": file_digest(weights)} if weights.is_file() else {}
    else:
        model = build_recall_model(a["model"], Dims(**a["dims"]), max(a["lengths"]), len(tokenizer))
        stage.digests = {}
    stage.digests["tokenizer.json"] = file_digest(tokenizer_dir / "tokenizer.json")
    first, _, _ = passkey_batch(2, a["lengths"][0], train_filler, tokenizer, torch.Generator().manual_seed(a["seed"]),
                                tuple(a["train_depths"]), a["digits"], key_tokens)
    stage.digests["first_batch_sum"] = int(first.sum())

    generator, step = torch.Generator().manual_seed(a["seed"]), [0]

    def next_batch():  # the lengths in turn, each row at its own depth in train_depths
        n = a["lengths"][step[0] % len(a["lengths"])]
        step[0] += 1
        return passkey_batch(f["batch_size"], n, train_filler, tokenizer, generator, tuple(a["train_depths"]),
                             a["digits"], key_tokens)

    trained = finetune_passkey(model, next_batch, f["steps"], f["optimizer"], f["log_every"],
                               progress=lambda line: print(f"    {stage.key}: fine-tune {line}", flush=True))
    # the fine-tuned weights stay beside the pretrained ones (not committed), so a later question about the scores
    # (which keys, which depths) is answered from the model scored instead of a fine-tune repeated
    model.save_pretrained(output_dir / "finetune" / a["model"])
    cells, started = [], time.perf_counter()
    for li, n in enumerate(a["lengths"]):
        for di, depth in enumerate(a["depths"]):
            # each cell its own seed: a cell's examples do not depend on which other cells the preset has
            cell = torch.Generator().manual_seed(a["seed"] + 10_000 + 1_000 * li + di)
            sizes = [min(a["eval_batch_size"], a["eval_examples"] - s)
                     for s in range(0, a["eval_examples"], a["eval_batch_size"])]
            score = evaluate_passkey(model, (passkey_batch(size, n, eval_filler, tokenizer, cell, depth, a["digits"],
                                                           key_tokens) for size in sizes), tokenizer)
            cells.append({"length": n, "depth": depth, **score})
    return {"cells": cells, "exact_match": sum(c["exact_match"] for c in cells) / len(cells),
            "digit_accuracy": sum(c["digit_accuracy"] for c in cells) / len(cells),
            "state_bytes": {str(n): decoding_state_bytes(model, n, len(tokenizer)) for n in a["lengths"]},
            "parameters": sum(p.numel() for p in model.parameters()), "eval_seconds": time.perf_counter() - started,
            "filler_tokens": {"train": len(train_filler), "validation": len(eval_filler)}, **trained}


def missing_outputs(output_dir: Path):
    """`run_stages`' retake: a finished tokenizer stage whose folder is gone is trained again (deterministic: the
    same tokenizer), and so is a finished pretraining whose model is gone while its passkey stage still needs it."""
    finished = set(load_records(output_dir))

    def retake(record: dict) -> bool:
        if record["kind"] == "tokenizer":
            return not (output_dir / "tokenizer" / "tokenizer.json").is_file()
        if record["kind"] == "pretrain":
            model = record["args"]["model"]
            return (f"passkey/{model}" not in finished
                    and not (output_dir / "pretrain" / model / "config.json").is_file())
        return False

    return retake


# ------------------------------------------------------------------------------------------------------- report

def summarise(records: dict) -> dict:
    """{model: {"cells", "state_bytes", "pretrain", ...}} from the finished passkey and pretrain stages."""
    models = {}
    for record in records.values():
        a, m = record["args"], record["metrics"]
        if record["kind"] == "passkey":
            models.setdefault(a["model"], {}).update({
                "cells": m["cells"], "state_bytes": m["state_bytes"], "exact_match": m["exact_match"],
                "digit_accuracy": m["digit_accuracy"], "parameters": m["parameters"], "start": a["start"],
                "finetune_loss": m["loss_curve"][-1][1] if m["loss_curve"] else None,
                "finetune_seconds": m["train_seconds"], "seconds": record["seconds"]})
        elif record["kind"] == "pretrain":
            models.setdefault(a["model"], {})["pretrain"] = {
                "perplexity": m["perplexity"], "eval_loss": m["eval_loss"], "seconds": record["seconds"],
                "command": m["command"], "mixed_precision": m["mixed_precision"]}
    return {name: entry for name, entry in models.items() if "cells" in entry}


def render(models: dict, meta: dict) -> str:
    out = ["# Passkey retrieval", "", f"Command: `{meta['command']}`.", "",
           f"Machine: {meta['machine']}" + "".join(f"; {text}" for text in meta.get("hardware", []))
           + f". Preset: {meta['preset']}, {meta['finished']} of {meta['total']} stages finished. {meta['notes']}", "",
           "Cells: exact match of the key (per-digit accuracy in brackets), teacher-forced: exact match is what greedy "
           "generation gives. State: bytes of one sequence's decoding cache after n tokens (float32).", ""]
    depths = sorted({c["depth"] for entry in models.values() for c in entry["cells"]})
    out += ["| model | n | state | " + " | ".join(f"depth {d:.0%}" for d in depths) + " | all depths |",
            "|---" * (len(depths) + 4) + "|"]
    for name, entry in models.items():
        for n in sorted({c["length"] for c in entry["cells"]}):
            cells = {c["depth"]: c for c in entry["cells"] if c["length"] == n}
            state = entry["state_bytes"].get(str(n))
            mean_exact = sum(c["exact_match"] for c in cells.values()) / len(cells)
            mean_digit = sum(c["digit_accuracy"] for c in cells.values()) / len(cells)
            out.append(f"| {LABELS.get(name, name)} | {n:,} | {state / 1024:,.0f} KiB | " if state else
                       f"| {LABELS.get(name, name)} | {n:,} | - | ")
            out[-1] += " | ".join(f"{cells[d]['exact_match']:.0%} ({cells[d]['digit_accuracy']:.0%})" if d in cells
                                  else "-" for d in depths) + f" | {mean_exact:.0%} ({mean_digit:.0%}) |"
    out += misses_by_token(models)
    out += ["", "## Training", "", "| model | parameters | start | pretraining: validation perplexity | fine-tune: "
            "final loss on the key | stage time |", "|---|---|---|---|---|---|"]
    for name, entry in models.items():
        pre = entry.get("pretrain") or {}
        ppl = f"{pre['perplexity']:,.1f}" if pre.get("perplexity") else "-"
        loss = f"{entry['finetune_loss']:.3f}" if entry.get("finetune_loss") is not None else "-"
        minutes = (entry["seconds"] + pre.get("seconds", 0)) / 60
        out.append(f"| {LABELS.get(name, name)} | {entry['parameters']:,} | {entry['start']} | {ppl} | {loss} | "
                   f"{minutes:,.1f} min |")
    command = next((e["pretrain"]["command"] for e in models.values() if e.get("pretrain")), None)
    if command:
        out += ["", f"Pretraining command of each model (run in-process by the runner): `{command}` (the first "
                "model's; the others differ only in the model config and folder)."]
    out += ["", "Plot: passkey.png (exact match by depth and length, one panel per model). Records of every stage: "
            "records.json."]
    return "\n".join(out) + "\n"


# A byte-level BPE trained on WikiText-2 holds number tokens of three and four digits (mostly years: " 1955", " 190"),
# so a few random 5-digit keys in a hundred are written with one of them (54 of passkey-keys' 1,000 scored keys); the
# rest use tokens of one or two digits, which every fine-tune sees thousands of times. A model whose misses are those
# keys has learnt to copy the tokens it was trained on, not to find the key: the split below tells the two apart.
LONG_TOKEN_DIGITS = 3


def misses_by_token(models: dict) -> list[str]:
    """The report's lines splitting each model's exact match by how its keys are tokenized, for the models whose
    cells record their keys (evaluate_passkey's "keys"; stages recorded before 2026-11-28 do not)."""
    rows = []
    for name, entry in models.items():
        keys = [k for c in entry["cells"] for k in c.get("keys", [])]
        if not keys or len(keys) != sum(c["examples"] for c in entry["cells"]):
            continue
        # split by the tokenizer's own writing of the key, also where it was scored one digit per token
        is_long = [max(k.get("bpe_token_digits", k["token_digits"])) >= LONG_TOKEN_DIGITS for k in keys]
        long = [k for k, flag in zip(keys, is_long) if flag]
        short = [k for k, flag in zip(keys, is_long) if not flag]

        def share(group):
            hit = sum(k["exact"] for k in group)
            return f"{hit} of {len(group)} ({hit / len(group):.0%})" if group else "-"

        # a missed key, and where recorded the model's teacher-forced argmax token at each answer position
        missed = [k["key"] + (f" ({'|'.join(t.strip() for t in k['answered'])})" if k.get("answered") else "")
                  for k in keys if not k["exact"]]
        shown = ", ".join(missed[:8]) + (f" and {len(missed) - 8} more" if len(missed) > 8 else "")
        rows.append(f"| {LABELS.get(name, name)} | {share(long)} | {share(short)} | {shown or 'none'} |")
    if not rows:
        return []
    return ["", "## Misses by the key's tokens", "",
            f"Exact match over every cell, split by how the tokenizer writes the key: with a token of "
            f"{LONG_TOKEN_DIGITS} or more digits (mostly years, such as ' 1955'), or with "
            "tokens of one and two digits only (where a preset writes the key one digit per token, the split is by "
            "the writing the tokenizer would have given it). A model that misses only the first kind copies the "
            "tokens its fine-tune taught it and finds the key at every depth.", "",
            "Keys missed: the key, then in brackets the model's argmax at each of its token positions (teacher-forced, "
            "the true tokens before it).", "",
            f"| model | keys with a token of {LONG_TOKEN_DIGITS}+ digits: exact | other keys: exact | keys missed |",
            "|---|---|---|---|", *rows]


def plot(models: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(models) or ["none"]
    import textwrap

    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.1), squeeze=False)
    image = None
    for ax, name in zip(axes[0], names):
        cells = models.get(name, {}).get("cells", [])
        depths = sorted({c["depth"] for c in cells})
        lengths = sorted({c["length"] for c in cells})
        grid = [[next((c["exact_match"] for c in cells if (c["length"], c["depth"]) == (n, d)), float("nan"))
                 for d in depths] for n in lengths]
        image = ax.imshow(grid or [[float("nan")]], vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=7,
                            color="white" if value < 0.6 else "black")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths], fontsize=7)
        ax.set_title(textwrap.fill(LABELS.get(name, name), 26), fontsize=8)
        ax.set_xlabel("depth of the key", fontsize=7)
    axes[0][0].set_ylabel("n (tokens)", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="exact match")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def describe(preset: dict) -> str:
    p, f, o = preset["pretrain"], preset["finetune"], preset["finetune"]["optimizer"]
    start = (f"pretrained on WikiText-2 train ({preset['train_file']}) at n = {max(preset['lengths']):,} with "
             f"scripts/pretrain.py's code path for {p['max_steps']:,} steps"
             + (f" x batch {p['per_device_train_batch_size']}" if "per_device_train_batch_size" in p else "")
             + (f", lr {p['learning_rate']}" if "learning_rate" in p else "") if pretrained(preset)
             else "from random init (the preset's pretrain max_steps is 0)")
    return (f"{preset['num_layers']} layers x width {preset['width']}, head size {preset['head_size']}, feed-forward "
            f"{preset['ffn_multiple']}x width; byte-level BPE of {preset['tokenizer_vocab_size']:,} tokens trained on "
            f"WikiText-2 train. Each model {start}; then fine-tuned on passkey examples for {f['steps']:,} steps x "
            f"batch {f['batch_size']} (lengths in turn, depths uniform in {preset['train_depths'][0]:.0%}-"
            f"{preset['train_depths'][1]:.0%}, filler from WikiText-2 train, loss on the key's tokens only"
            + ("; the key written one digit per token" if preset.get("key_tokens", "bpe") == "digits" else "")
            + "), AdamW lr "
            f"{o['lr']}, warm-up {o.get('warmup_fraction', 0.1):.0%} then linear decay, seed {preset['seed']}. Scored "
            f"on {preset['eval_examples']} examples per cell with {preset['digits']}-digit keys and filler from "
            f"WikiText-2 validation ({preset['validation_file']}), text no model trained on.")


def run(preset_path: Path, output_dir: Path, models=None, dry_run=False, report_only=False, argv=None,
        log=print) -> dict:
    from benchmarks.measuring import hardware_of_records

    preset = load_preset(preset_path)
    stages = plan(preset, models)
    if dry_run:
        for stage in stages:
            log(f"{stage.key}: {json.dumps(stage.args)}")
        log(f"{len(stages)} stages")
        return {}
    output_dir = Path(output_dir).resolve()
    runners = {"tokenizer": lambda stage: run_tokenizer(stage, output_dir, preset),
               "pretrain": lambda stage: run_pretrain(stage, output_dir),
               "passkey": lambda stage: run_passkey(stage, output_dir)}
    records, machine = run_or_reload(stages, lambda stage: runners[stage.kind](stage), output_dir, report_only, log,
                                     retake=missing_outputs(output_dir))
    # the report covers every finished stage of the whole preset, so that a --models slice adds its rows instead of
    # replacing the folder's report with the slice's, under the command that runs the whole preset
    whole = plan(preset)
    keys = {s.key for s in whole}
    finished = {k: r for k, r in records.items() if k in keys}
    summary = summarise(finished)
    # the machines the stages ran on (each record keeps its own), not the one writing the report
    meta = {"preset": Path(preset_path).stem, "machine": stage_machines(finished, machine), "finished": len(finished),
            "total": len(whole),
            "hardware": hardware_of_records(finished.values()), "date": time.strftime("%Y-%m-%d"),
            "command": "python scripts/recall.py " + shlex.join(whole_command(sys.argv[1:] if argv is None else argv,
                                                                              ("--models",))),
            "notes": describe(preset)}
    write_atomic(output_dir / "results.json", json.dumps({"meta": meta, "models": summary}, indent=1))
    write_atomic(output_dir / "results.md", render(summary, meta))
    plot(summary, output_dir / "passkey.png")
    return {"meta": meta, "models": summary}


# ------------------------------------------------------------------------------------------------------ estimate

def estimate(preset_path: Path, models=None, log=print, repeats: int = 2) -> dict:
    """A projection of the preset's time from a probe of a few steps of each model on this machine: a pretraining
    step at the longest length, a fine-tune step and an evaluation batch at each length (random tokens: the time
    does not depend on the text). Data preparation (tokenizer, packing, filler) is not probed."""
    import torch

    from benchmarks.measuring import describe_machine
    from hf_linear_attn.training.accelerator import resolve_mixed_precision

    from .training import AnswerTokensLoss

    preset = load_preset(preset_path)
    models = models or preset["models"]
    check_models(models)
    p, f = preset["pretrain"], preset["finetune"]
    vocab, n_max, lengths = preset["tokenizer_vocab_size"], max(preset["lengths"]), preset["lengths"]
    bf16 = resolve_mixed_precision(p.get("mixed_precision", "auto")) == "bf16"

    def timed(step) -> float:
        step()  # the first call pays for allocation and kernel selection
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return min(times)

    def train_step(model, ids, labels, scorer=None):
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and scorer is None):
                loss = (scorer or model)(input_ids=ids, labels=labels).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        return step

    log(f"probing on {describe_machine()}")
    rows, total = [], 0.0
    for name in models:
        torch.manual_seed(0)
        model = build_recall_model(name, Dims(**dims_for(preset, preset["width"])), n_max, vocab)
        seconds = 0.0
        if pretrained(preset):
            batch = p.get("per_device_train_batch_size", 16)
            ids = torch.randint(3, vocab, (batch, n_max))
            pre = timed(train_step(model, ids, ids))
            evals = math.ceil(p["max_steps"] / p.get("eval_steps", 200))
            eval_rows = p.get("max_eval_samples") or 250  # WikiText-2 validation: about 250 rows of 1,024 tokens
            seconds += p["max_steps"] * pre + evals * eval_rows * pre / batch / 3  # a forward: about 1/3 of a step
        per_length = {}
        for n in lengths:
            ids = torch.randint(3, vocab, (f["batch_size"], n))
            labels = torch.full_like(ids, -100)
            labels[:, -preset["digits"]:] = ids[:, -preset["digits"]:]
            ft = timed(train_step(model, ids, labels, AnswerTokensLoss(model)))
            eval_ids = torch.randint(3, vocab, (preset["eval_batch_size"], n))
            with torch.no_grad():
                fwd = timed(lambda: model.base_model(input_ids=eval_ids))
            per_length[n] = (ft, fwd)
            seconds += (f["steps"] / len(lengths)) * ft
            seconds += len(preset["depths"]) * math.ceil(preset["eval_examples"] / preset["eval_batch_size"]) * fwd
        total += seconds
        rows.append({"model": name, "pretrain_step": pre if pretrained(preset) else None,
                     "finetune_step": {str(n): v[0] for n, v in per_length.items()},
                     "eval_batch": {str(n): v[1] for n, v in per_length.items()}, "projected_seconds": seconds})
        log(f"{name}: " + (f"pretrain step {pre:.2f} s at n = {n_max}; " if pretrained(preset) else "")
            + "; ".join(f"n = {n}: fine-tune step {ft:.2f} s, eval batch {fwd:.2f} s" for n, (ft, fwd)
                        in per_length.items()) + f"; projected {seconds / 3600:.2f} h")
    log(f"projected total: {total / 3600:.1f} h for {len(models)} models (model compute only; tokenizer, packing "
        "and filler add about a minute per model)")
    return {"machine": describe_machine(), "models": rows, "projected_seconds": total}
