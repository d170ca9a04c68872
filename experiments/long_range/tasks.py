"""The long-range tasks: ListOps (seeded generator), byte-level IMDB text, and the copy task.

Every task yields token ids with the RoBERTa convention shared by all encoders here: <s> = 0, <pad> = 1, </s> = 2,
task symbols from 3 on. Classification inputs are `<s> tokens </s>`, padded on the right to the task length.
"""

import hashlib
import json
import random
from pathlib import Path

import torch

from hf_linear_attn.training.errors import UsageError

BOS, PAD, EOS = 0, 1, 2

# ------------------------------------------------------------------------------------------------------ ListOps
# Nangia & Bowman 2018 as generated for Long Range Arena: nested [MAX, [MIN, [MED (median), [SM (sum modulo 10)
# over the digits 0-9, each list closed by "]"; the label is the value of the whole expression (10 classes).
# Parentheses of the original release are left out, as LRA's input pipeline strips them.

LISTOPS_OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
LISTOPS_SYMBOLS = [str(d) for d in range(10)] + list(LISTOPS_OPERATORS) + ["]"]
LISTOPS_VOCAB = {symbol: 3 + i for i, symbol in enumerate(LISTOPS_SYMBOLS)}
LISTOPS_VOCAB_SIZE = 3 + len(LISTOPS_SYMBOLS)


def _apply(op: str, values: list[int]) -> int:
    if op == "[MAX":
        return max(values)
    if op == "[MIN":
        return min(values)
    if op == "[SM":
        return sum(values) % 10
    ordered = sorted(values)  # [MED: the median, rounded down for an even count (LRA: int(np.median))
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) // 2


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, leaf_p: float) -> tuple[list[str], int]:
    """(tokens, value) of a random expression: a digit with probability leaf_p (always at max_depth), else a list."""
    if depth > 0 and (depth >= max_depth or rng.random() < leaf_p):
        digit = rng.randrange(10)
        return [str(digit)], digit
    op = rng.choice(LISTOPS_OPERATORS)
    tokens, values = [op], []
    for _ in range(rng.randint(2, max_args)):
        sub_tokens, sub_value = _tree(rng, depth + 1, max_depth, max_args, leaf_p)
        tokens += sub_tokens
        values.append(sub_value)
    tokens.append("]")
    return tokens, _apply(op, values)


def generate_listops(count: int, seed: int, min_length: int, max_length: int, max_depth: int = 10,
                     max_args: int = 10, leaf_p: float = 0.75) -> list[tuple[list[str], int]]:
    """`count` (tokens, label) expressions of min_length..max_length tokens, by rejection as LRA's generator.

    LRA draws each argument as a digit with probability 0.75 and a nested list otherwise, up to depth 10 with 2-10
    arguments, and keeps expressions whose length lies in the window. The root is always a list here.
    """
    if not 1 <= min_length <= max_length:
        raise UsageError(f"ListOps needs 1 <= min_length <= max_length, got {min_length}, {max_length}: fix the preset.")
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < count:
        tries += 1
        if tries > 2000 * count + 100000:
            raise UsageError(f"ListOps: no expressions of {min_length}-{max_length} tokens after {tries} draws: widen "
                             "the window or raise max_depth / max_args in the preset.")
        tokens, value = _tree(rng, 0, max_depth, max_args, leaf_p)
        if min_length <= len(tokens) <= max_length:
            out.append((tokens, value))
    return out


def generate_listops_sized(count: int, seed: int, min_length: int, max_length: int, max_args: int = 10,
                           max_depth: int = 10) -> list[tuple[list[str], int]]:
    """As generate_listops, but grows each expression towards a drawn target length (fast for long windows).

    Each list draws its argument count and spends a share of its length budget on nested lists; expressions are
    kept only inside [min_length, max_length], so the lengths are exact, the structure random and nested.
    """
    rng = random.Random(seed)

    def grow(budget: int, depth: int) -> tuple[list[str], int]:
        if budget < 4 or depth >= max_depth:
            digit = rng.randrange(10)
            return [str(digit)], digit
        op = rng.choice(LISTOPS_OPERATORS)
        args = rng.randint(2, max_args)
        inner = budget - 2  # the operator and "]"
        # split the inner budget at random among the arguments; small shares become digits
        cuts = sorted(rng.random() for _ in range(args - 1))
        shares = [int(inner * (b - a)) for a, b in zip([0.0] + cuts, cuts + [1.0])]
        tokens, values = [op], []
        for share in shares:
            sub_tokens, sub_value = grow(share, depth + 1) if share >= 4 else grow(1, depth + 1)
            tokens += sub_tokens
            values.append(sub_value)
        tokens.append("]")
        return tokens, _apply(op, values)

    out = []
    while len(out) < count:
        target = rng.randint(min_length, max_length)
        tokens, value = grow(target, 0)
        if min_length <= len(tokens) <= max_length:
            out.append((tokens, value))
    return out


