"""Training and scoring on MQAR and passkey: fresh seeded batches every step (an endless task, as the copy task is),
the long-range suite's loop (`train_causal_lm`); MQAR scored by `score_causal_lm` at the query positions, passkey by
exact match and per-digit accuracy on the key's tokens, the loss on those tokens only."""

import torch

from experiments.long_range.training import score_causal_lm, train_causal_lm

from .tasks import mqar_batch


def evaluate_mqar(model, task: dict, batch_size: int, batches: int, seed: int) -> dict:
    """Loss and accuracy at the query positions over fresh batches from their own seed."""
    generator = torch.Generator().manual_seed(seed)
    score = score_causal_lm(model, (mqar_batch(batch_size, generator=generator, **task) for _ in range(batches)))
    return {"eval_loss": score["loss"], "eval_accuracy": score["accuracy"], "eval_queries": score["scored"]}


# A feature "keeps" a write across the pairs at >= half of it, "forgets" it at <= 5% (memory_spans' per-feature reading)
KEEPS_HALF, FORGETS = 0.5, 0.05

# The positions of a queried pair that an attention lookup can land on: the value's (2i + 1; where an induction head
# looks, the token after the key's first occurrence) and the two after it, the last positions whose short-convolution
# window (width 4: a position and the 3 before it) still holds the key and its value both.
LOOKUP_SPAN = 3


@torch.no_grad()
def lookup_attention(model, task: dict, batch_size: int, batches: int, seed: int) -> dict | None:
    """Where a trained model looks up: at each query of fresh MQAR batches (the queried key's position, where the
    value is predicted), each layer's and head's attention weight on the queried pair (its value's position and the
    LOOKUP_SPAN - 1 after it), averaged over the queries: "layers" the weight, "layers_abs" the share of the row's
    absolute weight there (for a signed matrix such as the delta rule's, where weights of both signs cancel in a
    sum). A head that recalls by attention puts most of its weight there; "uniform" is what a head spreading its
    weight evenly over the positions it sees would put there. None for a model whose weights are not an n x n matrix
    in position order (Linformer's k columns, Reformer's buckets) or that returns none (SDPA's GPT-2)."""
    if getattr(model.config, "model_type", None) == "reformer":  # LSH weights come sorted by bucket, not position
        return None
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums, uniform, queries = None, 0.0, 0
    try:
        for _ in range(batches):
            ids, labels = mqar_batch(batch_size, generator=generator, **task)
            attentions = model(input_ids=ids.to(device), output_attentions=True).attentions
            n = ids.shape[1]
            if not attentions or any(a is None or tuple(a.shape[-2:]) != (n, n) for a in attentions):
                return None
            rows, answers = (labels != -100).nonzero(as_tuple=True)
            at = answers - 1  # the queried key's position: the value is predicted there
            pair = (ids[:, 0 : 2 * task["pairs"] : 2][rows] == ids[rows, at][:, None]).int().argmax(-1)  # its pair
            span = 2 * pair[:, None] + 1 + torch.arange(LOOKUP_SPAN)  # (queries, LOOKUP_SPAN); beyond `at`: weight 0
            seen = span <= at[:, None]
            span = span.clamp(max=n - 1)
            # each layer's weights at the query rows (queries, heads, n), taken on the device, then those on the span:
            # the weight there, and its share of the row's absolute weight (the same for softmax and normalised linear
            # attention, whose rows are positive and sum to 1; the delta rule's are signed and unnormalised)
            weights = [a[rows.to(device), :, at.to(device)].float().cpu() for a in attentions]
            on_pair = [w.gather(-1, span[:, None, :].expand(-1, w.shape[1], -1)) * seen[:, None, :] for w in weights]
            mass = torch.stack([torch.stack((p.sum(-1), p.abs().sum(-1) / w.abs().sum(-1).clamp(min=1e-30)))
                                for p, w in zip(on_pair, weights)])  # (layers, 2, queries, heads)
            sums = mass.sum(2) if sums is None else sums + mass.sum(2)
            uniform += (seen.sum(-1) / (at + 1)).sum().item()
            queries += len(at)
    finally:
        model.train(was_training)
    means = sums / queries
    return {"layers": means[:, 0].tolist(), "layers_abs": means[:, 1].tolist(), "uniform": uniform / queries,
            "queries": queries}


