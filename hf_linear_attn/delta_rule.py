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

With a decay (Gated DeltaNet, Yang et al. 2025, arXiv 2412.06464; ``log_decay`` = log alpha_t <= 0, one per head
and token) the state fades before each write, S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T; with
alpha = 1 everywhere it is the rule above exactly. With one decay per key feature (Kimi Delta Attention, KDA: Kimi
Team 2025, arXiv 2510.26692; ``log_decay`` (B, H, n, d_k)) the state's rows fade each at their own rate first,
S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T (the order fla's reference takes).

Forms (float32 throughout, autocast off, output in V's dtype):

* :func:`naive_delta_rule`: the recurrence, one position at a time (the reference the tests use; also the decoding
  step and the rollback replay).
* :func:`causal_delta_rule`: chunks of C positions (the "WY" / UT-transform form). Inside a chunk starting from S,
  the corrections u_t = beta_t (v_t - S_{t-1}^T k_t) solve a unit lower-triangular system,
  (I + tril(diag(beta) K K^T, -1)) U = diag(beta) (V - K S), so U = T V - (T K) S with T the solved
  diag(beta); then Y = Q S + tril(Q K^T) U and the next chunk starts from S + K^T U. The triangular solves are done
  for every chunk at once; only the C-row state products run chunk after chunk. With a decay, every product between
  positions s <= t of a chunk is scaled by exp(B_t - B_s) (B the running sum of log alpha in the chunk; with one
  decay per feature, feature by feature inside the product, as GLA's kernel computes its scores) and the carried
  state by exp(B_t): no exponent is ever positive.
  Under ``torch.export`` the whole sequence is one chunk (quadratic in n, no chunk count read from n).
* :func:`delta_rule_weights`: the n x n matrix the rule applies to the values from an empty state,
  tril(Q K^T) T (``output_attentions``).
"""

import math

import torch

from .decayed_linear_attention import _blocked_scores, _decayed_scores, _split_scores
from .linear_attention import _no_autocast

MAMBA2_DT_RANGE = (0.001, 0.1)  # the gate's time step at init, Mamba-2's and fla's dt_min, dt_max


def delta_rule_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeltaNet's query and key map (fla's defaults ``qk_activation="silu"``, ``qk_norm="l2"``): SiLU, then unit
    length per head, in float32. With a unit key the rule moves the state's reading at it, k^T S, a fraction beta of
    the way to v and no further, and leaves the directions orthogonal to k as they were."""
    q, k = (torch.nn.functional.normalize(torch.nn.functional.silu(t.float()), dim=-1, eps=1e-6) for t in (q, k))
    return q, k


def _check_log_decay(log_decay: torch.Tensor, k: torch.Tensor) -> None:
    n, d_k = k.shape[2], k.shape[-1]
    per_head = log_decay.dim() == 3 and log_decay.shape[-1] in (1, n)
    per_feature = log_decay.dim() == 4 and log_decay.shape[2] in (1, n) and log_decay.shape[-1] == d_k
    if not (per_head or per_feature):
        raise ValueError(
            f"log_decay must be (batch, heads, n) (one decay per head and token, Gated DeltaNet) or (batch, heads, n, "
            f"d_k) (one per key feature, KDA), broadcastable to k {tuple(k.shape)}; got {tuple(log_decay.shape)}.")


def _float32(q, k, v, beta, key_mask, log_decay=None):
    """float32 q, k, v, beta (B, H, n) and log alpha (B, H, n, g) with g = 1 (one per head) or d_k (one per feature;
    None without a decay), with beta and log alpha 0 at pads (a pad writes nothing, erases nothing and leaves the
    state undecayed)."""
    beta = beta.float()
    if log_decay is not None:
        _check_log_decay(log_decay, k)
        log_decay = log_decay.float()[..., None] if log_decay.dim() == 3 else log_decay.float()
        log_decay = log_decay.expand(*beta.shape, log_decay.shape[-1])
    if key_mask is not None:
        real = key_mask[:, None, :].bool()
        beta = torch.where(real, beta, 0.0)
        if log_decay is not None:
            log_decay = torch.where(real[..., None], log_decay, 0.0)
    return q.float(), k.float(), v.float(), beta, log_decay


def _empty_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return k.new_zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])


def naive_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one position at a time: q, k (B, H, n, d_k), v (B, H, n, d_v), beta (B, H, n) in [0, 1],
    ``key_mask`` (B, n) (True: a real token), ``state`` S (B, H, d_k, d_v) or None (empty), ``log_decay`` log alpha
    <= 0, (B or 1, H, n or 1) (one per head) or (B or 1, H, n or 1, d_k) (one per key feature), or None (no decay).
    Returns the outputs (B, H, n, d_v) in V's dtype and the final S in float32."""
    out_dtype = v.dtype
    with _no_autocast(q):
        q, k, v, beta, log_decay = _float32(q, k, v, beta, key_mask, log_decay)
        s = _empty_state(k, v) if state is None else state.float()
        outputs = []
        n = q.shape[2]
        decays = [None] * n if log_decay is None else log_decay.unbind(2)  # unbind: see causal_delta_rule
        for q_t, k_t, v_t, b_t, decay_t in zip(q.unbind(2), k.unbind(2), v.unbind(2), beta.unbind(2), decays):
            if decay_t is not None:  # the state fades first (Gated DeltaNet; KDA row by row), then the rule
                s = decay_t[..., None].exp() * s
            correction = b_t[..., None] * (v_t - torch.einsum("bhk,bhkv->bhv", k_t, s))
            s = s + k_t[..., :, None] * correction[..., None, :]
            outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, s))
        y = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return y.to(out_dtype), s


