"""The one training loop of every model: plain torch; AdamW with linear warm-up then linear decay and gradient
clipping (every preset's default), or RAdam with a step schedule (the copy task as "Transformers are RNNs" ran it);
float32 or bf16 autocast; for long stages, checkpoints every N steps from which a rerun resumes exactly."""

import contextlib
import errno
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hf_linear_attn.training.errors import DiskFullError, UsageError

from .tasks import COPY_SEPARATOR, copy_batch, copy_paper_lengths, copy_task_batch, pad_batch

OPTIMIZERS = ("adamw", "radam")
SCHEDULES = ("linear", "step")
PRECISIONS = ("float32", "bf16")


def check_optimizer(optim: dict) -> None:
    """Refuse an optimizer block the loop cannot run, naming the fix."""
    name, schedule = optim.get("name", "adamw"), optim.get("schedule", "linear")
    if name not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer name {name!r}: use 'adamw' (AdamW, the default) or 'radam' (RAdam, "
                         "as the copy task of 'Transformers are RNNs')")
    if not isinstance(optim.get("lr"), (int, float)) or optim["lr"] <= 0:
        raise UsageError(f"optimizer 'lr' must be a positive number, got {optim.get('lr')!r}: fix the preset")
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown optimizer schedule {schedule!r}: use 'linear' (warm-up, then linear decay to "
                         "zero) or 'step' (lr times 'gamma' at each of 'milestones', counted in updates)")
    if schedule == "step":
        milestones, gamma = optim.get("milestones"), optim.get("gamma")
        if (not isinstance(milestones, list) or not milestones
                or any(not isinstance(m, int) or m < 1 for m in milestones) or milestones != sorted(milestones)):
            raise UsageError(f"schedule 'step' needs 'milestones', a rising list of positive update counts (the paper: "
                             f"[3000]), got {milestones!r}: fix the preset")
        if not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
            raise UsageError(f"schedule 'step' needs 'gamma' in (0, 1] (the paper: 0.1), got {gamma!r}: fix the preset")
    clip = optim.get("grad_clip", 1.0)
    if clip is not None and (not isinstance(clip, (int, float)) or clip <= 0):
        raise UsageError(f"'grad_clip' must be a positive number, or null for no clipping, got {clip!r}")


def make_optimizer(model, optim: dict, steps: int):
    """The optimizer and schedule shared by every model of a preset. Default: AdamW (weight decay on matrices only),
    linear warm-up, then linear decay to zero. `"name": "radam"`: RAdam (Liu et al. 2020) with decoupled weight
    decay on every parameter, as the original RAdam code the copy task's paper trained with. `"schedule": "step"`:
    the lr times `gamma` after each of `milestones` updates (the paper: 1e-3, then 1e-4 after 3,000)."""
    check_optimizer(optim)
    if optim.get("name", "adamw") == "radam":
        optimizer = torch.optim.RAdam(model.parameters(), lr=optim["lr"],
                                      betas=tuple(optim.get("betas", (0.9, 0.999))), eps=optim.get("eps", 1e-8),
                                      weight_decay=optim.get("weight_decay", 0.0), decoupled_weight_decay=True)
    else:
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": optim["weight_decay"]},
                                       {"params": no_decay, "weight_decay": 0.0}],
                                      lr=optim["lr"], betas=tuple(optim.get("betas", (0.9, 0.98))), eps=1e-8)
    if optim.get("schedule", "linear") == "step":
        milestones, gamma = optim["milestones"], optim["gamma"]

        def factor(step):  # `step` updates done: update step + 1 runs at lr * factor(step)
            return gamma ** sum(step >= m for m in milestones)

        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    warmup = max(1, int(optim.get("warmup_fraction", 0.1) * steps))

    def factor(step):
        return (step + 1) / warmup if step < warmup else max(0.0, (steps - step) / max(1, steps - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def device_of(model) -> torch.device:
    """Where the model's weights are (the CPU for a module without any)."""
    return next(model.parameters(), torch.empty(0)).device


def check_device(device: str) -> None:
    """Refuse, before any work, a device a stage cannot train on: 'cpu', or 'cuda' where torch sees a GPU."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: use 'cpu' (the default) or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); run "
                         "on a machine with a GPU and a CUDA build of torch, or leave --device out")


def device_name(device: str) -> str:
    """How a stage record names the GPU it trained on (CPU records name no device)."""
    return f"{device}: {torch.cuda.get_device_name(device)}"


def autocast_for(model, precision: str):
    """The forward's autocast context for a precision: float32 runs as is; bf16 autocasts on the model's device
    (float32 weights, optimizer state and gradients; matmuls in bfloat16)."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}: use 'float32' or 'bf16' (bfloat16 autocast)")
    if precision == "float32":
        return None
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)


