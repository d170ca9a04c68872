"""RoBERTa-style encoder with a pluggable self-attention: layers, base model and the five task heads.

The families (Linformer, linear attention) supply only their self-attention module (on RoBERTa's query / key / value
projections, :class:`RobertaStyleSelfAttention`); the init of what they add is :func:`~.weight_init.init_added_weights`.
Everything else reuses RoBERTa's own building blocks from transformers, so parameter names (``roberta.embeddings...``,
``roberta.encoder.layer.N.attention.self.query``, ``lm_head``, ``classifier``...) match RoBERTa one to one.

The attention modules take a boolean ``key_mask`` (batch, n), True at real tokens, instead of an additive
n x n mask: neither family ever builds an n x n matrix.
"""

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.models.roberta.modeling_roberta import (
    RobertaClassificationHead,
    RobertaEmbeddings,
    RobertaIntermediate,
    RobertaLMHead,
    RobertaOutput,
    RobertaPooler,
    RobertaSelfOutput,
)
from transformers.utils.generic import can_return_tuple

from .attention_mask import check_padding_mask
from .configuration_common import validate_config
from .sequence_classification import sequence_classification_loss
from .weight_init import init_added_weights


class RobertaStyleEmbeddings(RobertaEmbeddings):
    """RoBERTa's embeddings (same parameter names), with the first position row read from the config.

    `config.position_offset` None: RoBERTa's numbering, unchanged (from pad_token_id + 1, pads at the pad row).
    An int (0 for BERT and MiniLM checkpoints): real tokens are numbered from that row over real tokens only, so a
    right-padded sequence gets BERT's own positions and a left-padded one the positions it has alone; pads sit at
    the first row (their outputs are masked everywhere downstream).
    """

    def __init__(self, config):
        super().__init__(config)
        self.position_offset = config.position_offset
        if self.position_offset is not None:
            # RoBERTa's table freezes the pad row (padding_idx gets no gradient); with BERT's numbering that row is
            # the [CLS] position, a real row that must keep learning.
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                past_key_values_length=0):
        """input_ids (batch, n) or inputs_embeds (batch, n, hidden) -> embeddings (batch, n, hidden)."""
        if position_ids is None and self.position_offset is not None:
            if input_ids is not None:
                real = input_ids.ne(self.padding_idx) if self.padding_idx is not None else torch.ones_like(
                    input_ids, dtype=torch.bool)
                position_ids = (real.cumsum(dim=1) - 1).clamp(min=0) * real + self.position_offset
            else:
                batch, n = inputs_embeds.shape[:2]
                position_ids = torch.arange(n, device=inputs_embeds.device).expand(batch, n) + self.position_offset
        return super().forward(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, past_key_values_length=past_key_values_length)


class RobertaStyleSelfAttention(nn.Module):
    """RoBERTa's query / key / value projections around a family's attention, hidden (B, n, D) -> (B, n, D).

    Subclasses implement ``forward(hidden_states, key_mask, output_attentions, shared_projection)`` on the heads that
    ``_split_heads`` gives, and ``build_shared_projection`` where their layers share parameters.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    @staticmethod
    def build_shared_projection(config) -> nn.Module | None:
        """Parameters shared by every layer, owned by the encoder; none by default."""
        return None

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n, D) -> (B, H, n, d)."""
        return x.reshape(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)


class RobertaStyleAttention(nn.Module):
    """Self-attention of a family plus RoBERTa's output projection, residual and LayerNorm."""

    def __init__(self, config, self_attention: nn.Module):
        super().__init__()
        self.self = self_attention
        self.output = RobertaSelfOutput(config)

    def forward(self, hidden_states, key_mask=None, output_attentions=False, shared_projection=None):
        attention_output, weights = self.self(hidden_states, key_mask, output_attentions, shared_projection)
        return self.output(attention_output, hidden_states), weights


class RobertaStyleLayer(GradientCheckpointingLayer):
    """One post-LayerNorm encoder layer: attention, then GELU feed-forward (RoBERTa's layout).

    ``config.chunk_size_feed_forward`` > 0 runs the feed-forward on that many positions at a time, as in RoBERTa:
    same result, an n x intermediate_size activation never held at once (the last chunk may be shorter: unlike
    transformers' helper, n need not be a multiple of the chunk size).
    """

    def __init__(self, config, layer_idx: int, self_attention_class):
        super().__init__()
        self.attention = RobertaStyleAttention(config, self_attention_class(config, layer_idx))
        self.intermediate = RobertaIntermediate(config)
        self.output = RobertaOutput(config)
        self.chunk_size_feed_forward = config.chunk_size_feed_forward

    def forward(self, hidden_states, key_mask=None, output_attentions=False, shared_projection=None):
        attention_output, weights = self.attention(hidden_states, key_mask, output_attentions, shared_projection)
        chunk = self.chunk_size_feed_forward
        if chunk and chunk < attention_output.shape[1]:
            layer_output = torch.cat([self.feed_forward(part) for part in attention_output.split(chunk, dim=1)], dim=1)
        else:
            layer_output = self.feed_forward(attention_output)
        return layer_output, weights

    def feed_forward(self, attention_output):
        return self.output(self.intermediate(attention_output), attention_output)


