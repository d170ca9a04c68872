"""SQuAD v1.1 exact match and F1, as the official evaluation script (`evaluate-v1.1.py`) computes them and the Hub's
`evaluate` "squad" metric reports them: answers are compared after normalisation (lower case, punctuation and the
articles a / an / the removed, white space collapsed); a question scores the best match over its reference answers;
the totals are percentages (0-100) over every reference question, a question without a prediction scoring 0.
Written here so that question answering is scored offline (`evaluate.load("squad")` fetches its script from the
Hub); `tests/training/test_qa_mc.py` checks it against hand-computed cases."""

import re
import string
from collections import Counter

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, reference: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(reference)


def f1_score(prediction: str, reference: str) -> float:
    """The F1 of the normalised words of a prediction against one reference (0 when no word is shared, so an empty
    prediction against an empty reference scores 0, as in the official script)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    shared = sum((Counter(predicted) & Counter(expected)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)


def best_over_references(score, prediction: str, references) -> float:
    """A question's score: the best over its reference answers."""
    return max(float(score(prediction, reference)) for reference in references)


def squad_scores(predictions: dict, references: dict) -> dict:
    """{"exact_match", "f1"} in percent: `predictions` {id: answer text}, `references` {id: [answer texts]}, every
    reference question counted (one without a prediction scores 0)."""
    if not references:
        raise ValueError("no reference questions to score")
    exact = f1 = 0.0
    for question_id, answers in references.items():
        if not answers:
            raise ValueError(f"question {question_id!r} has no reference answer (SQuAD v1 scores answered questions)")
        if question_id not in predictions:
            continue
        exact += best_over_references(exact_match_score, predictions[question_id], answers)
        f1 += best_over_references(f1_score, predictions[question_id], answers)
    return {"exact_match": 100.0 * exact / len(references), "f1": 100.0 * f1 / len(references)}
