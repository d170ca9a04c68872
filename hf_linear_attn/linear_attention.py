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


def _float32_inputs(phi_q, phi_k, v, key_mask):
    """phi(Q), phi(K), V in float32 with the pad rows of phi(K) and V zeroed (call with autocast off)."""
    phi_k, v = mask_keys(phi_k.float(), v.float(), key_mask)
    return phi_q.float(), phi_k, v


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
        phi_q, phi_k, v = _float32_inputs(phi_q, phi_k, v, key_mask)
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


def causal_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal linear attention in chunkwise-parallel form: (B, H, n, d_v) outputs and the final (S, z) state.

    y_t = phi(q_t) S_t / (phi(q_t) . z_t + eps) with S_t = S_0 + sum_{j<=t} phi(k_j) v_j^T, z_t = z_0 + sum phi(k_j).
    Inside a chunk of C positions: exact masked (phi(Q) phi(K)^T * tril) V; across chunks: phi(Q) times the state of
    the earlier chunks. Memory is O(n C + (n / C) m d_v): no n x n matrix and no per-position m x d_v state.
    ``state`` = (S (B, H, m, d_v), z (B, H, m)) continues from an earlier call (prefill, then decoding).
    """
    out_dtype = v.dtype
    batch, heads, n, m = phi_q.shape
    d_v = v.shape[-1]
    with _no_autocast(v):
        phi_q, phi_k, v = _float32_inputs(phi_q, phi_k, v, key_mask)
        if state is None:
            state = (phi_q.new_zeros(batch, heads, m, d_v), phi_q.new_zeros(batch, heads, m))
        c = max(1, min(chunk_size, n))
        padded = -n % c
        if padded:  # zero keys and values add nothing; the padded query rows are dropped at the end
            phi_q, phi_k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (phi_q, phi_k, v))
        chunks = (n + padded) // c
        q_c = phi_q.reshape(batch, heads, chunks, c, m)
        k_c = phi_k.reshape(batch, heads, chunks, c, m)
        v_c = v.reshape(batch, heads, chunks, c, d_v)

        scores = torch.matmul(q_c, k_c.transpose(-1, -2)).tril()  # (B, H, N, C, C), causal inside the chunk
        numerator = torch.matmul(scores, v_c)
        denominator = scores.sum(-1)

        chunk_kv = torch.matmul(k_c.transpose(-1, -2), v_c)  # (B, H, N, m, d_v): one state per chunk
        chunk_k = k_c.sum(-2)  # (B, H, N, m)
        kv_before = torch.cumsum(chunk_kv, dim=2) - chunk_kv + state[0].unsqueeze(2)  # exclusive prefix
        k_before = torch.cumsum(chunk_k, dim=2) - chunk_k + state[1].unsqueeze(2)
        numerator = numerator + torch.matmul(q_c, kv_before)
        denominator = denominator + (q_c * k_before.unsqueeze(-2)).sum(-1)

        out = (numerator / (denominator.unsqueeze(-1) + eps)).reshape(batch, heads, n + padded, d_v)[:, :, :n]
        final_state = (kv_before[:, :, -1] + chunk_kv[:, :, -1], k_before[:, :, -1] + chunk_k[:, :, -1])
        return out.to(out_dtype), final_state


def recurrent_linear_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One RNN step: phi_q, phi_k (B, H, 1, m), v (B, H, 1, d_v), state (S, z) -> y (B, H, 1, d_v), new state.

    S <- S + phi(k) v^T, z <- z + phi(k), y = phi(q) S / (phi(q) . z + eps): constant memory per token.
    """
    out_dtype = v.dtype
    with _no_autocast(v):
        phi_q, phi_k, v = _float32_inputs(phi_q, phi_k, v, key_mask)
        # Broadcast products instead of matmuls: batched matmuls with a dimension of 1 hit slow paths on CPU
        # (measured up to 8 ms for a 1 x 32 by 32 x 32 product per head, against microseconds here).
        s = state[0] + phi_k.transpose(-1, -2) * v  # (B, H, m, d_v): outer product phi(k) v^T
        z = state[1] + phi_k.squeeze(-2)
        numerator = (phi_q.transpose(-1, -2) * s).sum(-2, keepdim=True)  # phi(q) S: (B, H, 1, d_v)
        y = numerator / ((phi_q.squeeze(-2) * z).sum(-1)[..., None, None] + eps)
        return y.to(out_dtype), (s, z)
