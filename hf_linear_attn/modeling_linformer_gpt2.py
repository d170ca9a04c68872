"""Causal block-Linformer decoder as a GPT-2-style model (semantics and cost in ``block_linformer.py``).

Plain Linformer sees the future (every projected row mixes all positions). Here a token attends exactly to the
earlier tokens of its own block of b tokens and to k-row Linformer summaries of the completed earlier blocks. The
generation cache holds those summaries and the current block: it grows by k rows per b tokens.
"""

import torch

from .block_linformer import (
    BlockLinformerState,
    block_linformer_step,
    causal_block_linformer_attention,
    empty_block_linformer_state,
)
from .configuration_linformer_gpt2 import LinformerGPT2Config
from .linformer_projection import (
    LinformerProjection,
    add_linformer_projections,
    linformer_projection_weights,
    shared_linformer_projection,
)
from .modeling_gpt2_style import (
    GPT2StyleAttention,
    GPT2StyleForCausalLM,
    GPT2StyleForSequenceClassification,
    GPT2StyleModel,
    GPT2StylePreTrainedModel,
)
from .recurrent_cache import BlockLinformerCacheLayer


class LinformerGPT2Attention(GPT2StyleAttention):
    """Multi-head causal block Linformer; E, F have shape (P, k, block size), shared as ``linformer_sharing`` says.

    ``output_attentions`` (whole sequence, no past state) returns weights (B, H, n, S k + b): per query, over the
    k-row summaries of blocks 0..S-1 (only earlier blocks get weight) followed by the b keys of its own block.
    """

    cache_layer_class = BlockLinformerCacheLayer
    fixed_shape_prompt_state = False  # the prompt pass keeps one summary slot per completed block

    def __init__(self, config: LinformerGPT2Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.block_size = config.linformer_block_size
        self.proj_k = config.linformer_k
        self.max_positions = config.n_positions
        self.sharing = config.linformer_sharing
        self.dropout = config.attn_pdrop
        add_linformer_projections(self, self.sharing, self.num_heads, config.linformer_k, self.block_size)

    @staticmethod
    def build_shared_projection(config: LinformerGPT2Config) -> LinformerProjection | None:
        """The single matrix of layerwise sharing, owned by the base model; None for the other modes."""
        return shared_linformer_projection(config.linformer_sharing, config.linformer_k, config.linformer_block_size)

    def initial_state(self, batch_size: int) -> BlockLinformerState:
        """An empty state with a fixed capacity of n_positions // block_size summary slots (every block a sequence
        within the position table can complete), so its shapes never change (see :class:`DecoderStateStep`)."""
        return empty_block_linformer_state(
            batch_size, self.num_heads, self.head_dim, self.proj_k, self.block_size,
            self.c_attn.weight.dtype, self.c_attn.weight.device, capacity=self.max_positions // self.block_size,
        )

    def attend(self, q, k, v, key_mask, state, use_cache, need_tail, output_attentions, shared_projection):
        if q.shape[0] == 0:  # the block summaries' reductions fail on 0 rows: name the input instead
            raise ValueError(
                "the input holds 0 sequences (a batch of size 0): pass at least one sequence (skip empty batches, "
                "e.g. a DataLoader with drop_last=True or a filter before the model)"
            )
        key_projection, value_projection = linformer_projection_weights(self, self.sharing, shared_projection)
        # The generation cache holds a BlockLinformerState that adds a slot per completed block; DecoderStateStep
        # hands the fixed-capacity state of initial_state() over as a plain tuple of tensors.
        grow = state is None or isinstance(state, BlockLinformerState)
        if state is None:
            output, weights, state = causal_block_linformer_attention(
                q, k, v, key_projection, value_projection, self.block_size, key_mask,
                dropout=self.dropout if self.training else 0.0, need_weights=output_attentions,
                return_state=use_cache,
            )
        else:
            state = BlockLinformerState(*state).to(q.device)
            outputs = []
            for t in range(q.shape[2]):  # new tokens after a cached prefix: one decoding step each
                step_output, state = block_linformer_step(
                    q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, key_projection, value_projection,
                    key_mask=None if key_mask is None else key_mask[:, t], grow=grow,
                )
                outputs.append(step_output)
            output, weights = torch.cat(outputs, dim=2).to(v.dtype), None
        tail = None
        if need_tail:  # rollback tail: the tokens' keys, values and realness, and the E / F that summarise blocks
            real = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if key_mask is None else key_mask
            tail = (k, v, real, key_projection, value_projection)
        return output, weights, state if use_cache else None, tail


class LinformerGPT2PreTrainedModel(GPT2StylePreTrainedModel):
    """Config, attention and padding rule of the causal block Linformer. Init (``init_added_weights``): E and F by
    ``config.linformer_init``."""

    config_class = LinformerGPT2Config
    attention_class = LinformerGPT2Attention

    def check_key_mask(self, key_mask: torch.Tensor, has_past: bool) -> None:
        """Blocks start at each row's first real token: the real tokens must be one run (left or right padding).

        After a cached prefix, new tokens are fed one step at a time and pads are simply skipped.
        """
        if has_past:
            return
        starts = key_mask & ~torch.nn.functional.pad(key_mask, (1, 0))[:, :-1]
        if bool((starts.sum(-1) > 1).any()):
            raise ValueError(
                "The causal Linformer needs each row's real tokens to be one contiguous run (left or right padding); "
                "the attention_mask has padding between real tokens. Pad on one side only."
            )


class LinformerGPT2Model(LinformerGPT2PreTrainedModel, GPT2StyleModel):
    """The bare causal block-Linformer decoder: last_hidden_state (B, n, D) and the block cache."""


LinformerGPT2PreTrainedModel.base_model_class = LinformerGPT2Model  # the decoder every head below builds inside it


class LinformerGPT2ForCausalLM(LinformerGPT2PreTrainedModel, GPT2StyleForCausalLM):
    """Causal block-Linformer decoder with GPT-2's LM head."""


class LinformerGPT2ForSequenceClassification(LinformerGPT2PreTrainedModel, GPT2StyleForSequenceClassification):
    """Causal block-Linformer decoder classifying each sequence from its last real token."""
