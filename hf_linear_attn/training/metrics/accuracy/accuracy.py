"""Accuracy, offline, with the output key of the Hub's `evaluate` "accuracy" metric: {"accuracy"}."""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="fraction of predictions equal to the references (offline copy of evaluate's accuracy)",
            citation="",
            inputs_description="predictions and references: lists of integer class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(references)))}
