"""Kernelized linear-attention encoder (Katharopoulos et al. 2020) as a RoBERTa-style Transformers model.

Softmax attention is replaced by a feature map phi: out_i = phi(q_i) S / (phi(q_i) . z + eps) with
S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j), so cost and memory are linear in n. Pads are removed after the
feature map; S, z and the normaliser are float32 under bf16 / fp16.
"""

from .configuration_linear_roberta import LinearRobertaConfig
from .feature_maps import build_feature_map
from .linear_attention import bidirectional_linear_attention, linear_attention_weights
from .modeling_roberta_style import (
    RobertaStyleForMaskedLM,
    RobertaStyleForMultipleChoice,
    RobertaStyleForQuestionAnswering,
    RobertaStyleForSequenceClassification,
    RobertaStyleForTokenClassification,
    RobertaStyleModel,
    RobertaStylePreTrainedModel,
    RobertaStyleSelfAttention,
)
from .sliding_window_attention import (
    SlidingWindowFactor,
    banded_sliding_window_attention,
    sliding_window_attention_weights,
)
from .weight_init import RandomFeaturesMixin


class LinearRobertaSelfAttention(RobertaStyleSelfAttention):
    """Multi-head bidirectional linear attention: hidden (B, n, D) -> (B, n, D).

    With ``output_attentions`` it also returns the n x n matrix it applies implicitly (quadratic: for inspection
    and distillation only). Linear attention shares nothing across layers (no shared projection).
    """

    def __init__(self, config: LinearRobertaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.eps = config.linear_attention_eps
        self.feature_map = build_feature_map(
            config.feature_map, self.num_heads, self.head_dim,
            num_random_features=config.num_random_features, learned_feature_dim=config.learned_feature_dim,
        )
        # attention_window > 0: exact softmax over the band |i - j| < W, the feature map beyond (one normaliser)
        self.window = config.attention_window
        self.chunk_size = config.linear_attention_chunk_size
        if self.window:
            self.window_factor = SlidingWindowFactor(self.num_heads)

    def forward(self, hidden_states, key_mask=None, output_attentions=False, shared_projection=None):
        q, k, v = (self._split_heads(proj(hidden_states)) for proj in (self.query, self.key, self.value))
        phi_q, phi_k = self.feature_map.pair(q, k, key_mask)
        if self.window:
            theta = self.window_factor()
            output = banded_sliding_window_attention(
                q, k, v, phi_q, phi_k, self.window, key_mask, theta, self.eps, self.chunk_size
            )
            weights = None
            if output_attentions:
                weights = sliding_window_attention_weights(
                    q, k, phi_q, phi_k, self.window, key_mask, False, theta, self.eps
                )
            return output.transpose(1, 2).reshape(hidden_states.shape), weights
        output = bidirectional_linear_attention(phi_q, phi_k, v, key_mask, eps=self.eps)
        weights = linear_attention_weights(phi_q, phi_k, key_mask, eps=self.eps) if output_attentions else None
        return output.transpose(1, 2).reshape(hidden_states.shape), weights


class LinearRobertaPreTrainedModel(RandomFeaturesMixin, RobertaStylePreTrainedModel):
    """Config and attention of the linear-attention encoders, and FAVOR+ redraws. Init (``init_added_weights``):
    FAVOR+ draws orthogonal random features, hedgehog starts at the identity, the band's factor at g = 1."""

    config_class = LinearRobertaConfig
    self_attention_class = LinearRobertaSelfAttention


class LinearRobertaModel(LinearRobertaPreTrainedModel, RobertaStyleModel):
    """The bare linear-attention encoder: last_hidden_state (B, n, D) and pooler_output (B, D)."""


LinearRobertaPreTrainedModel.base_model_class = LinearRobertaModel  # the encoder every head below builds inside it


class LinearRobertaForMaskedLM(LinearRobertaPreTrainedModel, RobertaStyleForMaskedLM):
    """Linear-attention encoder with RoBERTa's masked-LM head."""


class LinearRobertaForSequenceClassification(LinearRobertaPreTrainedModel, RobertaStyleForSequenceClassification):
    """Linear-attention encoder with RoBERTa's sequence classification / regression head."""


class LinearRobertaForTokenClassification(LinearRobertaPreTrainedModel, RobertaStyleForTokenClassification):
    """Linear-attention encoder with a token classification head."""


class LinearRobertaForQuestionAnswering(LinearRobertaPreTrainedModel, RobertaStyleForQuestionAnswering):
    """Linear-attention encoder with an extractive question-answering head."""


class LinearRobertaForMultipleChoice(LinearRobertaPreTrainedModel, RobertaStyleForMultipleChoice):
    """Linear-attention encoder with a multiple-choice head."""
