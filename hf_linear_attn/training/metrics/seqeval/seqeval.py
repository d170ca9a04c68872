"""Entity-level scores for token classification, offline, with the output keys of the Hub's `evaluate` "seqeval"
metric: per entity type {"precision", "recall", "f1", "number"}, and overall_precision / overall_recall /
overall_f1 / overall_accuracy. The Hub module needs the `seqeval` package (pip install "hf-linear-attn[ner]");
this copy computes the same scores (conlleval's rules, seqeval's default mode) with
`hf_linear_attn.training.metrics.entities`."""

import datasets
import evaluate

from hf_linear_attn.training.metrics.entities import entity_scores


class Seqeval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="entity precision, recall and F1 and word accuracy (offline copy of evaluate's seqeval)",
            citation="Tjong Kim Sang and De Meulder 2003, Introduction to the CoNLL-2003 Shared Task (conlleval)",
            inputs_description="predictions and references: one list of tag strings (O, B-PER, I-PER, ...) per "
                               "sentence",
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                        "references": datasets.Sequence(datasets.Value("string"))}),
        )

    def _compute(self, predictions, references):
        return entity_scores(predictions, references)
