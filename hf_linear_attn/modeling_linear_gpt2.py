"""Causal linear-attention decoder ("Transformers are RNNs", Katharopoulos et al. 2020) as a GPT-2-style model.

Training and prefill run the chunkwise-parallel causal form (no n x n matrix, no per-position state: memory linear
in n); each generated token then updates a fixed-size state per layer, S (B, H, m, d) and z (B, H, m) in float32,
so the cost of a token does not grow with the context.
"""

from typing import NamedTuple

import torch

from .configuration_linear_gpt2 import LinearGPT2Config, feature_width, retnet_decay_rates
from .decayed_linear_attention import (
    causal_decayed_linear_attention,
    decayed_linear_attention_weights,
    recurrent_decayed_linear_attention_step,
)
from .delta_rule import (MAMBA2_DT_RANGE, DeltaRuleGate, DeltaRuleOutputNorm, causal_delta_rule, delta_rule_qk,
                         delta_rule_weights, naive_delta_rule)
from .feature_maps import build_feature_map
from .linear_attention import (
    causal_linear_attention,
    linear_attention_weights,
    mask_keys,
    recurrent_linear_attention_step,
)
from .modeling_gpt2_style import (
    GPT2StyleAttention,
    GPT2StyleForCausalLM,
    GPT2StyleForSequenceClassification,
    GPT2StyleModel,
    GPT2StylePreTrainedModel,
)
from .recurrent_cache import (
    SHORT_CONV_STATE_LAYERS,
    DecayedStateLayer,
    DeltaRuleStateLayer,
    KeyValueStateLayer,
    LinearAttentionStateLayer,
    SlidingWindowStateLayer,
    StabilisedFavorStateLayer,
)
from .short_convolution import ShortConvolution, causal_short_convolution, mask_pad_inputs
from .sliding_window_attention import (
    SlidingWindowFactor,
    causal_sliding_window_attention,
    empty_sliding_window_state,
    sliding_window_attention_step,
    sliding_window_attention_weights,
)
from .weight_init import RandomFeaturesMixin


class KeyValueSlots(NamedTuple):
    """A full-attention layer's state of fixed shapes (for :class:`~.explicit_state.DecoderStateStep`, export and
    fullgraph compilation), as Transformers' static cache keeps one: keys and values (B, H, P, d) in P = n_positions
    slots, a token's slot being its position in its row, and the tokens so far per row (B,). A step writes its keys
    and values at slots ``length ...`` and attends over the slots up to its own (later slots are empty), so every
    step costs what a step at the end of the position table costs. The generation cache grows instead (it keeps
    (keys, values, real-token mask) of the tokens so far)."""

    keys: torch.Tensor
    values: torch.Tensor
    length: torch.Tensor


class BufferedKeyValueSlots(NamedTuple):
    """:class:`KeyValueSlots` and the short convolution's buffer (B, K-1, 3 D) of a full-attention layer whose q, k, v
    pass the convolution (``short_conv_on_full_attention``): what :class:`~.explicit_state.DecoderStateStep` hands
    such a layer. Its own type, because the generation cache's (keys, values, mask, buffer) has four tensors too and
    takes the growing-cache path."""

    keys: torch.Tensor
    values: torch.Tensor
    length: torch.Tensor
    buffer: torch.Tensor


