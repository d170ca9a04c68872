"""Configuration of the causal block-Linformer decoder."""

from huggingface_hub.dataclasses import strict

from .configuration_common import DECODER_HEADS, build_auto_map, plain_value_errors
from .configuration_gpt2_style import GPT2StyleConfig
from .linformer_projection import check_linformer_options


@plain_value_errors
@strict
class LinformerGPT2Config(GPT2StyleConfig):
    r"""
    A GPT-2-style decoder with causal block Linformer attention (see `block_linformer.py`): each sequence is cut
    into blocks of `linformer_block_size` tokens; a token attends exactly to the tokens before it in its own block
    and to the k-row Linformer summaries (E K_i, F V_i, with E, F of shape (k, block size)) of every completed
    earlier block. Causal by construction; cost O(n b + n^2 k / b), b / k times less than softmax attention; the
    generation cache grows by k rows per block. All GPT-2 fields are as in [`GPT2StyleConfig`]; in addition:

    Args:
        linformer_k (`int`, defaults to 64): rows k of each block summary (at most `linformer_block_size`).
        linformer_block_size (`int`, defaults to 256): block length b.
        linformer_sharing (`str`, defaults to `"headwise"`): sharing of E and F as in the encoder and the paper:
            `"none"` (per head), `"headwise"` (per layer), `"key-value"` (per layer, E = F), `"layerwise"` (one matrix
            for keys and values of every layer).
        linformer_init (`str`, defaults to `"xavier_uniform"`): init of E and F, `"xavier_uniform"` (fairseq, gain
            1/sqrt(2)), `"normal"` (N(0, initializer_range)) or `"pooling"` (means of b / k consecutive positions).
    """

    model_type = "linformer_gpt2"

    linformer_k: int = 64
    linformer_block_size: int = 256
    linformer_sharing: str = "headwise"
    linformer_init: str = "xavier_uniform"

    default_auto_map = build_auto_map("linformer_gpt2", "LinformerGPT2", DECODER_HEADS)

    def validate_block_linformer(self):
        check_linformer_options(self.linformer_sharing, self.linformer_init)
        if self.linformer_block_size < 1:
            raise ValueError(f"linformer_block_size must be positive, got {self.linformer_block_size}.")
        if not 1 <= self.linformer_k <= self.linformer_block_size:
            raise ValueError(
                f"linformer_k={self.linformer_k} must be between 1 and linformer_block_size={self.linformer_block_size}: "
                "a block summary has at most as many rows as the block."
            )
