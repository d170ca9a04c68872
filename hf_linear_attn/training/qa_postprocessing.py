"""From a question answering model's start / end logits over the windows of a split back to answer texts, as
run_qa.py's `postprocess_qa_predictions` (SQuAD v1) does: in each window the `n_best_size` best start and end
tokens are paired, pairs that leave the context, end before they start or are longer than `max_answer_length` tokens
are dropped, and a question's answer is the context text under its best-scoring pair (start + end logit) over all its
windows; also the n best, with their probabilities. Then SQuAD exact match and F1 for Trainer."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def best_answers(contexts, example_ids, feature_example_index, feature_offsets, start_logits, end_logits,
                 n_best_size: int = 20, max_answer_length: int = 30) -> tuple[dict, dict]:
    """({id: answer text}, {id: [the n best {"text", "score", "probability", "start_logit", "end_logit"}]}).

    `contexts` / `example_ids`: one per question; `feature_example_index[w]`: the question of window w;
    `feature_offsets[w][t]`: the characters [start, end) of token t in its context, None outside the context;
    `start_logits` / `end_logits` (windows, n): the model's logits, padded with anything past a window's length (Trainer
    pads with -100). A question with no valid span in any window gets the empty answer."""
    windows_of = [[] for _ in contexts]
    for window, example in enumerate(feature_example_index):
        windows_of[example].append(window)
    predictions, n_best = {}, {}
    for example, (context, question_id) in enumerate(zip(contexts, example_ids)):
        candidates = []
        for window in windows_of[example]:
            offsets = feature_offsets[window]
            starts, ends = np.asarray(start_logits[window]), np.asarray(end_logits[window])
            best_starts = np.argsort(-starts, kind="stable")[:n_best_size]
            best_ends = np.argsort(-ends, kind="stable")[:n_best_size]
            for start in best_starts:
                for end in best_ends:
                    if start >= len(offsets) or end >= len(offsets) or offsets[start] is None or offsets[end] is None:
                        continue  # padding, the question or a special token
                    if end < start or end - start + 1 > max_answer_length:
                        continue
                    candidates.append((float(starts[start] + ends[end]), float(starts[start]), float(ends[end]),
                                       offsets[start][0], offsets[end][1]))
        candidates.sort(key=lambda c: -c[0])
        chosen = [{"text": context[first:last], "score": score, "start_logit": s, "end_logit": e}
                  for score, s, e, first, last in candidates[:n_best_size]]
        if not chosen:
            chosen = [{"text": "", "score": 0.0, "start_logit": 0.0, "end_logit": 0.0}]
        scores = np.array([c["score"] for c in chosen])
        probabilities = np.exp(scores - scores.max())
        for candidate, probability in zip(chosen, probabilities / probabilities.sum()):
            candidate["probability"] = float(probability)
        predictions[question_id] = chosen[0]["text"]
        n_best[question_id] = chosen
    return predictions, n_best


@dataclass
class QASplit:
    """What turns a split's window logits into answers: its questions (ids, contexts, reference answers where
    labelled) and, for each window, its question and its context tokens' character offsets."""

    ids: list
    contexts: list
    answers: list | None
    feature_example_index: list
    feature_offsets: list

    @classmethod
    def from_encoded(cls, rows, windows):
        """From the rows of `load_qa_data` and the windows of `encode_qa_split`."""
        answers = list(rows["answers"]) if "answers" in rows.column_names else None
        return cls(list(rows["id"]), list(rows["context"]), answers, list(windows["example_index"]),
                   list(windows["offset_mapping"]))

    def answers_from(self, logits, n_best_size: int, max_answer_length: int) -> tuple[dict, dict]:
        """({id: answer text}, {id: n best}) from Trainer's predictions: (start_logits, end_logits)."""
        start_logits, end_logits = logits[0], logits[1]
        return best_answers(self.contexts, self.ids, self.feature_example_index, self.feature_offsets, start_logits,
                            end_logits, n_best_size, max_answer_length)

    def score(self, metric, predictions: dict) -> dict:
        """The `evaluate` squad metric (Hub or offline copy) on the answers: {"exact_match", "f1"} in percent."""
        return metric.compute(
            predictions=[{"id": i, "prediction_text": predictions[i]} for i in self.ids],
            references=[{"id": i, "answers": a} for i, a in zip(self.ids, self.answers)])


def qa_metric_function(split: QASplit, metric, n_best_size: int, max_answer_length: int, keep: dict):
    """compute_metrics for Trainer over the evaluation windows: their answers scored by SQuAD exact match and F1;
    the answers are kept in `keep` ("predictions", "n_best") for the predictions file."""

    def compute_metrics(prediction):
        predictions, n_best = split.answers_from(prediction.predictions, n_best_size, max_answer_length)
        keep.update(predictions=predictions, n_best=n_best)
        return split.score(metric, predictions)

    return compute_metrics


def write_answers(output_dir: Path, stage: str, predictions: dict, n_best: dict) -> None:
    """run_qa.py's `{stage}_predictions.json` ({id: answer}) and `{stage}_nbest_predictions.json`."""
    (output_dir / f"{stage}_predictions.json").write_text(json.dumps(predictions, indent=4, ensure_ascii=False),
                                                          encoding="utf-8")
    (output_dir / f"{stage}_nbest_predictions.json").write_text(json.dumps(n_best, indent=4, ensure_ascii=False),
                                                                encoding="utf-8")
