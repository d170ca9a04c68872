"""Configuration fields shared by the GPT-style decoders (linear attention and causal block Linformer)."""

from huggingface_hub.dataclasses import strict

from .configuration_common import FamilyConfig, check_dropouts, check_positive


@strict
class GPT2StyleConfig(FamilyConfig):
    r"""
    The GPT-2 fields, with GPT-2's names and meanings, so that a GPT-2 checkpoint maps one to one (pre-LayerNorm
    blocks, learned absolute positions, LM head tied to the token embeddings).

    Args:
        vocab_size (`int`, defaults to 50257): size of the token vocabulary.
        n_positions (`int`, defaults to 1024): rows of the learned position table, so the longest sequence (prompt
            plus generated tokens). The attention itself has no length limit.
        n_embd (`int`, defaults to 768): width of the layers (`hidden_size`).
        n_layer (`int`, defaults to 12): number of decoder blocks (`num_hidden_layers`).
        n_head (`int`, defaults to 12): heads per attention layer (`num_attention_heads`); must divide `n_embd`.
        n_inner (`int`, *optional*): width of the feed-forward layer (defaults to 4 * n_embd).
        activation_function (`str`, defaults to `"gelu_new"`): feed-forward activation.
        resid_pdrop (`float`, defaults to 0.1): dropout on the attention and feed-forward outputs.
        embd_pdrop (`float`, defaults to 0.1): dropout on the embeddings.
        attn_pdrop (`float`, defaults to 0.1): dropout on attention probabilities (where the attention has explicit
            probabilities: the causal Linformer; linear attention has none).
        layer_norm_epsilon (`float`, defaults to 1e-5): LayerNorm epsilon.
        initializer_range (`float`, defaults to 0.02): std of the N(0, std) init (output projections are scaled by
            1 / sqrt(2 n_layer), as in GPT-2).
        use_cache (`bool`, defaults to `True`): whether an evaluation-mode forward returns the recurrent cache
            (`past_key_values`); training-mode forwards return none unless asked.
        bos_token_id, eos_token_id, pad_token_id (`int`): special tokens (GPT-2's 50256, 50256, none).
    """

    attribute_map = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float | int = 0.1
    embd_pdrop: float | int = 0.1
    attn_pdrop: float | int = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None

    def validate_decoder_shape(self):
        check_positive(self, ("vocab_size", "n_embd", "n_layer", "n_head"))
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}); change one of them.")
        if self.n_positions < 1:
            raise ValueError(f"n_positions must be positive, got {self.n_positions}.")
        if self.add_cross_attention:
            raise ValueError("These decoders have no cross-attention: add_cross_attention must be False.")
        check_dropouts(self, ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
