"""The model families of the package, and what the code around the models needs to know about each.

Adding a family means its configuration / modeling pair in this folder and one entry here: registration with the
Auto classes (`hf_linear_attn/__init__.py`), conversion, distillation, length extension and model cards read it.
This module is not imported by any model file, so it never travels inside a checkpoint.
"""

import importlib
from dataclasses import dataclass

from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from .configuration_linear_gpt2 import LinearGPT2Config
from .configuration_linear_roberta import LinearRobertaConfig
from .configuration_linformer import LinformerConfig
from .configuration_linformer_gpt2 import LinformerGPT2Config


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config class, its model class for each Auto class, and its facts."""

    config_class: type
    models: dict  # Auto class name ("AutoModel", "AutoModelForMaskedLM", ...) -> model class
    kind: str  # "encoder" (RoBERTa-style, pretrained as a masked LM) or "decoder" (GPT-2-style, causal LM)
    attention: str  # "linformer" or "linear"
    description: str  # one sentence on its attention, for model cards

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @property
    def objective(self) -> str:
        """The pretraining objective: "mlm" or "clm"."""
        return "mlm" if self.kind == "encoder" else "clm"

    @property
    def distillation_mode(self) -> str:
        """What a converted student matches of its softmax teacher: the attention output of each layer where the
        attention is a drop-in kernel ("attention", linear attention), the layer output where the attention has
        new projections that see the whole layer input ("layer_output", Linformer)."""
        return "layer_output" if self.attention == "linformer" else "attention"


def _family(config_class, attention: str, description: str) -> ModelFamily:
    """A family from its config class: the model classes are the ones its ``auto_map`` names (the map every
    checkpoint of the family carries), so registration and checkpoints can never disagree."""
    models = {}
    for auto_name, path in config_class.default_auto_map.items():
        if auto_name != "AutoConfig":
            module, name = path.split(".")
            models[auto_name] = getattr(importlib.import_module(f".{module}", __package__), name)
    kind = "encoder" if "AutoModelForMaskedLM" in models else "decoder"
    return ModelFamily(config_class, models, kind, attention, description)


MODEL_FAMILIES = {family.model_type: family for family in (
    _family(LinformerConfig, "linformer",
            "Self-attention is Linformer's (Wang et al. 2020): keys and values are projected along the sequence from "
            "n to k rows by learned matrices, so attention costs O(n k) instead of O(n^2)."),
    _family(LinearRobertaConfig, "linear",
            "Self-attention is kernelized linear attention (Katharopoulos et al. 2020): softmax is replaced by a "
            "feature map phi, and attention costs O(n) in the sequence length."),
    _family(LinearGPT2Config, "linear",
            "Causal linear attention (Katharopoulos et al. 2020): a constant-size recurrent state replaces the "
            "key/value cache."),
    _family(LinformerGPT2Config, "linformer",
            "Causal block Linformer: each token attends to its own block and to k-row summaries of earlier blocks."),
)}


def family_of(model_or_config) -> ModelFamily | None:
    """The family of a model or config of this package (None for any other, e.g. stock RoBERTa)."""
    config = getattr(model_or_config, "config", model_or_config)
    return MODEL_FAMILIES.get(getattr(config, "model_type", None))


def max_model_length(config) -> int:
    """The longest input the model's position table allows, for this package's families and stock models alike."""
    if hasattr(config, "max_sequence_length"):  # this package's encoders
        return config.max_sequence_length
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and config.model_type.startswith(("roberta", "xlm")):
        return config.max_position_embeddings - (config.pad_token_id or 0) - 1  # RoBERTa offsets positions
    return getattr(config, "n_positions", None) or config.max_position_embeddings