def evaluate_listops(tokens: list[str]) -> int:
    """Value of a ListOps expression given as tokens (a stack machine, independent of the generator)."""
    stack: list = []
    for token in tokens:
        if token == "]":
            args = []
            while not isinstance(stack[-1], str):
                args.append(stack.pop())
            op = stack.pop()
            args = sorted(args)
            if op == "[MAX":
                stack.append(args[-1])
            elif op == "[MIN":
                stack.append(args[0])
            elif op == "[SM":
                stack.append(sum(args) % 10)
            else:
                import statistics
                stack.append(int(statistics.median(args)))
        elif token in LISTOPS_OPERATORS:
            stack.append(token)
        else:
            stack.append(int(token))
    if len(stack) != 1:
        raise ValueError(f"not one expression: {stack[:5]}")
    return stack[0]


def encode_listops(tokens: list[str]) -> list[int]:
    """<s> ids </s> of a ListOps expression."""
    return [BOS] + [LISTOPS_VOCAB[t] for t in tokens] + [EOS]


# ------------------------------------------------------------------------------------------------- byte-level text

BYTES_VOCAB_SIZE = 3 + 256


def encode_bytes(text: str, max_length: int) -> list[int]:
    """<s> UTF-8 bytes + 3 </s>, the bytes truncated so the whole fits max_length (LRA keeps the first bytes)."""
    data = text.encode("utf-8")[: max_length - 2]
    return [BOS] + [b + 3 for b in data] + [EOS]


def decode_bytes(ids: list[int]) -> str:
    """The text of byte ids (specials dropped); an encoding cut inside a character decodes with a replacement."""
    return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


def load_imdb(dataset: str, data_dir: Path | None, eval_size: int, seed: int) -> dict:
    """{'train': [(text, label)], 'eval': [...], 'eval_name': str, 'digest': str}.

    local: ../shared/data/imdb/train.jsonl, with `eval_size` rows held out by a seeded shuffle (no IMDB test split
    offline). hub: stanfordnlp/imdb, train and its test split.
    """
    if dataset == "hub":
        try:
            from datasets import load_dataset

            hub = load_dataset("stanfordnlp/imdb")
        except Exception as error:  # noqa: BLE001 - offline, or the Hub unreachable
            raise UsageError(f"--dataset hub: could not load stanfordnlp/imdb ({type(error).__name__}: "
                             f"{str(error)[:200]}); use --dataset local with --data_dir pointing at shared/data") from error
        train = [(r["text"], int(r["label"])) for r in hub["train"]]
        test = [(r["text"], int(r["label"])) for r in hub["test"]]
        rng = random.Random(seed)
        rng.shuffle(test)
        return {"train": train, "eval": test[:eval_size] if eval_size else test,
                "eval_name": f"stanfordnlp/imdb test ({eval_size or len(test)} rows, seeded sample)",
                "digest": "hub:stanfordnlp/imdb"}
    if dataset != "local":
        raise UsageError(f"unknown --dataset {dataset!r}: use 'local' (../shared/data/imdb) or 'hub'")
    path = Path(data_dir or "") / "imdb" / "train.jsonl"
    if data_dir is None or not path.is_file():
        raise UsageError(f"IMDB not found at {path}: pass --data_dir pointing at the folder holding imdb/train.jsonl "
                         "(e.g. ../shared/data), or --dataset hub where the Hub is reachable")
    raw = path.read_bytes()
    rows = [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]
    pairs = [(r["text"], int(r["label"])) for r in rows]
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = set(order[:eval_size])
    return {"train": [pairs[i] for i in order[eval_size:]], "eval": [pairs[i] for i in sorted(held)],
            "eval_name": f"IMDB train, held-out split ({eval_size} rows, seed {seed}; not the IMDB test set)",
            "digest": hashlib.sha256(raw).hexdigest()}


# ------------------------------------------------------------------------------------------------------ copy task
# "Transformers are RNNs" section 4.1: sequences of symbols from an alphabet of 10, then a separator, then the
# same symbols again; a causal LM learns to reproduce the first half. Ids: 0 the separator, 1 padding, 3..12 the
# symbols (2 unused), so that the encoders' convention for padding holds here too.

COPY_SEPARATOR, COPY_SYMBOLS, COPY_VOCAB_SIZE = 0, 10, 13