def _step(model, optimizer, scheduler, batch, clip: float | None, autocast=None) -> float:
    with autocast if autocast is not None else contextlib.nullcontext():
        loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    scheduler.step()
    return loss.item()


# ------------------------------------------------------------------------------------------------------ checkpoints


@dataclass
class Checkpointing:
    """Where and how often a training run saves what it needs to go on (`path`, every `every` steps), the arguments
    that say which run it is (`identity`: a checkpoint of another run is refused), and where progress is told."""

    path: Path
    every: int
    identity: dict
    log: Callable[[str], None] | None = None


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save into a temp file beside `path`, flushed to disk, then renamed over it: a kill at any moment leaves
    the previous checkpoint or the new one, never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        if error.errno == errno.ENOSPC:
            raise DiskFullError(f"no space left for the checkpoint in {path.parent}: free some, then rerun the "
                                "same command (it resumes from the last checkpoint)") from error
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(checkpointing: Checkpointing) -> dict | None:
    """The checkpoint of this run, None if there is none; a UsageError if it was written by another run."""
    if not checkpointing.path.is_file():
        return None
    state = torch.load(checkpointing.path, map_location="cpu", weights_only=True)
    identity = json.loads(json.dumps(checkpointing.identity))
    if state["identity"] != identity:
        changed = sorted(k for k in set(state["identity"]) | set(identity)
                         if state["identity"].get(k) != identity.get(k))
        raise UsageError(f"the checkpoint {checkpointing.path} was written by a run with other arguments (changed: "
                         f"{', '.join(changed)}): delete it to start the stage over, or use another --output_dir")
    return state


def checkpoint_progress(path: Path, identity: dict) -> dict | None:
    """How far the run that writes the checkpoint at `path` has come: its step, loss curve, training seconds and the
    steps it resumed at; None where there is no checkpoint or it belongs to a run with other arguments. Read for
    reports while the run goes on (checkpoints are replaced whole, never written in place)."""
    try:
        state = load_checkpoint(Checkpointing(Path(path), 1, identity))
    except UsageError:  # another run's checkpoint: nothing of this stage's to show
        return None
    if state is None:
        return None
    return {"step": state["step"], "curve": state["curve"], "seconds": state["seconds"],
            "resumed_at": state["resumed_at"]}


def train_causal_lm(model, next_batch, steps: int, optim: dict, log_every: int, stop_on_nonfinite: bool = False,
                    precision: str = "float32", checkpointing: Checkpointing | None = None,
                    generator: torch.Generator | None = None, progress=None) -> dict:
    """Train a causal LM on `steps` fresh (input_ids, labels) batches from `next_batch()`; the loss curve every
    `log_every` steps (Figure 2's shape) and the seconds it took. `progress`, where given, is called with a line
    (step, loss, speed) at each point of the curve: what a background run's log shows while it trains.

    With `checkpointing`, every `every` steps the model, optimizer, schedule, the RNG states (torch's global one,
    Python's, and `generator`, the one `next_batch` draws from; on a GPU, the device's generator too) and the curve
    so far are saved, and a run that finds its checkpoint goes on from there: the same batches, dropout masks and
    updates as a run never stopped. The batches are drawn on the CPU (the same on every device) and moved to the
    model's device."""
    device = device_of(model)
    optimizer, scheduler = make_optimizer(model, optim, steps)
    autocast = autocast_for(model, precision)
    model.train()
    curve, window, first, seconds_before, resumed = [], [], 0, 0.0, []
    state = load_checkpoint(checkpointing) if checkpointing else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:  # dropout masks drawn on the GPU
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        random.setstate(state["python_rng"])
        if generator is not None:
            generator.set_state(state["generator"])
        curve, window, first = state["curve"], state["window"], state["step"]
        seconds_before, resumed = state["seconds"], state["resumed_at"] + [first]
        if checkpointing.log:
            checkpointing.log(f"resuming from the checkpoint at step {first} of {steps}")
            if state["threads"] != torch.get_num_threads():
                checkpointing.log(f"the checkpoint ran {state['threads']} torch threads, this run "
                                  f"{torch.get_num_threads()} (OMP_NUM_THREADS): the curve goes on correctly, but "
                                  "sums may round differently from a run never stopped; set the same number to "
                                  "continue it bit for bit")
    start = time.perf_counter()
    for step in range(first, steps):
        ids, labels = (t.to(device) for t in next_batch())
        window.append(_step(model, optimizer, scheduler, dict(input_ids=ids, labels=labels),
                            optim.get("grad_clip", 1.0), autocast))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append([step + 1, sum(window) / len(window)])
            window = []
            if progress is not None:
                speed = (step + 1 - first) / (time.perf_counter() - start)
                progress(f"step {step + 1} of {steps}, loss {curve[-1][1]:.4g}, {speed:.3g} steps/s")
            if stop_on_nonfinite and not math.isfinite(curve[-1][1]):
                break
        if checkpointing and (step + 1) % checkpointing.every == 0 and step + 1 < steps:
            elapsed = seconds_before + time.perf_counter() - start
            save_checkpoint(checkpointing.path, {
                "identity": json.loads(json.dumps(checkpointing.identity)), "step": step + 1,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                "generator": generator.get_state() if generator is not None else None,
                "curve": curve, "window": window, "seconds": elapsed, "resumed_at": resumed,
                "threads": torch.get_num_threads()})
            if checkpointing.log:
                last = f", loss {curve[-1][1]:.4g} at step {curve[-1][0]}" if curve else ""
                speed = (step + 1 - first) / (elapsed - seconds_before)
                checkpointing.log(f"step {step + 1} of {steps}{last}, {speed:.3g} steps/s: checkpoint saved")
    seconds = seconds_before + time.perf_counter() - start
    out = {"loss_curve": curve, "train_seconds": seconds, "steps": steps, "steps_per_second": steps / seconds}
    return {**out, "resumed_at": resumed} if resumed else out


