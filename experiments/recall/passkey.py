"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300): the generator and an
independent checker.

An example is exactly n tokens of real WikiText-2 text with one sentence hidden in it, then a question, then the
answer::

    <filler ...> The pass key is 48213. Remember it.<filler ...> What is the pass key? The pass key is 48213
                 '---------- key sentence ---------'             '------------ question -------------' answer

The key is a random number of `digits` digits (no leading zero), stated once. The key sentence starts at
round(depth x F) of the F filler tokens (depth 0: before all of them, depth 1: after all of them), so the depth says
how far back the key sits from the question. A causal LM is scored only on the answer's tokens (labels are -100
elsewhere; the model shifts them): it must copy the key from the sentence, which nothing else in the text tells.

Landmark Attention's prompt repeats one made-up paragraph ("The grass is green. The sky is blue. ...") as filler;
ours is real text, as the decoders are pretrained on it, so the model cannot learn where the key is from the
filler's regularity. Their sentence also says the key twice ("... Remember it. 48213 is the pass key."); ours says it
once, so the one copy sits where the depth says.

Token ids, not text, are put together: the filler is the pretraining token stream (each WikiText line's tokens, then
the end-of-text token, as `pack_corpus` packs them), cut at a token boundary. A byte-level BPE (GPT-2's pre-tokenizer)
tokenizes a number separately from the words and punctuation around it, so the key's tokens are the same in the
sentence and after the question; `passkey_parts` refuses a tokenizer for which that does not hold.

How the key is written in tokens (`key_tokens`): "bpe" (the default) as the tokenizer writes the number, in tokens of
one to four digits; a BPE trained on WikiText-2 holds years and other common numbers (" 1955", " 190") as single
tokens, so a few keys in a hundred carry one, each too rare among random keys for a short fine-tune to teach it as an
answer. "digits" writes the key one digit per token (" 4" "8" "2" "1" "3"), as LLaMA's tokenizer, the one Landmark
Attention tested, writes every number: ten answer tokens, each seen thousands of times, so a miss is a key not found.
The text is the same either way; only its token ids differ.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_linear_attn.training.errors import UsageError

KEY_TOKENS = ("bpe", "digits")
KEY_SENTENCE = " The pass key is {key}. Remember it."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"
MIN_FILLER = 10  # filler tokens an example must hold at least: depths 10% apart then land on different tokens
DATA_HELP = "see ../shared/data/README.md, or name another file in the preset"


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of text, no special tokens."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class PasskeyParts:
    """The token ids of one key's sentence, the question and the answer (the key's own tokens)."""

    key: str
    sentence: list[int]
    question: list[int]
    answer: list[int]
    answer_digits: list[int]  # digits each answer token carries (its text, leading space removed)


def check_key_tokens(key_tokens: str) -> None:
    if key_tokens not in KEY_TOKENS:
        raise UsageError(f"key_tokens must be 'bpe' (the key as the tokenizer writes it) or 'digits' (one digit per "
                         f"token), got {key_tokens!r}: fix the preset")


def key_ids(tokenizer, key: str, key_tokens: str = "bpe") -> list[int]:
    """The token ids of " <key>": as the tokenizer writes it ("bpe"), or one digit at a time ("digits": the first
    digit with its leading space, as GPT-2's pre-tokenizer keeps " 4" together, then each other digit alone)."""
    check_key_tokens(key_tokens)
    if key_tokens == "bpe":
        return encode(tokenizer, ANSWER.format(key=key))
    return [t for i, digit in enumerate(key) for t in encode(tokenizer, (" " if i == 0 else "") + digit)]


def passkey_parts(tokenizer, key: str, key_tokens: str = "bpe") -> PasskeyParts:
    """The sentence, question and answer of `key`, refusing a tokenizer that splits the digits unexpectedly: the answer
    must decode to the key, token by token (so that each digit belongs to one answer token), and be a run of the
    sentence's own tokens (else the model would have to answer with tokens it never saw in the context). With
    key_tokens "digits" the sentence holds the key's digit tokens between the tokens of the text around it (a byte-level
    BPE's pre-tokenizer cuts the text at the number, so those are the tokens the whole sentence has there)."""
    before, after = KEY_SENTENCE.split("{key}")
    question, answer = encode(tokenizer, QUESTION), key_ids(tokenizer, key, key_tokens)
    sentence = (encode(tokenizer, KEY_SENTENCE.format(key=key)) if key_tokens == "bpe"
                else encode(tokenizer, before.rstrip(" ")) + answer + encode(tokenizer, after))
    fix = ("use a byte-level BPE whose pre-tokenizer splits numbers from words and punctuation, as "
           "train_bpe_tokenizer's (GPT-2's) does")
    pieces = [tokenizer.decode([t]) for t in answer]
    if "".join(pieces) != ANSWER.format(key=key):
        raise UsageError(f"the tokenizer does not give the key back: {ANSWER.format(key=key)!r} is tokenized as "
                         f"{tokenizer.convert_ids_to_tokens(answer)}, whose tokens decode to {''.join(pieces)!r}; "
                         f"{fix}")
    if not any(sentence[i : i + len(answer)] == answer for i in range(len(sentence) - len(answer) + 1)):
        raise UsageError(f"the tokenizer writes the key {key} differently inside the key sentence "
                         f"({tokenizer.convert_ids_to_tokens(sentence)}) than as the answer "
                         f"({tokenizer.convert_ids_to_tokens(answer)}): the answer is no copy of the context; {fix}")
    if key_tokens == "digits" and pieces != [" " + key[0], *key[1:]]:
        raise UsageError(f"key_tokens 'digits' needs a token for each digit and for each digit after a space; this "
                         f"tokenizer writes {ANSWER.format(key=key)!r} one digit at a time as "
                         f"{tokenizer.convert_ids_to_tokens(answer)}: use key_tokens 'bpe', or a tokenizer trained on "
                         "text with numbers")
    # the pieces are the key's digits and one leading space (a lone space token, as SentencePiece's, carries none)
    return PasskeyParts(key, sentence, question, answer, [len(piece.strip()) for piece in pieces])


def check_digits(digits: int) -> None:
    if not 1 <= digits <= 18:
        raise UsageError(f"a pass key has 1 to 18 digits, got digits={digits}: fix the preset (Landmark Attention "
                         "uses 5)")


def check_depth(depth: float) -> None:
    if not 0.0 < depth < 1.0:
        raise UsageError(f"a depth is a fraction of the filler strictly between 0 and 1, got {depth}: use e.g. 0.1 "
                         "(the key near the start) to 0.9 (near the question)")


def min_passkey_length(tokenizer, digits: int, key_tokens: str = "bpe") -> int:
    """The shortest example that holds any key of `digits` digits: the key sentence and question, two copies of the key
    at one token per digit (the most a byte-level BPE can take), and MIN_FILLER filler tokens."""
    parts = passkey_parts(tokenizer, "1" * digits, key_tokens)
    return len(parts.sentence) - len(parts.answer) + len(parts.question) + 2 * digits + MIN_FILLER


def check_passkey_settings(tokenizer, lengths, depths, digits: int, sample_keys: int = 500, seed: int = 0,
                           key_tokens: str = "bpe") -> None:
    """Refuse, before any model is built, what the generator cannot honour: a depth outside (0, 1), a length too
    short for the key sentence, question and answer, and a tokenizer that splits the digits unexpectedly (checked
    on `sample_keys` seeded random keys; every drawn key is checked again when it is used)."""
    check_digits(digits)
    check_key_tokens(key_tokens)
    for depth in depths:
        check_depth(depth)
    shortest = min_passkey_length(tokenizer, digits, key_tokens)
    for n in lengths:
        if n < shortest:
            raise UsageError(f"length {n} is too short for a pass key of {digits} digits: the key sentence, the "
                             f"question, the answer and {MIN_FILLER} filler tokens need {shortest} tokens; use lengths "
                             f">= {shortest}")
    generator = torch.Generator().manual_seed(seed)
    for key in torch.randint(10 ** (digits - 1), 10**digits, (sample_keys,), generator=generator).tolist():
        passkey_parts(tokenizer, str(key), key_tokens)


def load_filler(path, tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """The token stream of a WikiText file as the decoders are pretrained on it (`pack_corpus`): each non-empty line's
    tokens followed by the end-of-text token. Stops after the line that passes `max_tokens` (None: the whole file).
    Returns a 1-d long tensor."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no filler text at {path}: {DATA_HELP}")
    if tokenizer.eos_token_id is None:
        raise UsageError("the tokenizer has no end-of-text token to separate the filler's lines, as pretraining does")
    stream, lines = [], []

    def flush():
        if not lines:
            return
        for ids in tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(tokenizer.eos_token_id)
        lines.clear()

    with path.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.rstrip("\n")
            if line.strip():  # empty lines are skipped, as load_text_corpus skips them
                lines.append(line)
            if len(lines) == 1000:
                flush()
                if max_tokens is not None and len(stream) >= max_tokens:
                    break
    flush()
    if max_tokens is not None:
        stream = stream[:max_tokens]
    return torch.tensor(stream, dtype=torch.long)


@dataclass
class PasskeyExample:
    """One example: ids and labels (length n), the key, where its sentence, the question and the answer start."""

    input_ids: list[int]
    labels: list[int]
    key: str
    depth: float
    key_start: int
    question_start: int
    answer_start: int
    answer_digits: list[int] = field(default_factory=list)
    # the digits of each token the tokenizer's own writing (key_tokens "bpe") gives the key, whichever is scored:
    # with "digits" it says which keys the BPE would have written with a rare number token
    bpe_digits: list[int] = field(default_factory=list)


def passkey_example(filler: torch.Tensor, tokenizer, length: int, depth: float, generator: torch.Generator,
                    digits: int = 5, tries: int = 50, key_tokens: str = "bpe") -> PasskeyExample:
    """One example of exactly `length` tokens (see the module docstring): a random key, a random window of the filler
    that does not hold the key's digits, the key sentence at round(depth x filler tokens) of it."""
    check_digits(digits)
    check_depth(depth)
    for _ in range(tries):
        key = str(torch.randint(10 ** (digits - 1), 10**digits, (1,), generator=generator).item())
        parts = passkey_parts(tokenizer, key, key_tokens)
        context = length - len(parts.question) - len(parts.answer)  # filler + key sentence
        needed = context - len(parts.sentence)
        if needed < MIN_FILLER:
            raise UsageError(f"length {length} is too short: the key sentence, question and answer of key {key} take "
                             f"{length - needed} tokens, leaving {needed} for filler (at least {MIN_FILLER}); use "
                             f"lengths >= {min_passkey_length(tokenizer, digits, key_tokens)}")
        if len(filler) < needed:
            raise UsageError(f"the filler text holds {len(filler)} tokens, an example of {length} tokens needs "
                             f"{needed}: give a longer text (the preset's train_file / validation_file) or raise "
                             "filler_max_tokens")
        offset = torch.randint(0, len(filler) - needed + 1, (1,), generator=generator).item()
        window = filler[offset : offset + needed].tolist()
        if key in tokenizer.decode(window):  # the key would appear twice: draw another key and window
            continue
        start = round(depth * needed)
        ids = window[:start] + parts.sentence + window[start:] + parts.question + parts.answer
        answer_start = length - len(parts.answer)
        labels = [-100] * answer_start + parts.answer
        bpe = parts if key_tokens == "bpe" else passkey_parts(tokenizer, key)
        return PasskeyExample(ids, labels, key, depth, start, context, answer_start, parts.answer_digits,
                              bpe.answer_digits)
    raise UsageError(f"{tries} random {digits}-digit keys in a row each appeared in their filler window: use more "
                     "digits, so that a key is rare in the text")


def passkey_batch(batch_size: int, length: int, filler: torch.Tensor, tokenizer, generator: torch.Generator,
                  depth, digits: int = 5, key_tokens: str = "bpe") -> tuple[torch.Tensor, torch.Tensor,
                                                                            list[PasskeyExample]]:
    """(input_ids, labels), both (batch, length) long, and the examples. `depth`: one depth for every row, or a pair
    (low, high) from which each row draws its own, uniformly."""
    examples = []
    for _ in range(batch_size):
        if isinstance(depth, (tuple, list)):
            low, high = depth
            row_depth = low + (high - low) * torch.rand((), generator=generator).item()
        else:
            row_depth = depth
        examples.append(passkey_example(filler, tokenizer, length, row_depth, generator, digits,
                                        key_tokens=key_tokens))
    ids = torch.tensor([e.input_ids for e in examples], dtype=torch.long)
    labels = torch.tensor([e.labels for e in examples], dtype=torch.long)
    return ids, labels, examples


def check_passkey_example(ids: list[int], labels: list[int], tokenizer, length: int, depth: float, key: str,
                          digits: int, key_tokens: str = "bpe") -> None:
    """An independent check of one example, in plain Python from the token ids and the task's texts: exactly `length`
    tokens; labels only on the last tokens, equal to the tokens they label, decoding to the key; the key of `digits`
    digits; the question right before the answer; the key sentence exactly once, starting where the depth says (within
    half a token); the key's digits exactly once in all the text before the answer. With key_tokens "digits", every
    answer token decodes to one digit (the first with its space) and the sentence is its text's tokens with the key
    written so. Raises AssertionError naming the first rule that fails."""
    assert len(ids) == length and len(labels) == length, f"{len(ids)} ids and {len(labels)} labels, expected {length}"
    assert len(key) == digits and key.isdigit() and key[0] != "0", f"key {key!r} is not a {digits}-digit number"
    labelled = [t for t, label in enumerate(labels) if label != -100]
    assert labelled, "no labelled position"
    answer_start = labelled[0]
    assert labelled == list(range(answer_start, length)), "the labels are not one span at the end"
    assert all(labels[t] == ids[t] for t in labelled), "a label differs from the token it labels"
    assert tokenizer.decode(ids[answer_start:]) == " " + key, (
        f"the answer span decodes to {tokenizer.decode(ids[answer_start:])!r}, not the key {key}")
    question = tokenizer(" What is the pass key? The pass key is", add_special_tokens=False)["input_ids"]
    question_start = answer_start - len(question)
    assert ids[question_start:answer_start] == question, "the question does not come right before the answer"
    if key_tokens == "digits":
        assert [tokenizer.decode([t]) for t in ids[answer_start:]] == [" " + key[0], *key[1:]], (
            f"the answer's tokens {[tokenizer.decode([t]) for t in ids[answer_start:]]} are not one digit each")
        sentence = (tokenizer(" The pass key is", add_special_tokens=False)["input_ids"] + ids[answer_start:]
                    + tokenizer(". Remember it.", add_special_tokens=False)["input_ids"])
    else:
        sentence = tokenizer(f" The pass key is {key}. Remember it.", add_special_tokens=False)["input_ids"]
    found = [i for i in range(question_start - len(sentence) + 1) if ids[i : i + len(sentence)] == sentence]
    assert len(found) == 1, f"the key sentence appears {len(found)} times before the question"
    filler = question_start - len(sentence)
    assert abs(found[0] / filler - depth) <= 0.5 / filler + 1e-9, (
        f"the key sentence starts after {found[0]} of {filler} filler tokens ({found[0] / filler:.3f}), not at depth "
        f"{depth}")
    assert tokenizer.decode(ids[:answer_start]).count(key) == 1, "the key's digits appear more than once in the text"