class RobertaStyleEncoder(nn.Module):
    """The stack of layers, plus parameters shared by all of them (Linformer's layerwise projection)."""

    def __init__(self, config, self_attention_class):
        super().__init__()
        self.layer = nn.ModuleList(
            [RobertaStyleLayer(config, i, self_attention_class) for i in range(config.num_hidden_layers)]
        )
        self.shared_projection = self_attention_class.build_shared_projection(config)

    def forward(self, hidden_states, key_mask=None, output_attentions=False, output_hidden_states=False):
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layer:
            hidden_states, weights = layer(
                hidden_states, key_mask=key_mask, output_attentions=output_attentions,
                shared_projection=self.shared_projection,
            )
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if output_attentions:
                all_attentions += (weights,)
        return hidden_states, all_hidden_states, all_attentions


class RobertaStylePreTrainedModel(PreTrainedModel):
    """Init and loading plumbing shared by both encoder families."""

    base_model_prefix = "roberta"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RobertaStyleEmbeddings", "RobertaStyleLayer"]
    # Set by each family: its self-attention class (a RobertaStyleSelfAttention) and its bare model class, the one
    # every head of the family builds inside it.
    self_attention_class = None
    base_model_class = None

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RobertaLMHead):
            init.zeros_(module.bias)
        elif isinstance(module, RobertaEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)
        init_added_weights(module, self.config)

    def check_key_mask(self, key_mask: torch.Tensor) -> None:
        """Raise if this family cannot honour ``key_mask`` (batch, n); every mask is fine by default."""

    def _run_base_model(self, **inputs):
        return self.roberta(**inputs, return_dict=True)



class RobertaStyleModel(RobertaStylePreTrainedModel):
    """The bare encoder: embeddings, layers and (optionally) RoBERTa's pooler."""

    def __init__(self, config, add_pooling_layer: bool = True):
        validate_config(config)  # again: a value assigned after the config was built is checked here
        super().__init__(config)
        self.embeddings = RobertaStyleEmbeddings(config)
        self.encoder = RobertaStyleEncoder(config, self.self_attention_class)
        self.pooler = RobertaPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def _key_mask(self, attention_mask, input_shape):
        if attention_mask is None:
            return None
        if tuple(attention_mask.shape) != tuple(input_shape):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the input is {tuple(input_shape)}: "
                "these encoders take the tokenizer's 2-D 0/1 mask (batch, sequence), not an expanded 4-D mask."
            )
        check_padding_mask(attention_mask)
        key_mask = attention_mask.bool()
        if not torch.compiler.is_compiling():
            self.check_key_mask(key_mask)
        return key_mask

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
    ) -> BaseModelOutputWithPooling | tuple:
        """input_ids (batch, n) -> last_hidden_state (batch, n, hidden), pooler_output (batch, hidden)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        input_shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        given = "input_ids" if input_ids is not None else "inputs_embeds"
        if len(input_shape) != 2:  # else a reshape or an index error deep inside, naming neither the input nor the fix
            dims = "batch, sequence length" + (", hidden" if given == "inputs_embeds" else "")
            raise ValueError(
                f"{given} has shape {tuple((input_ids if input_ids is not None else inputs_embeds).shape)}; these "
                f"encoders take {given} of shape ({dims}): add the batch dimension ({given}[None] for one sequence; tokenizer(..., return_tensors='pt') "
                "returns it)."
            )
        if input_shape[-1] == 0:
            raise ValueError(
                f"{given} has shape {tuple(input_shape)}: a sequence of 0 tokens, which leaves the pooler and every "
                "head nothing to read. Tokenize with the special tokens (tokenizer(text) adds <s> ... </s> / "
                "[CLS] ... [SEP]) or drop empty inputs."
            )
        if input_shape[-1] > self.config.max_sequence_length:
            raise ValueError(
                f"The input has {input_shape[-1]} tokens but this model takes at most {self.config.max_sequence_length} "
                "(its position table's rows). Truncate it, e.g. "
                f"tokenizer(..., truncation=True, max_length={self.config.max_sequence_length}), or grow the model "
                "with `python scripts/convert.py --extend_max_length N` and fine-tune it at that length."
            )
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        key_mask = self._key_mask(attention_mask, input_shape)

        embeddings = self.embeddings(
            input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids, inputs_embeds=inputs_embeds
        )
        sequence_output, hidden_states, attentions = self.encoder(
            embeddings, key_mask, output_attentions=output_attentions, output_hidden_states=output_hidden_states
        )
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        output = BaseModelOutputWithPooling(
            last_hidden_state=sequence_output,
            pooler_output=pooled_output,
            hidden_states=hidden_states,
            attentions=attentions,
        )
        return output


class RobertaStyleForMaskedLM(RobertaStylePreTrainedModel):
    """Encoder with RoBERTa's masked-LM head; the decoder weight is tied to the word embeddings."""

    _tied_weights_keys = {
        "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    }

    def __init__(self, config):
        super().__init__(config)
        self.roberta = self.base_model_class(config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels: torch.LongTensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
    ) -> MaskedLMOutput | tuple:
        """logits (batch, n, vocab); loss: mean cross-entropy over labels != -100."""
        outputs = self._run_base_model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.reshape(-1, self.config.vocab_size), labels.to(logits.device).reshape(-1))
        output = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output


