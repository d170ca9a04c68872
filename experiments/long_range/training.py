"""The one training loop of every model: plain torch, AdamW, linear warm-up then linear decay, gradient clipping."""

import math
import time

import torch

from .tasks import copy_batch, pad_batch


def make_optimizer(model, optim: dict, steps: int):
    """AdamW and the schedule shared by every model of a preset: linear warm-up, then linear decay to zero."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": optim["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=optim["lr"], betas=tuple(optim.get("betas", (0.9, 0.98))), eps=1e-8)
    warmup = max(1, int(optim.get("warmup_fraction", 0.1) * steps))

    def factor(step):
        return (step + 1) / warmup if step < warmup else max(0.0, (steps - step) / max(1, steps - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _step(model, optimizer, scheduler, batch, clip: float) -> float:
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    scheduler.step()
    return loss.item()


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
    losses, correct, total = [], 0, 0
    for ids, labels in batches:
        out = model(input_ids=ids, labels=labels)
        losses.append(out.loss.item())
        predicted = out.logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        keep = target != -100
        correct += (predicted[keep] == target[keep]).sum().item()
        total += keep.sum().item()
    model.train()
    return {"loss": sum(losses) / len(losses), "accuracy": correct / total, "scored": total}


def train_causal_lm(model, next_batch, steps: int, optim: dict, log_every: int, stop_on_nonfinite: bool = False) -> dict:
    """Train a causal LM on `steps` fresh (input_ids, labels) batches from `next_batch()`; the loss curve every
    `log_every` steps (Figure 2's shape) and the seconds it took."""
    optimizer, scheduler = make_optimizer(model, optim, steps)
    model.train()
    curve, window = [], []
    start = time.perf_counter()
    for step in range(steps):
        ids, labels = next_batch()
        window.append(_step(model, optimizer, scheduler, dict(input_ids=ids, labels=labels),
                            optim.get("grad_clip", 1.0)))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append([step + 1, sum(window) / len(window)])
            window = []
            if stop_on_nonfinite and not math.isfinite(curve[-1][1]):
                break
    seconds = time.perf_counter() - start
    return {"loss_curve": curve, "train_seconds": seconds, "steps": steps, "steps_per_second": steps / seconds}


def evaluate_copy(model, length: int, batch_size: int, batches: int, seed: int) -> dict:
    """Loss and token accuracy on the copied half, over fresh seeded batches."""
    generator = torch.Generator().manual_seed(seed)
    score = score_causal_lm(model, (copy_batch(batch_size, length, generator) for _ in range(batches)))
    return {"eval_loss": score["loss"], "eval_token_accuracy": score["accuracy"]}


def train_copy(model, length: int, steps: int, batch_size: int, optim: dict, seed: int, log_every: int) -> dict:
    """Train a causal LM on fresh copy-task batches; the loss curve every `log_every` steps (Figure 2's shape)."""
    generator = torch.Generator().manual_seed(seed)
    trained = train_causal_lm(model, lambda: copy_batch(batch_size, length, generator), steps, optim, log_every)
    return {**evaluate_copy(model, length, batch_size, 4, seed + 1), **trained}
