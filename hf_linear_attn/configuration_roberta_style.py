"""Configuration fields shared by the RoBERTa-style encoders (Linformer and linear attention)."""

from huggingface_hub.dataclasses import strict

from .configuration_common import FamilyConfig, check_dropouts, check_positive


@strict
class RobertaStyleConfig(FamilyConfig):
    r"""
    The RoBERTa fields, with RoBERTa's names and meanings, so that a RoBERTa checkpoint maps one to one.

    Args:
        vocab_size (`int`, defaults to 50265): size of the token vocabulary.
        hidden_size (`int`, defaults to 768): width of the encoder layers.
        num_hidden_layers (`int`, defaults to 12): number of encoder layers.
        num_attention_heads (`int`, defaults to 12): heads per attention layer; must divide `hidden_size`.
        intermediate_size (`int`, defaults to 3072): width of the feed-forward layer.
        hidden_act (`str`, defaults to `"gelu"`): feed-forward activation.
        hidden_dropout_prob (`float`, defaults to 0.1): dropout on embeddings and layer outputs.
        attention_probs_dropout_prob (`float`, defaults to 0.1): dropout on attention probabilities (where the
            attention has explicit probabilities).
        max_position_embeddings (`int`, defaults to 514): rows of the learned position table. As in RoBERTa,
            positions start after `pad_token_id`, so the longest input is `max_position_embeddings - pad_token_id - 1`
            tokens (`max_sequence_length`, 512 by default).
        position_offset (`int`, *optional*): the position row of a sequence's first token. `None` (default):
            RoBERTa's numbering, from `pad_token_id + 1`. `0`: BERT's numbering, from row 0 (BERT and MiniLM
            checkpoints converted with `scripts/convert.py` set it), so the longest input is
            `max_position_embeddings - position_offset` tokens. Either way pad tokens take no position: a sequence
            gets the same positions alone or padded on either side.
        type_vocab_size (`int`, defaults to 1): token type vocabulary (RoBERTa uses 1, BERT 2: first and second
            segment of a pair).
        initializer_range (`float`, defaults to 0.02): std of the N(0, std) init of linear and embedding weights.
        layer_norm_eps (`float`, defaults to 1e-5): LayerNorm epsilon.
        classifier_dropout (`float`, *optional*): dropout of classification heads (defaults to `hidden_dropout_prob`).
        pad_token_id, bos_token_id, eos_token_id (`int`): special tokens (RoBERTa's 1, 0, 2).
    """

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 514
    position_offset: int | None = None
    type_vocab_size: int = 1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    classifier_dropout: float | int | None = None
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    use_cache: bool = False
    is_decoder: bool = False

    @property
    def first_position(self) -> int:
        """Position row of a sequence's first token: `position_offset`, or RoBERTa's pad_token_id + 1."""
        if self.position_offset is not None:
            return self.position_offset
        return (self.pad_token_id or 0) + 1

    @property
    def max_sequence_length(self) -> int:
        """Longest input in tokens: the position table minus the rows below the first position (RoBERTa reserves
        the pad index and those under it; BERT's numbering reserves none)."""
        return self.max_position_embeddings - self.first_position

    def validate_encoder_shape(self):
        check_positive(self, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                              "intermediate_size", "max_position_embeddings"))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}); change one of them."
            )
        if self.position_offset is None and self.pad_token_id is None:
            raise ValueError(
                "pad_token_id must be set: RoBERTa-style positions are numbered from pad_token_id + 1 "
                "(or set position_offset, e.g. 0 for BERT's numbering)."
            )
        if self.position_offset is not None and self.position_offset < 0:
            raise ValueError(f"position_offset must be 0 or more (got {self.position_offset}); 0 numbers as BERT.")
        if self.max_sequence_length < 1:
            raise ValueError(
                f"max_position_embeddings ({self.max_position_embeddings}) leaves no positions after the first one "
                f"({self.first_position}); use at least {self.first_position + 1}."
            )
        check_dropouts(self, ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"))
        if self.is_decoder or self.add_cross_attention:
            raise ValueError(
                "These encoders are bidirectional: is_decoder and add_cross_attention must be False. "
                "For causal models use the GPT-style decoders of this package."
            )