def copy_batch(batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (batch, length): `sep x sep x` with x of length/2 - 1 symbols; labels are the
    input ids on the copied half (positions length/2 + 1 on) and -100 elsewhere (the model shifts them)."""
    if length % 2 or length < 4:
        raise UsageError(f"copy task length must be even and at least 4, got {length}: fix the preset")
    half = length // 2 - 1
    symbols = torch.randint(3, 3 + COPY_SYMBOLS, (batch_size, half), generator=generator)
    sep = torch.full((batch_size, 1), COPY_SEPARATOR)
    ids = torch.cat([sep, symbols, sep, symbols], dim=1)
    labels = ids.clone()
    labels[:, : half + 2] = -100
    return ids, labels


# The copy task as the paper's code draws it (the CopyTask generator of the authors' fast-transformers copy example,
# read in the copy kept at minhtannguyen/fmmformer-code-submission, causal-copy/main.py): each sequence draws its
# own number of symbols m uniformly from [length // 4, (length - 1) // 2) (32-62 at length 128), then reads
# `x sep x` followed by padding up to `length`. The loss covers the separator and the copy (positions m to 2m of
# the input: predicted from positions m - 1 to 2m - 1), never the first half or the padding. Here padding is its
# own id (1), where the original pads with the separator's id; the models are causal, so padding after the copy
# cannot change any scored prediction, and no attention mask is passed.

COPY_VARIANTS = ("fixed", "paper")


def copy_paper_lengths(length: int) -> tuple[int, int]:
    """(lowest, highest) number of symbols m per sequence of the paper's generator at this total length."""
    return length // 4, (length - 1) // 2 - 1


def check_copy_length(variant: str, length: int) -> None:
    """Refuse a copy-task length (or variant) the generator cannot fill, naming the fix."""
    if variant not in COPY_VARIANTS:
        raise UsageError(f"unknown copy task variant {variant!r}: use 'fixed' (sep x sep x, every sequence "
                         "length/2 - 1 symbols) or 'paper' (a random number of symbols per sequence, as the paper's "
                         "code)")
    if variant == "fixed":
        if length % 2 or length < 4:
            raise UsageError(f"copy task length must be even and at least 4, got {length}: fix the preset")
        return
    if not isinstance(length, int) or length < 8:
        raise UsageError(f"the paper's copy task draws {length // 4}-{(length - 1) // 2 - 1} symbols per sequence at "
                         f"length {length}, too few to copy: use a length of at least 8 (the paper uses 128)")


def copy_paper_batch(batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (batch, length): per row `x sep x pad...` with x of m random symbols, m drawn per
    row from copy_paper_lengths(length); labels are the input ids on the separator and the copy, -100 elsewhere
    (the model shifts them: the separator is predicted from the last symbol of x, as the original's loss mask)."""
    check_copy_length("paper", length)
    low, high = copy_paper_lengths(length)
    m = torch.randint(low, high + 1, (batch_size, 1), generator=generator)
    symbols = torch.randint(3, 3 + COPY_SYMBOLS, (batch_size, length), generator=generator)
    pos = torch.arange(length).expand(batch_size, length)
    first, second = pos < m, (pos > m) & (pos <= 2 * m)
    source = torch.where(second, pos - m - 1, pos)  # the copy reads the symbol of the first half it repeats
    ids = torch.full((batch_size, length), PAD, dtype=torch.long)
    ids = torch.where(first | second, symbols.gather(1, source), ids)
    ids = torch.where(pos == m, torch.full_like(ids, COPY_SEPARATOR), ids)
    labels = torch.where((pos >= m) & (pos <= 2 * m), ids, torch.full_like(ids, -100))
    return ids, labels


def copy_task_batch(variant: str, batch_size: int, length: int, generator: torch.Generator):
    """A batch of the copy task of this variant ('fixed': copy_batch, 'paper': copy_paper_batch)."""
    check_copy_length(variant, length)
    return (copy_batch if variant == "fixed" else copy_paper_batch)(batch_size, length, generator)


# ---------------------------------------------------------------------------------------------------- batching


def pad_batch(sequences: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), right-padded to `length`; refuses a longer sequence."""
    ids = torch.full((len(sequences), length), PAD, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq) > length:
            raise UsageError(f"a sequence of {len(seq)} tokens exceeds the task length {length}: raise the length")
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def digest_of(examples) -> str:
    """sha256 of a list of (ids, label) examples: the input digest recorded with a stage."""
    h = hashlib.sha256()
    for ids, label in examples:
        h.update(bytes(str(label), "ascii") + b":" + ",".join(map(str, ids)).encode() + b"\n")
    return h.hexdigest()
