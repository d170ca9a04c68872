"""Causal linear attention whose state decays: a fixed per-head decay (RetNet) or a gate computed from the input
(GLA), layer 1: torch only, no transformers import.

    S_t = a_t * S_{t-1} + phi(k_t) v_t^T,  z_t = a_t * z_{t-1} + phi(k_t),  y_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)

``a_t`` in (0, 1] scales the rows of the state (B, H, m, d_v): one value per head (RetNet's gamma, (B, H, n, 1)
after broadcasting) or one per feature of phi (GLA's gate, (B, H, n, m)). It is passed as ``log_decay`` = log a_t
<= 0, which is what the kernels sum. With a_t = 1 everywhere this is :func:`~.linear_attention.causal_linear_attention`
exactly. The normaliser z decays with S, so y_t stays a weighted average of the values (RetNet and GLA drop the
normaliser for a group norm; this family keeps the "Transformers are RNNs" output, with positive features).

Forms (float32 throughout, autocast off, output in V's dtype):

* :func:`naive_decayed_linear_attention`: the recurrence, one position at a time (the reference the tests use).
* the chunked form (:func:`causal_decayed_linear_attention`): chunks of C positions; inside a chunk exact decayed
  scores, across chunks the carried state. With B_t the sum of log a over the chunk up to t, the decay from s to t
  is exp(B_t - B_s) <= 1, the decay of the carried state to t is exp(B_t) <= 1 and a key's decay to the chunk's end
  exp(B_C - B_s) <= 1: no exponent is ever positive, so nothing overflows however strong the decay (splitting
  exp(B_t - B_s) into exp(B_t) exp(-B_s), as a plain matmul of rescaled q and k would, overflows float32 once a chunk
  decays by more than e^-88). One decay per head: the scores are (phi(Q) phi(K)^T) * exp(B_t - B_s), a matmul and a
  C x C factor. One per feature: sum_f q_tf k_sf exp(B_tf - B_sf), as one matmul of q and k rescaled around the
  chunk's middle where no factor exceeds e^40 (:func:`_split_scores`: a chunk of 64 whose gates average above
  e^-1.25), else in chunks of :data:`FEATURE_GATE_CHUNK`, the same way or, where even those decay too strongly, as a
  C x C x m product (GLA's "secondary chunk" level). The choice is exact either way; only the speed differs.
  Every chunk at once (:func:`_chunked_form`) or one after another carrying the state (:func:`_scan_form`,
  cache-resident on CPUs); ``form="auto"`` picks by :func:`choose_decayed_form`.
* the pairwise form over the whole sequence (:func:`_pairwise_form`): what ``torch.export`` takes (no loop over a
  number of chunks read from n), O(n^2 g) memory; and the n x n weights for ``output_attentions``.
"""

import torch

from .linear_attention import _no_autocast, _split_output, _state_with_normaliser, _with_ones, mask_keys

# Chunk length for one decay per feature where a chunk decays too strongly for the matmul form (_split_scores): the
# C x C x m product costs C m floats per position (4 kB at m = 64), so the chunk stays short.
FEATURE_GATE_CHUNK = 16


def _check_log_decay(log_decay: torch.Tensor, phi_q: torch.Tensor) -> None:
    batch, heads, n, m = phi_q.shape
    if log_decay.dim() != 4 or log_decay.shape[2] != n or log_decay.shape[-1] not in (1, m):
        raise ValueError(
            f"log_decay must be (batch, heads, n, 1) (one decay per head) or (batch, heads, n, m) (one per feature), "
            f"broadcastable to phi(Q) {tuple(phi_q.shape)}; got {tuple(log_decay.shape)}."
        )


def _float32_decay_inputs(phi_q, phi_k, v, log_decay, key_mask):
    """float32 phi(Q), phi(K), [V, 1] and log a, with pad keys adding nothing and leaving the state undecayed."""
    batch, heads, n, _ = phi_q.shape
    phi_k, v = mask_keys(phi_k.float(), v.float(), key_mask)
    log_decay = log_decay.float().expand(batch, heads, n, log_decay.shape[-1])
    if key_mask is not None:  # a pad position leaves the state exactly as it was: no key, no decay
        log_decay = torch.where(key_mask[:, None, :, None], log_decay, 0.0)
    return phi_q.float(), phi_k, _with_ones(v), log_decay