class LinearGPT2Attention(GPT2StyleAttention):
    """Multi-head causal linear attention; it continues from a (S, z) state and returns the new one.

    With ``output_attentions`` (whole sequence, no past state) it also returns the causal n x n matrix it applies
    implicitly (quadratic: for inspection and distillation only).
    """

    cache_layer_class = LinearAttentionStateLayer
    delta_rule = False  # state_update="delta": DeltaNet's rule instead of the feature map's sum

    def __init__(self, config: LinearGPT2Config, layer_idx: int):
        super().__init__(config, layer_idx)
        # the delta rule's output norm and gate (delta_output_norm); an instance attribute, so that a module assigned
        # later is what attribute lookup finds (a class attribute would shadow nn.Module's submodule lookup)
        self.o_norm = None
        self.eps = config.linear_attention_eps
        self.chunk_size = config.linear_attention_chunk_size
        # A hybrid schedule's "full_attention" layer is GPT-2's softmax attention with a key/value cache: the same
        # parameters (c_attn, c_proj), no feature map and no window.
        self.full_attention = config.layer_types is not None and config.layer_types[layer_idx] == "full_attention"
        self.window = 0
        self.state_decay = None
        if self.full_attention:
            self.attn_pdrop = config.attn_pdrop
            self.feature_map = None
            self.cache_layer_class = KeyValueStateLayer
            self.slot_capacity = config.n_positions  # KeyValueSlots: every position the table can embed
            # short_conv_on_full_attention: GPT-2 + short conv, the softmax baseline with the same token mixing as
            # the linear layers (the cache then keeps the convolution's buffer beside the keys and values)
            if config.use_short_conv and config.short_conv_on_full_attention:
                self._add_short_conv(config)
            return
        if config.state_update == "delta":
            # DeltaNet: q and k through SiLU and unit length (delta_rule_qk), no feature map and no normaliser; a
            # step size beta per head and token from the layer input (fla's b_proj, no bias)
            self.delta_rule = True
            self.feature_map = None
            self.favor_stabiliser = False
            self.b_proj = torch.nn.Linear(self.embed_dim, self.num_heads, bias=False)
            # a decay: RetNet's fixed rates per head, or a gate from the input, Gated DeltaNet's per head or KDA's
            # per key feature (delta_gate)
            self.state_decay = config.state_decay
            per_feature_gate = self.state_decay == "gated" and config.delta_gate == "feature"
            if self.state_decay == "fixed":
                self.decay_rates = list(config.decay_rates or retnet_decay_rates(self.num_heads))
            elif self.state_decay == "gated":
                per_feature = self.head_dim if per_feature_gate else None
                self.delta_gate = DeltaRuleGate(self.embed_dim, self.num_heads, per_feature,
                                                config.delta_gate_dt_range or MAMBA2_DT_RANGE)
            if config.delta_output_norm is not None:  # fla's o_norm: RMSNorm per head, and an output gate
                gate = None if config.delta_output_norm == "rms" else "sigmoid" if per_feature_gate else "swish"
                self.o_norm = DeltaRuleOutputNorm(self.embed_dim, self.num_heads, self.head_dim, gate,
                                                  config.layer_norm_epsilon)
            self.cache_layer_class = DeltaRuleStateLayer
            if config.use_short_conv:
                self._add_short_conv(config)
            return
        self.feature_map = build_feature_map(
            config.feature_map, self.num_heads, self.head_dim, num_random_features=config.num_random_features,
            learned_feature_dim=config.learned_feature_dim, causal=True,
        )
        # attention_window > 0: exact softmax over the last W keys, the feature map beyond (sliding_window_attention)
        self.window = config.attention_window
        if self.window:
            self.window_factor = SlidingWindowFactor(self.num_heads, config.attention_window_factor_init)
            self.cache_layer_class = SlidingWindowStateLayer  # per instance: the cache holds the window too
        # state_decay: S_t = a_t S_{t-1} + phi(k_t) v_t^T (decayed_linear_attention); a fixed a per head (RetNet) or
        # a per-feature gate from the layer input (GLA's low-rank projection, named as fla names it: gk_proj)
        self.state_decay = config.state_decay
        if self.state_decay is not None:
            self.cache_layer_class = DecayedStateLayer  # its rollback replays the decays too
        # Causal FAVOR+ (a window with FAVOR+ is refused): keys scaled by the running maximum of each feature's
        # logit, never a later key's (FavorFeatureMap.causal_pair), so no feature underflows at large key norms. The
        # maximum's growth rescales the state, a decay, so these layers run the decayed kernel and their state also
        # carries the maximum.
        self.favor_stabiliser = config.feature_map == "favor"
        if self.favor_stabiliser:
            self.cache_layer_class = StabilisedFavorStateLayer
        if self.state_decay == "fixed":
            self.decay_rates = list(config.decay_rates or retnet_decay_rates(self.num_heads))
        elif self.state_decay == "gated":
            width = feature_width(config.feature_map, self.head_dim, config.num_random_features,
                                  config.learned_feature_dim)
            self.gk_proj = torch.nn.Sequential(
                torch.nn.Linear(self.embed_dim, config.gate_low_rank_dim, bias=False),
                torch.nn.Linear(config.gate_low_rank_dim, self.num_heads * width, bias=True),
            )
            self.gate_logit_normalizer = config.gate_logit_normalizer
        # use_short_conv: a depthwise causal convolution of width conv_size on each of q, k, v (SiLU after), named as
        # fla names them. Linear-attention layers; a hybrid's full_attention layers (returned above) stay GPT-2's
        # softmax attention without one, as in fla's hybrids, unless short_conv_on_full_attention.
        if config.use_short_conv:
            self._add_short_conv(config)

    def _add_short_conv(self, config):
        """The convolutions on q, k, v; the cache layer then also keeps the convolution's buffer."""
        self.has_short_conv = True
        self.q_conv1d = ShortConvolution(self.embed_dim, config.conv_size)
        self.k_conv1d = ShortConvolution(self.embed_dim, config.conv_size)
        self.v_conv1d = ShortConvolution(self.embed_dim, config.conv_size)
        self.cache_layer_class = SHORT_CONV_STATE_LAYERS[self.cache_layer_class]

    def short_conv(self, qkv, key_mask, buffer):
        """q, k, v (fused (B, n, 3 D)) through their short convolutions, pads zeroed first: one depthwise convolution
        over the 3 D channels with the three weights stacked (the same as three). Returns (q, k, v fused, the new
        buffer (B, K-1, 3 D): the last K-1 inputs, the inputs (B, n, 3 D), which a rollback replays)."""
        inputs = mask_pad_inputs(qkv, key_mask)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        mixed, buffer = causal_short_convolution(inputs, weight, buffer)
        return mixed, buffer, inputs

    def normalize_output(self, output, hidden_states):
        return output if self.o_norm is None else self.o_norm(output, hidden_states)

    def per_token_inputs(self, hidden_states):
        """log a_t of the decayed state: (1, H, 1, 1) fixed rates, or the gate (B, H, n, m) from ``hidden_states``;
        the delta rule's step size beta (B, H, n) in (0, 1)."""
        if self.delta_rule:  # beta (B, H, n); log alpha (1, H, 1) fixed, (B, H, n) or (B, H, n, d_k) gated
            inputs = {"beta": torch.sigmoid(self.b_proj(hidden_states).float()).transpose(1, 2)}
            if self.state_decay == "fixed":
                rates = torch.tensor(self.decay_rates, dtype=torch.float32, device=hidden_states.device)
                inputs["log_decay"] = rates.log().view(1, -1, 1)
            elif self.state_decay == "gated":
                inputs["log_decay"] = self.delta_gate(hidden_states)
            return inputs
        if self.state_decay is None:
            return {}
        if self.state_decay == "fixed":
            rates = torch.tensor(self.decay_rates, dtype=torch.float32, device=hidden_states.device)
            return {"log_decay": rates.log().view(1, -1, 1, 1)}
        # GLA: log a = log sigmoid(x W_down W_up + b) / tau, in float32 (a product of many a's near 1 is what decays)
        logits = self.gk_proj(hidden_states).float()
        log_decay = torch.nn.functional.logsigmoid(logits) / self.gate_logit_normalizer
        return {"log_decay": log_decay.view(*hidden_states.shape[:2], self.num_heads, -1).transpose(1, 2)}

    def initial_state(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Zeros (S (B, H, m, d), z (B, H, m)) in float32, m the feature map's output width (causal FAVOR+ adds its
        running maximum, -inf (B, H, m)); with a window also the empty window (keys, phi(keys), values (B, H, W, .)
        zeros, valid (B, W) False); with a short convolution last its buffer, zeros (B, K-1, 3 D)."""
        if self.full_attention:  # KeyValueSlots, empty: zero keys and values, no token yet
            weight = self.c_attn.weight
            shape = (batch_size, self.num_heads, self.slot_capacity, self.head_dim)
            slots = KeyValueSlots(weight.new_zeros(shape), weight.new_zeros(shape),
                                  torch.zeros(batch_size, dtype=torch.long, device=weight.device))
            return (*slots, self._empty_conv_buffer(batch_size)) if self.has_short_conv else slots
        device = self.c_attn.weight.device
        if self.delta_rule:  # S (B, H, d_k, d_v), no normaliser
            state = (torch.zeros(batch_size, self.num_heads, self.head_dim, self.head_dim, device=device),)
            return (*state, self._empty_conv_buffer(batch_size)) if self.has_short_conv else state
        features = self.feature_map(torch.zeros(1, self.num_heads, 1, self.head_dim, device=device), is_query=False)
        if self.window:
            state = empty_sliding_window_state(
                batch_size, self.num_heads, self.window, self.head_dim, features.shape[-1], self.head_dim, device
            )
        else:
            shape = (batch_size, self.num_heads, features.shape[-1])
            state = torch.zeros(*shape, self.head_dim, device=device), torch.zeros(shape, device=device)
            if self.favor_stabiliser:  # the running maximum: -inf, no key seen yet
                state = (*state, torch.full(shape, -torch.inf, device=device))
        if self.has_short_conv:
            state = (*state, self._empty_conv_buffer(batch_size))
        return tuple(state)

    def _empty_conv_buffer(self, batch_size: int) -> torch.Tensor:
        """The convolution's buffer before a sequence's first token: zeros (B, K-1, 3 D)."""
        width = self.q_conv1d.kernel_size[0] - 1
        return self.c_attn.weight.new_zeros(batch_size, width, 3 * self.embed_dim)

    def _attend_window(self, q, k, v, phi_q, phi_k, key_mask, state, need_tail, output_attentions):
        """attend() with a sliding window: chunked form for prompts, the step for single tokens after a state."""
        theta = self.window_factor()
        if state is not None and q.shape[2] == 1:
            output, state = sliding_window_attention_step(q, k, v, phi_q, phi_k, state, key_mask, theta, self.eps)
        else:
            output, state = causal_sliding_window_attention(
                q, k, v, phi_q, phi_k, self.window, key_mask, theta, self.eps, self.chunk_size, state
            )
        tail = None
        if need_tail:  # rollback tail: keys (the window's scores), phi(k) and v, pads zeroed, and the real-token mask
            real = key_mask if key_mask is not None else torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
            keep = real.bool()[:, None, :, None]
            tail = tuple(torch.where(keep, t.float(), 0.0) for t in (k, phi_k, v)) + (real.bool(),)
        weights = None
        if output_attentions:
            weights = sliding_window_attention_weights(q, k, phi_q, phi_k, self.window, key_mask, True, theta, self.eps)
        return output, weights, state, tail

    def _attend_full(self, q, k, v, key_mask, state, output_attentions):
        """GPT-2's causal softmax attention (SDPA) over the cached keys / values and the new ones; returns the output,
        weights or None and the new cache (keys, values (B, H, T, d), real-token mask (B, T))."""
        batch, _, n, _ = q.shape
        real = torch.ones(batch, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
        if state is not None:
            k, v = torch.cat([state[0].to(k.dtype), k], dim=2), torch.cat([state[1].to(v.dtype), v], dim=2)
            real = torch.cat([state[2], real], dim=1)
        total = k.shape[2]
        query_positions = torch.arange(total - n, total, device=q.device)[:, None]
        key_positions = torch.arange(total, device=q.device)[None, :]
        # causal and real keys only; a (left) pad query keeps its own key, so that no row is empty (its output is
        # never read)
        allowed = ((key_positions <= query_positions)[None] & real[:, None, :]) | (key_positions == query_positions)[None]
        dropout = self.attn_pdrop if self.training else 0.0
        if output_attentions:
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
            weights = torch.softmax(scores.masked_fill(~allowed[:, None], -torch.inf).float(), dim=-1)
            output = torch.matmul(torch.nn.functional.dropout(weights, dropout, self.training).to(v.dtype), v)
        else:
            weights = None
            output = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], dropout_p=dropout)
        return output, weights, (k, v, real)

    def _attend_slots(self, q, k, v, key_mask, slots: KeyValueSlots):
        """_attend_full on the fixed-shape state (:class:`KeyValueSlots`): the n new tokens (all real, as
        DecoderStateStep feeds them) go to slots length .. length + n - 1, and each attends over the slots up to its
        own. Returns the output and the new slots."""
        if key_mask is not None:
            raise ValueError("KeyValueSlots take real tokens only (DecoderStateStep passes no mask): drop the pads.")
        batch, heads, n, head_dim = q.shape
        keys, values, length = slots
        slot = length[:, None] + torch.arange(n, device=q.device)  # (B, n): each new token's position in its row
        index = slot[:, None, :, None].expand(batch, heads, n, head_dim)
        keys, values = keys.scatter(2, index, k.to(keys.dtype)), values.scatter(2, index, v.to(values.dtype))
        # slots before and at a query's own are filled (earlier tokens and this call's); later ones are empty
        allowed = torch.arange(keys.shape[2], device=q.device)[None, None, :] <= slot[:, :, None]
        output = torch.nn.functional.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=allowed[:, None]
        )
        return output, KeyValueSlots(keys, values, length + n)

    def explicit_state(self, tensors):
        if not self.full_attention:
            return tensors
        return BufferedKeyValueSlots(*tensors) if self.has_short_conv else KeyValueSlots(*tensors)

    def split_conv_buffer(self, state):
        if isinstance(state, BufferedKeyValueSlots):  # the slots stay KeyValueSlots, so attend() takes the slot path
            return KeyValueSlots(*state[:3]), state.buffer
        return super().split_conv_buffer(state)

    def exported_prompt_state(self, state):
        """A full-attention layer's prompt state (keys, values (B, H, n, d), real-token mask (B, n)) as
        :class:`KeyValueSlots`: each real token at its slot (its position among its row's real tokens, as
        DecoderPrefill numbers positions), pads left out (sent to a spare slot that is dropped)."""
        if not self.full_attention:
            return state
        if self.has_short_conv:  # the buffer (last) is already of fixed shape; pads were zeroed before it was taken
            return (*self._prompt_slots(state[:3]), state[-1])
        return self._prompt_slots(state)

    def _prompt_slots(self, state) -> KeyValueSlots:
        """(keys, values, real-token mask) of a prompt pass as :class:`KeyValueSlots` (exported_prompt_state)."""
        keys, values, real = state
        batch, heads, _, head_dim = keys.shape
        capacity = self.slot_capacity
        slot = torch.where(real, real.long().cumsum(-1) - 1, capacity)
        index = slot[:, None, :, None].expand_as(keys)
        shape = (batch, heads, capacity + 1, head_dim)
        keys = keys.new_zeros(shape).scatter(2, index, keys)[:, :, :capacity]
        values = values.new_zeros(shape).scatter(2, index, values)[:, :, :capacity]
        return KeyValueSlots(keys, values, real.long().sum(-1))

    def _attend_decayed(self, phi_q, phi_k, v, log_decay, key_mask, state, need_tail, output_attentions):
        """attend() with a decaying state: the chunked form for prompts, the recurrent step for single tokens."""
        n = phi_q.shape[2]
        log_decay = log_decay.expand(*log_decay.shape[:2], n, log_decay.shape[-1])
        if state is not None and n == 1:
            output, state = recurrent_decayed_linear_attention_step(
                phi_q, phi_k, v, log_decay, state, key_mask, eps=self.eps
            )
        else:
            output, state = causal_decayed_linear_attention(
                phi_q, phi_k, v, log_decay, key_mask, eps=self.eps, chunk_size=self.chunk_size, state=state
            )
        tail = None
        if need_tail:  # rollback tail: phi(k), v with pads zeroed and the decays (0 at pads: they leave the state)
            phi_k_tail, v_tail = mask_keys(phi_k, v, key_mask)
            decay_tail = log_decay.float().expand(phi_q.shape[0], -1, -1, -1)
            if key_mask is not None:
                decay_tail = torch.where(key_mask[:, None, :, None], decay_tail, 0.0)
            tail = (phi_k_tail, v_tail, decay_tail)
        weights = None
        if output_attentions:
            weights = decayed_linear_attention_weights(phi_q, phi_k, log_decay, key_mask, eps=self.eps)
        return output, weights, state, tail

    def _attend_delta(self, q, k, v, beta, log_decay, key_mask, state, need_tail, output_attentions):
        """attend() with the delta rule: the chunked form for prompts, the recurrence for single tokens after a state.
        State (S,); rollback tail: the unit keys, the values, beta and log alpha (both 0 at pads; log alpha 0
        without a decay)."""
        q, k = delta_rule_qk(q, k)
        decay = beta.new_zeros(()) if log_decay is None else log_decay
        decay = decay.expand(*beta.shape, *decay.shape[3:])  # (B, H, n), or (B, H, n, d_k) for KDA's gate
        if key_mask is not None:  # a pad writes nothing, erases nothing and leaves the state undecayed
            real = key_mask[:, None, :].bool()
            beta = torch.where(real, beta, 0.0)
            decay = torch.where(real[..., None] if decay.dim() == 4 else real, decay, 0.0)
        log_decay = None if log_decay is None else decay
        start = None if state is None else state[0]
        if state is not None and q.shape[2] == 1:
            output, s = naive_delta_rule(q, k, v, beta, state=start, log_decay=log_decay)
        else:
            output, s = causal_delta_rule(q, k, v, beta, state=start, chunk_size=self.chunk_size, log_decay=log_decay)
        weights = delta_rule_weights(q, k, beta, log_decay=log_decay) if output_attentions else None
        return output, weights, (s,), (k, v.float(), beta, decay) if need_tail else None

    def _attend_favor(self, q, k, v, key_mask, state, use_cache, need_tail, output_attentions, log_decay):
        """attend() for causal FAVOR+: state (S, z, running maximum (B, H, m)); the maximum's growth is a decay of
        (S, z), added to the layer's own decay where it has one. Rollback tail: the decayed kernel's (phi(k), v,
        log a) and the running maximum at each token."""
        running = None if state is None else state[2]
        phi_q, phi_k, log_growth, running = self.feature_map.causal_pair(q, k, key_mask, running)
        log_decay = log_growth if log_decay is None else log_decay + log_growth
        output, weights, state, tail = self._attend_decayed(
            phi_q, phi_k, v, log_decay, key_mask, None if state is None else state[:2], need_tail, output_attentions
        )
        state = (*state, running[:, :, -1])
        return output, weights, state if use_cache else None, None if tail is None else (*tail, running)

    def attend(self, q, k, v, key_mask, state, use_cache, need_tail, output_attentions, shared_projection,
               log_decay=None, beta=None):
        if isinstance(state, KeyValueSlots):  # DecoderStateStep's fixed-shape state of a full-attention layer
            output, state = self._attend_slots(q, k, v, key_mask, KeyValueSlots(*(t.to(q.device) for t in state)))
            return output, None, state if use_cache else None, None
        if state is not None:
            state = tuple(t.to(q.device) for t in state)
        if self.full_attention:
            output, weights, state = self._attend_full(q, k, v, key_mask, state, output_attentions)
            # No rollback tail of its own: crop truncates the keys and values. An empty one (not None) when asked,
            # so that a short convolution's inputs can follow it.
            return output, weights, state if use_cache else None, () if need_tail else None
        if self.delta_rule:
            output, weights, state, tail = self._attend_delta(
                q, k, v, beta, log_decay, key_mask, state, need_tail, output_attentions
            )
            return output, weights, state if use_cache else None, tail
        if self.favor_stabiliser:
            return self._attend_favor(q, k, v, key_mask, state, use_cache, need_tail, output_attentions, log_decay)
        phi_q, phi_k = self.feature_map.pair(q, k, key_mask)
        if log_decay is not None:
            output, weights, state, tail = self._attend_decayed(
                phi_q, phi_k, v, log_decay, key_mask, state, need_tail, output_attentions
            )
            return output, weights, state if use_cache else None, tail
        if self.window:
            output, weights, state, tail = self._attend_window(
                q, k, v, phi_q, phi_k, key_mask, state, need_tail, output_attentions
            )
            return output, weights, state if use_cache else None, tail
        if state is not None and q.shape[2] == 1:
            output, state = recurrent_linear_attention_step(phi_q, phi_k, v, state, key_mask, eps=self.eps)
        else:
            output, state = causal_linear_attention(
                phi_q, phi_k, v, key_mask, eps=self.eps, chunk_size=self.chunk_size, state=state
            )
        # Rollback tail: what each token added to the state, phi(k) and v with pads zeroed.
        tail = mask_keys(phi_k, v, key_mask) if need_tail else None
        weights = None
        if output_attentions:
            weights = linear_attention_weights(phi_q, phi_k, key_mask, causal=True, eps=self.eps)
        return output, weights, state if use_cache else None, tail


class LinearGPT2PreTrainedModel(RandomFeaturesMixin, GPT2StylePreTrainedModel):
    """Config and attention of the linear-attention decoders, and FAVOR+ redraws. Init (``init_added_weights``):
    FAVOR+ draws orthogonal random features, hedgehog starts at the identity, the window's factor at g = 1."""

    config_class = LinearGPT2Config
    attention_class = LinearGPT2Attention


class LinearGPT2Model(LinearGPT2PreTrainedModel, GPT2StyleModel):
    """The bare linear-attention decoder: last_hidden_state (B, n, D) and the recurrent state."""


LinearGPT2PreTrainedModel.base_model_class = LinearGPT2Model  # the decoder every head below builds inside it


class LinearGPT2ForCausalLM(LinearGPT2PreTrainedModel, GPT2StyleForCausalLM):
    """Linear-attention decoder with GPT-2's LM head; generate() runs it as an RNN."""


class LinearGPT2ForSequenceClassification(LinearGPT2PreTrainedModel, GPT2StyleForSequenceClassification):
    """Linear-attention decoder classifying each sequence from its last real token."""