def _products(a: torch.Tensor, b: torch.Tensor, cumulative: torch.Tensor | None) -> torch.Tensor:
    """a_t . b_s for s <= t, 0 above the diagonal, each scaled by the decay from s to t where there is one:
    exp(B_t - B_s) from the running sums B (..., C, 1) of log alpha, or feature by feature, sum_f a_tf b_sf
    exp(B_tf - B_sf), from B (..., C, d_k); every exponent <= 0 (masked before exp). (..., C, C)."""
    if cumulative is None:
        return (a @ b.transpose(-1, -2)).tril()
    if cumulative.shape[-1] == 1:
        return _decayed_scores(a, b, cumulative)
    # one decay per feature: GLA's matmul around the chunk's middle where the chunk's decay allows it, else in blocks.
    # The blocks, not the C x C x d_k product: a KDA gate that forgets fast on some features fails the split of a
    # chunk of 64, and the product's (B, H, N, C, C, d_k) tensors then made KDA's MQAR stage (n = 256, batch 32) too
    # slow to finish. Under torch.export, which cannot trace the checks of the data, the product (its one chunk is
    # quadratic anyway)
    if torch.compiler.is_exporting():
        return _decayed_scores(a, b, cumulative)
    scores = _split_scores(a, b, cumulative)
    return _blocked_scores(a, b, cumulative) if scores is None else scores


