"""Kernelized linear attention (Katharopoulos et al. 2020), layer 1: torch only, no transformers import.

Inputs are features phi(Q), phi(K) of shape (batch, heads, n, m) from :mod:`feature_maps` and values V of
shape (batch, heads, n, d_v). Everything is computed in float32 with autocast off (S, z and the normaliser must
not be rounded to bf16 / fp16), and the output is returned in V's dtype.

Padding is removed AFTER the feature map (elu + 1 maps a zero key to ones, so zeroing K before phi would leave
the pad in the normaliser), with ``torch.where`` rather than a multiply (0 x NaN stays NaN).
"""

import torch


def _no_autocast(tensor: torch.Tensor):
    return torch.autocast(device_type=tensor.device.type, enabled=False)


def mask_keys(phi_k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None):
    """Zero the rows of phi(K) (B, H, n, m) and V (B, H, n, d) where ``key_mask`` (B, n) is False."""
    if key_mask is None:
        return phi_k, v
    keep = key_mask[:, None, :, None]
    return torch.where(keep, phi_k, 0.0), torch.where(keep, v, 0.0)


def bidirectional_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """out_i = phi(q_i) S / (phi(q_i) . z + eps), S = phi(K)^T V, z = sum_j phi(k_j): (B, H, n, d_v) in O(n m d)."""
    out_dtype = v.dtype
    with _no_autocast(v):
        phi_q, phi_k, v = phi_q.float(), phi_k.float(), v.float()
        phi_k, v = mask_keys(phi_k, v, key_mask)
        state = torch.matmul(phi_k.transpose(-1, -2), v)  # (B, H, m, d_v)
        normaliser_state = phi_k.sum(dim=-2, keepdim=True)  # (B, H, 1, m)
        numerator = torch.matmul(phi_q, state)
        denominator = (phi_q * normaliser_state).sum(-1, keepdim=True) + eps
        return (numerator / denominator).to(out_dtype)


def linear_attention_weights(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The n x n attention matrix that linear attention applies implicitly: (B, H, n, n), rows sum to ~1.

    Quadratic in n: meant for ``output_attentions`` and for distillation, never for the forward pass itself.
    """
    with _no_autocast(phi_q):
        scores = torch.matmul(phi_q.float(), phi_k.float().transpose(-1, -2))
        if key_mask is not None:
            scores = torch.where(key_mask[:, None, None, :], scores, 0.0)
        if causal:
            scores = torch.tril(scores)
        return scores / (scores.sum(-1, keepdim=True) + eps)
