"""Sliding-window softmax + linear attention with one shared normaliser (layer 1: torch only, no transformers import).

For query i, exact exponential terms for the keys inside the window and feature-map terms for every key outside it,
over ONE normaliser (the LoLCATs combination, Zhang et al. 2024):

    y_i = (sum_{j in win(i)} g exp(s_ij) v_j + sum_{j out(i)} phi(q_i).phi(k_j) v_j)
          / (sum_{j in win(i)} g exp(s_ij)   + sum_{j out(i)} phi(q_i).phi(k_j) + eps),     s_ij = q_i.k_j / sqrt(d)

causal: win(i) = the last W keys (i - W < j <= i), out(i) = every earlier key (j <= i - W);
band (bidirectional): win(i) = |i - j| < W (2W - 1 keys), out(i) = |i - j| >= W.
g = exp(theta_h) is a learned per-head factor (``log_factor`` theta, (H,)).

**The stabiliser cancels.** Every term, exact and feature-map alike, and eps are multiplied by exp(-c_i) with
c_i = max(max_{j in win(i)} s_ij + theta_h, log(sum_{j out(i)} phi(q_i).phi(k_j) + eps)): every term is then <= 1
and the normaliser >= 1 (no overflow, and no lone very negative score underflowing to 0 / 0), and the output is the
unstabilised formula above, exactly. LoLCATs subtracts the window's maximum from the
exact terms only, which makes the balance between window and history depend on the largest window score; here it is
a function of the scores alone: with a window covering the whole sequence and g = 1 it is softmax attention, and with
a feature map whose phi(q).phi(k) equals exp(s) it is softmax attention at any window.

**The factor.** g = exp(theta), theta initialised to 0 (g = 1: the formula above, unweighted), rather than LoLCATs'
sigmoid (g in (0, 1), initialised to 1/2): with elu + 1 a key outside the window weighs phi(q).phi(k) ~ m (the feature
width) at init against exp(s) ~ 1 inside it, so the model must be able to raise the window's weight, not only lower
it. It adds theta to the window's scores, so it costs nothing.

Padding: pad keys are removed after the feature map (``torch.where``, as in :mod:`linear_attention`) and excluded
from the window's scores and its maximum; a query whose window holds no real key (a pad query) gets c = 0.

Forms, all float32 with autocast off (the output in V's dtype):

* :func:`causal_sliding_window_attention` / :func:`banded_sliding_window_attention`: chunked, linear in n. Chunks of C
  positions; each chunk's queries take exact scores over their own chunk and the L = ceil((W - 1) / C) chunks on each
  side that can hold window keys (masked to the window; the same block's keys outside the window go through phi),
  and the float32 state phi(K)^T [V, 1] of every chunk beyond those (an exclusive prefix sum over chunks; the band
  adds a suffix sum). Work O(n (L + 1) C (d + m)), memory O(n ((L + 1) C + m d / C)); a written-out backward
  (:class:`_WindowChunks`).
* :func:`sliding_window_attention_step`: one decoding step on the window's keys / values (a buffer of W, shifted by
  one slot per token) and the linear state of the keys that left it: constant memory and work per token.
* :func:`sliding_window_attention_weights`: the n x n matrix applied implicitly (quadratic; ``output_attentions``).

The decoding state is (S (B, H, m, d_v), z (B, H, m), keys (B, H, W, d), phi(keys) (B, H, W, m), values
(B, H, W, d_v), valid (B, W) bool): S, z the sums over the keys that left the window, the rest the window, oldest
first. The buffer shifts by one slot per token instead of writing at a moving index: a ring index would have to be
carried in the exported state, while the shift is O(W d) per token, what the step's scores over the window cost
anyway.
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from .linear_attention import _no_autocast, _with_ones


class SlidingWindowFactor(nn.Module):
    """The learned per-head factor of the window's exact terms, g = exp(log_factor), log_factor (H,); ``init`` at
    init (the config's ``attention_window_factor_init``, 0 by default: g = 1)."""

    def __init__(self, num_heads: int, init: float = 0.0):
        super().__init__()
        self.init = float(init)
        self.log_factor = nn.Parameter(torch.full((num_heads,), self.init))

    def forward(self) -> torch.Tensor:
        """theta (H,), what the attention functions take as ``log_factor``."""
        return self.log_factor


def _head_bias(log_factor: torch.Tensor | None, heads: int, ndim: int, like: torch.Tensor) -> torch.Tensor:
    """theta (H,) shaped to broadcast against scores whose head axis is 1 (zeros without a factor)."""
    if log_factor is None:
        return like.new_zeros(())
    return log_factor.float().view(1, heads, *([1] * (ndim - 2)))


def _masked_inputs(q, k, v, phi_q, phi_k, key_mask):
    """float32 q, k, v, phi(Q), phi(K) with pad rows of K, phi(K) and V zeroed (``torch.where``: 0 x NaN stays NaN),
    and the (B, n) bool mask of real keys."""
    q, k, v, phi_q, phi_k = (t.float() for t in (q, k, v, phi_q, phi_k))
    if key_mask is None:
        valid = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    else:
        valid = key_mask.bool()
        keep = valid[:, None, :, None]
        # keys too: the window's buffer then holds zeros in pad slots, as a row alone holds in its empty slots
        k, phi_k, v = torch.where(keep, k, 0.0), torch.where(keep, phi_k, 0.0), torch.where(keep, v, 0.0)
    return q, k, v, phi_q, phi_k, valid


def _stabiliser(scores: torch.Tensor, linear_normaliser: torch.Tensor, eps: float) -> torch.Tensor:
    """c_i = max(max_j s_ij + theta, log(linear normaliser + eps)) over the window's scores (last axis; -inf where
    masked) and the feature-map part's normaliser (..., 1). Every exact term exp(s - c) and the feature-map part times
    exp(-c) are then <= 1 and the normaliser >= 1: neither overflow nor a lone very negative score underflowing to a
    0 / 0. It multiplies every term and eps, so it cancels; no gradient flows through it."""
    stabiliser = torch.maximum(scores.amax(-1, keepdim=True), torch.log(linear_normaliser + eps)).detach()
    return torch.where(torch.isfinite(stabiliser), stabiliser, 0.0)  # no key at all (a pad query) and eps = 0


def check_window(window: int) -> None:
    """Raise a ValueError unless ``window`` is a positive int."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive integer (the number of keys attended exactly), got {window!r}.")


def check_window_factor_init(factor_init, attention_window) -> None:
    """Raise a ValueError naming the fix for ``attention_window_factor_init``: a finite number, and set only with a
    window (without one there is no factor to start)."""
    if isinstance(factor_init, bool) or not isinstance(factor_init, (int, float)) or not math.isfinite(factor_init):
        raise ValueError(f"attention_window_factor_init must be a finite number (theta: the window's terms start "
                         f"weighted g = exp(theta)), got {factor_init!r}.")
    if factor_init and not attention_window:
        raise ValueError(f"attention_window_factor_init={factor_init} without a window (attention_window=0) starts a "
                         "factor no layer has: set attention_window=W, or leave the init at 0.")


def check_window_options(attention_window, longest: int, longest_name: str, feature_map: str) -> None:
    """Raise a ValueError naming the fix for a config's ``attention_window`` (0: off): a negative or non-int value, a
    window longer than the positions the model has (``longest``, named ``longest_name``), or a feature map whose
    phi(q).phi(k) is not a fixed kernel."""
    if isinstance(attention_window, bool) or not isinstance(attention_window, int) or attention_window < 0:
        raise ValueError(
            f"attention_window must be an integer >= 0 (0: plain linear attention, W > 0: exact softmax over the last "
            f"W keys), got {attention_window!r}."
        )
    if attention_window > longest:
        raise ValueError(
            f"attention_window={attention_window} is larger than the positions this model has ({longest_name} = "
            f"{longest}): it would hold keys that never exist (already at {longest} no key ever leaves it: softmax "
            f"attention at quadratic cost). Use a window of at most {longest}, in practice far below (LoLCATs: 64)."
        )
    if attention_window and feature_map == "favor":
        raise ValueError(
            "attention_window cannot be combined with feature_map='favor': FAVOR+'s stabilisers multiply phi(q).phi(k) "
            "by a per-query constant, which cancels in plain linear attention but not against the window's exact "
            "exp terms, so the balance between window and history would depend on the data. Use 'elu', 'relu' or "
            "'hedgehog' with a window."
        )


class _Block(NamedTuple):
    """One chunk of keys a chunk of queries reaches exactly: the keys of chunk n - shift for the queries of chunk n.

    ``window`` / ``outside``: whether any of its (query, key) pairs is inside / outside the window (then it gets
    exact scores / phi(q).phi(k)); a part needs its (C, C) mask (``in_window``, ``beyond``) only where the block holds
    other pairs too (``outside``; not ``all_outside``).
    """

    shift: int
    window: bool
    outside: bool
    all_outside: bool
    in_window: torch.Tensor
    beyond: torch.Tensor


def _local_blocks(window: int, c: int, causal: bool, chunks: int, device) -> list[_Block]:
    """The key chunks within L = ceil((W - 1) / C) of a query chunk (only the L before it when causal) that exist.

    Classified from the range of i - j over the block, not from the masks' values (no data-dependent branch): with
    W = C (causal) the previous chunk mixes window and history and the own chunk is window (or future) only, so
    phi(q).phi(k) is formed over one block, not two.
    """
    lookback = -(-(window - 1) // c)
    blocks = []
    for shift in range(lookback, -1 if causal else -lookback - 1, -1):
        if abs(shift) >= chunks:
            continue  # every key of this block is before position 0 or after the end
        rel = shift * c + torch.arange(c, device=device)[:, None] - torch.arange(c, device=device)  # i - j
        low, high = shift * c - (c - 1), shift * c + (c - 1)
        if causal:
            in_window, beyond = (rel >= 0) & (rel < window), rel >= window
            any_window, any_out, all_out = high >= 0 and low < window, high >= window, low >= window
        else:
            in_window, beyond = rel.abs() < window, rel.abs() >= window
            any_window = low < window and high > -window
            any_out, all_out = high >= window or low <= -window, low >= window or high <= -window
        blocks.append(_Block(shift, any_window, any_out, all_out, in_window, beyond))
    return blocks


def _pairs(shift: int, total: int) -> tuple[slice, slice]:
    """Slices of the flat (B H N, C, x) chunk axis pairing query chunk f with key chunk f - shift.

    One batched product over contiguous slices instead of gathering each chunk's neighbours (a copy per use and a
    copy back in the backward). Pairs that cross into another (batch, head) are garbage: :func:`_edge` clears them.
    """
    if shift >= 0:
        return slice(shift, total), slice(0, total - shift)
    return slice(0, total + shift), slice(-shift, total)


def _edge(t: torch.Tensor, shift: int) -> torch.Tensor:
    """The query chunks of ``t`` (B, H, N, C, x) whose block of keys at ``shift`` lies before 0 or after the end."""
    return t[:, :, :shift] if shift >= 0 else t[:, :, t.shape[2] + shift :]


def _prefix_beyond(states: torch.Tensor, lookback: int, reverse: bool) -> torch.Tensor:
    """sum_{k <= n - L - 1} states[k] for every chunk n (``reverse``: sum_{k >= n + L + 1}) along dim 2, of states
    (B, H, N, ...). Summed directly: an inclusive sum minus the nearby chunks' states would cancel catastrophically.

    Matrices (B, H, N, m, d_v) take one add per chunk, each over contiguous rows: torch.cumsum along a middle axis
    (plus the cat of leading zeros and the flips of a suffix sum) took several times as long. Vectors (B, H, N, m) are
    too small for that: there the per-call overhead of N adds dominates, and torch.cumsum is the faster one."""
    chunks = states.shape[2]
    if states.dim() == 4:
        if reverse:
            return _prefix_beyond(states.flip(2), lookback, False).flip(2)
        zeros = states.new_zeros(*states.shape[:2], lookback + 1, *states.shape[3:])
        return torch.cumsum(torch.cat([zeros, states], dim=2), dim=2)[:, :, :chunks]
    out = torch.empty_like(states)
    reach = min(lookback + 1, chunks)  # chunks with nothing beyond their blocks on this side
    if reverse:
        out[:, :, chunks - reach :].zero_()
        for i in range(chunks - reach - 1, -1, -1):
            torch.add(out[:, :, i + 1], states[:, :, i + lookback + 1], out=out[:, :, i])
    else:
        out[:, :, :reach].zero_()
        for i in range(reach, chunks):
            torch.add(out[:, :, i - 1], states[:, :, i - lookback - 1], out=out[:, :, i])
    return out


class _WindowChunks(torch.autograd.Function):
    """The combination per chunk of C queries (see the module docstring), with a written-out backward.

    Inputs in chunks (B, H, N, C, .): q, k (d), v (d_v), phi_q, phi_k (m); far_state [S, z] (B, H, m, d_v + 1) or
    None; theta (H,) or None; valid (B, N, C) bool. For block b (keys of chunk n - s_b, see :class:`_Block`):

        S_b = Q K_b^T / sqrt(d) + theta (-inf outside the window and at pad keys),  A_b = [phi(Q) phi(K_b)^T]_outside,
        [S, z]_far: the states of the chunks beyond the blocks (exclusive prefix / suffix sums of phi(K)^T [V, 1]),
        c = max(max_b rowmax S_b, log(rowsum A + phi(Q) z_far + eps)) (detached, it cancels), u = exp(-c),
        P_b = exp(S_b - c) + u A_b,  num = sum_b P_b V_b + u phi(Q) S_far,
        den = sum_b rowsum P_b + u phi(Q) z_far + eps u,  y = num / den.

    Backward, with G = dy / den and g = -G . y (the gradient of num and of den):

        dP_b = G V_b^T + g;  dV_b += P_b^T G;  dS_b = dP_b * exp(S_b - c) = [dP_b * P_b]_window;
        dA_b = u [dP_b]_outside;  dQ = sum_b dS_b K_b / sqrt(d);  dK_b += dS_b^T Q / sqrt(d);  dtheta = sum dS;
        dphi(Q) = sum_b dA_b phi(K_b) + u (G S_far^T + g z_far^T);  d[S, z]_far = phi(Q)^T u [G, g] per chunk;
        dphi(K_b) += dA_b^T phi(Q);  d[S, z]_k = the sum of d[S, z]_far over the chunks whose far state holds chunk k
        (suffix / prefix sums);  dphi(K) += V dS_k^T + dz_k,  dV += phi(K) dS_k;  dfar_state = the sum over chunks.

    Autograd spent a third of a call copying: gathering each chunk's neighbours (and scattering their gradients
    back), masked_fill / where on every score and its gradient; here every block is one product over contiguous
    slices (:func:`_pairs`), masks apply only to blocks that mix window and history, and phi(q).phi(k) is formed only
    for blocks holding keys outside the window. The normaliser's column of ones is kept apart from V (row sums
    instead): products with d_v + 1 = 65 columns, accumulated ones most, ran far slower than with 64.
    """

    @staticmethod
    def forward(ctx, q, k, v, phi_q, phi_k, far_state, log_factor, valid, window, causal, eps):
        batch, heads, chunks, c, d = q.shape
        total = batch * heads * chunks
        lookback = -(-(window - 1) // c)
        # shift 0 first: its pairs cover every chunk, so it writes the accumulators (bmm) and the others add to them
        blocks = sorted(_local_blocks(window, c, causal, chunks, q.device), key=lambda block: abs(block.shift))
        theta = q.new_zeros(()) if log_factor is None else log_factor.to(q.dtype).view(1, heads, 1, 1, 1)
        q_s = q * d**-0.5
        flat = lambda t: t.view(total, c, t.shape[-1])  # noqa: E731
        # valid keys of chunk n - s for every shift s: False before position 0 and after the end
        valid_pad = torch.nn.functional.pad(valid, (0, 0, lookback, lookback))

        scores, linear, row_max, linear_sum = [], [], None, None
        for block in blocks:
            rows, cols = _pairs(block.shift, total)
            if block.window:
                s_b = q.new_empty(batch, heads, chunks, c, c)
                torch.bmm(flat(q_s)[rows], flat(k)[cols].transpose(1, 2), out=flat(s_b)[rows])
                _edge(s_b, block.shift).zero_()  # garbage or never written; masked below (its keys are not valid)
                keys_valid = valid_pad[:, lookback - block.shift : lookback - block.shift + chunks]
                allowed = block.in_window & keys_valid[:, :, None, :]  # (B, N, C, C): a pass 1/H the scores' size
                s_b.add_(torch.where(allowed, 0.0, -torch.inf).to(q.dtype).unsqueeze(1))
                block_max = s_b.amax(-1, keepdim=True)
                row_max = block_max if row_max is None else torch.maximum(row_max, block_max)
            else:
                s_b = None
            if block.outside:
                a_b = q.new_empty(batch, heads, chunks, c, c)
                torch.bmm(flat(phi_q)[rows], flat(phi_k)[cols].transpose(1, 2), out=flat(a_b)[rows])
                _edge(a_b, block.shift).zero_()  # pad keys hold phi(k) = 0
                if not block.all_outside:
                    a_b.masked_fill_(~block.beyond, 0.0)
                block_sum = a_b.sum(-1, keepdim=True)
                linear_sum = block_sum if linear_sum is None else linear_sum + block_sum
            else:
                a_b = None
            scores.append(s_b)
            linear.append(a_b)

        far_s = far_z = None
        if chunks > lookback + 1 or far_state is not None:
            chunk_s = torch.matmul(phi_k.transpose(-1, -2), v)  # (B, H, N, m, d_v)
            chunk_z = phi_k.sum(-2)  # (B, H, N, m)
            far_s, far_z = _prefix_beyond(chunk_s, lookback, False), _prefix_beyond(chunk_z, lookback, False)
            if not causal:
                far_s += _prefix_beyond(chunk_s, lookback, True)
                far_z += _prefix_beyond(chunk_z, lookback, True)
            if far_state is not None:
                far_s += far_state[..., :-1].unsqueeze(2)
                far_z += far_state[..., -1].unsqueeze(2)
            far_linear = torch.matmul(phi_q, far_z.unsqueeze(-1))  # (B, H, N, C, 1)
            linear_sum = far_linear if linear_sum is None else linear_sum + far_linear
        if linear_sum is None:
            linear_sum = q.new_zeros(batch, heads, chunks, c, 1)
        stabiliser = torch.maximum(row_max + theta, torch.log(linear_sum + eps))
        stabiliser = torch.where(torch.isfinite(stabiliser), stabiliser, 0.0)  # a pad query with eps = 0
        scale = torch.exp(-stabiliser)

        weights, numerator = [], None
        denominator = (linear_sum + eps) * scale
        for block, s_b, a_b in zip(blocks, scores, linear):
            if s_b is not None:
                p_b = s_b.sub_(stabiliser - theta).exp_()  # theta enters through c: exp(S + theta - c)
                denominator += p_b.sum(-1, keepdim=True)  # the feature-map terms are in linear_sum already
                if a_b is not None:
                    p_b.addcmul_(a_b, scale)
            else:
                p_b = a_b.mul_(scale)
            rows, cols = _pairs(block.shift, total)
            if numerator is None:  # shift 0
                numerator = torch.bmm(flat(p_b), flat(v)).view(*q.shape[:-1], v.shape[-1])
            else:
                flat(numerator)[rows].baddbmm_(flat(p_b)[rows], flat(v)[cols])
            weights.append(p_b)
        if far_s is not None:
            numerator.addcmul_(torch.matmul(phi_q, far_s), scale)
        y = numerator / denominator
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(q_s, k, v, phi_q, phi_k, far_s, far_z, scale, denominator, y, *weights)
            ctx.blocks, ctx.lookback, ctx.causal = blocks, lookback, causal
            ctx.theta_dtype = None if log_factor is None else log_factor.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_y):
        q_s, k, v, phi_q, phi_k, far_s, far_z, scale, denominator, y, *weights = ctx.saved_tensors
        batch, heads, chunks, c, d = q_s.shape
        total = batch * heads * chunks
        flat = lambda t: t.view(total, c, t.shape[-1])  # noqa: E731
        g = (d_y / denominator).contiguous()  # (B, H, N, C, d_v): the numerator's gradient
        g_den = -(g * y).sum(-1, keepdim=True)  # (B, H, N, C, 1): the normaliser's
        d_far_state = d_q = d_k = d_v = None
        d_phi_k = torch.zeros_like(phi_k)
        if far_s is not None:
            g_scaled, g_den_scaled = g * scale, g_den * scale
            d_phi_q = torch.matmul(g_scaled, far_s.transpose(-1, -2)).addcmul_(g_den_scaled, far_z.unsqueeze(-2))
            d_far_s = torch.matmul(phi_q.transpose(-1, -2), g_scaled)  # (B, H, N, m, d_v)
            d_far_z = (phi_q * g_den_scaled).sum(-2)  # (B, H, N, m)
        else:
            d_phi_q = torch.zeros_like(phi_q)
        d_theta = q_s.new_zeros(heads) if ctx.needs_input_grad[6] else None
        for block, p_b in zip(ctx.blocks, weights):
            rows, cols = _pairs(block.shift, total)
            d_p = torch.empty_like(p_b)
            torch.bmm(flat(g)[rows], flat(v)[cols].transpose(1, 2), out=flat(d_p)[rows])
            d_p.add_(g_den)
            _edge(d_p, block.shift).zero_()  # pairs across heads: their weights are 0, their gradients must be too
            if d_v is None:  # shift 0, first: every key chunk
                d_v = torch.bmm(flat(p_b).transpose(1, 2), flat(g)).view_as(v)
            else:
                flat(d_v)[cols].baddbmm_(flat(p_b)[rows].transpose(1, 2), flat(g)[rows])
            if block.window:
                # P_b = exp(S_b - c) inside the window (0 at masked keys); in place unless dA_b needs dP_b too
                if block.outside:
                    d_s = (d_p * p_b).masked_fill_(~block.in_window, 0.0)
                else:
                    d_s = d_p.mul_(p_b)
                if d_theta is not None:
                    d_theta += d_s.sum((0, 2, 3, 4))
                if d_q is None:  # shift 0
                    d_q = torch.bmm(flat(d_s), flat(k)).view_as(q_s)
                    d_k = torch.bmm(flat(d_s).transpose(1, 2), flat(q_s)).view_as(k)
                else:
                    flat(d_q)[rows].baddbmm_(flat(d_s)[rows], flat(k)[cols])
                    flat(d_k)[cols].baddbmm_(flat(d_s)[rows].transpose(1, 2), flat(q_s)[rows])
            if block.outside:
                d_a = d_p.mul_(scale)
                if not block.all_outside:
                    d_a.masked_fill_(~block.beyond, 0.0)
                flat(d_phi_q)[rows].baddbmm_(flat(d_a)[rows], flat(phi_k)[cols])
                flat(d_phi_k)[cols].baddbmm_(flat(d_a)[rows].transpose(1, 2), flat(phi_q)[rows])
        if far_s is not None:
            d_states_s = _prefix_beyond(d_far_s, ctx.lookback, True)  # chunk k's state reaches chunks n >= k + L + 1
            d_states_z = _prefix_beyond(d_far_z, ctx.lookback, True)
            if not ctx.causal:
                d_states_s += _prefix_beyond(d_far_s, ctx.lookback, False)
                d_states_z += _prefix_beyond(d_far_z, ctx.lookback, False)
            d_phi_k.add_(torch.matmul(v, d_states_s.transpose(-1, -2))).add_(d_states_z.unsqueeze(-2))
            d_v.add_(torch.matmul(phi_k, d_states_s))
            if ctx.needs_input_grad[5]:
                d_far_state = torch.cat([d_far_s.sum(2), d_far_z.sum(2).unsqueeze(-1)], dim=-1)
        if d_theta is not None:
            d_theta = d_theta.to(ctx.theta_dtype)
        return d_q.mul_(d**-0.5), d_k, d_v, d_phi_q, d_phi_k, d_far_state, d_theta, None, None, None, None


def _chunked_form(q, k, v, phi_q, phi_k, valid, window, causal, log_factor, eps, chunk, far_state=None):
    """Outputs (B, H, P, d_v) of the combination for every position, in chunks (see the module docstring).

    q, k (B, H, P, d); v (B, H, P, d_v); phi_q, phi_k (B, H, P, m) with pad rows of phi(K) and V zeroed; valid (B, P);
    far_state (B, H, m, d_v + 1): [S, z] of keys before position 0, linear for every query (causal).
    """
    batch, heads, p, _ = q.shape
    c = max(1, min(chunk, p))
    back = -p % c
    chunks = (p + back) // c

    def in_chunks(t):
        # contiguous: the kernel pairs chunks as slices of one flat (B H N) axis (heads may come in transposed)
        if back:
            t = torch.nn.functional.pad(t, (0, 0, 0, back))
        return t.contiguous().view(batch, heads, chunks, c, t.shape[-1])

    valid_c = torch.nn.functional.pad(valid, (0, back)).view(batch, chunks, c)
    if far_state is not None:
        far_state = far_state.to(q.dtype)
    y = _WindowChunks.apply(
        in_chunks(q), in_chunks(k), in_chunks(v), in_chunks(phi_q), in_chunks(phi_k), far_state, log_factor, valid_c,
        window, causal, eps,
    )
    return y.reshape(batch, heads, chunks * c, -1)[:, :, :p]


def _quadratic_form(q, k, v1, phi_q, phi_k, valid, window, causal, log_factor, eps, far_state=None):
    """The same outputs as :func:`_chunked_form` from the explicit n x n weights (float32, O(P^2) memory).

    Its shapes are P or fixed (no padding to whole chunks), so torch.export keeps P dynamic: the prompt pass takes it
    under export. Also the form behind :func:`sliding_window_attention_weights`.
    """
    far_z = None if far_state is None else far_state[..., -1]
    weights, scale = _quadratic_weights(q, k, phi_q, phi_k, valid, window, causal, log_factor, eps, far_z)
    out = torch.matmul(weights, v1)
    if far_state is not None:
        out = out + torch.matmul(phi_q, far_state.float()) * scale
    return out[..., :-1] / (out[..., -1:] + eps * scale)


def _quadratic_weights(q, k, phi_q, phi_k, valid, window, causal, log_factor, eps, far_z=None):
    """Unnormalised stabilised weights (B, H, P, P) and the per-query factor exp(-c) (B, H, P, 1)."""
    p = q.shape[2]
    positions = torch.arange(p, device=q.device)
    rel = positions[:, None] - positions[None, :]
    in_window = ((rel >= 0) & (rel < window)) if causal else (rel.abs() < window)
    outside = (rel >= window) if causal else (rel.abs() >= window)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + _head_bias(log_factor, q.shape[1], 4, q)
    scores = scores.masked_fill(~(in_window & valid[:, None, None, :]), -torch.inf)
    linear = torch.where(outside, torch.matmul(phi_q, phi_k.transpose(-1, -2)), 0.0)
    linear_normaliser = linear.sum(-1, keepdim=True)
    if far_z is not None:
        linear_normaliser = linear_normaliser + torch.matmul(phi_q, far_z.float().unsqueeze(-1))
    stabiliser = _stabiliser(scores, linear_normaliser, eps)
    scale = torch.exp(-stabiliser)
    return torch.exp(scores - stabiliser) + linear * scale, scale


def _last_window(t: torch.Tensor, window: int, dim: int) -> torch.Tensor:
    """The last ``window`` entries of ``t`` along ``dim``, zero (or False) filled in front when it has fewer.

    Always padded first, then sliced: no shape condition on the length (torch.export keeps it dynamic).
    """
    shape = list(t.shape)
    shape[dim] = window
    padded = torch.cat([t.new_zeros(shape), t], dim=dim)
    return padded.narrow(dim, padded.shape[dim] - window, window)


def empty_sliding_window_state(
    batch: int, heads: int, window: int, head_dim: int, feature_dim: int, value_dim: int, device=None
) -> tuple[torch.Tensor, ...]:
    """The state before any token: zeros (S, z, keys, phi(keys), values) in float32 and an all-False valid mask."""
    zeros = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
    return (
        zeros(batch, heads, feature_dim, value_dim),
        zeros(batch, heads, feature_dim),
        zeros(batch, heads, window, head_dim),
        zeros(batch, heads, window, feature_dim),
        zeros(batch, heads, window, value_dim),
        torch.zeros(batch, window, dtype=torch.bool, device=device),
    )


def advance_sliding_window_state(state, keys, phi_keys, values, valid):
    """The state after more tokens, without outputs: keys (B, H, t, d), phi_keys (B, H, t, m) and values
    (B, H, t, d_v) with pad rows zeroed, valid (B, t). Rebuilds the state for rollback (``crop``)."""
    s, z, k_w, phi_w, v_w, valid_w = state
    window = k_w.shape[2]
    keys, phi_keys, values = (torch.cat([old, new.float()], dim=2) for old, new in ((k_w, keys), (phi_w, phi_keys), (v_w, values)))
    valid = torch.cat([valid_w, valid.bool()], dim=1)
    leaving = keys.shape[2] - window  # the oldest ones leave the window, into the linear state
    s = s + torch.matmul(phi_keys[:, :, :leaving].transpose(-1, -2), values[:, :, :leaving])
    z = z + phi_keys[:, :, :leaving].sum(-2)
    return s, z, keys[:, :, leaving:], phi_keys[:, :, leaving:], values[:, :, leaving:], valid[:, leaving:]


def _causal_forward(q, k, v, phi_q, phi_k, window, key_mask, log_factor, eps, chunk_size, state, quadratic):
    """Shared body of the causal entry point (float32, autocast off); see :func:`causal_sliding_window_attention`."""
    q, k, v, phi_q, phi_k, valid = _masked_inputs(q, k, v, phi_q, phi_k, key_mask)
    batch, heads, n, _ = q.shape
    far_state = None
    if state is not None:
        # The window's keys become the first W positions; their queries are placeholders whose outputs are dropped.
        s0, z0, k_w, phi_w, v_w, valid_w = state
        past = k_w.shape[2]
        if past != window:
            raise ValueError(f"The state holds a window of {past} keys, the call asks for {window}.")
        k, phi_k, v = (torch.cat([a.float(), b], dim=2) for a, b in ((k_w, k), (phi_w, phi_k), (v_w, v)))
        q = torch.cat([q.new_zeros(batch, heads, past, q.shape[-1]), q], dim=2)
        phi_q = torch.cat([phi_q.new_zeros(batch, heads, past, phi_q.shape[-1]), phi_q], dim=2)
        valid = torch.cat([valid_w.bool(), valid], dim=1)
        far_state = torch.cat([s0.float(), z0.float().unsqueeze(-1)], dim=-1)
    if quadratic:
        y = _quadratic_form(q, k, _with_ones(v), phi_q, phi_k, valid, window, True, log_factor, eps, far_state)
    else:
        y = _chunked_form(q, k, v, phi_q, phi_k, valid, window, True, log_factor, eps, chunk_size, far_state)
    y = y[:, :, y.shape[2] - n :]
    # Final state: every key but the last W leaves the window (a mask, not a slice: no shape condition on n).
    p = k.shape[2]
    leaving = (torch.arange(p, device=k.device) < p - window)[None, None, :, None]
    phi_leaving = torch.where(leaving, phi_k, 0.0)
    final_s, final_z = torch.matmul(phi_leaving.transpose(-1, -2), v), phi_leaving.sum(-2)  # as the kernel: no [V, 1]
    if far_state is not None:
        final_s, final_z = final_s + far_state[..., :-1], final_z + far_state[..., -1]
    new_state = (
        final_s,
        final_z,
        _last_window(k, window, 2),
        _last_window(phi_k, window, 2),
        _last_window(v, window, 2),
        _last_window(valid, window, 1),
    )
    return y, new_state


def causal_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    window: int,
    key_mask: torch.Tensor | None = None,
    log_factor: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
    state: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Causal window + linear attention, chunked: q, k (B, H, n, d), v (B, H, n, d_v), phi_q, phi_k (B, H, n, m),
    key_mask (B, n) -> outputs (B, H, n, d_v) and the decoding state after the n tokens (see the module docstring).

    ``state`` continues from an earlier call or step (prefill, then decoding); ``log_factor`` theta (H,) or None
    (g = 1). Under torch.export the quadratic form runs instead (its shapes keep n dynamic).
    """
    check_window(window)
    out_dtype = v.dtype
    with _no_autocast(v):
        y, new_state = _causal_forward(
            q, k, v, phi_q, phi_k, window, key_mask, log_factor, eps, chunk_size, state,
            quadratic=torch.compiler.is_exporting(),
        )
    return y.to(out_dtype), new_state


