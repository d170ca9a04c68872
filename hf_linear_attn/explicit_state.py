"""A causal LM of the GPT-2-style families on explicit state tensors, for ``torch.export``, ONNX and
``torch.compile(fullgraph=True)``: :class:`DecoderStateStep` (a step from a state) and :class:`DecoderPrefill` (the
prompt pass with a dynamic length). Generation does not use them; docs/deployment.md shows the exported programs in
use (onnxruntime, a compiled step).
"""

import torch
from torch import nn

from .attention_mask import check_padding_mask
from .modeling_gpt2_style import GPT2StyleForCausalLM


class DecoderStateStep(nn.Module):
    """A causal LM's forward on explicit state tensors, for ``torch.export``, ONNX and ``torch.compile(fullgraph=True)``.

    ``forward(input_ids (B, n), position_ids (B, n), *state) -> (logits (B, n, vocab), *new_state)``, the state being
    every layer's state tensors in layer order, a layer with a short convolution ending with its buffer
    (:meth:`initial_state` gives the state a sequence starts from). One token continues from the state by the
    recurrent step; several run the prefill form from it (linear attention) or one step per token (causal block
    Linformer). Every token is real: a padded batch passes each row's own
    positions and left pads are not masked here (:class:`DecoderPrefill` masks them in a prompt).

    The causal block Linformer's state here has a fixed capacity of block summaries, n_positions // block_size
    slots (the most blocks a sequence within the position table completes), where its generation cache adds one
    slot per completed block: fixed shapes are what export and fullgraph compilation need. Each step then attends
    over every slot (empty ones masked), so a step costs what a step at the end of the position table costs. A
    hybrid schedule's full-attention layers (``layer_types``) likewise keep keys and values in n_positions slots
    (:class:`~.modeling_linear_gpt2.KeyValueSlots`), as Transformers' static cache does.
    """

    def __init__(self, model: GPT2StyleForCausalLM):
        super().__init__()
        self.model = model
        # tensors per layer: a hybrid's full-attention layers carry three (KeyValueSlots), its linear layers theirs
        self.state_sizes = [len(block.attn.initial_state(1)) for block in model.transformer.h]
        self.num_layers = len(self.state_sizes)

    @torch.no_grad()
    def initial_state(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """The state before any token, every layer's tensors in layer order (zeros; empty block slots)."""
        return tuple(t for block in self.model.transformer.h for t in block.attn.initial_state(batch_size))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *state: torch.Tensor):
        transformer = self.model.transformer
        if len(state) != sum(self.state_sizes):
            raise ValueError(
                f"DecoderStateStep takes {sum(self.state_sizes)} state tensors for this model ({self.state_sizes} per "
                f"layer), got {len(state)}: pass initial_state() or the state the previous step returned, unchanged."
            )
        starts = [sum(self.state_sizes[:i]) for i in range(len(self.state_sizes))]
        states = [block.attn.explicit_state(tuple(state[start : start + size]))
                  for block, start, size in zip(transformer.h, starts, self.state_sizes)]
        hidden_states = transformer.embed(input_ids, None, position_ids)
        hidden_states, new_states, _, _, _ = transformer.run_blocks(hidden_states, None, states, use_cache=True)
        return (self.model.lm_head(hidden_states), *(t for layer_state in new_states for t in layer_state))


class DecoderPrefill(nn.Module):
    """A causal LM's prompt pass returning its state as plain tensors, for ``torch.export`` with a dynamic length.

    ``forward(input_ids (B, n), attention_mask (B, n)) -> (logits (B, n, vocab), *state)``, the state in the order
    :class:`DecoderStateStep` takes it, so the step continues from it. ``attention_mask`` is the tokenizer's 0/1
    mask: pads add nothing to the state, and positions count each row's real tokens (a left-padded row gets the
    positions it has alone; its next position is ``attention_mask.sum(-1)``). Linear attention only: the causal
    block Linformer's prompt pass keeps as many summary slots as the longest row completed blocks (a value, not a
    shape); feed its prompt through :class:`DecoderStateStep` instead.

    Under ``torch.export`` linear attention takes its prefix-sum form (every position's state at once, O(n m d)
    memory; see :func:`~.linear_attention.causal_linear_attention`), whose shapes hold for every length.
    """

    def __init__(self, model: GPT2StyleForCausalLM):
        super().__init__()
        attention = model.transformer.h[0].attn
        if not attention.fixed_shape_prompt_state:  # before any export starts
            raise ValueError(
                f"{type(attention).__name__}'s prompt pass keeps one summary slot per completed block, a number read "
                "from the data, so it cannot be exported with a dynamic length. Feed the prompt to DecoderStateStep "
                "instead (from initial_state(); it runs one step per token and keeps fixed shapes)."
            )
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        transformer = self.model.transformer
        check_padding_mask(attention_mask)  # eager only: it reads values
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden_states = transformer.embed(input_ids, None, position_ids)
        hidden_states, new_states, _, _, _ = transformer.run_blocks(
            hidden_states, attention_mask.bool(), [None] * len(transformer.h), use_cache=True
        )
        new_states = [block.attn.exported_prompt_state(layer) for block, layer in zip(transformer.h, new_states)]
        return (self.model.lm_head(hidden_states), *(t for layer_state in new_states for t in layer_state))
