"""Generation caches of the decoders: a fixed-size recurrent state per layer, never a growing key/value cache.

* :class:`LinearAttentionStateLayer` holds the state of causal linear attention, S (B, H, m, d) and z (B, H, m)
  in float32: its size does not depend on the number of tokens seen ("Transformers are RNNs").
* :class:`DecayedStateLayer` holds the same (S, z) for linear attention whose state decays (RetNet, GLA), and
  :class:`StabilisedFavorStateLayer` that and the running maximum of causal FAVOR+'s key logits.
* :class:`DeltaRuleStateLayer` holds the state S (B, H, d_k, d_v) of linear attention with the delta rule (DeltaNet).
* :class:`SlidingWindowStateLayer` holds that state plus the last W keys / values of window + linear attention.
* With a short convolution on q, k, v (``use_short_conv``) each of the linear layers above also holds the
  convolution's buffer, the last K-1 pre-convolution inputs (:class:`ShortConvStateMixin`).
* :class:`KeyValueStateLayer` holds the keys and values of a full-attention layer of a hybrid schedule, and
  :class:`ShortConvKeyValueStateLayer` those and a short convolution's buffer (``short_conv_on_full_attention``).
* :class:`BlockLinformerCacheLayer` holds the causal block Linformer's k-row summaries of completed blocks and the
  raw keys / values of the current block: it grows by k rows per block, not by one row per token.

Both count the tokens they have seen, left padding included, as ``generate`` expects of ``get_seq_length``.

Rollback (assisted and prompt-lookup decoding): after ``activate_past_recording()`` a layer also keeps the state at
the last commit point and the per-token inputs of the state update for every token since then (linear attention:
phi(k) and v; block Linformer: k, v and the real-token mask). ``crop(-r)`` rebuilds the state after all but the
last r of those tokens from these, exactly as the decoder would have built it, then commits. The cost is those
per-token inputs for the tokens since the last crop (a few draft tokens in assisted decoding), nothing otherwise.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .block_linformer import BlockLinformerState, block_linformer_step, empty_block_linformer_state
from .decayed_linear_attention import advance_decayed_state
from .delta_rule import causal_delta_rule
from .short_convolution import advance_buffer
from .sliding_window_attention import advance_sliding_window_state, empty_sliding_window_state


class RecurrentStateLayer(CacheLayerMixin):
    """One layer's state: a tuple of tensors whose first axis is the batch, plus a token counter.

    Subclasses say how per-token inputs rebuild a state (``_replay``) and which axis of each is the token axis.
    """

    is_compileable = False
    supports_early_init = False
    # Token axis of each tensor of a rollback tail, in order.
    tail_token_dims: tuple[int, ...] = ()

    def __init__(self):
        super().__init__()
        self.state: tuple | None = None
        self.seen_tokens = 0
        self.record_past = False
        self._committed_state: tuple | None = None  # the state at the last commit point (recording only)
        self._tail: tuple | None = None  # per-token inputs of every token since then
        self._tail_tokens = 0

    def __repr__(self):
        shapes = None if self.state is None else [tuple(t.shape) for t in self.state]
        return f"{type(self).__name__}(seen_tokens={self.seen_tokens}, state={shapes})"

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        """Nothing to allocate ahead of time: the model creates the state on its first forward."""

    def update(self, state: tuple, num_new_tokens: int, tail: tuple | None = None, *args, **kwargs) -> tuple:
        """Store the state after ``num_new_tokens`` more tokens; while recording, also their per-token inputs."""
        if self.record_past:
            if tail is None:
                raise ValueError("This cache records its past (for rollback): the model must hand over the tail.")
            self._append_tail(tail, num_new_tokens)
        self.state = state
        self.seen_tokens += num_new_tokens
        self.is_initialized = True
        return state

    def _append_tail(self, tail: tuple, num_new_tokens: int) -> None:
        tokens = tuple(tail[: len(self.tail_token_dims)])
        if self._tail is None:
            self._tail = tokens
        else:
            self._tail = tuple(torch.cat([old, new], dim) for old, new, dim in zip(self._tail, tokens, self.tail_token_dims))
        self._tail_tokens += num_new_tokens

    def _commit(self) -> None:
        """Forget the recorded tail: the current state becomes the point later crops return to at most."""
        self._committed_state, self._tail, self._tail_tokens = self.state, None, 0

    def _replay(self, state: tuple | None, tail: tuple) -> tuple | None:
        """The state after ``tail``'s tokens, starting from ``state`` (None: no token yet)."""
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1  # no limit from the cache (the position table still limits the model)

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else self.state[0].shape[0]

    def state_bytes(self) -> int:
        """Memory held by this layer's state, in bytes (the rollback record is :meth:`rollback_bytes`)."""
        return 0 if self.state is None else sum(t.numel() * t.element_size() for t in self.state)

    def rollback_bytes(self) -> int:
        """Memory held for rollback: the per-token inputs recorded since the last commit, in bytes."""
        return 0 if self._tail is None else sum(t.numel() * t.element_size() for t in self._tail)

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` can roll this layer back exactly: once past recording is on."""
        return self.record_past

    def activate_past_recording(self) -> None:
        """Record, from now on, what ``crop`` needs to roll the state back (``generate`` calls it for assisted decoding)."""
        self.record_past = True
        self._commit()

    def _recorded_tokens_to_remove(self, tokens_to_remove: int) -> int:
        """How many recorded tokens ``crop(tokens_to_remove)`` drops (0: it only commits); raises naming the fix for a
        positive count or more tokens than were recorded since the last commit."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling crop with a positive value ({tokens_to_remove}) is not supported: pass minus the number of "
                "tokens to remove, as for every Transformers cache layer."
            )
        remove = -tokens_to_remove
        if remove and (not self.record_past or remove > self._tail_tokens):
            recorded = self._tail_tokens if self.record_past else 0
            raise ValueError(
                f"{type(self).__name__} keeps a running state, so it can drop the last {remove} tokens only if it "
                f"recorded them: it holds {recorded} token(s) since the last commit. Call "
                "cache.activate_past_recording() before the forwards to roll back (generate() does this for assisted "
                "decoding), and crop no further back than the last crop."
            )
        return remove

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the last ``-tokens_to_remove`` tokens (a negative count, as for Transformers' caches); 0 commits."""
        remove = self._recorded_tokens_to_remove(tokens_to_remove)
        if remove == 0:
            if self.record_past:
                self._commit()
            return
        keep = self._tail_tokens - remove
        tail = tuple(t.narrow(dim, 0, keep) for t, dim in zip(self._tail, self.tail_token_dims))
        self.state = self._replay(self._committed_state, tail) if keep else self._committed_state
        self.seen_tokens -= remove
        self._commit()

    def _map_state(self, fn) -> None:
        def mapped(state):
            if state is None:
                return None
            values = [fn(t) for t in state]
            return type(state)(*values) if hasattr(state, "_fields") else tuple(values)

        self.state, self._committed_state, self._tail = (
            mapped(self.state), mapped(self._committed_state), mapped(self._tail)
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self):
        self._map_state(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        pass  # the model moves the state to its own device when it reads it

    def reset(self) -> None:
        self.state = None
        self.seen_tokens = 0
        self.is_initialized = False
        self._commit()


class LinearAttentionStateLayer(RecurrentStateLayer):
    """State (S (B, H, m, d_v), z (B, H, m)) of causal linear attention, float32, constant in size.

    Rollback tail: phi(k) (B, H, t, m) and v (B, H, t, d_v) of the recorded tokens, pads zeroed; the state after a
    prefix of them is S + phi(K)^T V, z + sum phi(K), in float32 as the decoder accumulates it.
    """

    # Fixed shapes: a compiled decoding step does not see the state change shape. generate() compiles it only when
    # asked, and never with CUDA graphs (GPT2StyleForCausalLM._valid_auto_compile_criteria says why).
    is_compileable = True
    tail_token_dims = (2, 2)

    def _replay(self, state, tail):
        phi_k, v = (t.float() for t in tail)
        s, z = torch.matmul(phi_k.transpose(-1, -2), v), phi_k.sum(-2)
        return (s, z) if state is None else (state[0] + s, state[1] + z)


class DecayedStateLayer(LinearAttentionStateLayer):
    """State (S, z) of linear attention with a decaying state (``state_decay``), float32, constant in size.

    Rollback tail: phi(k), v (pads zeroed) and log a_t (B, H, t, 1 or m; 0 at pads) of the recorded tokens; the
    state after a prefix of them is the committed state decayed and added to, as the decoder builds it.
    """

    tail_token_dims = (2, 2, 2)

    def _replay(self, state, tail):
        return advance_decayed_state(*tail, state)


class StabilisedFavorStateLayer(DecayedStateLayer):
    """State (S, z, running maximum (B, H, m)) of causal FAVOR+ stabilised by the running maximum of each feature's
    key logit (``FavorFeatureMap.causal_pair``): (S, z) as :class:`DecayedStateLayer` holds it, the maximum's growth
    being the decay, float32, constant in size.

    Rollback tail: the decayed layer's phi(k), v, log a and the running maximum at each recorded token (B, H, t, m);
    the state after a prefix of them is the decayed replay with the maximum at the prefix's last token.
    """

    tail_token_dims = (2, 2, 2, 2)

    def _replay(self, state, tail):
        *decayed, running = tail
        return (*advance_decayed_state(*decayed, None if state is None else state[:2]), running[:, :, -1])


class DeltaRuleStateLayer(RecurrentStateLayer):
    """State (S (B, H, d_k, d_v),) of linear attention with the delta rule (``state_update="delta"``), float32,
    constant in size; no normaliser.

    Rollback tail: the unit keys k (B, H, t, d_k), values v (B, H, t, d_v), step sizes beta and log decays (B, H, t;
    both 0 at pads, the decays 0 without one) of the recorded tokens; the state after a prefix of them is the
    committed state run through the rule again (the rule erases before it writes, so a token's change cannot be
    subtracted back out: it is replayed, not undone).
    """

    # generate() does not compile its step, even when asked: the compiled step is untested for this layer
    is_compileable = False
    tail_token_dims = (2, 2, 2, 2)

    def _replay(self, state, tail):
        keys, values, beta, log_decay = tail
        _, s = causal_delta_rule(keys, keys, values, beta, state=None if state is None else state[0],
                                 log_decay=log_decay)
        return (s,)


class SlidingWindowStateLayer(RecurrentStateLayer):
    """State of window + linear attention: (S, z) of the keys that left the window (float32) and the window itself,
    keys, phi(keys), values (B, H, W, .) and a valid mask (B, W), oldest first: a fixed size, W slots per layer.

    Rollback tail: keys, phi(k), v (B, H, t, .) (pads zeroed) and the real-token mask (B, t) of the recorded tokens;
    the state after a prefix of them is the committed state advanced by those tokens (the oldest leave the window
    into S, z), as the decoder builds it.
    """

    # Not compiled by generate(), even when asked (a compile_config is then skipped with transformers' warning): its
    # compiled step is untested; the explicit-state step (DecoderStateStep) compiles and exports.
    is_compileable = False
    tail_token_dims = (2, 2, 2, 1)

    def _replay(self, state, tail):
        keys, phi_keys, values, real = tail
        if state is None:  # recording started before the first token: the current state gives the window's size
            batch, heads, _, head_dim = keys.shape
            state = empty_sliding_window_state(
                batch, heads, self.state[2].shape[2], head_dim, phi_keys.shape[-1], values.shape[-1], keys.device
            )
        return advance_sliding_window_state(state, keys, phi_keys, values, real)


class KeyValueStateLayer(RecurrentStateLayer):
    """Keys, values (B, H, T, d) and the real-token mask (B, T) of every token so far: the cache of a full-attention
    layer in a hybrid schedule (``layer_types``). It grows by one row per token, as GPT-2's does.

    Rollback needs no record: ``crop(-r)`` drops the last r rows, exactly, at any time.
    """

    tail_token_dims = (2, 2, 1)

    def update(self, state, num_new_tokens, tail=None, *args, **kwargs):
        """Store the keys / values after ``num_new_tokens`` more tokens (no rollback tail: crop truncates)."""
        self.state = state
        self.seen_tokens += num_new_tokens
        self.is_initialized = True
        return state

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens' keys and values (a negative count, as Transformers' caches)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling crop with a positive value ({tokens_to_remove}) is not supported: pass minus the number of "
                "tokens to remove, as for every Transformers cache layer."
            )
        remove = min(-tokens_to_remove, self.seen_tokens)
        if remove and self.state is not None:
            keep = self.state[0].shape[2] - remove
            self.state = tuple(t.narrow(dim, 0, keep) for t, dim in zip(self.state, self.tail_token_dims))
        self.seen_tokens -= remove


class BlockLinformerCacheLayer(RecurrentStateLayer):
    """A :class:`~.block_linformer.BlockLinformerState`: k-row summaries of completed blocks + the current block.

    Rollback tail: k, v (B, H, t, d) and the real-token mask (B, t) of the recorded tokens, plus the layer's E and F
    (which are weights, not recorded per token); the state after a prefix of them is rebuilt one decoding step at a
    time, as generation builds it.
    """

    state: BlockLinformerState | None
    tail_token_dims = (2, 2, 1)

    def _append_tail(self, tail, num_new_tokens):
        self._projections = tail[3:]
        super()._append_tail(tail, num_new_tokens)

    def _replay(self, state, tail):
        keys, values, real = tail
        key_projection, value_projection = self._projections
        batch, heads, tokens, head_dim = keys.shape
        if state is None:
            state = empty_block_linformer_state(
                batch, heads, head_dim, key_projection.shape[-2], key_projection.shape[-1], keys.dtype, keys.device
            )
        query = keys.new_zeros(batch, heads, 1, head_dim)  # the step's output is not needed, only its state
        for t in range(tokens):
            _, state = block_linformer_step(
                query, keys[:, :, t : t + 1], values[:, :, t : t + 1], state, key_projection, value_projection,
                key_mask=real[:, t],
            )
        return state


class ShortConvStateMixin:
    """A state layer whose state and rollback tail end in a short convolution's tensors: its buffer (B, K-1, C) after
    the layer's own state, the pre-convolution inputs (B, t, C) of the recorded tokens (pads zeroed) after its own
    tail. One mechanism for every layer kind: the layer's own replay rebuilds its part, and the buffer after a prefix
    of the tail is the last K-1 rows of (committed buffer ++ those tokens' inputs), exactly as the decoder carries it.
    Beam reordering, ``state_bytes`` and ``rollback_bytes`` see the buffer as any other tensor of the state.
    """

    @property
    def tail_token_dims(self) -> tuple[int, ...]:
        return super().tail_token_dims + (1,)

    def _replay(self, state, tail):
        *own_tail, inputs = tail
        if state is None:  # recording started before the first token: zeros, as the decoder starts from
            own_state, buffer = None, inputs.new_zeros(inputs.shape[0], self.state[-1].shape[1], inputs.shape[-1])
        else:
            own_state, buffer = state[:-1], state[-1]
        return (*super()._replay(own_state, tuple(own_tail)), advance_buffer(buffer, inputs))


class ShortConvLinearAttentionStateLayer(ShortConvStateMixin, LinearAttentionStateLayer):
    """:class:`LinearAttentionStateLayer`'s (S, z) and a short convolution's buffer."""


class ShortConvDecayedStateLayer(ShortConvStateMixin, DecayedStateLayer):
    """:class:`DecayedStateLayer`'s (S, z) and a short convolution's buffer."""


class ShortConvStabilisedFavorStateLayer(ShortConvStateMixin, StabilisedFavorStateLayer):
    """:class:`StabilisedFavorStateLayer`'s (S, z, running maximum) and a short convolution's buffer."""


class ShortConvDeltaRuleStateLayer(ShortConvStateMixin, DeltaRuleStateLayer):
    """:class:`DeltaRuleStateLayer`'s S and a short convolution's buffer."""


class ShortConvSlidingWindowStateLayer(ShortConvStateMixin, SlidingWindowStateLayer):
    """:class:`SlidingWindowStateLayer`'s state and a short convolution's buffer."""


class ShortConvKeyValueStateLayer(KeyValueStateLayer):
    """:class:`KeyValueStateLayer`'s keys, values (B, H, T, d) and real-token mask (B, T), then a short convolution's
    buffer (B, K-1, C): a full-attention layer whose q, k, v pass the convolution (``short_conv_on_full_attention``,
    GPT-2 + short conv). It grows by one key / value row per token; the buffer keeps its size.

    Rollback: the keys and values are truncated, but the buffer (the last K-1 *pre*-convolution inputs) cannot be
    read back from them, so it is replayed as :class:`ShortConvStateMixin` replays a linear layer's, from the buffer
    at the last commit and the recorded inputs (B, t, C) of the tokens since: ``crop`` needs past recording, as for
    the linear layers (``generate()`` turns it on for assisted decoding). Only the buffer is kept at a commit, never
    a second reference to the growing keys and values.
    """

    tail_token_dims = (1,)  # the convolution's inputs; the keys and values need no record

    def update(self, state, num_new_tokens, tail=None, *args, **kwargs):
        """Store the state after ``num_new_tokens`` more tokens; while recording, also their convolution inputs."""
        return RecurrentStateLayer.update(self, state, num_new_tokens, tail)

    def _commit(self) -> None:
        self._committed_state = None if self.state is None else (self.state[-1],)
        self._tail, self._tail_tokens = None, 0

    @property
    def is_croppable(self) -> bool:
        return self.record_past

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative count, as Transformers' caches; 0 commits): their keys
        and values, and the buffer rebuilt from the recorded inputs of the tokens kept."""
        remove = self._recorded_tokens_to_remove(tokens_to_remove)
        if remove:
            keys, values, real, buffer = self.state
            inputs = self._tail[0].narrow(1, 0, self._tail_tokens - remove)
            start = buffer.new_zeros(buffer.shape) if self._committed_state is None else self._committed_state[0]
            keep = keys.shape[2] - remove
            self.state = (keys[:, :, :keep], values[:, :, :keep], real[:, :keep], advance_buffer(start, inputs))
            self.seen_tokens -= remove
        if self.record_past:
            self._commit()


# The cache layer of each layer kind when its q, k, v pass a short convolution first.
SHORT_CONV_STATE_LAYERS = {
    LinearAttentionStateLayer: ShortConvLinearAttentionStateLayer,
    DecayedStateLayer: ShortConvDecayedStateLayer,
    StabilisedFavorStateLayer: ShortConvStabilisedFavorStateLayer,
    DeltaRuleStateLayer: ShortConvDeltaRuleStateLayer,
    SlidingWindowStateLayer: ShortConvSlidingWindowStateLayer,
    KeyValueStateLayer: ShortConvKeyValueStateLayer,
}


class RecurrentStateCache(Cache):
    """A cache of one recurrent-state layer per decoder layer.

    ``generate`` gets it from the model; a direct forward with ``use_cache`` creates one. Pass it back as
    ``past_key_values`` to continue.
    """

    def __init__(self, layers: list[RecurrentStateLayer]):
        super().__init__(layers=layers)

    def state_bytes(self) -> int:
        """Memory held by the whole cache, in bytes (independent of the context length for linear attention)."""
        return sum(layer.state_bytes() for layer in self.layers)

    def rollback_bytes(self) -> int:
        """Memory held for rollback by the whole cache, in bytes (0 unless past recording is on)."""
        return sum(layer.rollback_bytes() for layer in self.layers)