@torch.no_grad()
def evaluate_classifier(model, examples, length: int, batch_size: int) -> float:
    """Accuracy of a sequence classifier on (ids, label) examples."""
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        ids, mask = pad_batch([ids for ids, _ in chunk], length)
        logits = model(input_ids=ids, attention_mask=mask).logits
        correct += (logits.argmax(-1) == torch.tensor([label for _, label in chunk])).sum().item()
    model.train()
    return correct / max(1, len(examples))


def train_classifier(model, train, evaluation, length: int, steps: int, batch_size: int, optim: dict, seed: int,
                     log_every: int, eval_batch_size: int | None = None) -> dict:
    """Train on (ids, label) examples for `steps` batches (seeded reshuffle each epoch); accuracy on `evaluation`."""
    generator = torch.Generator().manual_seed(seed)
    optimizer, scheduler = make_optimizer(model, optim, steps)
    model.train()
    order, cursor, curve, window = torch.randperm(len(train), generator=generator).tolist(), 0, [], []
    start = time.perf_counter()
    for step in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(train), generator=generator).tolist(), 0
        chunk = [train[i] for i in order[cursor : cursor + batch_size]]
        cursor += batch_size
        ids, mask = pad_batch([ids for ids, _ in chunk], length)
        labels = torch.tensor([label for _, label in chunk])
        window.append(_step(model, optimizer, scheduler, dict(input_ids=ids, attention_mask=mask, labels=labels),
                            optim.get("grad_clip", 1.0)))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append([step + 1, sum(window) / len(window)])
            window = []
            if not math.isfinite(curve[-1][1]):
                break
    train_seconds = time.perf_counter() - start
    accuracy = evaluate_classifier(model, evaluation, length, eval_batch_size or batch_size)
    return {"eval_accuracy": accuracy, "loss_curve": curve, "train_seconds": train_seconds,
            "steps": steps, "steps_per_second": steps / train_seconds, "examples_seen": steps * batch_size,
            "eval_rows": len(evaluation)}


@torch.no_grad()
def score_causal_lm(model, batches) -> dict:
    """Loss and accuracy of a causal LM at its labelled positions over (input_ids, labels) batches (the model shifts
    the labels): what the copy task and recall score."""
    model.eval()
    device = device_of(model)
    losses, correct, total = [], 0, 0
    for ids, labels in batches:
        ids, labels = ids.to(device), labels.to(device)
        out = model(input_ids=ids, labels=labels)
        losses.append(out.loss.item())
        predicted = out.logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        keep = target != -100
        correct += (predicted[keep] == target[keep]).sum().item()
        total += keep.sum().item()
    model.train()
    return {"loss": sum(losses) / len(losses), "accuracy": correct / total, "scored": total}


