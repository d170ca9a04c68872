"""Linformer encoder (Wang et al. 2020) as a RoBERTa-style Transformers model.

Self-attention is `softmax(Q (E K)^T / sqrt(d)) (F V)` with learned E, F of shape (k, n_max): cost O(n k) instead
of O(n^2). Inputs shorter than n_max use the first n columns of E and F; pad rows of K and V are zeroed before the
projection, so an example gives the same outputs alone or in a right-padded batch.
"""


import torch

from .configuration_linformer import LinformerConfig
from .linformer_projection import (
    LinformerProjection,
    add_linformer_projections,
    linformer_projection_weights,
    project_sequence,
    projected_attention,
    reached_rows,
    row_starts,
    shared_linformer_projection,
)
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


EMPTY_BATCH = ("the input holds 0 sequences (a batch of size 0): pass at least one sequence (skip empty batches, "
               "e.g. a DataLoader with drop_last=True or a filter before the model)")


class LinformerSelfAttention(RobertaStyleSelfAttention):
    """Multi-head Linformer attention: hidden (B, n, D) -> (B, n, D), weights (B, H, n, k) on request.

    Projections by sharing mode: "none": `key_projection` / `value_projection` with one matrix per head;
    "headwise": one matrix each, shared by the heads; "key-value": `key_projection` only, used for keys and values;
    "layerwise": none here, the encoder's `shared_projection` is used for keys and values of every layer.
    """

    def __init__(self, config: LinformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.dropout = config.attention_probs_dropout_prob
        self.sharing = config.linformer_sharing
        self.normalize_rows = config.linformer_normalize_rows
        # where each projected row starts, to drop unreached rows: plain ints that follow from the config, not a
        # buffer (transformers allocates a loaded model's unsaved buffers empty and would leave them so)
        self.row_starts = None
        if config.linformer_drop_unreached_rows:
            k, max_length = config.k_for_layer(layer_idx), config.max_sequence_length
            self.row_starts = row_starts(config.linformer_init, k, max_length)
        add_linformer_projections(
            self, self.sharing, self.num_heads, config.k_for_layer(layer_idx), config.max_sequence_length
        )

    @staticmethod
    def build_shared_projection(config: LinformerConfig) -> LinformerProjection | None:
        """The single matrix of layerwise sharing, owned by the encoder; None for the other modes."""
        return shared_linformer_projection(config.linformer_sharing, config.k_for_layer(0), config.max_sequence_length)

    def forward(self, hidden_states, key_mask=None, output_attentions=False, shared_projection=None):
        if hidden_states.shape[0] == 0:  # the projection's reshape cannot size 0 rows: name the input instead
            raise ValueError(EMPTY_BATCH)
        key_projection, value_projection = linformer_projection_weights(self, self.sharing, shared_projection)
        # K and V are projected to k rows as soon as each is computed: the n-row K and V are never alive together
        # with Q, which lowers the peak activation memory at long n.
        rows = self.normalize_rows
        projected_k = project_sequence(self._split_heads(self.key(hidden_states)), key_projection, key_mask, rows)
        projected_v = project_sequence(self._split_heads(self.value(hidden_states)), value_projection, key_mask, rows)
        row_mask = None
        if self.row_starts is not None:
            starts = torch.tensor(self.row_starts, device=hidden_states.device)
            row_mask = reached_rows(starts, key_mask, hidden_states.shape[1])
        output, weights = projected_attention(
            self._split_heads(self.query(hidden_states)), projected_k, projected_v,
            dropout=self.dropout if self.training else 0.0, need_weights=output_attentions, row_mask=row_mask,
        )
        return output.transpose(1, 2).reshape(hidden_states.shape), weights


class LinformerPreTrainedModel(RobertaStylePreTrainedModel):
    """Config, attention and padding rule of the Linformer encoders. Init (``init_added_weights``): E and F by
    `config.linformer_init`."""

    config_class = LinformerConfig
    self_attention_class = LinformerSelfAttention

    def check_key_mask(self, key_mask: torch.Tensor) -> None:
        """Refuse left padding: E and F index absolute positions, so a shifted example would be projected differently."""
        if (key_mask[:, 1:] & ~key_mask[:, :-1]).any():
            raise ValueError(
                "Linformer needs right padding: the attention_mask has padding before real tokens, and E / F "
                "project by absolute position. Set tokenizer.padding_side = 'right'."
            )


class LinformerModel(LinformerPreTrainedModel, RobertaStyleModel):
    """The bare Linformer encoder: last_hidden_state (B, n, D) and pooler_output (B, D)."""


LinformerPreTrainedModel.base_model_class = LinformerModel  # the encoder every head below builds inside it


class LinformerForMaskedLM(LinformerPreTrainedModel, RobertaStyleForMaskedLM):
    """Linformer with RoBERTa's masked-LM head."""


class LinformerForSequenceClassification(LinformerPreTrainedModel, RobertaStyleForSequenceClassification):
    """Linformer with RoBERTa's sequence classification / regression head."""


class LinformerForTokenClassification(LinformerPreTrainedModel, RobertaStyleForTokenClassification):
    """Linformer with a token classification head."""


class LinformerForQuestionAnswering(LinformerPreTrainedModel, RobertaStyleForQuestionAnswering):
    """Linformer with an extractive question-answering head."""


class LinformerForMultipleChoice(LinformerPreTrainedModel, RobertaStyleForMultipleChoice):
    """Linformer with a multiple-choice head."""
