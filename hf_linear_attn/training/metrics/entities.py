"""Entity-level precision, recall and F1 for token classification (named entities, chunks), as CoNLL's conlleval
scores them and seqeval's default mode reproduces: an entity counts only when its type and its exact span are both
right. Written here so that the scores are computed offline without the `seqeval` package (and scikit-learn, which
it imports); `tests/training/test_token_classification.py` checks them against hand counts and, where it is
installed, against seqeval itself.

Tags are "O" or PREFIX-TYPE with the prefix B (begins), I (inside), E (ends) or S (single): IOB1, IOB2 (BIO) and
IOBES all read the same way. An entity begins at B or S, and at I or E that follows "O", another type, or the end
of an entity (E or S); it ends before "O", before a tag that begins another entity, and after E or S. A tag without
such a prefix (a POS tag such as "NOUN") is a one-word entity of that type, so plain tags are scored word by word.
"""

import re

SCHEMED_TAG = re.compile(r"^([BIES])-(.+)$")


def split_tag(tag: str) -> tuple[str, str | None]:
    """(prefix, type): ("O", None) for "O", ("B", "PER") for "B-PER", ("S", tag) for a tag without a prefix."""
    if tag == "O":
        return "O", None
    found = SCHEMED_TAG.match(tag)
    return (found.group(1), found.group(2)) if found else ("S", tag)


def has_entity_scheme(label_names) -> bool:
    """Whether every label is "O" or PREFIX-TYPE (B / I / E / S): the labels then mark multi-word entities."""
    return all(name == "O" or SCHEMED_TAG.match(name) for name in label_names)


def entity_spans(tags) -> list[tuple[str, int, int]]:
    """The entities of one sequence of tags as (type, start, end), end exclusive, in order."""
    spans, current = [], None  # current: (type, start) of the entity being read
    for position, tag in enumerate(tags):
        prefix, kind = split_tag(tag)
        if prefix == "O":
            if current is not None:
                spans.append((current[0], current[1], position))
                current = None
            continue
        if prefix in ("B", "S") or current is None or current[0] != kind:
            if current is not None:
                spans.append((current[0], current[1], position))
            current = (kind, position)
        if prefix in ("E", "S"):  # the entity ends with this word
            spans.append((current[0], current[1], position + 1))
            current = None
    if current is not None:
        spans.append((current[0], current[1], len(tags)))
    return spans


def _precision_recall_f1(correct: int, predicted: int, actual: int) -> tuple[float, float, float]:
    """With nothing predicted (or nothing to find) precision (recall) is 0, as seqeval's zero_division default."""
    precision = correct / predicted if predicted else 0.0
    recall = correct / actual if actual else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def entity_scores(predictions, references) -> dict:
    """Scores of predicted tag sequences against reference ones (lists of lists of tag strings, one per sentence),
    with the keys of `evaluate`'s seqeval metric: for each entity type {"precision", "recall", "f1", "number"}
    (number: the reference entities of that type), and "overall_precision", "overall_recall", "overall_f1" (micro
    averages over all entities) and "overall_accuracy" (the share of words whose tag is right, "O" included)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predicted sequences for {len(references)} references")
    predicted, actual = set(), set()
    right = total = 0
    for sentence, (guess, truth) in enumerate(zip(predictions, references)):
        if len(guess) != len(truth):
            raise ValueError(f"sequence {sentence}: {len(guess)} predicted tags for {len(truth)} reference tags")
        predicted.update((sentence, *span) for span in entity_spans(guess))
        actual.update((sentence, *span) for span in entity_spans(truth))
        right += sum(g == t for g, t in zip(guess, truth))
        total += len(truth)
    correct = predicted & actual
    scores = {}
    for kind in sorted({span[1] for span in predicted | actual}):
        counts = [sum(span[1] == kind for span in spans) for spans in (correct, predicted, actual)]
        precision, recall, f1 = _precision_recall_f1(*counts)
        scores[kind] = {"precision": precision, "recall": recall, "f1": f1, "number": counts[2]}
    precision, recall, f1 = _precision_recall_f1(len(correct), len(predicted), len(actual))
    scores.update(overall_precision=precision, overall_recall=recall, overall_f1=f1,
                  overall_accuracy=right / total if total else 0.0)
    return scores
