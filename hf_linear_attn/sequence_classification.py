"""The loss of a sequence classification head, chosen by ``config.problem_type`` as in RoBERTa and GPT-2."""

import torch
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss


def sequence_classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits (B, num_labels), labels (B,) or (B, num_labels): MSE, cross-entropy or BCE; sets problem_type once."""
    num_labels = config.num_labels
    if config.problem_type is None:
        if num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        if num_labels == 1:
            return MSELoss()(logits.squeeze(), labels.squeeze().to(logits.dtype))
        return MSELoss()(logits, labels.to(logits.dtype))
    if config.problem_type == "single_label_classification":
        return CrossEntropyLoss()(logits.reshape(-1, num_labels), labels.reshape(-1))
    return BCEWithLogitsLoss()(logits, labels.to(logits.dtype))