def evaluate_copy(model, length: int, batch_size: int, batches: int, seed: int, variant: str = "fixed") -> dict:
    """Loss and token accuracy on the scored positions, over fresh seeded batches. The paper's variant scores the
    separator and the copy, as it trains (eval_loss, eval_token_accuracy: token-weighted), and adds the copy alone
    (eval_copy_loss, eval_copy_accuracy) and the separator alone (eval_separator_loss, eval_separator_accuracy). All
    can reach zero: the separator is scored only where it falls, so a model that predicts it after every symbol of
    the first half (where nothing else is scored) is never wrong. Where the copy goes wrong: its token accuracy by
    the sequence's number of symbols m (four equal ranges of the generator's lengths) and by the token's place in
    the copy (its quarters, from the first symbols copied to the last; every one was read m + 1 tokens before, so
    the place says how many tokens the model has taken in by then: m + 1 + place)."""
    generator = torch.Generator().manual_seed(seed)
    if variant == "fixed":
        score = score_causal_lm(model, (copy_batch(batch_size, length, generator) for _ in range(batches)))
        return {"eval_loss": score["loss"], "eval_token_accuracy": score["accuracy"]}
    model.eval()
    device = device_of(model)
    sums = {"all": [0.0, 0, 0], "copy": [0.0, 0, 0], "separator": [0.0, 0, 0]}  # loss, correct, tokens
    low, high = copy_paper_lengths(length)
    bins = {"length": torch.zeros(2, 4), "place": torch.zeros(2, 4)}  # correct, tokens per bin
    with torch.no_grad():
        for _ in range(batches):
            ids, labels = copy_task_batch(variant, batch_size, length, generator)
            logits = model(input_ids=ids.to(device)).logits[:, :-1].float().cpu()
            target = labels[:, 1:]
            losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                       ignore_index=-100, reduction="none").view_as(target)
            right = logits.argmax(-1) == target
            scored = target != -100
            copied = scored & (target != COPY_SEPARATOR)
            for part, keep in (("all", scored), ("copy", copied), ("separator", scored & (target == COPY_SEPARATOR))):
                sums[part][0] += losses[keep].sum().item()
                sums[part][1] += right[keep].sum().item()
                sums[part][2] += keep.sum().item()
            m = (ids == COPY_SEPARATOR).long().argmax(1, keepdim=True)  # the separator's position: m symbols before
            place = torch.arange(1, length) - m - 1  # 0 .. m - 1 along the copy (target j predicts token j + 1)
            for name, which in (("length", ((m - low) * 4 // (high - low + 1)).expand_as(target)),
                                ("place", (place * 4 // m).clamp(0, 3))):
                for b in range(4):
                    keep = copied & (which == b)
                    bins[name][0, b] += right[keep].sum().item()
                    bins[name][1, b] += keep.sum().item()
    model.train()
    edges = [low - (-(high - low + 1) * b // 4) for b in range(5)]  # bin b holds m with 4 (m - low) // span == b
    by_length = {f"m {edges[b]}-{edges[b + 1] - 1}": (bins["length"][0, b] / bins["length"][1, b]).item()
                 for b in range(4) if bins["length"][1, b]}
    by_place = {f"quarter {b + 1}": (bins["place"][0, b] / bins["place"][1, b]).item()
                for b in range(4) if bins["place"][1, b]}
    return {"eval_loss": sums["all"][0] / sums["all"][2], "eval_token_accuracy": sums["all"][1] / sums["all"][2],
            "eval_copy_loss": sums["copy"][0] / sums["copy"][2],
            "eval_copy_accuracy": sums["copy"][1] / sums["copy"][2],
            "eval_separator_loss": sums["separator"][0] / sums["separator"][2],
            "eval_separator_accuracy": sums["separator"][1] / sums["separator"][2],
            "eval_copy_accuracy_by_length": by_length, "eval_copy_accuracy_by_place": by_place}


def train_copy(model, length: int, steps: int, batch_size: int, optim: dict, seed: int, log_every: int,
               variant: str = "fixed", precision: str = "float32", checkpointing: Checkpointing | None = None) -> dict:
    """Train a causal LM on fresh copy-task batches of `variant` ('fixed' or the paper's); the loss curve every
    `log_every` steps (Figure 2's shape), then the scores on 4 fresh batches from another seed (in float32)."""
    generator = torch.Generator().manual_seed(seed)
    trained = train_causal_lm(model, lambda: copy_task_batch(variant, batch_size, length, generator), steps, optim,
                              log_every, precision=precision, checkpointing=checkpointing, generator=generator)
    return {**evaluate_copy(model, length, batch_size, 4, seed + 1, variant), **trained}
