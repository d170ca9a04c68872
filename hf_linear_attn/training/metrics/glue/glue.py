"""GLUE metric for the classification tasks, offline, with the output keys of the Hub's `evaluate` "glue" metric.

Loaded with `evaluate.load(<this folder>, config_name=<task>)` where the Hub cannot be reached. sst2 / qnli / rte /
wnli / mnli: {"accuracy"}; qqp / mrpc: {"accuracy", "f1"} (F1 of the positive class 1, as sklearn's default).
"""

import datasets
import evaluate
import numpy as np

ACCURACY_ONLY = ("sst2", "qnli", "rte", "wnli", "mnli", "mnli_matched", "mnli_mismatched", "ax")
WITH_F1 = ("qqp", "mrpc")


def accuracy_and_f1(predictions, references):
    """Accuracy and the binary F1 of class 1 (0 when class 1 is never predicted nor present)."""
    predictions, references = np.asarray(predictions), np.asarray(references)
    true_positive = float(np.sum((predictions == 1) & (references == 1)))
    predicted, actual = float(np.sum(predictions == 1)), float(np.sum(references == 1))
    f1 = 2 * true_positive / (predicted + actual) if predicted + actual > 0 else 0.0
    return {"accuracy": float(np.mean(predictions == references)), "f1": f1}


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in ACCURACY_ONLY + WITH_F1:
            raise KeyError(f"this offline GLUE metric covers {list(ACCURACY_ONLY + WITH_F1)}, not {self.config_name!r}")
        return evaluate.MetricInfo(
            description="GLUE classification metrics (offline copy of the keys of evaluate's glue metric)",
            citation="Wang et al. 2018, GLUE: A Multi-Task Benchmark and Analysis Platform for NLU",
            inputs_description="predictions and references: lists of integer class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        scores = accuracy_and_f1(predictions, references)
        return scores if self.config_name in WITH_F1 else {"accuracy": scores["accuracy"]}
