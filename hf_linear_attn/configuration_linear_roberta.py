"""Configuration of the kernelized linear-attention encoder (Katharopoulos et al. 2020)."""

from huggingface_hub.dataclasses import strict

from .configuration_common import ENCODER_HEADS, build_auto_map, check_layer_types, plain_value_errors
from .configuration_roberta_style import RobertaStyleConfig
from .feature_maps import check_feature_map_options
from .sliding_window_attention import check_window_factor_init, check_window_options


@plain_value_errors
@strict
class LinearRobertaConfig(RobertaStyleConfig):
    r"""
    A RoBERTa-style encoder whose softmax attention is replaced by a feature map phi:
    `out_i = phi(q_i) (sum_j phi(k_j) v_j^T) / (phi(q_i) . sum_j phi(k_j) + eps)`, linear in n.
    All RoBERTa fields are as in [`RobertaStyleConfig`] (`attention_probs_dropout_prob` is unused: there are no
    explicit attention probabilities); in addition:

    Args:
        feature_map (`str`, defaults to `"elu"`): `"elu"` (elu(x) + 1), `"relu"`, `"favor"` (Performer FAVOR+
            positive orthogonal random features, an unbiased estimate of softmax attention) or `"hedgehog"` (a
            learnable per-head map [softmax(xW), softmax(-xW)], W initialised to the identity).
        num_random_features (`int`, defaults to 256): number of FAVOR+ random features m.
        learned_feature_dim (`int`, *optional*): width f of each half of the hedgehog map (defaults to the head size).
        linear_attention_eps (`float`, defaults to 1e-6): eps added to the normaliser phi(q) . z.
        attention_window (`int`, defaults to 0): W > 0 attends to the band |i - j| < W with exact softmax terms
            (`g exp(q.k / sqrt(d))`, g a learned per-head factor, `attention.self.window_factor`) and to every key
            beyond it with the feature map, over one shared normaliser; computed in chunks, linear in n. 0: plain
            linear attention, exactly as before. At most `max_sequence_length`; not with `feature_map="favor"`.
        attention_window_factor_init (`float`, defaults to 0): theta, the window factor's start, g = exp(theta) on
            every head. 0 (g = 1, as Based and LoLCATs start) suits feature maps whose phi(q).phi(k) is on softmax's
            scale (hedgehog); with elu + 1, phi(q).phi(k) starts near m (the feature width: elu(x) + 1 is about 1 per
            feature for the small q, k of a fresh model) against exp(q.k / sqrt(d)) near 1, so at 0 the window's keys
            start with about 1/m of the weight of the keys beyond it; log(m) starts them even. Only with a window.
        linear_attention_chunk_size (`int`, defaults to 64): chunk length C of the banded form (used with a window).
        layer_types (`list[str]`, *optional*): a hybrid schedule, one entry per layer, named as Transformers' hybrid
            models name them: `"linear_attention"` (this family's attention, with its band if any) or
            `"full_attention"` (RoBERTa's softmax attention, SDPA, on the same query / key / value weights: a
            converted RoBERTa or BERT keeps those layers exactly). None: every layer linear.
    """

    model_type = "linear_roberta"

    feature_map: str = "elu"
    num_random_features: int = 256
    learned_feature_dim: int | None = None
    linear_attention_eps: float | int = 1e-6
    attention_window: int = 0
    attention_window_factor_init: float | int = 0.0
    linear_attention_chunk_size: int = 64
    layer_types: list[str] | None = None

    default_auto_map = build_auto_map("linear_roberta", "LinearRoberta", ENCODER_HEADS)

    def validate_linear_attention(self):
        check_feature_map_options(
            self.feature_map, self.num_random_features, self.learned_feature_dim, self.linear_attention_eps
        )
        if self.linear_attention_chunk_size < 1:
            raise ValueError(f"linear_attention_chunk_size must be positive, got {self.linear_attention_chunk_size}.")
        check_window_options(self.attention_window, self.max_sequence_length, "max_sequence_length", self.feature_map)
        check_window_factor_init(self.attention_window_factor_init, self.attention_window)
        check_layer_types(self.layer_types, self.num_hidden_layers, "num_hidden_layers")
