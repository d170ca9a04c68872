"""Causal linear attention with the delta rule (DeltaNet: Schlag et al. 2021, "Linear Transformers Are Secretly Fast
Weight Programmers"; the chunkwise form of Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length", arXiv 2406.06484), layer 1: torch only, no transformers import.

Additive linear attention writes every key's value on top of the state, S_t = S_{t-1} + k_t v_t^T, so a key that
resembles earlier ones reads back their values mixed into its own: with more pairs than the state has dimensions
the memories interfere and recall saturates (Zoology's MQAR; docs/recall.md). The delta rule first reads what the
state holds for the key and writes only the correction, with a step size beta_t in (0, 1) computed from the input:

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    y_t = S_t^T q_t

S (B, H, d_k, d_v) maps keys to values (rows indexed by key features, as this package's states are). With unit keys
and beta = 1 a key's old value is replaced, not added to: the state is an associative memory that can be
overwritten. There is no normaliser: q and k are given unit length by the caller (DeltaNet's SiLU then L2 norm,
:func:`delta_rule_qk`), so a stored value is read back at its own size. A pad (beta = 0) leaves the state as it was.

Forms (float32 throughout, autocast off, output in V's dtype):

* :func:`naive_delta_rule`: the recurrence, one position at a time (the reference the tests use; also the decoding
  step and the rollback replay).
* :func:`causal_delta_rule`: chunks of C positions (the "WY" / UT-transform form). Inside a chunk starting from S,
  the corrections u_t = beta_t (v_t - S_{t-1}^T k_t) solve a unit lower-triangular system,
  (I + tril(diag(beta) K K^T, -1)) U = diag(beta) (V - K S), so U = T V - (T K) S with T the solved
  diag(beta); then Y = Q S + tril(Q K^T) U and the next chunk starts from S + K^T U. The triangular solves are done
  for every chunk at once; only the C-row state products run chunk after chunk.
  Under ``torch.export`` the whole sequence is one chunk (quadratic in n, no chunk count read from n).
* :func:`delta_rule_weights`: the n x n matrix the rule applies to the values from an empty state,
  tril(Q K^T) T (``output_attentions``).
"""

import torch

from .linear_attention import _no_autocast


def delta_rule_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeltaNet's query and key map (fla's defaults ``qk_activation="silu"``, ``qk_norm="l2"``): SiLU, then unit
    length per head, in float32. With a unit key the rule moves the state's reading at it, k^T S, a fraction beta of
    the way to v and no further, and leaves the directions orthogonal to k as they were."""
    q, k = (torch.nn.functional.normalize(torch.nn.functional.silu(t.float()), dim=-1, eps=1e-6) for t in (q, k))
    return q, k


def _float32(q, k, v, beta, key_mask):
    """float32 q, k, v, beta (B, H, n), with beta 0 at pads (a pad writes nothing and erases nothing)."""
    beta = beta.float()
    if key_mask is not None:
        beta = torch.where(key_mask[:, None, :].bool(), beta, 0.0)
    return q.float(), k.float(), v.float(), beta


def _empty_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return k.new_zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])


def naive_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one position at a time: q, k (B, H, n, d_k), v (B, H, n, d_v), beta (B, H, n) in [0, 1],
    ``key_mask`` (B, n) (True: a real token), ``state`` S (B, H, d_k, d_v) or None (empty). Returns the outputs
    (B, H, n, d_v) in V's dtype and the final S in float32."""
    out_dtype = v.dtype
    with _no_autocast(q):
        q, k, v, beta = _float32(q, k, v, beta, key_mask)
        s = _empty_state(k, v) if state is None else state.float()
        outputs = []
        for t in range(q.shape[2]):
            k_t, b_t = k[:, :, t], beta[:, :, t, None]
            correction = b_t * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, s))
            s = s + k_t[..., :, None] * correction[..., None, :]
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], s))
        y = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return y.to(out_dtype), s


def _solved_chunks(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """T = (I + tril(diag(beta) K K^T, -1))^-1 diag(beta) for chunks k (..., C, d_k), beta (..., C): (..., C, C),
    unit lower-triangular solve (exact: no series expansion)."""
    c = k.shape[-2]
    strictly_lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril(-1)
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2))).masked_fill(~strictly_lower, 0.0)
    eye = torch.eye(c, dtype=k.dtype, device=k.device)
    return torch.linalg.solve_triangular(eye + a, torch.diag_embed(beta), upper=False, unitriangular=True)


def causal_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule in chunks of ``chunk_size`` positions, exact: the same arguments and results as
    :func:`naive_delta_rule`. Memory: a C x C system per chunk and one state per chunk for autograd."""
    out_dtype = v.dtype
    batch, heads, n, d_k = q.shape
    if n == 0:
        return v, _empty_state(k, v) if state is None else state.float()
    with _no_autocast(q):
        q, k, v, beta = _float32(q, k, v, beta, key_mask)
        s = _empty_state(k, v) if state is None else state.float()
        # under torch.export one chunk of the whole sequence (quadratic, as the other kernels' pairwise forms): no
        # chunk count or padding read from a dynamic n
        c = n if torch.compiler.is_exporting() else min(chunk_size, n)
        pad = 0 if c == n else -n % c
        if pad:  # zero rows: beta 0 writes nothing, and their outputs are dropped below
            q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            beta = torch.nn.functional.pad(beta, (0, pad))
        chunks = (n + pad) // c
        q, k, v = (t.reshape(batch, heads, chunks, c, t.shape[-1]) for t in (q, k, v))
        beta = beta.reshape(batch, heads, chunks, c)
        t_matrix = _solved_chunks(k, beta)
        w, u = t_matrix @ k, t_matrix @ v  # (B, H, N, C, d_k), (B, H, N, C, d_v)
        scores = (q @ k.transpose(-1, -2)).tril()  # (B, H, N, C, C), a query sees its own key
        outputs = []
        for i in range(chunks):
            corrections = u[:, :, i] - w[:, :, i] @ s  # u_t = beta_t (v_t - S_{t-1}^T k_t), all rows of the chunk
            outputs.append(q[:, :, i] @ s + scores[:, :, i] @ corrections)
            s = s + k[:, :, i].transpose(-1, -2) @ corrections
        y = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * c, -1)[:, :, :n]
    return y.to(out_dtype), s


def delta_rule_weights(
    q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The causal n x n matrix A (B, H, n, n) with y = A V from an empty state: tril(Q K^T) T over the whole sequence
    (quadratic; for inspection). Unlike softmax's, its rows need not be positive or sum to 1: a later key that
    overwrites an earlier one gives the earlier value a negative weight."""
    with _no_autocast(q):
        q, k, _, beta = _float32(q, k, k, beta, key_mask)
        return (q @ k.transpose(-1, -2)).tril() @ _solved_chunks(k, beta)