class RobertaStyleForSequenceClassification(RobertaStylePreTrainedModel):
    """Encoder with RoBERTa's classification head on the <s> token (regression when num_labels == 1)."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.roberta = self.base_model_class(config, add_pooling_layer=False)
        self.classifier = RobertaClassificationHead(config)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels: torch.Tensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
    ) -> SequenceClassifierOutput | tuple:
        """logits (batch, num_labels); loss chosen by config.problem_type, as in RoBERTa."""
        outputs = self._run_base_model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        logits = self.classifier(outputs.last_hidden_state)
        loss = None if labels is None else sequence_classification_loss(self.config, logits, labels.to(logits.device))
        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output


class RobertaStyleForTokenClassification(RobertaStylePreTrainedModel):
    """Encoder with a linear classifier on every token."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.roberta = self.base_model_class(config, add_pooling_layer=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels: torch.LongTensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
    ) -> TokenClassifierOutput | tuple:
        """logits (batch, n, num_labels); loss: cross-entropy over labels != -100."""
        outputs = self._run_base_model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.reshape(-1, self.num_labels), labels.to(logits.device).reshape(-1))
        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output


class RobertaStyleForQuestionAnswering(RobertaStylePreTrainedModel):
    """Encoder with span start / end logits for extractive question answering."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.roberta = self.base_model_class(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
    ) -> QuestionAnsweringModelOutput | tuple:
        """start_logits, end_logits (batch, n); loss: mean of the start and end cross-entropies."""
        outputs = self._run_base_model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, inputs_embeds=inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        logits = self.qa_outputs(outputs.last_hidden_state)
        start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            # Positions outside the input are ignored, as in RoBERTa.
            ignored = start_logits.size(1)
            start = start_positions.reshape(-1).clamp(0, ignored).to(logits.device)
            end = end_positions.reshape(-1).clamp(0, ignored).to(logits.device)
            loss_fct = CrossEntropyLoss(ignore_index=ignored)
            loss = (loss_fct(start_logits, start) + loss_fct(end_logits, end)) / 2
        output = QuestionAnsweringModelOutput(
            loss=loss, start_logits=start_logits, end_logits=end_logits,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )
        return output


class RobertaStyleForMultipleChoice(RobertaStylePreTrainedModel):
    """Encoder scoring each of num_choices sequences with a linear layer on the pooled output."""

    def __init__(self, config):
        super().__init__(config)
        self.roberta = self.base_model_class(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels: torch.LongTensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
    ) -> MultipleChoiceModelOutput | tuple:
        """Inputs (batch, num_choices, n) -> logits (batch, num_choices)."""
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]

        def flat(tensor, trailing=1):
            return None if tensor is None else tensor.reshape(-1, *tensor.shape[-trailing:])

        outputs = self._run_base_model(
            input_ids=flat(input_ids), attention_mask=flat(attention_mask), token_type_ids=flat(token_type_ids),
            position_ids=flat(position_ids), inputs_embeds=flat(inputs_embeds, trailing=2),
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output)).reshape(-1, num_choices)
        loss = None if labels is None else CrossEntropyLoss()(logits, labels.to(logits.device))
        output = MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output
