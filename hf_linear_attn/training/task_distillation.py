"""Fine-tuning against a fine-tuned teacher's predictions as well as the labels (knowledge distillation, Hinton et
al. 2015; DistilBERT's and TinyBERT's task stage): scripts/finetune.py --distill_from TEACHER.

    loss = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))

Why here: a model converted from a fine-tuned classifier (Hedgehog's recipe for a task model) has its teacher at
hand, and on a training subset the teacher's soft predictions say more per row than a 0 / 1 label (how sure, and
where it errs); T^2 keeps the soft term's gradients on the scale of the hard term's as T grows. Only training uses
the teacher: evaluation reports the plain cross-entropy, comparable with any other fine-tune.
"""

import torch
from transformers import AutoModelForSequenceClassification

from .errors import UsageError
from .trainer_checkpoints import AtomicCheckpointTrainer


def check_distillation_arguments(args, do_train: bool) -> None:
    """Refuse settings that cannot work, before any data is read."""
    if args.distill_from is None:
        return
    if not do_train:
        raise UsageError(f"--distill_from {args.distill_from} trains against a teacher, but nothing is trained: add "
                         "--do_train, or leave --distill_from out")
    if args.task_type != "sequence_classification":
        raise UsageError(f"--distill_from reads a sequence classifier's class scores; --task_type {args.task_type} has "
                         "none: leave --distill_from out")
    if not 0.0 <= args.distill_alpha <= 1.0:
        raise UsageError(f"--distill_alpha must be between 0 (labels only) and 1 (teacher only), got "
                         f"{args.distill_alpha}; 0.5 is usual")
    if not args.distill_temperature > 0:
        raise UsageError(f"--distill_temperature must be positive, got {args.distill_temperature}; 1 to 4 is usual")


def load_teacher(args, model):
    """The teacher, frozen and in evaluation mode, checked against the student: the same labels in the same order
    and the same vocabulary (it reads the student's token ids), a classifier (not regression)."""
    teacher = AutoModelForSequenceClassification.from_pretrained(args.distill_from,
                                                                 trust_remote_code=args.trust_remote_code)
    theirs, ours = teacher.config, model.config
    if ours.problem_type == "regression" or ours.num_labels == 1:
        raise UsageError("--distill_from distils class probabilities; this task is a regression: leave it out")
    if theirs.num_labels != ours.num_labels or dict(theirs.label2id) != dict(ours.label2id):
        raise UsageError(f"the teacher {args.distill_from} scores the labels {dict(theirs.label2id)}, the task has "
                         f"{dict(ours.label2id)}: distil from a teacher fine-tuned on this task")
    if theirs.vocab_size != ours.vocab_size:
        raise UsageError(f"the teacher {args.distill_from} has a vocabulary of {theirs.vocab_size} tokens, the student "
                         f"{ours.vocab_size}: they must share the tokenizer (a student converted from the teacher "
                         "does)")
    teacher.eval().requires_grad_(False)
    return teacher


def distillation_loss(student_logits, teacher_logits, labels, alpha: float, temperature: float) -> torch.Tensor:
    """(1 - alpha) * cross-entropy with the labels + alpha * T^2 * KL(teacher_T || student_T), batch means."""
    hard = torch.nn.functional.cross_entropy(student_logits.float(), labels)
    soft = torch.nn.functional.kl_div(torch.log_softmax(student_logits.float() / temperature, -1),
                                      torch.log_softmax(teacher_logits.float() / temperature, -1),
                                      log_target=True, reduction="batchmean")
    return (1 - alpha) * hard + alpha * temperature**2 * soft


class DistillingTrainer(AtomicCheckpointTrainer):
    """Trainer whose training loss is `distillation_loss` against `teacher` (evaluation: the model's own loss)."""

    def __init__(self, *args, teacher, alpha: float, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.to(self.args.device)
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:  # evaluation and prediction: the plain loss, comparable with other fine-tunes
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs)
        features = {name: value for name, value in inputs.items() if name != "labels"}
        with torch.no_grad():
            teacher_logits = self.teacher(**features).logits
        loss = distillation_loss(outputs.logits, teacher_logits, inputs["labels"], self.alpha, self.temperature)
        return (loss, outputs) if return_outputs else loss
