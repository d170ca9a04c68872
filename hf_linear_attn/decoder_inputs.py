"""What the GPT-2-style decoders check of their inputs before any work, and how they count positions: shapes (static
in a graph), the cache a call continues from, the 2-D padding mask, and position values (eager mode only). A mixin of
:class:`~.modeling_gpt2_style.GPT2StyleModel`, which holds the blocks (``self.h``), the config and the attention
class these read.
"""

import torch

from .attention_mask import check_padding_mask
from .recurrent_cache import RecurrentStateCache


class DecoderInputChecks:
    """Input checks and positions of a GPT-2-style base model (see the module docstring)."""

    def _check_input_shape(self, input_ids, inputs_embeds) -> None:
        """Shapes only (static in a graph): (batch, n) ids or (batch, n, n_embd) embeddings with n >= 1.

        Without this, a 1-D input_ids, an empty sequence or (causal Linformer) an empty batch failed deep inside the
        attention with a reshape or reduction error that named neither the input nor the fix."""
        given, rank = ("input_ids", 2) if inputs_embeds is None else ("inputs_embeds", 3)
        shape = tuple((input_ids if inputs_embeds is None else inputs_embeds).shape)
        if len(shape) != rank:
            raise ValueError(
                f"{given} has shape {shape}; these decoders take {given} of shape (batch, sequence length"
                + (")" if rank == 2 else ", n_embd)") + ": add the batch dimension (input_ids[None] or "
                "input_ids.unsqueeze(0) for one sequence; tokenizer(..., return_tensors='pt') returns it)."
            )
        if shape[1] == 0:
            raise ValueError(
                f"{given} has shape {shape}: a sequence of 0 tokens. A causal LM needs at least one token to predict "
                "from; start generation from the bos token (e.g. input_ids=[[tokenizer.bos_token_id]]) rather than "
                "an empty prompt."
            )

    def _check_cache(self, cache, batch: int | None = None) -> None:
        expected = self.attention_class.cache_layer_class
        if not isinstance(cache, RecurrentStateCache) or len(cache.layers) != len(self.h) or not all(
            isinstance(layer, block.attn.cache_layer_class) for layer, block in zip(cache.layers, self.h)
        ):
            raise ValueError(
                f"past_key_values must be the RecurrentStateCache this model returned (one {expected.__name__} per "
                f"layer), got {type(cache).__name__}. These decoders keep a recurrent state, not keys and values: "
                "pass past_key_values=None (or nothing) to start, then the returned past_key_values."
            )
        cached = cache.layers[0].batch_size  # a property
        if batch is not None and cached != -1 and cached != batch:  # -1: no state yet
            raise ValueError(
                f"past_key_values holds the state of {cached} sequence(s) but the input has {batch} row(s): continue "
                "each cached sequence with one row of input, in the same order (the cache returned for that batch), "
                "or start a new batch with past_key_values=None."
            )

    def _positions_and_mask(self, attention_mask, position_ids, batch, n, past_length, device):
        """Position ids (B, n) and the key mask (B, n) of the new tokens (None: all real).

        Only shapes are checked here (they are static in a graph); position values are checked by
        :meth:`_check_positions`, in eager mode.
        """
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in (
                n, past_length + n
            ):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; these decoders take the tokenizer's 2-D "
                    f"0/1 mask (batch, past + new tokens) = ({batch}, {past_length + n}). 4-D masks are not supported."
                )
            if past_length and attention_mask.shape[1] == n and position_ids is None:
                raise ValueError(
                    f"attention_mask covers the {n} new tokens only, after {past_length} cached ones: pass the mask of "
                    f"the past and new tokens ({batch}, {past_length + n}), as generate() does, since positions count "
                    "each row's real tokens and left padding in the cached part would shift them; or pass position_ids."
                )
            check_padding_mask(attention_mask)
            key_mask = attention_mask[:, -n:].bool()
        given = position_ids is not None
        if not given:
            if attention_mask is not None and attention_mask.shape[1] == past_length + n:
                # Count real tokens only, so left padding does not shift the positions of a prompt.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -n:]
            else:
                position_ids = torch.arange(past_length, past_length + n, device=device).expand(batch, n)
        # Derived positions are below past_length + n: the shapes prove the bound, no tensor value is read.
        self._check_positions(position_ids, None if given else past_length + n)
        return position_ids, key_mask

    def _check_positions(self, position_ids: torch.Tensor, bound: int | None) -> None:
        """Raise if a position is beyond the position table. ``bound``: a known upper bound of the positions + 1.

        Eager mode only, and it reads a tensor value (a host sync on an accelerator) only when the bound does not
        settle it: a compiled or exported graph keeps no data-dependent branch.
        """
        if torch.compiler.is_compiling() or (bound is not None and bound <= self.config.n_positions):
            return
        if position_ids.numel() and int(position_ids.max()) >= self.config.n_positions:
            raise ValueError(
                f"Position {int(position_ids.max())} is beyond this model's position table (n_positions = "
                f"{self.config.n_positions}): prompt plus generated tokens must stay within {self.config.n_positions}. "
                "Truncate the input (tokenizer(..., truncation=True)) or generate fewer tokens."
            )