@torch.no_grad()
def attention_inputs(model, task: dict, batch_size: int, seed: int, layers) -> tuple[torch.Tensor, dict]:
    """(input_ids, {layer: its attention's input}) of a forward in eval mode over one fresh MQAR batch drawn from
    `seed`, for the decoder layers numbered in `layers`: what a layer computes its decays from."""
    blocks = model.transformer.h
    inputs, hooks = {}, []
    for i in layers:
        hooks.append(blocks[i].attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        ids, _ = mqar_batch(batch_size, generator=torch.Generator().manual_seed(seed), **task)
        model(input_ids=ids.to(next(model.parameters()).device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return ids, inputs


@torch.no_grad()
def memory_spans(model, task: dict, batch_size: int, seed: int) -> dict | None:
    """How long each decayed state keeps what it holds: on a fresh MQAR batch, each layer's and head's per-token
    decay alpha_t (the layer's own ``per_token_inputs``: RetNet's fixed rates, GLA's gate, Gated DeltaNet's or KDA's;
    one alpha per feature averaged in the log, the geometric mean), as the mean alpha and the median share of the state
    kept across the context's pairs (2 x pairs tokens: what a pair written first still has at the first query); with
    one decay per feature also "features_kept" and "features_forgotten", the shares of the head's features that keep
    at least half a write across the pairs and at most FORGETS of it, each feature's median on its own. None for a
    model without a decaying layer. {"layers": [[{"alpha", "kept"(, "features_kept", "features_forgotten")} per
    head] or None per layer], "span"}."""
    layers = getattr(getattr(model, "transformer", None), "h", None) or []
    attentions = [getattr(block, "attn", None) for block in layers]
    decayed = [a is not None and getattr(a, "state_decay", None) is not None for a in attentions]
    if not any(decayed):
        return None
    span = 2 * task["pairs"]
    ids, inputs = attention_inputs(model, task, batch_size, seed, [i for i, d in enumerate(decayed) if d])
    out = []
    for i, attn in enumerate(attentions):
        if not decayed[i]:
            out.append(None)
            continue
        log_decay = attn.per_token_inputs(inputs[i])["log_decay"].float().cpu()
        features = {}
        if log_decay.dim() == 4:  # (B or 1, H, n or 1, g): the geometric mean over features
            # and each feature on its own: the share of a head's features that keep half a write across the pairs, and
            # that keep at most FORGETS of it (a third of them forgetting reads as "keeps nothing" in the geometric
            # mean, whatever the rest keep)
            per_feature = log_decay.expand(ids.shape[0], -1, ids.shape[1], -1).unfold(2, span, 1).sum(-1).exp()
            per_feature = per_feature.transpose(0, 1).flatten(1, 2).median(1).values  # (H, g): each one's median
            features = {"features_kept": (per_feature >= KEEPS_HALF).float().mean(-1),
                        "features_forgotten": (per_feature <= FORGETS).float().mean(-1)}
            log_decay = log_decay.mean(-1)
        log_decay = log_decay.expand(ids.shape[0], -1, ids.shape[1])  # (B, H, n)
        kept = log_decay.unfold(2, span, 1).sum(-1).exp()  # (B, H, windows)
        out.append([{"alpha": log_decay[:, h].exp().mean().item(), "kept": kept[:, h].median().item(),
                     **{key: share[h].item() for key, share in features.items()}}
                    for h in range(log_decay.shape[1])])
    return {"layers": out, "span": span}


def train_mqar(model, task: dict, steps: int, batch_size: int, optim: dict, seed: int, log_every: int,
               eval_batches: int, checkpointing=None, precision: str = "float32") -> dict:
    """Train on fresh MQAR batches for `steps`; the loss curve every `log_every` steps; then the held-out score.
    With `checkpointing` (the long-range suite's), a run killed mid-way goes on from its last checkpoint to the same
    batches, updates and score as a run never stopped. `precision` "bf16" autocasts the training forward (float32
    weights); the score is taken in float32."""
    generator = torch.Generator().manual_seed(seed)
    trained = train_causal_lm(model, lambda: mqar_batch(batch_size, generator=generator, **task), steps, optim,
                              log_every, stop_on_nonfinite=True, checkpointing=checkpointing, generator=generator,
                              precision=precision)
    return {**evaluate_mqar(model, task, batch_size, eval_batches, seed + 10_000), **trained}


class AnswerTokensLoss(torch.nn.Module):
    """A causal LM whose output head runs only where a label is (the pass key's few tokens), as pretraining's
    MaskedTokensLoss does for masked LM: `forward(input_ids, labels).loss` is `model(input_ids, labels=labels).loss`
    without the (batch, n, vocab) logits of the tokens that carry no label, all but a few per row: at n = 1,024 and a
    vocabulary of 8,000 those logits cost more than the layers of a 2-layer decoder of width 128."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def logits_and_targets(self, input_ids, labels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits at the labelled positions (labelled, vocab), their targets (labelled,), the mask (batch, n - 1))."""
        hidden = self.model.base_model(input_ids=input_ids).last_hidden_state[:, :-1]
        target = labels[:, 1:]  # the token after each position: the shift the model's own loss makes
        picked = target != -100
        return self.model.lm_head(hidden[picked]), target[picked], picked

    def forward(self, input_ids, labels):
        from transformers.modeling_outputs import CausalLMOutput

        logits, target, _ = self.logits_and_targets(input_ids, labels)
        return CausalLMOutput(loss=torch.nn.functional.cross_entropy(logits.float(), target))


@torch.no_grad()
def evaluate_passkey(model, batches, tokenizer=None) -> dict:
    """Exact match of the key and per-digit accuracy over (input_ids, labels, examples) batches, teacher-forced: the
    key is matched exactly when the argmax at every answer position is the key's next token, which is what greedy
    generation produces token by token; a digit counts as right when the token that carries it is predicted right
    (a byte-level BPE gives a key's tokens one or more digits each). Also the mean loss on the answer tokens, and
    each example's key ("keys": the key, the digits each of its tokens carries, the digits right, exact or not, and
    where the key was scored one digit per token the digits of the tokenizer's own writing of it): which
    keys a model misses, and whether they share a tokenization, is then read from the record, not inferred; with a
    `tokenizer`, a missed key's record also holds the model's argmax token at each answer position, teacher-forced,
    as text ("answered"): what it gave instead."""
    scorer = AnswerTokensLoss(model)
    model.eval()
    losses, keys = [], []
    for ids, labels, examples in batches:
        logits, target, picked = scorer.logits_and_targets(ids, labels)
        losses.append(torch.nn.functional.cross_entropy(logits.float(), target).item())
        answered = logits.argmax(-1)
        right = (answered == target).tolist()
        answered = answered.tolist()
        counts = picked.sum(-1).tolist()
        cursor = 0
        for example, count in zip(examples, counts):
            row, given = right[cursor : cursor + count], answered[cursor : cursor + count]
            cursor += count
            record = {"key": example.key, "token_digits": list(example.answer_digits),
                      "digits_right": sum(d for d, ok in zip(example.answer_digits, row) if ok), "exact": all(row)}
            if example.bpe_digits and example.bpe_digits != example.answer_digits:  # scored in another writing
                record["bpe_token_digits"] = list(example.bpe_digits)
            if tokenizer is not None and not record["exact"]:
                record["answered"] = [tokenizer.decode([t]) for t in given]
            keys.append(record)
    model.train()
    # the rates are the per-key record summed
    return {"exact_match": sum(k["exact"] for k in keys) / len(keys),
            "digit_accuracy": sum(k["digits_right"] for k in keys) / sum(sum(k["token_digits"]) for k in keys),
            "answer_loss": sum(losses) / len(losses), "examples": len(keys), "keys": keys}


def finetune_passkey(model, next_batch, steps: int, optim: dict, log_every: int, progress=None) -> dict:
    """Fine-tune on `steps` passkey batches from `next_batch()` -> (input_ids, labels, examples), with the loss on the
    answer's tokens only; the suite's loop (AdamW, warm-up then linear decay, clipping); `progress` gets a line every
    `log_every` steps."""
    return train_causal_lm(AnswerTokensLoss(model), lambda: next_batch()[:2], steps, optim, log_every,
                           stop_on_nonfinite=True, progress=progress)
