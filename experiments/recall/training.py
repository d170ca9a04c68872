"""Training and scoring on MQAR: fresh seeded batches every step (an endless task, as the copy task is), the long-range
suite's optimizer and step, accuracy only at the query positions."""

import math
import time

import torch

from experiments.long_range.training import _step, make_optimizer

from .tasks import mqar_batch


@torch.no_grad()
def evaluate_mqar(model, task: dict, batch_size: int, batches: int, seed: int) -> dict:
    """Loss and accuracy at the query positions over fresh batches from their own seed."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    losses, correct, total = [], 0, 0
    for _ in range(batches):
        ids, labels = mqar_batch(batch_size, generator=generator, **task)
        out = model(input_ids=ids, labels=labels)
        losses.append(out.loss.item())
        predicted, target = out.logits[:, :-1].argmax(-1), labels[:, 1:]
        keep = target != -100
        correct += (predicted[keep] == target[keep]).sum().item()
        total += keep.sum().item()
    model.train()
    return {"eval_loss": sum(losses) / len(losses), "eval_accuracy": correct / total, "eval_queries": total}


def train_mqar(model, task: dict, steps: int, batch_size: int, optim: dict, seed: int, log_every: int,
               eval_batches: int) -> dict:
    """Train on fresh MQAR batches for `steps`; the loss curve every `log_every` steps; then the held-out score."""
    generator = torch.Generator().manual_seed(seed)
    optimizer, scheduler = make_optimizer(model, optim, steps)
    model.train()
    curve, window = [], []
    start = time.perf_counter()
    for step in range(steps):
        ids, labels = mqar_batch(batch_size, generator=generator, **task)
        window.append(_step(model, optimizer, scheduler, dict(input_ids=ids, labels=labels), optim.get("grad_clip", 1.0)))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append([step + 1, sum(window) / len(window)])
            window = []
            if not math.isfinite(curve[-1][1]):
                break
    seconds = time.perf_counter() - start
    return {**evaluate_mqar(model, task, batch_size, eval_batches, seed + 10_000), "loss_curve": curve,
            "train_seconds": seconds, "steps": steps, "steps_per_second": steps / seconds}
