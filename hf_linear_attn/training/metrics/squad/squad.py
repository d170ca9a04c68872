"""SQuAD v1.1 exact match and F1, offline, with the inputs and output keys of the Hub's `evaluate` "squad" metric:
predictions [{"id", "prediction_text"}], references [{"id", "answers": {"text": [...], "answer_start": [...]}}],
result {"exact_match", "f1"} in percent. The scores are `hf_linear_attn.training.metrics.squad_scores`'."""

import datasets
import evaluate

from hf_linear_attn.training.metrics.squad_scores import squad_scores


class Squad(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="SQuAD v1.1 exact match and F1 in percent (offline copy of evaluate's squad)",
            citation="Rajpurkar et al. 2016, SQuAD: 100,000+ Questions for Machine Comprehension of Text",
            inputs_description="predictions: {id, prediction_text}; references: {id, answers: {text, answer_start}}",
            features=datasets.Features({
                "predictions": {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")},
                "references": {"id": datasets.Value("string"),
                               "answers": datasets.Sequence({"text": datasets.Value("string"),
                                                             "answer_start": datasets.Value("int32")})},
            }),
        )

    def _compute(self, predictions, references):
        return squad_scores({p["id"]: p["prediction_text"] for p in predictions},
                            {r["id"]: list(r["answers"]["text"]) for r in references})