def banded_sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    window: int,
    key_mask: torch.Tensor | None = None,
    log_factor: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Bidirectional band + linear attention, chunked: exact terms for |i - j| < W, feature-map terms beyond, one
    normaliser. q, k (B, H, n, d), v (B, H, n, d_v), phi_q, phi_k (B, H, n, m), key_mask (B, n) -> (B, H, n, d_v)."""
    check_window(window)
    out_dtype = v.dtype
    with _no_autocast(v):
        q, k, v, phi_q, phi_k, valid = _masked_inputs(q, k, v, phi_q, phi_k, key_mask)
        y = _chunked_form(q, k, v, phi_q, phi_k, valid, window, False, log_factor, eps, chunk_size)
    return y.to(out_dtype)


def sliding_window_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    state: tuple[torch.Tensor, ...],
    key_mask: torch.Tensor | None = None,
    log_factor: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One decoding step: q, k (B, H, 1, d), v (B, H, 1, d_v), phi_q, phi_k (B, H, 1, m), key_mask (B, 1), state ->
    y (B, H, 1, d_v) and the new state. The oldest window slot moves into (S, z); the new key takes the last slot."""
    out_dtype = v.dtype
    with _no_autocast(v):
        q, k, v, phi_q, phi_k, valid = _masked_inputs(q, k, v, phi_q, phi_k, key_mask)
        s, z, k_w, phi_w, v_w, valid_w = state
        # Broadcast products instead of matmuls: batched matmuls with a dimension of 1 hit slow paths on CPU.
        s = s.float() + phi_w[:, :, 0, :, None].float() * v_w[:, :, 0, None, :].float()  # the leaving key's phi(k) v^T
        z = z.float() + phi_w[:, :, 0].float()
        k_w = torch.cat([k_w[:, :, 1:].float(), k], dim=2)
        phi_w = torch.cat([phi_w[:, :, 1:].float(), phi_k], dim=2)
        v_w = torch.cat([v_w[:, :, 1:].float(), v], dim=2)
        valid_w = torch.cat([valid_w[:, 1:].bool(), valid], dim=1)
        heads = q.shape[1]
        scores = (q * k_w).sum(-1) * q.shape[-1] ** -0.5 + _head_bias(log_factor, heads, 3, q)  # (B, H, W)
        scores = scores.masked_fill(~valid_w[:, None, :], -torch.inf)
        linear_normaliser = (phi_q.squeeze(2) * z).sum(-1, keepdim=True)  # (B, H, 1)
        stabiliser = _stabiliser(scores, linear_normaliser, eps)
        scale = torch.exp(-stabiliser)
        weights = torch.exp(scores - stabiliser)
        numerator = (weights[..., None] * v_w).sum(-2) + (phi_q.transpose(-1, -2) * s).sum(-2) * scale
        normaliser = weights.sum(-1, keepdim=True) + linear_normaliser * scale
        y = (numerator / (normaliser + eps * scale)).unsqueeze(2)
    return y.to(out_dtype), (s, z, k_w, phi_w, v_w, valid_w)


def sliding_window_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    window: int,
    key_mask: torch.Tensor | None = None,
    causal: bool = True,
    log_factor: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The n x n matrix the combination applies implicitly: (B, H, n, n) float32, rows summing to ~1.

    Quadratic in n: for ``output_attentions`` and distillation, never for the forward pass itself.
    """
    check_window(window)
    with _no_autocast(q):
        v = q.new_zeros(*q.shape[:-1], 1)
        q, k, _, phi_q, phi_k, valid = _masked_inputs(q, k, v, phi_q, phi_k, key_mask)
        weights, scale = _quadratic_weights(q, k, phi_q, phi_k, valid, window, causal, log_factor, eps)
        return weights / (weights.sum(-1, keepdim=True) + eps * scale)


__all__ = [
    "SlidingWindowFactor",
    "advance_sliding_window_state",
    "banded_sliding_window_attention",
    "causal_sliding_window_attention",
    "check_window",
    "check_window_factor_init",
    "check_window_options",
    "empty_sliding_window_state",
    "sliding_window_attention_step",
    "sliding_window_attention_weights",
]
