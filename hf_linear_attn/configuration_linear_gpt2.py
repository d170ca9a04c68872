"""Configuration of the causal linear-attention decoder (Katharopoulos et al. 2020, "Transformers are RNNs")."""

from huggingface_hub.dataclasses import strict

from .configuration_common import DECODER_HEADS, build_auto_map, plain_value_errors
from .configuration_gpt2_style import GPT2StyleConfig
from .feature_maps import check_feature_map_options
from .sliding_window_attention import check_window_options

LAYER_TYPES = ("linear_attention", "full_attention")


def check_layer_types(layer_types, n_layer: int) -> None:
    """Raise a ValueError naming the fix for a hybrid schedule: one known kind per layer."""
    if layer_types is None:
        return
    if len(layer_types) != n_layer:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries for n_layer={n_layer}: give one kind per layer "
            f"({' / '.join(LAYER_TYPES)}), or None for every layer linear."
        )
    for i, kind in enumerate(layer_types):
        if kind == "sliding_attention":
            raise ValueError(
                f"layer_types[{i}] = 'sliding_attention': a pure sliding-window softmax layer is not implemented; "
                "use 'linear_attention' with attention_window=W (exact softmax over the last W keys, linear attention "
                "beyond), or 'full_attention'."
            )
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] = {kind!r} is not a layer kind; choose one of {', '.join(LAYER_TYPES)}.")


@plain_value_errors
@strict
class LinearGPT2Config(GPT2StyleConfig):
    r"""
    A GPT-2-style decoder whose causal softmax attention is replaced by a feature map phi:
    `y_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)` with `S_t = sum_{j<=t} phi(k_j) v_j^T`, `z_t = sum_{j<=t} phi(k_j)`.
    Training and prefill use the chunked form (time and memory linear in n); generation carries (S, z)
    from token to token, a state whose size does not depend on the context. All GPT-2 fields are as in
    [`GPT2StyleConfig`] (`attn_pdrop` is unused); in addition:

    Args:
        feature_map (`str`, defaults to `"elu"`): `"elu"` (elu(x) + 1), `"relu"`, `"favor"` (Performer FAVOR+
            positive random features; in a decoder the keys get no stabiliser, since one would look at future
            tokens) or `"hedgehog"` (learnable per-head [softmax(xW), softmax(-xW)], W initialised to the identity).
        num_random_features (`int`, defaults to 256): number of FAVOR+ random features m.
        learned_feature_dim (`int`, *optional*): width f of each half of the hedgehog map (defaults to the head size).
        linear_attention_eps (`float`, defaults to 1e-6): eps added to the normaliser phi(q) . z.
        linear_attention_chunk_size (`int`, defaults to 64): chunk length C of the chunked form (exact masked
            attention inside a chunk, states across chunks). Any sequence length works; C trades the O(n C)
            intra-chunk work against the number of chunk steps.
        attention_window (`int`, defaults to 0): W > 0 attends to the last W keys with exact softmax terms
            (`g exp(q.k / sqrt(d))`, g a learned per-head factor, `attn.window_factor`) and to every earlier key
            with the feature map, over one shared normaliser (LoLCATs' combination); generation keeps the window's
            keys and values (W per layer) beside the linear state, still a fixed size. 0: plain linear attention,
            exactly as before. At most `n_positions`; not with `feature_map="favor"`.
        layer_types (`list[str]`, *optional*): a hybrid schedule, one entry per layer, named as Transformers'
            hybrid models name them: `"linear_attention"` (this family's attention, with its window if any) or
            `"full_attention"` (GPT-2's causal softmax attention, SDPA, with a key/value cache that grows by one row
            per token). None: every layer linear.
    """

    model_type = "linear_gpt2"

    feature_map: str = "elu"
    num_random_features: int = 256
    learned_feature_dim: int | None = None
    linear_attention_eps: float | int = 1e-6
    linear_attention_chunk_size: int = 64
    attention_window: int = 0
    layer_types: list[str] | None = None

    default_auto_map = build_auto_map("linear_gpt2", "LinearGPT2", DECODER_HEADS)

    def validate_linear_attention(self):
        check_feature_map_options(
            self.feature_map, self.num_random_features, self.learned_feature_dim, self.linear_attention_eps
        )
        if self.linear_attention_chunk_size < 1:
            raise ValueError(f"linear_attention_chunk_size must be positive, got {self.linear_attention_chunk_size}.")
        check_window_options(self.attention_window, self.n_positions, "n_positions", self.feature_map)
        check_layer_types(self.layer_types, self.n_layer)
