"""Configuration of the causal linear-attention decoder (Katharopoulos et al. 2020, "Transformers are RNNs")."""

from huggingface_hub.dataclasses import strict

from .configuration_common import DECODER_HEADS, build_auto_map, check_layer_types, plain_value_errors
from .configuration_gpt2_style import GPT2StyleConfig
from .feature_maps import check_feature_map_options
from .sliding_window_attention import check_window_factor_init, check_window_options

STATE_DECAYS = ("fixed", "gated")
STATE_UPDATES = ("add", "delta")
DELTA_GATES = ("head", "feature")
DELTA_OUTPUT_NORMS = ("rms", "rms_gated")


def retnet_decay_rates(num_heads: int) -> list[float]:
    """RetNet's fixed per-head decays, gamma_h = 1 - 2^(-5 - h) (Sun et al. 2023, section 2.2): memories of ~32 to
    ~32 * 2^(H-1) tokens."""
    return [1.0 - 2.0 ** (-5 - h) for h in range(num_heads)]


def feature_width(feature_map: str, head_dim: int, num_random_features: int, learned_feature_dim: int | None) -> int:
    """m, the width of phi's output per head (the rows of the state S)."""
    if feature_map == "favor":
        return num_random_features
    if feature_map == "hedgehog":
        return 2 * (learned_feature_dim or head_dim)
    return head_dim


def check_decay_options(config) -> None:
    """Raise a ValueError naming the fix for a bad state decay: its kind, rates, gate sizes and the combinations
    that are not built (a window, FAVOR+ with a per-feature gate)."""
    decay = config.state_decay
    if decay is None:
        if config.decay_rates is not None:
            raise ValueError("decay_rates is set but state_decay is None: set state_decay='fixed' to use the rates.")
        return
    if decay not in STATE_DECAYS:
        raise ValueError(f"state_decay must be None, 'fixed' (RetNet) or 'gated' (GLA), got {decay!r}.")
    if config.attention_window:
        raise ValueError(
            f"state_decay={decay!r} with attention_window={config.attention_window}: a decayed state beside a window "
            "is not implemented; choose one of them (or combine a decayed layer with full_attention layers through "
            "layer_types)."
        )
    if decay == "fixed":
        rates = config.decay_rates
        if rates is not None:
            if len(rates) != config.n_head:
                raise ValueError(f"decay_rates has {len(rates)} entries for n_head={config.n_head}: give one per head.")
            bad = [r for r in rates if not 0.0 < r <= 1.0]
            if bad:
                raise ValueError(f"decay_rates must lie in (0, 1] (1: no decay), got {bad}.")
            if min(rates) < 1e-30:
                raise ValueError(f"decay_rates {min(rates)} is below float32's range: use a rate of at least 1e-30.")
        return
    if config.decay_rates is not None:
        raise ValueError("decay_rates applies to state_decay='fixed'; a gated decay is computed from the input.")
    if config.feature_map == "favor":
        raise ValueError(
            "state_decay='gated' gives each feature of phi its own gate, but FAVOR+'s features are random draws that "
            "redraw_random_features replaces, so a learned gate would lose its feature: use feature_map 'elu', "
            "'relu' or 'hedgehog', or state_decay='fixed'."
        )
    if config.gate_low_rank_dim < 1:
        raise ValueError(f"gate_low_rank_dim must be positive, got {config.gate_low_rank_dim}.")
    if not config.gate_logit_normalizer > 0:
        raise ValueError(f"gate_logit_normalizer must be positive, got {config.gate_logit_normalizer}.")


