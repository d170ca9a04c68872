"""Kernelized linear-attention encoder (Katharopoulos et al. 2020) as a RoBERTa-style Transformers model.

Softmax attention is replaced by a feature map phi: out_i = phi(q_i) S / (phi(q_i) . z + eps) with
S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j), so cost and memory are linear in n. Pads are removed after the
feature map; S, z and the normaliser are float32 under bf16 / fp16. A hybrid schedule (``layer_types``) keeps
RoBERTa's softmax attention in the layers it marks ``full_attention``.
"""

import torch

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
        # A hybrid schedule's "full_attention" layer is RoBERTa's softmax attention on the same projections: no
        # feature map and no band factor, so it adds no parameter and a converted layer stays exact.
        self.full_attention = config.layer_types is not None and config.layer_types[layer_idx] == "full_attention"
        if self.full_attention:
            self.dropout = config.attention_probs_dropout_prob
            return
        self.eps = config.linear_attention_eps
        self.feature_map = build_feature_map(
            config.feature_map, self.num_heads, self.head_dim,
            num_random_features=config.num_random_features, learned_feature_dim=config.learned_feature_dim,
        )
        # attention_window > 0: exact softmax over the band |i - j| < W, the feature map beyond (one normaliser)
        self.window = config.attention_window
        self.chunk_size = config.linear_attention_chunk_size
        if self.window:
            self.window_factor = SlidingWindowFactor(self.num_heads, config.attention_window_factor_init)

    def forward(self, hidden_states, key_mask=None, output_attentions=False, shared_projection=None):
        q, k, v = (self._split_heads(proj(hidden_states)) for proj in (self.query, self.key, self.value))
        if self.full_attention:
            output, weights = self._softmax_attention(q, k, v, key_mask, output_attentions)
            return output.transpose(1, 2).reshape(hidden_states.shape), weights
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

    def _softmax_attention(self, q, k, v, key_mask, output_attentions):
        """RoBERTa's attention, softmax(q k^T / sqrt(d) + mask) v, q, k, v (B, H, n, d) -> (B, H, n, d) and the
        weights when asked. Pad keys get the dtype's lowest value added, as stock RoBERTa's mask does (not -inf: a row
        of pads only would be 0 / 0)."""
        mask = None
        if key_mask is not None:
            blocked = torch.finfo(q.dtype).min
            mask = torch.where(key_mask.bool()[:, None, None, :], 0.0, blocked).to(q.dtype)  # (B, 1, 1, n)
        dropout = self.dropout if self.training else 0.0
        if not output_attentions:
            output = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
            return output, None
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        output = torch.matmul(torch.nn.functional.dropout(weights, dropout, self.training), v)
        return output, weights


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