def _solved_chunks(k: torch.Tensor, beta: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
    """T = (I + tril(diag(beta) P, -1))^-1 diag(beta) for chunks k (..., C, d_k), beta (..., C) and the (decayed)
    key products P (..., C, C) of :func:`_products`: (..., C, C), unit lower-triangular solve (exact: no series
    expansion)."""
    c = k.shape[-2]
    strictly_lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril(-1)
    a = (beta[..., :, None] * products).masked_fill(~strictly_lower, 0.0)
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
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule in chunks of ``chunk_size`` positions, exact: the same arguments and results as
    :func:`naive_delta_rule`. Memory: a C x C system per chunk and one state per chunk for autograd."""
    out_dtype = v.dtype
    batch, heads, n, d_k = q.shape
    if n == 0:
        return v, _empty_state(k, v) if state is None else state.float()
    with _no_autocast(q):
        q, k, v, beta, log_decay = _float32(q, k, v, beta, key_mask, log_decay)
        s = _empty_state(k, v) if state is None else state.float()
        # under torch.export one chunk of the whole sequence (quadratic, as the other kernels' pairwise forms): no
        # chunk count or padding read from a dynamic n
        c = n if torch.compiler.is_exporting() else min(chunk_size, n)
        pad = 0 if c == n else -n % c
        if pad:  # zero rows: beta 0 writes nothing, and their outputs are dropped below
            q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            beta = torch.nn.functional.pad(beta, (0, pad))
            if log_decay is not None:
                log_decay = torch.nn.functional.pad(log_decay, (0, 0, 0, pad))
        chunks = (n + pad) // c
        q, k, v = (t.reshape(batch, heads, chunks, c, t.shape[-1]) for t in (q, k, v))
        beta = beta.reshape(batch, heads, chunks, c)
        if log_decay is not None:
            # B_t: log of the decay from the chunk's start to t, <= 0, (B, H, N, C, g) with g 1 or d_k
            running = log_decay.reshape(batch, heads, chunks, c, -1).cumsum(-2)
            carried, to_end = running.exp(), (running[..., -1:, :] - running).exp()
            t_matrix = _solved_chunks(k, beta, _products(k, k, running))
            w, u = t_matrix @ (carried * k), t_matrix @ v  # the start state reaches position t decayed by exp(B_t)
            scores = _products(q, k, running)
            # the chunk's whole decay of the state's rows: (B, H, N, g, 1)
            q_carried, k_to_end, chunk_decay = carried * q, to_end * k, running[..., -1, :, None].exp()
        else:
            t_matrix = _solved_chunks(k, beta, _products(k, k, None))
            w, u = t_matrix @ k, t_matrix @ v  # (B, H, N, C, d_k), (B, H, N, C, d_v)
            scores = (q @ k.transpose(-1, -2)).tril()  # (B, H, N, C, C), a query sees its own key
            q_carried, k_to_end, chunk_decay = q, k, None
        outputs = []
        # unbind, not [:, :, i]: the backward of one index is a zero tensor of the whole input, so n / C of them
        # cost O((n / C)^2) (measured before this: forward + backward 233 ms at n = 1,024, 76 s at 16,384, where the
        # forward grew linearly), where unbind's backward stacks the slices' gradients once
        decays = [None] * chunks if chunk_decay is None else chunk_decay.unbind(2)
        for u_i, w_i, q_i, scores_i, k_i, decay_i in zip(u.unbind(2), w.unbind(2), q_carried.unbind(2),
                                                         scores.unbind(2), k_to_end.unbind(2), decays):
            corrections = u_i - w_i @ s  # u_t = beta_t (v_t - S_{t-1}^T k_t), all rows of the chunk
            outputs.append(q_i @ s + scores_i @ corrections)
            if decay_i is not None:
                s = decay_i * s
            s = s + k_i.transpose(-1, -2) @ corrections
        y = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * c, -1)[:, :, :n]
    return y.to(out_dtype), s


def delta_rule_weights(
    q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, key_mask: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal n x n matrix A (B, H, n, n) with y = A V from an empty state: tril(Q K^T) T over the whole sequence,
    each product scaled by the decay between its positions where there is one (quadratic; for inspection). Unlike
    softmax's, its rows need not be positive or sum to 1: a later key that overwrites an earlier one gives the earlier
    value a negative weight."""
    with _no_autocast(q):
        q, k, _, beta, log_decay = _float32(q, k, k, beta, key_mask, log_decay)
        running = None if log_decay is None else log_decay.cumsum(-2)
        return _products(q, k, running) @ _solved_chunks(k, beta, _products(k, k, running))


class DeltaRuleGate(torch.nn.Module):
    """The delta rule's decay from the layer's input, Mamba-2's form as fla computes it, log alpha = -exp(A_log) *
    softplus(logits + dt_bias) <= 0, with A_log one per head:

    * ``head_dim`` None, Gated DeltaNet's gate: one alpha per head and token, logits = x W_a (``a_proj``, no bias),
      ``dt_bias`` one per head. Output (B, H, n).
    * ``head_dim`` d_k, Kimi Delta Attention's gate: one alpha per key feature, logits from a low-rank projection
      x W_down W_up (``f_proj``, rank d_k, no biases, as fla's KDA), ``dt_bias`` one per head and feature. Output
      (B, H, n, d_k).

    A in [1, 16] and dt log-uniform in ``dt_range`` at init (:func:`delta_rule_gate_init`); Mamba-2's [0.001, 0.1]
    starts a head's per-token decay anywhere from 0.20 to 0.999, memories from about 1 to 1,000 tokens. Parameter
    names are fla's."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None,
                 dt_range: tuple[float, float] = MAMBA2_DT_RANGE):
        super().__init__()
        self.head_dim = head_dim
        self.dt_range = tuple(dt_range)  # read by the init, not a weight
        if head_dim is None:
            self.a_proj = torch.nn.Linear(hidden_size, num_heads, bias=False)
        else:
            self.f_proj = torch.nn.Sequential(torch.nn.Linear(hidden_size, head_dim, bias=False),
                                              torch.nn.Linear(head_dim, num_heads * head_dim, bias=False))
        self.A_log = torch.nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = torch.nn.Parameter(torch.zeros(num_heads * (head_dim or 1)))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """log alpha in float32 from the layer's input (B, n, D): (B, H, n), or (B, H, n, d_k) per feature."""
        heads = self.A_log.shape[0]
        proj = self.a_proj if self.head_dim is None else self.f_proj
        logits = (proj(hidden_states).float() + self.dt_bias.float()).unflatten(-1, (heads, -1))  # (B, n, H, g)
        log_decay = (-self.A_log.float().exp()[:, None] * torch.nn.functional.softplus(logits)).transpose(1, 2)
        return log_decay[..., 0] if self.head_dim is None else log_decay


class DeltaRuleOutputNorm(torch.nn.Module):
    """What fla's DeltaNet, Gated DeltaNet and KDA layers put between the rule's output and ``o_proj`` (their
    ``o_norm``): RMSNorm over each head's output, one weight of head size shared by the heads, and with ``gate``,
    times an output gate from the layer's input (``g_proj``):

    * ``"swish"``: silu(x W_g), W_g hidden x hidden without a bias (fla's ``FusedRMSNormGated`` as Gated DeltaNet, and
      DeltaNet with ``use_gate``, build it);
    * ``"sigmoid"``: sigmoid(x W_down W_up + b), rank the head size, a bias on the second (fla's KDA).

    In float32, as fla's fused norm computes it; the result in the output's dtype. The state is untouched: a cache,
    rollback and export see the same state as without it."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, gate: str | None, eps: float):
        super().__init__()
        self.num_heads, self.eps, self.gate = num_heads, eps, gate
        self.weight = torch.nn.Parameter(torch.ones(head_dim))
        if gate == "swish":
            self.g_proj = torch.nn.Linear(hidden_size, hidden_size, bias=False)
        elif gate == "sigmoid":
            self.g_proj = torch.nn.Sequential(torch.nn.Linear(hidden_size, head_dim, bias=False),
                                              torch.nn.Linear(head_dim, hidden_size, bias=True))
        elif gate is not None:
            raise ValueError(f"gate must be None, 'swish' or 'sigmoid', got {gate!r}")

    def forward(self, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """output (B, H, n, d_v) of the rule, hidden_states (B, n, D) the layer's input -> (B, H, n, d_v)."""
        o = output.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        if self.gate is not None:
            g = self.g_proj(hidden_states).float().unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
            o = o * (torch.nn.functional.silu(g) if self.gate == "swish" else torch.sigmoid(g))
        return o.to(output.dtype)


def delta_rule_gate_init(num_heads: int, generator: torch.Generator | None = None, features: int = 1,
                         dt_range: tuple[float, float] = MAMBA2_DT_RANGE) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log (H), dt_bias (H * features)) as Mamba-2 and fla's GatedDeltaNet and KDA start them: A ~ U(1, 16) per
    head, dt log-uniform in ``dt_range`` (theirs: [0.001, 0.1]) per head and feature, dt_bias its inverse softplus.
    At init the per-token decay is about exp(-A dt) (the gate's projection starts near 0). (Mamba-2 also floors dt
    at 1e-4, a no-op: a log-uniform draw never falls below its range.)"""
    a = torch.empty(num_heads).uniform_(1, 16, generator=generator)
    low, high = math.log(dt_range[0]), math.log(dt_range[1])
    dt = torch.exp(low + (high - low) * torch.rand(num_heads * features, generator=generator))
    return a.log(), dt + torch.log(-torch.expm1(-dt))
