"""What every configuration of this package shares: the dropout check and the ``auto_map`` of a family."""

# Auto class -> class-name suffix of every head a family ships, for the encoders and for the decoders.
ENCODER_HEADS = {
    "AutoModel": "Model",
    "AutoModelForMaskedLM": "ForMaskedLM",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
    "AutoModelForTokenClassification": "ForTokenClassification",
    "AutoModelForQuestionAnswering": "ForQuestionAnswering",
    "AutoModelForMultipleChoice": "ForMultipleChoice",
}
DECODER_HEADS = {
    "AutoModel": "Model",
    "AutoModelForCausalLM": "ForCausalLM",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
}


def check_dropouts(config, names) -> None:
    """Raise a ValueError naming a dropout probability outside [0, 1)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"{name} must be a probability in [0, 1), got {value}.")


def build_auto_map(model_type: str, class_prefix: str, heads: dict[str, str]) -> dict[str, str]:
    """Every Auto class a checkpoint of a family opens with (``trust_remote_code``): the config and each head.

    ``build_auto_map("linformer", "Linformer", ENCODER_HEADS)`` maps AutoConfig to
    ``configuration_linformer.LinformerConfig`` and AutoModel to ``modeling_linformer.LinformerModel``, and so on:
    save_pretrained itself writes only the saved class's own Auto class.
    """
    auto_map = {"AutoConfig": f"configuration_{model_type}.{class_prefix}Config"}
    auto_map.update({auto: f"modeling_{model_type}.{class_prefix}{suffix}" for auto, suffix in heads.items()})
    return auto_map
