"""Multi-query associative recall (MQAR; Zoology, Arora et al. 2023, arXiv 2312.04927): the generator and an
independent checker.

A sequence of n tokens starts with D key-value pairs ``k_1 v_1 ... k_D v_D`` (distinct keys); the rest holds the D
keys again as queries, each at its own random slot and followed by its value, in random order, with random tokens
between them. A causal LM is scored only where it must recall: the token after each queried key is that key's value
(labels are -100 elsewhere; the model shifts them, as Transformers' causal LMs do). Nothing but the pairs at the start
tells the value, so a model must keep D associations in its state until their query comes.

Token ids: 0 and 1 as the other tasks use them (<s>, <pad>; never generated), 2 unused, then ``num_keys`` key ids,
then ``num_values`` value ids. Queries sit on even offsets after the context (slots of two tokens: key, value), drawn
uniformly among the free slots; Zoology draws query gaps from a power law (``power_a``), which puts queries closer to
the context on average: uniform slots make the mean distance to recall longer, never shorter.
"""

import torch

from hf_linear_attn.training.errors import UsageError

FIRST_ID = 3  # ids 0 (<s>), 1 (<pad>) and 2 are never part of a sequence


def mqar_vocab_size(num_keys: int, num_values: int) -> int:
    """Embedding rows a model needs for this task's ids."""
    return FIRST_ID + num_keys + num_values


def check_mqar(length: int, pairs: int, num_keys: int, num_values: int) -> None:
    """Refuse settings the generator cannot honour, naming the fix, before any model is built."""
    if pairs < 1:
        raise UsageError(f"MQAR needs at least one key-value pair, got pairs={pairs}: fix the preset")
    if 4 * pairs > length:
        raise UsageError(f"MQAR with {pairs} pairs needs at least {4 * pairs} tokens (the pairs, then each key queried "
                         f"with its value), got length {length}: lengthen the sequence or use at most {length // 4} "
                         "pairs")
    if pairs > num_keys:
        raise UsageError(f"MQAR with {pairs} distinct keys needs num_keys >= {pairs}, got {num_keys}: raise num_keys")
    if num_values < 2:
        raise UsageError(f"MQAR needs at least 2 value tokens, got num_values={num_values}: raise num_values")


def mqar_batch(batch_size: int, length: int, pairs: int, num_keys: int, num_values: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (batch, length) long: see the module docstring."""
    check_mqar(length, pairs, num_keys, num_values)
    key_base, value_base = FIRST_ID, FIRST_ID + num_keys
    rows = torch.arange(batch_size)[:, None]
    # distinct keys per row: the first `pairs` of a random permutation of the key ids
    keys = torch.rand(batch_size, num_keys, generator=generator).argsort(-1)[:, :pairs] + key_base
    values = torch.randint(num_values, (batch_size, pairs), generator=generator) + value_base
    # the rest: random tokens (keys or values), then the queries written over their slots
    ids = torch.randint(FIRST_ID, FIRST_ID + num_keys + num_values, (batch_size, length), generator=generator)
    ids[:, 0 : 2 * pairs : 2], ids[:, 1 : 2 * pairs : 2] = keys, values
    free_slots = (length - 2 * pairs) // 2
    slots = torch.rand(batch_size, free_slots, generator=generator).argsort(-1)[:, :pairs]  # distinct slots
    order = torch.rand(batch_size, pairs, generator=generator).argsort(-1)  # which pair each slot queries
    query_positions = 2 * pairs + 2 * slots
    ids[rows, query_positions] = keys[rows, order]
    ids[rows, query_positions + 1] = values[rows, order]
    labels = torch.full_like(ids, -100)
    labels[rows, query_positions + 1] = values[rows, order]
    return ids, labels


def check_mqar_batch(ids: torch.Tensor, labels: torch.Tensor, pairs: int) -> None:
    """An independent check of a generated batch, row by row in plain Python: distinct keys in the context, exactly
    `pairs` labelled positions, each the value its preceding (queried) key was given in the context, each key queried
    once, every label equal to the token it labels. Raises AssertionError naming the first row that breaks a rule."""
    for row, (seq, lab) in enumerate(zip(ids.tolist(), labels.tolist())):
        context = {seq[2 * i]: seq[2 * i + 1] for i in range(pairs)}
        assert len(context) == pairs, f"row {row}: keys repeat in the context"
        targets = [t for t, label in enumerate(lab) if label != -100]
        assert len(targets) == pairs, f"row {row}: {len(targets)} labelled positions, expected {pairs}"
        queried = []
        for t in targets:
            assert t >= 2 * pairs + 1, f"row {row}: a label inside the context (position {t})"
            key = seq[t - 1]
            assert key in context, f"row {row}: the token before label {t} is not a key of the context"
            assert lab[t] == context[key] == seq[t], f"row {row}: label {t} is not its key's value"
            queried.append(key)
        assert sorted(queried) == sorted(context), f"row {row}: not every key is queried exactly once"
