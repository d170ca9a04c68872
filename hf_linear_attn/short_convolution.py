"""Short causal convolution ("short conv") over the sequence, as every current linear-attention model puts on q, k and
v after their projections (GLA, DeltaNet, Mamba-2, Based; flash-linear-attention's ``ShortConvolution``).

A depthwise convolution of width K (about 4) with SiLU after: ``y_t = silu(sum_{j<K} w[:, j] * x_{t-K+1+j})``, each
channel with its own K taps and no bias. It gives every position its K-1 predecessors' projections, the
previous-token shift an induction head otherwise needs a whole attention layer for, which is what lets a 2-layer
model learn associative recall (MQAR; Zoology, Based).

Causal and streaming: the inputs before the first token are zeros, and a continuation carries the last K-1 inputs
(the *buffer*, (B, K-1, C)) from one call to the next, so a prompt in pieces, a token at a time, or whole gives the
same outputs. Torch only; no transformers import.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution weights over ``hidden_size`` channels: weight (C, 1, K), no bias (fla's layout
    and defaults; SiLU is applied by :func:`causal_short_convolution`)."""

    def __init__(self, hidden_size: int, kernel_size: int):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False)


def short_convolution_init_bound(kernel_size: int) -> float:
    """Bound b of the weights' U(-b, b) init: PyTorch's own Conv1d default, 1 / sqrt(fan_in), fan_in = K for a
    depthwise conv."""
    return 1.0 / math.sqrt(kernel_size)


def mask_pad_inputs(x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """x (B, n, C) with the rows of pad positions (``key_mask`` (B, n) False) set to 0: a pad then contributes what a
    position before the first token does, so a left-padded row is convolved exactly as the row alone."""
    if key_mask is None:
        return x
    return torch.where(key_mask.bool()[..., None], x, 0.0)


def advance_buffer(buffer: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The buffer after ``inputs``: the last K-1 rows of buffer (B, K-1, C) ++ inputs (B, t, C)."""
    return torch.cat([buffer.to(inputs.dtype), inputs], dim=1)[:, -buffer.shape[1]:]


def empty_buffer(x: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """The buffer before any token: zeros (B, K-1, C) like x (B, n, C)."""
    return x.new_zeros(x.shape[0], kernel_size - 1, x.shape[-1])


def causal_short_convolution(
    x: torch.Tensor, weight: torch.Tensor, buffer: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(depthwise causal conv) of x (B, n, C) with weight (C, 1, K), continuing from ``buffer`` (B, K-1, C) (None:
    zeros, no earlier token). Returns (y (B, n, C), the new buffer (B, K-1, C)). Pads must already be zeroed
    (:func:`mask_pad_inputs`). A single token after a buffer takes :func:`short_convolution_step`."""
    kernel_size = weight.shape[-1]
    if buffer is None:
        buffer = empty_buffer(x, kernel_size)
    if x.shape[1] == 1:
        return short_convolution_step(x, weight, buffer)
    padded = torch.cat([buffer.to(x.dtype), x], dim=1)  # (B, K-1+n, C): the conv's left context, then the tokens
    y = F.conv1d(padded.transpose(1, 2), weight.to(x.dtype), groups=x.shape[-1]).transpose(1, 2)
    return F.silu(y), padded[:, -(kernel_size - 1):]


def short_convolution_step(
    x: torch.Tensor, weight: torch.Tensor, buffer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x (B, 1, C), weight (C, 1, K), buffer (B, K-1, C) -> (y (B, 1, C), the new buffer): the K inputs
    (buffer ++ x) times the taps, summed, then SiLU (a product and a sum, no convolution call)."""
    window = torch.cat([buffer.to(x.dtype), x], dim=1)  # (B, K, C), oldest first, as the taps are ordered
    y = (window * weight.to(x.dtype)[:, 0].transpose(0, 1)).sum(1, keepdim=True)
    return F.silu(y), window[:, 1:]