def check_state_update(config) -> None:
    """Raise a ValueError naming the fix for a bad state update: its kind, and what the delta rule does not combine
    with (it maps q and k itself, keeps no normaliser, is built without a window, and its gate is per head)."""
    update = config.state_update
    if config.delta_gate not in DELTA_GATES:
        raise ValueError(f"delta_gate must be 'head' (Gated DeltaNet) or 'feature' (KDA), got {config.delta_gate!r}.")
    if config.delta_gate != "head" and (update, config.state_decay) != ("delta", "gated"):
        raise ValueError(
            f"delta_gate={config.delta_gate!r} chooses the delta rule's gate, but state_update={update!r} and "
            f"state_decay={config.state_decay!r}: set state_update='delta' and state_decay='gated' for KDA's gate, or "
            "leave delta_gate at 'head'."
        )
    dt_range = config.delta_gate_dt_range
    if dt_range is not None:
        if (update, config.state_decay) != ("delta", "gated"):
            raise ValueError(
                f"delta_gate_dt_range={dt_range!r} starts the delta rule's gate, but state_update={update!r} and "
                f"state_decay={config.state_decay!r}: set state_update='delta' and state_decay='gated', or leave "
                "delta_gate_dt_range at None."
            )
        if (not isinstance(dt_range, (list, tuple)) or len(dt_range) != 2
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in dt_range)
                or not 0 < dt_range[0] <= dt_range[1]):
            raise ValueError(
                f"delta_gate_dt_range must be [dt_min, dt_max] with 0 < dt_min <= dt_max (Mamba-2's: [0.001, 0.1]; "
                f"[1e-4, 1e-3] starts every head near a decay of 1), got {dt_range!r}."
            )
    norm = config.delta_output_norm
    if norm is not None and norm not in DELTA_OUTPUT_NORMS:
        raise ValueError(f"delta_output_norm must be None, 'rms' (RMSNorm per head) or 'rms_gated' (RMSNorm times an "
                         f"output gate), got {norm!r}.")
    if norm is not None and update != "delta":
        raise ValueError(
            f"delta_output_norm={norm!r} normalises the delta rule's output, but state_update={update!r}: set "
            "state_update='delta', or leave delta_output_norm at None."
        )
    if update not in STATE_UPDATES:
        raise ValueError(f"state_update must be 'add' (linear attention's sum) or 'delta' (DeltaNet's delta rule), got "
                         f"{update!r}.")
    if update == "add":
        return
    if config.feature_map != "elu":
        raise ValueError(
            f"state_update='delta' maps q and k itself (SiLU, then unit length, as DeltaNet does), so "
            f"feature_map={config.feature_map!r} would go unused: leave feature_map at its default, or use "
            "state_update='add' for that feature map."
        )
    if config.attention_window:
        raise ValueError(
            f"state_update='delta' with attention_window={config.attention_window}: a delta-rule state beside a "
            "window is not built; drop one of them, or combine a delta-rule layer with full_attention layers through "
            "layer_types."
        )
    if config.state_decay == "gated" and (config.gate_low_rank_dim, config.gate_logit_normalizer) != (16, 16):
        raise ValueError(
            "gate_low_rank_dim and gate_logit_normalizer shape GLA's per-feature gate; with state_update='delta' "
            "state_decay='gated' is Gated DeltaNet's gate (one per head: A_log, dt_bias, a_proj) or KDA's "
            "(delta_gate='feature': f_proj of rank head size, as fla's), which they do not change: leave them at "
            "their defaults."
        )


