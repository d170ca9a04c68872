"""Generation caches of the decoders: a fixed-size recurrent state per layer, never a growing key/value cache.

* :class:`LinearAttentionStateLayer` holds the state of causal linear attention, S (B, H, m, d) and z (B, H, m)
  in float32: its size does not depend on the number of tokens seen ("Transformers are RNNs").
* :class:`BlockLinformerCacheLayer` holds the causal block Linformer's k-row summaries of completed blocks and the
  raw keys / values of the current block: it grows by k rows per block, not by one row per token.

Both count the tokens they have seen, left padding included, as ``generate`` expects of ``get_seq_length``.
A state cannot be rolled back to an earlier token, so ``crop`` raises and the models set ``_is_stateful``.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .block_linformer import BlockLinformerState


class RecurrentStateLayer(CacheLayerMixin):
    """One layer's state: a tuple of tensors whose first axis is the batch, plus a token counter."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state: tuple | None = None
        self.seen_tokens = 0

    def __repr__(self):
        shapes = None if self.state is None else [tuple(t.shape) for t in self.state]
        return f"{type(self).__name__}(seen_tokens={self.seen_tokens}, state={shapes})"

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        """Nothing to allocate ahead of time: the attention layer creates the state on its first call."""

    def update(self, state: tuple, num_new_tokens: int, *args, **kwargs) -> tuple:
        """Store the state after ``num_new_tokens`` more tokens (called by the attention layer)."""
        self.state = state
        self.seen_tokens += num_new_tokens
        self.is_initialized = True
        return state

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
        """Memory held by this layer's state, in bytes."""
        return 0 if self.state is None else sum(t.numel() * t.element_size() for t in self.state)

    def _map_state(self, fn) -> None:
        if self.state is not None:
            values = [fn(t) for t in self.state]
            self.state = type(self.state)(*values) if hasattr(self.state, "_fields") else tuple(values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self):
        self._map_state(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        pass  # the attention layer moves the state to its own device when it reads it

    def reset(self) -> None:
        self.state = None
        self.seen_tokens = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError(
            f"{type(self).__name__} keeps a running state, not one entry per token, so it cannot drop the last "
            f"{abs(tokens_to_remove)} tokens. Decoding strategies that roll the cache back (assisted / speculative "
            "decoding) are not supported by these models; regenerate from the prompt instead."
        )


class LinearAttentionStateLayer(RecurrentStateLayer):
    """State (S (B, H, m, d_v), z (B, H, m)) of causal linear attention, float32, constant in size."""


class BlockLinformerCacheLayer(RecurrentStateLayer):
    """A :class:`~.block_linformer.BlockLinformerState`: k-row summaries of completed blocks + the current block."""

    state: BlockLinformerState | None


class RecurrentStateCache(Cache):
    """A cache of one recurrent-state layer per decoder layer.

    The models create it themselves (``use_cache=True``); pass it back as ``past_key_values`` to continue.
    """

    def __init__(self, layers: list[RecurrentStateLayer]):
        super().__init__(layers=layers)

    def state_bytes(self) -> int:
        """Memory held by the whole cache, in bytes (independent of the context length for linear attention)."""
        return sum(layer.state_bytes() for layer in self.layers)