def causal_decayed_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    form: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Decayed causal linear attention, exact, in chunks: (B, H, n, d_v) outputs and the final (S, z) state.

    ``log_decay``: log a_t <= 0, (B or 1, H, n, 1) or (B or 1, H, n, m). ``state`` = (S (B, H, m, d_v), z (B, H, m))
    continues from an earlier call (prefill, then decoding). Gradients: autograd through the chunk loop, which
    holds one (B, H, m, d_v + 1) state per chunk. Under ``torch.export`` the pairwise form runs instead (its shapes
    are linear or quadratic in n, with no chunk count).

    ``form``: "chunks" computes every chunk at once (few, large kernels), "scan" one chunk after another carrying
    the state (cache-resident steps); "auto" takes :func:`choose_decayed_form`'s pick.
    """
    _check_log_decay(log_decay, phi_q)
    if form not in ("auto", "chunks", "scan"):
        raise ValueError(f"form must be 'auto', 'chunks' or 'scan', got {form!r}.")
    batch, heads, n, m = phi_q.shape
    d_v = v.shape[-1]
    out_dtype = v.dtype
    with _no_autocast(v):
        q, k, v1, log_decay = _float32_decay_inputs(phi_q, phi_k, v, log_decay, key_mask)
        s0 = _state_with_normaliser(state, batch, heads, m, d_v, q)
        if torch.compiler.is_exporting():
            out, final = _pairwise_form(q, k, v1, log_decay, s0)
        else:
            if form == "auto":
                # as the plain kernel decides it: whether autograd records this call
                needs_grad = torch.is_grad_enabled() and any(
                    t.requires_grad for t in (phi_q, phi_k, v, log_decay, *(state if state is not None else ()))
                )
                form = choose_decayed_form(q.device.type, batch * heads * n, needs_grad)
            run = _scan_form if form == "scan" else _chunked_form
            out, final = run(q, k, v1, log_decay, s0, max(1, min(chunk_size, max(n, 1))))
        return _split_output(out, final, d_v, eps, out_dtype)


# Where the scan pays on a CPU, from this many positions (batch x heads x n), without and with gradients. Measured on
# a 2-core Zen 5 EPYC (`python scripts/state_variants_benchmark.py --forms`, H 12, d 64, batch 1, one run): forward,
# the two forms tie at n 1,024 (12,288 positions; fixed decay 12.3 / 12.9 ms) and the scan leads from 4,096 (1.6x /
# 2.0x at 16,384 for the fixed decay / the gate); forward + backward, the all-chunks form leads at 1,024 (24 against
# 33 ms), they tie at 4,096, and the scan leads at 16,384 (686 against 1,012 ms; gate 864 against 1,539). GPUs keep
# the all-chunks form (few, large kernels), unmeasured.
SCAN_FROM_POSITIONS = {False: 24576, True: 98304}


def choose_decayed_form(device: str, positions: int, needs_grad: bool) -> str:
    """"chunks" or "scan" for this device type, number of positions (batch x heads x n) and gradients or not."""
    return "scan" if device == "cpu" and positions >= SCAN_FROM_POSITIONS[needs_grad] else "chunks"


def _decay_matrix(b_t: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """exp(b_t - b_s) for s <= t, 0 above the diagonal: (..., T, S, g) from (..., T, g) and (..., S, g).

    The difference is masked before exp, so the positive exponents above the diagonal are never evaluated (no inf,
    and no NaN gradient through them)."""
    diff = b_t.unsqueeze(-2) - b_s.unsqueeze(-3)  # (..., T, S, g)
    causal = torch.ones(b_t.shape[-2], b_s.shape[-2], dtype=torch.bool, device=b_t.device).tril()
    return torch.exp(torch.where(causal[:, :, None], diff, -torch.inf))


def _decayed_scores(q, k, b):
    """sum_f q_tf k_sf exp(b_tf - b_sf) for s <= t: (..., C, C) from (..., C, m) q, k and (..., C, g) b."""
    decay = _decay_matrix(b, b)  # (..., C, C, g)
    if b.shape[-1] == 1:  # one decay per head: a matmul and a C x C factor
        return torch.matmul(q, k.transpose(-1, -2)) * decay.squeeze(-1)
    return (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)  # one per feature: C x C x m


# One decay per feature, the fast way: exp(b_t - b_s) = exp(b_t - b_mid) exp(b_mid - b_s), b_mid the chunk's middle, so
# the scores are one matmul of rescaled q and k. Each factor is at most exp(half the chunk's decay); at most e^40
# keeps every product, those above the diagonal too (masked afterwards), below e^80 and finite in float32.
SPLIT_EXPONENT = 40.0


def _split_scores(q, k, b, causal=None):
    """_decayed_scores for one decay per feature as a matmul around the chunk's middle, or None where a chunk decays
    too strongly for it (see :data:`SPLIT_EXPONENT`; the caller then takes shorter chunks or the C x C x m form).
    ``causal``: the C x C lower-triangular mask, where the caller has it."""
    c = b.shape[-2]
    mid = b[..., c // 2 : c // 2 + 1, :]
    # one check (a host sync) per call: the largest factor of any chunk, before or after its middle
    if torch.maximum(b[..., :1, :] - mid, mid - b[..., -1:, :]).max() > SPLIT_EXPONENT:
        return None
    scores = torch.matmul(q * torch.exp(b - mid), (k * torch.exp(mid - b)).transpose(-1, -2))
    if causal is None:
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    return torch.where(causal, scores, 0.0)  # where, not a product: an entry above the diagonal may be large


def _blocked_scores(q, k, b, block: int = FEATURE_GATE_CHUNK):
    """_decayed_scores for one decay per feature, exact and finite at any decay, without the C x C x m product: the
    chunk cut into blocks of ``block`` positions. A query t after key block j (its last position e) takes the decay
    from s in j as exp(b_t - b_e) exp(b_e - b_s), two factors <= 1 (the running log decay b never rises), so the
    pairs across blocks are a matmul of q and k rescaled to each block's end (fla's chunked GLA splits the same way);
    the pairs inside a block are :func:`_split_scores` of the block (a matmul around its middle) where its decay
    allows, else the same way in blocks a quarter as long, down to blocks of 4 or fewer, whose pairs take the block x
    block x m product: C x 4 x m floats per chunk, not C x C x m. Chunks not a multiple of ``block``: the plain
    product. (Not under ``torch.export``: its checks read the data and the chunk's length.)"""
    c = b.shape[-2]
    if c <= block or c % block:
        return _decayed_scores(q, k, b)
    blocks = c // block
    q_b, k_b, b_b = (t.unflatten(-2, (blocks, block)) for t in (q, k, b))  # (..., N, block, m)
    end = b_b[..., -1:, :]  # (..., N, 1, g): the running log decay at each block's last position
    keys = k_b * torch.exp(end - b_b)  # each key decayed to its block's end
    # every query against every block's end; the exponent clamped at 0 where the query is not after the block (those
    # pairs are dropped below), so nothing overflows
    queries = q.unsqueeze(-3) * torch.exp((b.unsqueeze(-3) - end).clamp(max=0))  # (..., N, C, m)
    across = torch.matmul(queries, keys.transpose(-1, -2))  # (..., N_keys, C, block)
    after = (torch.arange(c, device=q.device) // block)[None, :] > torch.arange(blocks, device=q.device)[:, None]
    across = torch.where(after[:, :, None], across, 0.0).movedim(-3, -2).flatten(-2)  # (..., C, C)
    inside = _split_scores(q_b, k_b, b_b)  # (..., N, block, block)
    if inside is None:
        inside = _blocked_scores(q_b, k_b, b_b, block // 4) if block >= 8 else _decayed_scores(q_b, k_b, b_b)
    eye = torch.eye(blocks, dtype=inside.dtype, device=q.device)
    return across + (inside.unsqueeze(-2) * eye[:, None, :, None]).flatten(-4, -3).flatten(-2)


def _chunked_form(q, k, v1, log_decay, s0, c: int):
    """out_t = phi(q_t) [S_t, z_t] for every t and the final [S, z]: float32 (B, H, n, m) q, k, (B, H, n, d + 1) v1,
    (B, H, n, g) log a, (B, H, m, d + 1) initial state, chunks of c."""
    batch, heads, n, m = q.shape
    if n == 0:
        return q.new_zeros(batch, heads, 0, v1.shape[-1]), s0
    padded = -n % c
    if padded:  # padded positions: no key, no decay; their query rows are dropped at the end
        q, k, v1, log_decay = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (q, k, v1, log_decay))
    chunks = (n + padded) // c
    q_c, k_c, v_c, a_c = (t.reshape(batch, heads, chunks, c, t.shape[-1]) for t in (q, k, v1, log_decay))
    b = torch.cumsum(a_c, dim=3)  # (B, H, N, C, g): log of the decay from the chunk's start to t
    if b.shape[-1] == 1:
        scores = _decayed_scores(q_c, k_c, b)
    else:  # one decay per feature: the matmul form where the chunk's decay allows it, else shorter chunks, C x C x m
        scores = _split_scores(q_c, k_c, b)
        if scores is None and c > FEATURE_GATE_CHUNK:
            return _chunked_form(q[:, :, :n], k[:, :, :n], v1[:, :, :n], log_decay[:, :, :n], s0, FEATURE_GATE_CHUNK)
        if scores is None:
            scores = _decayed_scores(q_c, k_c, b)
    b_end = b[:, :, :, -1:]  # (B, H, N, 1, g): the whole chunk's
    # what each chunk adds to the state, decayed to the chunk's end, and the chunk's decay of the state before it
    chunk_kv = torch.matmul((k_c * torch.exp(b_end - b)).transpose(-1, -2), v_c)  # (B, H, N, m, d + 1)
    chunk_decay = torch.exp(b_end).transpose(-1, -2)  # (B, H, N, g, 1): broadcasts over the state's rows
    states, s = [], s0
    # the only sequential part: n / C elementwise updates of a (B, H, m, d + 1) state. unbind, not [:, :, i]: the
    # backward of one index is a zero tensor of the whole input, so n / C of them cost O((n / C)^2) (measured: 26x the
    # time for 4x the length), where unbind's backward stacks the slices' gradients once
    for decay, kv in zip(chunk_decay.unbind(2), chunk_kv.unbind(2)):
        states.append(s)
        s = decay * s + kv
    before = torch.stack(states, dim=2)  # (B, H, N, m, d + 1): the state entering each chunk
    out = torch.matmul(scores, v_c) + torch.matmul(q_c * torch.exp(b), before)
    return out.reshape(batch, heads, n + padded, -1)[:, :, :n], s


def _scan_form(q, k, v1, log_decay, s0, c: int):
    """The chunked form one chunk at a time, carrying the state: the same outputs and final state as
    :func:`_chunked_form`, but every operand of a step is one chunk's (a few hundred kB at 12 heads, C = 64), so it
    stays in cache where the all-chunks form streams (B, H, n / C, ...) tensors through memory."""
    batch, heads, n, m = q.shape
    outs, s = [q.new_zeros(batch, heads, 0, v1.shape[-1])], s0
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # split, not [start:end] slices: under autograd each slice's backward is a zero tensor of the whole input,
    # O((n / C)^2) in all, where split's backward joins the chunks' gradients once
    for q_c, k_c, v_c, a_c in zip(*(t.split(c, dim=2) for t in (q, k, v1, log_decay))):
        b = torch.cumsum(a_c, dim=2)
        size = b.shape[2]
        scores = _split_scores(q_c, k_c, b, causal[:size, :size]) if b.shape[-1] > 1 else None
        if scores is None:
            scores = _decayed_scores(q_c, k_c, b)
        # a list joined once, not writes into one output (whose backward would copy the whole gradient per chunk)
        outs.append(torch.matmul(scores, v_c) + torch.matmul(q_c * torch.exp(b), s))
        s = _advance(s, k_c, v_c, b)
    return torch.cat(outs, dim=2), s


def _advance(s, k, v1, b):
    """[S, z] (B, H, m, d + 1) after the keys k (B, H, t, m) and values [V, 1] whose running log decays, counted from
    the state's position, are b (B, H, t, g): the state decays by the whole span, each key by its decay to the end
    (every exponent <= 0)."""
    b_end = b[:, :, -1:]
    return torch.exp(b_end).transpose(-1, -2) * s + torch.matmul((k * torch.exp(b_end - b)).transpose(-1, -2), v1)


def _pairwise_form(q, k, v1, log_decay, s0):
    """The same function over the whole sequence at once: decayed scores (B, H, n, n), no chunk count (export)."""
    b = torch.cumsum(log_decay, dim=2)  # (B, H, n, g)
    out = torch.matmul(_decayed_scores(q, k, b), v1) + torch.matmul(q * torch.exp(b), s0)
    return out, _advance(s0, k, v1, b)


def decayed_linear_attention_weights(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    log_decay: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The causal n x n matrix decayed linear attention applies implicitly (from an empty state): (B, H, n, n), rows
    sum to ~1. Quadratic in n (O(n^2 m) for one decay per feature): for ``output_attentions`` and distillation."""
    _check_log_decay(log_decay, phi_q)
    with _no_autocast(phi_q):
        q, k, _, log_decay = _float32_decay_inputs(phi_q, phi_k, phi_q[..., :1], log_decay, key_mask)
        scores = _decayed_scores(q, k, torch.cumsum(log_decay, dim=2))
        return scores / (scores.sum(-1, keepdim=True) + eps)


def naive_decayed_linear_attention(phi_q, phi_k, v, log_decay, state=None, eps: float = 1e-6):
    """Reference: the recurrence one position at a time, in the inputs' dtype (float64 in the tests)."""
    batch, heads, n, m = phi_q.shape
    a = torch.exp(log_decay).expand(batch, heads, n, log_decay.shape[-1])
    s = phi_q.new_zeros(batch, heads, m, v.shape[-1]) if state is None else state[0].to(phi_q.dtype)
    z = phi_q.new_zeros(batch, heads, m) if state is None else state[1].to(phi_q.dtype)
    outputs = []
    for t in range(n):
        s = a[:, :, t].unsqueeze(-1) * s + phi_k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        z = a[:, :, t] * z + phi_k[:, :, t]
        numerator = torch.einsum("bhm,bhmd->bhd", phi_q[:, :, t], s)
        outputs.append(numerator / ((phi_q[:, :, t] * z).sum(-1, keepdim=True) + eps))
    return torch.stack(outputs, dim=2), (s, z)


def recurrent_decayed_linear_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One RNN step: S <- a S + phi(k) v^T, z <- a z + phi(k), y = phi(q) S / (phi(q) . z + eps); (B, H, 1, .) inputs,
    ``log_decay`` (B or 1, H, 1, 1 or m). A pad token (``key_mask`` False) leaves the state unchanged."""
    _check_log_decay(log_decay, phi_q)
    out_dtype = v.dtype
    with _no_autocast(v):
        q, k, v1, log_decay = _float32_decay_inputs(phi_q, phi_k, v, log_decay, key_mask)
        a = torch.exp(log_decay).transpose(-1, -2)  # (B, H, g, 1): scales the state's rows
        # broadcast products, as in the undecayed step (batched matmuls with a dimension of 1 are slow on CPUs)
        s = a * state[0].float() + k.transpose(-1, -2) * v1[..., :-1]
        z = a.squeeze(-1) * state[1].float() + k.squeeze(-2)
        numerator = (q.transpose(-1, -2) * s).sum(-2, keepdim=True)
        y = numerator / ((q.squeeze(-2) * z).sum(-1)[..., None, None] + eps)
        return y.to(out_dtype), (s, z)


def advance_decayed_state(phi_k, v, log_decay, state):
    """The state (S, z) after the tokens phi(K), V (pads already zeroed) with decays ``log_decay``, from ``state``
    (None: empty): what a cache replays to roll back. float32."""
    batch, heads, n, m = phi_k.shape
    d_v = v.shape[-1]
    with _no_autocast(v):
        v1 = _with_ones(v.float())
        log_decay = log_decay.float().expand(batch, heads, n, log_decay.shape[-1])
        s0 = _state_with_normaliser(state, batch, heads, m, d_v, phi_k.float())
        final = _advance(s0, phi_k.float(), v1, torch.cumsum(log_decay, dim=2))
        return final[..., :d_v].contiguous(), final[..., d_v].contiguous()