def check_short_conv_options(config) -> None:
    """Raise a ValueError naming the fix for a bad short convolution: its width, a width without the convolution, a
    convolution no layer would have."""
    size = config.conv_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise ValueError(
            f"conv_size must be an integer of at least 2 (the convolution's width, the current token and conv_size - 1 "
            f"before it; fla's default is 4), got {size!r}."
        )
    if not config.use_short_conv:
        if size != 4:
            raise ValueError(
                f"conv_size={size} is set but use_short_conv is False: set use_short_conv=True to add the convolution, "
                "or leave conv_size at its default."
            )
        if config.short_conv_on_full_attention:
            raise ValueError(
                "short_conv_on_full_attention=True extends the short convolution to the full_attention layers, but "
                "use_short_conv is False, so there is no convolution: set use_short_conv=True as well."
            )
        return
    full_layers = config.layer_types is not None and "full_attention" in config.layer_types
    if config.short_conv_on_full_attention:
        if not full_layers:
            raise ValueError(
                "short_conv_on_full_attention=True but no entry of layer_types is 'full_attention', so it changes "
                "nothing: mark the softmax layers 'full_attention' in layer_types, or leave it False."
            )
        return
    if config.layer_types is not None and "linear_attention" not in config.layer_types:
        raise ValueError(
            "use_short_conv=True applies to linear_attention layers only, and every entry of layer_types is "
            "'full_attention': set short_conv_on_full_attention=True for softmax attention with the convolution "
            "(GPT-2 + short conv), make some layers linear, or set use_short_conv=False."
        )


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
        attention_window_factor_init (`float`, defaults to 0): theta, the window factor's start, g = exp(theta) on
            every head. 0 (g = 1, as Based and LoLCATs start) suits feature maps whose phi(q).phi(k) is on softmax's
            scale (hedgehog); with elu + 1, phi(q).phi(k) starts near m (the feature width: elu(x) + 1 is about 1 per
            feature for the small q, k of a fresh model) against exp(q.k / sqrt(d)) near 1, so at 0 the window's keys
            start with about 1/m of the weight of the keys beyond it; log(m) starts them even. Only with a window.
        layer_types (`list[str]`, *optional*): a hybrid schedule, one entry per layer, named as Transformers'
            hybrid models name them: `"linear_attention"` (this family's attention, with its window if any) or
            `"full_attention"` (GPT-2's causal softmax attention, SDPA, with a key/value cache that grows by one row
            per token). None: every layer linear.
        state_decay (`str`, *optional*): a decaying state, `S_t = a_t S_{t-1} + phi(k_t) v_t^T` and z alike (the
            normaliser decays with S): `"fixed"` (RetNet: one constant a per head, `decay_rates`) or `"gated"` (GLA:
            a per-feature gate from the layer input, `a_t = sigmoid(x W_down W_up + b)^(1 / gate_logit_normalizer)`,
            `attn.gk_proj`). None: no decay, exactly as before. Not with `attention_window`; `"gated"` not with
            `feature_map="favor"`.
        decay_rates (`list[float]`, *optional*): the fixed decays, one per head in (0, 1]; defaults to RetNet's
            `1 - 2^(-5 - h)`.
        gate_low_rank_dim (`int`, defaults to 16): rank of the gate's projection (GLA's `gate_low_rank_dim`).
        gate_logit_normalizer (`float`, defaults to 16): GLA's temperature tau; larger keeps the gate nearer 1.
        use_short_conv (`bool`, defaults to `False`): a short causal convolution on q, k and v after their projection
            (flash-linear-attention's `use_short_conv`): per channel `silu(sum_j w_j x_{t-j})` over the current and
            `conv_size - 1` previous tokens, no bias (`attn.q_conv1d`, `attn.k_conv1d`, `attn.v_conv1d`). In the
            linear-attention layers only (a hybrid's `full_attention` layers get none, unless
            `short_conv_on_full_attention`); combines with every feature map, the window and both decays. Generation
            keeps the last `conv_size - 1` inputs per layer beside the state. False: no convolution, exactly as before.
        state_update (`str`, defaults to `"add"`): how a token changes the state. `"add"`: linear attention's sum
            above. `"delta"`: DeltaNet's delta rule (Schlag et al. 2021; Yang et al. 2024), which replaces what the
            state holds for a key instead of adding to it, `S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T`,
            `y_t = S_t^T q_t`, with q and k through SiLU and then unit length, a step size
            `beta_t = sigmoid(x_t W_beta)` per head (`attn.b_proj`, fla's name) and no normaliser (`feature_map`
            and `linear_attention_eps` are not used). The state is S (d_k x d_v per head), z is not kept. With
            `state_decay` the state fades before each write, `S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} +
            beta_t k_t v_t^T`, one alpha per head: `"fixed"` RetNet's rates, `"gated"` Gated DeltaNet's gate
            `log alpha_t = -exp(A_log) softplus(x_t W_a + dt_bias)` (`attn.delta_gate`), not GLA's per-feature one.
            Not with `attention_window`.
        delta_gate (`str`, defaults to `"head"`): the delta rule's gate with `state_decay="gated"`. `"head"`: Gated
            DeltaNet's, one alpha per head and token. `"feature"`: Kimi Delta Attention's (KDA, Kimi Linear), one per
            key feature, `S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T`, its logits from a
            low-rank projection `x_t W_down W_up` (`attn.delta_gate.f_proj`, rank the head size) and a `dt_bias` per
            head and feature, as fla's KDA layer computes it.
        delta_gate_dt_range (`list[float]`, *optional*): where the delta rule's gate starts, `[dt_min, dt_max]`: its
            time step dt is drawn log-uniform from this range per head (and feature), and with A in [1, 16] the
            per-token decay starts near `exp(-A dt)`. None: Mamba-2's and fla's `[0.001, 0.1]`, decays from 0.20 to
            0.999 at the start. A smaller range starts every head nearer 1, a long memory (`[1e-4, 1e-3]`: 0.984 to
            0.9999). Init only: a checkpoint's trained gate is loaded as saved. Only with `state_update="delta"` and
            `state_decay="gated"`.
        delta_output_norm (`str`, *optional*): what fla's delta-rule layers put between the rule's output and the
            output projection (their `o_norm`, `attn.o_norm`): `"rms"` RMSNorm over each head's output (one weight of
            head size; fla's DeltaNet), `"rms_gated"` the same times an output gate from the layer's input
            (`attn.o_norm.g_proj`): `silu(x W_g)` (fla's Gated DeltaNet, and DeltaNet with `use_gate`), or with
            `delta_gate="feature"` KDA's `sigmoid(x W_down W_up + b)` of rank the head size. None: neither, as before.
            The state and the cache are unchanged. Only with `state_update="delta"`.
        conv_size (`int`, defaults to 4): the convolution's width K (fla's `conv_size`), at least 2.
        short_conv_on_full_attention (`bool`, defaults to `False`): the same convolution on q, k, v of the
            `full_attention` layers too (their own weights, before the softmax attention), so that `layer_types` all
            `"full_attention"` with `use_short_conv=True` is GPT-2 + short conv, the equal-architecture softmax
            baseline of a linear model with the convolution. Needs `use_short_conv=True` and a `full_attention` layer.
            Generation keeps the buffer beside each such layer's keys and values. False: exactly as before.
    """

    model_type = "linear_gpt2"

    feature_map: str = "elu"
    num_random_features: int = 256
    learned_feature_dim: int | None = None
    linear_attention_eps: float | int = 1e-6
    linear_attention_chunk_size: int = 64
    attention_window: int = 0
    attention_window_factor_init: float | int = 0.0
    layer_types: list[str] | None = None
    state_decay: str | None = None
    decay_rates: list[float] | None = None
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float | int = 16
    use_short_conv: bool = False
    conv_size: int = 4
    short_conv_on_full_attention: bool = False
    state_update: str = "add"
    delta_gate: str = "head"
    delta_gate_dt_range: list[float | int] | None = None
    delta_output_norm: str | None = None

    default_auto_map = build_auto_map("linear_gpt2", "LinearGPT2", DECODER_HEADS)

    def validate_linear_attention(self):
        check_feature_map_options(
            self.feature_map, self.num_random_features, self.learned_feature_dim, self.linear_attention_eps
        )
        if self.linear_attention_chunk_size < 1:
            raise ValueError(f"linear_attention_chunk_size must be positive, got {self.linear_attention_chunk_size}.")
        check_window_options(self.attention_window, self.n_positions, "n_positions", self.feature_map)
        check_window_factor_init(self.attention_window_factor_init, self.attention_window)
        check_layer_types(self.layer_types, self.n_layer)
        check_decay_options(self)
        check_short_conv_options(self)
        check_state_update(self)
