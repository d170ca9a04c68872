"""Training and scoring on MQAR: fresh seeded batches every step (an endless task, as the copy task is), the long-range
suite's loop (`train_causal_lm`) and scoring (`score_causal_lm`), accuracy only at the query positions."""

import torch

from experiments.long_range.training import score_causal_lm, train_causal_lm

from .tasks import mqar_batch


def evaluate_mqar(model, task: dict, batch_size: int, batches: int, seed: int) -> dict:
    """Loss and accuracy at the query positions over fresh batches from their own seed."""
    generator = torch.Generator().manual_seed(seed)
    score = score_causal_lm(model, (mqar_batch(batch_size, generator=generator, **task) for _ in range(batches)))
    return {"eval_loss": score["loss"], "eval_accuracy": score["accuracy"], "eval_queries": score["scored"]}


def train_mqar(model, task: dict, steps: int, batch_size: int, optim: dict, seed: int, log_every: int,
               eval_batches: int) -> dict:
    """Train on fresh MQAR batches for `steps`; the loss curve every `log_every` steps; then the held-out score."""
    generator = torch.Generator().manual_seed(seed)
    trained = train_causal_lm(model, lambda: mqar_batch(batch_size, generator=generator, **task), steps, optim,
                              log_every, stop_on_nonfinite=True)
    return {**evaluate_mqar(model, task, batch_size, eval_batches, seed + 10_000), **trained}
