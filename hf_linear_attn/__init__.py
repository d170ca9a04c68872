"""hf-linear-attn: Linformer and kernelized linear attention as first-class Transformers models.

Importing the package registers every model with the Auto classes (AutoConfig, AutoModel, AutoModelFor...), and
marks each class for its Auto class so `save_pretrained` writes the model code beside the weights.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .block_linformer import BlockLinformerState, block_linformer_step, causal_block_linformer_attention
from .configuration_linear_gpt2 import LinearGPT2Config
from .configuration_linear_roberta import LinearRobertaConfig
from .configuration_linformer import LinformerConfig
from .configuration_linformer_gpt2 import LinformerGPT2Config
from .families import MODEL_FAMILIES, ModelFamily, family_of
from .feature_maps import FEATURE_MAPS, FavorFeatureMap, HedgehogFeatureMap, build_feature_map
from .linear_attention import (
    bidirectional_linear_attention,
    causal_linear_attention,
    linear_attention_weights,
    recurrent_linear_attention_step,
)
from .linformer_projection import (
    LINFORMER_SHARING,
    LinformerProjection,
    linformer_attention,
    pooling_matrix,
    project_sequence,
)
from .explicit_state import DecoderPrefill, DecoderStateStep
from .modeling_linear_gpt2 import (
    KeyValueSlots,
    LinearGPT2ForCausalLM,
    LinearGPT2ForSequenceClassification,
    LinearGPT2Model,
    LinearGPT2PreTrainedModel,
)
from .modeling_linear_roberta import (
    LinearRobertaForMaskedLM,
    LinearRobertaForMultipleChoice,
    LinearRobertaForQuestionAnswering,
    LinearRobertaForSequenceClassification,
    LinearRobertaForTokenClassification,
    LinearRobertaModel,
    LinearRobertaPreTrainedModel,
)
from .modeling_linformer import (
    LinformerForMaskedLM,
    LinformerForMultipleChoice,
    LinformerForQuestionAnswering,
    LinformerForSequenceClassification,
    LinformerForTokenClassification,
    LinformerModel,
    LinformerPreTrainedModel,
)
from .modeling_linformer_gpt2 import (
    LinformerGPT2ForCausalLM,
    LinformerGPT2ForSequenceClassification,
    LinformerGPT2Model,
    LinformerGPT2PreTrainedModel,
)
from .recurrent_cache import (
    BlockLinformerCacheLayer,
    DecayedStateLayer,
    DeltaRuleStateLayer,
    KeyValueStateLayer,
    LinearAttentionStateLayer,
    RecurrentStateCache,
    SlidingWindowStateLayer,
)
from .decayed_linear_attention import (
    causal_decayed_linear_attention,
    naive_decayed_linear_attention,
    recurrent_decayed_linear_attention_step,
)
from .delta_rule import causal_delta_rule, delta_rule_qk, delta_rule_weights, naive_delta_rule
from .short_convolution import ShortConvolution, causal_short_convolution, short_convolution_step
from .sliding_window_attention import (
    banded_sliding_window_attention,
    causal_sliding_window_attention,
    sliding_window_attention_step,
    sliding_window_attention_weights,
)

__version__ = "0.1.0"

_AUTO_CLASSES = {
    "AutoModel": AutoModel,
    "AutoModelForMaskedLM": AutoModelForMaskedLM,
    "AutoModelForSequenceClassification": AutoModelForSequenceClassification,
    "AutoModelForTokenClassification": AutoModelForTokenClassification,
    "AutoModelForQuestionAnswering": AutoModelForQuestionAnswering,
    "AutoModelForMultipleChoice": AutoModelForMultipleChoice,
    "AutoModelForCausalLM": AutoModelForCausalLM,
}


def _register() -> None:
    for family in MODEL_FAMILIES.values():
        AutoConfig.register(family.model_type, family.config_class, exist_ok=True)
        family.config_class.register_for_auto_class()
        for auto_name, model_class in family.models.items():
            _AUTO_CLASSES[auto_name].register(family.config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_name)


_register()

__all__ = [
    "FEATURE_MAPS",
    "LINFORMER_SHARING",
    "MODEL_FAMILIES",
    "FavorFeatureMap",
    "HedgehogFeatureMap",
    "LinformerProjection",
    "ModelFamily",
    "BlockLinformerCacheLayer",
    "BlockLinformerState",
    "DecoderPrefill",
    "DecoderStateStep",
    "DecayedStateLayer",
    "DeltaRuleStateLayer",
    "LinearAttentionStateLayer",
    "LinearGPT2Config",
    "LinearRobertaConfig",
    "LinformerConfig",
    "LinformerGPT2Config",
    "RecurrentStateCache",
    "SlidingWindowStateLayer",
    "KeyValueSlots",
    "KeyValueStateLayer",
    "banded_sliding_window_attention",
    "causal_delta_rule",
    "delta_rule_qk",
    "delta_rule_weights",
    "naive_delta_rule",
    "causal_sliding_window_attention",
    "sliding_window_attention_step",
    "sliding_window_attention_weights",
    "bidirectional_linear_attention",
    "family_of",
    "pooling_matrix",
    "block_linformer_step",
    "causal_block_linformer_attention",
    "build_feature_map",
    "causal_linear_attention",
    "recurrent_linear_attention_step",
    "causal_decayed_linear_attention",
    "naive_decayed_linear_attention",
    "recurrent_decayed_linear_attention_step",
    "ShortConvolution",
    "causal_short_convolution",
    "short_convolution_step",
    "linear_attention_weights",
    "linformer_attention",
    "project_sequence",
] + [model.__name__ for family in MODEL_FAMILIES.values() for model in family.models.values()] + [
    "LinformerPreTrainedModel",
    "LinearRobertaPreTrainedModel",
    "LinearGPT2PreTrainedModel",
    "LinformerGPT2PreTrainedModel",
]
