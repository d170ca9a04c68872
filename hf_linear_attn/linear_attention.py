"""Kernelized linear attention (Katharopoulos et al. 2020), layer 1: torch only, no transformers import.

Inputs are features phi(Q), phi(K) of shape (batch, heads, n, m) from :mod:`feature_maps` and values V of
shape (batch, heads, n, d_v). Everything is computed in float32 with autocast off (S, z and the normaliser must
not be rounded to bf16 / fp16), and the output is returned in V's dtype.

Padding is removed AFTER the feature map (elu + 1 maps a zero key to ones, so zeroing K before phi would leave
the pad in the normaliser), with ``torch.where`` rather than a multiply (0 x NaN stays NaN).
"""

import functools

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


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """[V, 1]: a column of ones after V, so one product gives the numerator phi(q) S and the normaliser phi(q) . z."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _state_with_normaliser(state, batch, heads, m, d_v, like):
    """[S, z] (B, H, m, d_v + 1) in float32, the state as the products with [V, 1] carry it; zeros without a state."""
    if state is None:
        return like.new_zeros(batch, heads, m, d_v + 1)
    return torch.cat([state[0].float(), state[1].float().unsqueeze(-1)], dim=-1)


def _split_output(out, final, d_v, eps, out_dtype):
    """Outputs phi(q) S / (phi(q) . z + eps) in ``out_dtype`` and the final (S, z) from the products with [V, 1]."""
    y = out[..., :d_v] / (out[..., d_v:] + eps)
    return y.to(out_dtype), (final[..., :d_v].contiguous(), final[..., d_v].contiguous())


def bidirectional_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    precision: str = "auto",
) -> torch.Tensor:
    """out_i = phi(q_i) S / (phi(q_i) . z + eps), S = phi(K)^T V, z = sum_j phi(k_j): (B, H, n, d_v) in O(n m d).

    ``precision`` as in :func:`causal_linear_attention`: on the bf16 compute path S = phi(K)^T V and phi(Q) S are
    bf16 products (accumulated in float32 inside the product, S rounded once), z and the normaliser float32.
    """
    out_dtype = v.dtype
    with _no_autocast(v):
        if _bf16_compute(precision, phi_q, phi_k, v):
            phi_q, phi_k = phi_q.bfloat16(), phi_k.bfloat16()
            phi_k, v = mask_keys(phi_k, v, key_mask)
            z = phi_k.float().sum(-2, keepdim=True)  # (B, H, 1, m) float32
            normaliser = (phi_q.float() * z).sum(-1, keepdim=True)
            numerator = torch.matmul(phi_q, torch.matmul(phi_k.transpose(-1, -2), v))
            return (numerator.float() / (normaliser + eps)).to(out_dtype)
        phi_q, phi_k, v = _float32_inputs(phi_q, phi_k, v, key_mask)
        d_v = v.shape[-1]
        state = torch.matmul(phi_k.transpose(-1, -2), _with_ones(v))  # (B, H, m, d_v + 1): [S, z]
        out = torch.matmul(phi_q, state)  # numerator and normaliser in one product
        return (out[..., :d_v] / (out[..., d_v:] + eps)).to(out_dtype)


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


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, n, x) -> (B * H, n, x), contiguous."""
    return t.reshape(-1, *t.shape[-2:]).contiguous()


def _chunked_scan(a, b, c, state, chunk: int, reverse: bool = False):
    """out_t = a_t (state + sum_{j<=t} b_j^T c_j) for (G, n, p) a, b and (G, n, r) c; returns out and the final state.

    With ``reverse`` the sum runs over j >= t instead. The positions are visited one chunk of C at a time: inside
    the chunk a masked (a b^T) c product, across chunks the carried (G, p, r) state. Every operand of a step is a
    few hundred kB (12 heads, C = 64: cache-resident), which is what makes this form fast on CPUs: the
    all-chunks-at-once form streams (G, n / C, p, r) prefix states through memory and reached a third of the speed.

    bf16 a, b, c (the bf16 compute path): every product runs in bf16 (native bf16 dot products), while the state
    and the output stay float32: each chunk's contribution is rounded once to bf16 and then added in float32, so
    rounding errors do not accumulate along the sequence. float32 a, b, c: everything in float32.
    """
    n = a.shape[1]
    low = a.dtype != torch.float32
    out = torch.empty(*a.shape[:2], c.shape[-1], dtype=torch.float32, device=a.device)
    # Contiguous: the backward passes transposed states, and a strided state sends every baddbmm_ below through a
    # loop of per-matrix addmm_ (8,192 calls in one training step of the copy-paper decoder, profiled).
    state = state.float().clone(memory_format=torch.contiguous_format)
    mask = torch.ones(chunk, chunk, dtype=a.dtype, device=a.device)
    mask = mask.triu_() if reverse else mask.tril_()
    starts = range(0, n, chunk)
    for start in reversed(starts) if reverse else starts:
        end = min(start + chunk, n)
        a_c, b_c, c_c = a[:, start:end], b[:, start:end], c[:, start:end]
        scores = torch.bmm(a_c, b_c.transpose(1, 2)).mul_(mask[: end - start, : end - start])
        if low:
            out_c = out[:, start:end]
            out_c.copy_(torch.bmm(scores, c_c)).add_(torch.bmm(a_c, state.to(a.dtype)))
            state.add_(torch.bmm(b_c.transpose(1, 2), c_c))
        else:
            out[:, start:end] = torch.bmm(scores, c_c).baddbmm_(a_c, state)
            state.baddbmm_(b_c.transpose(1, 2), c_c)
    return out, state


class _CausalLinearAttentionScan(torch.autograd.Function):
    """O = tril(Q K^T) V + Q S_0 and S_n = S_0 + K^T V, with a backward of three more scans (no stored scores).

    dQ = tril(dO V^T) K + dO S_0^T;  dK = triu(V dO^T) Q + V dS_n^T;  dV = triu(K Q^T) dO + K dS_n;
    dS_0 = Q^T dO + dS_n (the final state of the dV scan).
    """

    @staticmethod
    def forward(ctx, q, k, v, state, chunk):
        ctx.save_for_backward(q, k, v, state)
        ctx.chunk = chunk
        return _chunked_scan(q, k, v, state, chunk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_state):
        q, k, v, state = ctx.saved_tensors
        d_out, d_state = d_out.to(q.dtype).contiguous(), d_state.contiguous()  # bf16 path: bf16 products
        d_q = d_k = d_v = d_state0 = None
        if ctx.needs_input_grad[0]:
            d_q, _ = _chunked_scan(d_out, v, k, state.transpose(1, 2), ctx.chunk)
        if ctx.needs_input_grad[1]:
            d_k, _ = _chunked_scan(v, d_out, q, d_state.transpose(1, 2), ctx.chunk, reverse=True)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            d_v, d_state0 = _chunked_scan(k, q, d_out, d_state, ctx.chunk, reverse=True)
        return d_q, d_k, d_v, d_state0, None


# Where each causal form wins: (device, bf16 compute, needs gradients) -> rows (fewest positions, form, chunk size),
# positions = batch x heads x n (the forms' cost and working set grow with all three); the last row whose first
# value is <= the call's positions applies; devices not listed use the "cuda" rows (few, large kernels).
# CPU float32, from results/benchmarks/crossover-cpu-2core-quick (2-core AMD EPYC, AVX2, `scripts/benchmark.py
# --preset quick --only crossover`; H 12, d 64, batch 1 and 16): forward, scan C=64 is the fastest form or within
# the rows' noise (up to 30%: the table's pick against its identical explicit twin) at every n. Forward + backward,
# parallel C=64 (autograd's backward) beats scan C=64 (the hand-written backward) on small calls, 1.05-1.35x at
# batch 1 up to n 2,048 (1.19x at n 1,024) and 1.05-1.11x at batch 16 up to n 256; from batch 16 x n 1,024
# (196,608 positions) the scan wins by 1.4-1.6x, and at batch 1 from n 4,096 by 1.05-1.17x. The boundary at 65,536
# positions sits between.
# CPU bf16 products (the bf16 path: "auto" takes it on such CPUs for training, and for a forward below
# CPU_BF16_FORWARD_BELOW positions, see _bf16_compute), on a 2-core Zen 5 EPYC with AVX512-BF16, H 12, d 64, batch 1,
# `python scripts/bf16_kernel_check.py --n ... --forms ...` (results/benchmarks/bf16-kernel-zen5-2026-11-26-b for
# n 1,024 / 4,096, -b-long for 16,384 / 65,536; bf16 matmul peak about 410 GFLOP/s there). The parallel form with its
# normaliser from its own scores and a hand-written backward (_ChunkwiseParallelBF16), C=64, is the fastest form or
# within 3% of it at every n measured: forward + backward 41.3 ms at 4,096 against 95.7-110.1 for the scans, 2.06 s
# at 65,536 (786,432 positions) against 2.85-3.07; forward 16.3 ms at 4,096 against 24.4 for the scan C=128, 789 ms
# at 65,536 against 859-864, and at 16,384 173 ms against 169 for the scan C=128 (a tie).
# GPUs: fla's Triton kernel where installed (see causal_linear_attention), else these "cuda" rows, the earlier fixed
# choice; not measured yet.
CAUSAL_FORM_TABLE: dict[tuple[str, bool, bool], list[tuple[int, str, int]]] = {
    ("cpu", False, False): [(0, "scan", 64)],
    ("cpu", False, True): [(0, "parallel", 64), (65536, "scan", 64)],
    ("cpu", True, False): [(0, "parallel", 64)],
    ("cpu", True, True): [(0, "parallel", 64)],
    ("cuda", False, False): [(0, "parallel", 64)],
    ("cuda", False, True): [(0, "parallel", 64)],
    ("cuda", True, False): [(0, "parallel", 64)],
    ("cuda", True, True): [(0, "parallel", 64)],
}


def choose_causal_form(device: str, bf16: bool, positions: int, needs_grad: bool) -> tuple[str, int]:
    """(form, chunk size) that :data:`CAUSAL_FORM_TABLE` gives for this device type, compute dtype, number of
    positions (batch x heads x n) and whether gradients are needed."""
    rows = CAUSAL_FORM_TABLE.get((device, bf16, needs_grad)) or CAUSAL_FORM_TABLE[("cuda", bf16, needs_grad)]
    form, chunk = rows[0][1:]
    for fewest, row_form, row_chunk in rows:
        if positions >= fewest:
            form, chunk = row_form, row_chunk
    return form, chunk


def causal_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk_size: int | None = None,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    form: str = "auto",
    precision: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal linear attention, exact, in chunks of C positions: (B, H, n, d_v) outputs and the final (S, z) state.

    y_t = phi(q_t) S_t / (phi(q_t) . z_t + eps) with S_t = S_0 + sum_{j<=t} phi(k_j) v_j^T, z_t = z_0 + sum phi(k_j).
    Inside a chunk: masked (phi(Q) phi(K)^T * tril) V; across chunks: phi(Q) times the state of the earlier chunks.
    No n x n matrix and no per-position m x d_v state. ``state`` = (S (B, H, m, d_v), z (B, H, m)) continues from an
    earlier call (prefill, then decoding).

    ``precision``: float32 inputs are computed in float32 (z rides along as a column of ones after V, so one product
    gives numerator and normaliser). bf16 V (as a model's value projection gives it under autocast or with bf16
    weights), with phi(Q), phi(K) in bf16 or float32 (rounded to bf16 here), takes the bf16 compute path with
    "bfloat16", and with "auto" where the device computes bf16 natively and it pays (CUDA; CPUs with AVX512-BF16 /
    AMX when gradients are needed or below :data:`CPU_BF16_FORWARD_BELOW` positions; see :func:`_bf16_compute`);
    "float32" keeps the float32 path. On the bf16 path the products run in bf16, the state S,
    z and the normaliser phi(q) . z_t are accumulated in float32 (in the torch forms z_t is a float32 prefix sum and
    the normaliser a float32 dot product; in the "fla" form fla's kernel computes the normaliser as it computes the
    numerator, accumulating in float32 and writing it in bf16: see :func:`_causal_fla`).

    ``form``: "scan" visits the chunks in order carrying the state (cache-resident steps, a hand-written backward
    of three more scans that stores nothing but the inputs); "parallel" computes every chunk at once with a prefix
    sum of per-chunk states (few, large kernels; autograd's backward); "fla" runs flash-linear-attention's Triton
    chunk kernel for the numerator (bf16 path on CUDA only, see :func:`_causal_fla`). "auto" takes "fla" where it
    can run (:func:`fla_chunk_kernel`), else picks form and chunk size (also when ``chunk_size=None``) from
    :data:`CAUSAL_FORM_TABLE`, by device, compute dtype, batch x heads x n and whether gradients are needed. Under
    ``torch.export`` ``form`` and ``chunk_size`` are set aside for the prefix-sum form (:func:`_prefix_sum_form`),
    the one whose exported program holds for every n.
    """
    if form not in ("auto", "scan", "parallel", "fla"):
        raise ValueError(f"form must be 'auto', 'scan', 'parallel' or 'fla', got {form!r}.")
    out_dtype = v.dtype
    batch, heads, n, m = phi_q.shape
    d_v = v.shape[-1]
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (phi_q, phi_k, v, *(state if state is not None else ()))
    )
    low = _bf16_compute(precision, phi_q, phi_k, v, causal=True, needs_grad=needs_grad, positions=batch * heads * n)
    if torch.compiler.is_exporting():
        # torch.export (and the ONNX exporter, which runs it) traces n as a symbol: the scan's loop over chunks
        # would unroll for the traced n, and the chunked forms' padding to a whole number of chunks leaves shape
        # conditions (n a multiple of C? one chunk?) that fix n. The prefix-sum form's shapes are linear in n, so
        # one exported program serves every length. Eager and torch.compile keep the forms below.
        form, c = "prefix-sum", None
    else:
        if form == "fla":
            if not low:
                raise ValueError("form='fla' (flash-linear-attention's Triton chunk kernel) computes the bf16 path "
                                 "only: pass bfloat16 phi(Q), phi(K) and V, or choose form 'scan' or 'parallel'.")
            if fla_chunk_kernel(phi_q.device.type) is None:
                raise ValueError("form='fla' needs flash-linear-attention's kernels on a CUDA device: install the "
                                 "'fla' extra (pip install fla-core) and run on CUDA, or choose form 'scan' or "
                                 "'parallel'.")
        elif form == "auto" and low and n > 0 and fla_chunk_kernel(phi_q.device.type) is not None:
            form = "fla"  # where fla's Triton kernel computes this same function (see _causal_fla), it runs it
        if form != "fla" and (form == "auto" or chunk_size is None):
            auto_form, auto_chunk = choose_causal_form(phi_q.device.type, low, batch * heads * n, needs_grad)
            form = auto_form if form == "auto" else form
            chunk_size = auto_chunk if chunk_size is None else chunk_size
        c = max(1, min(chunk_size or 64, n))
    with _no_autocast(v):
        if low:
            return _causal_bf16(phi_q.bfloat16(), phi_k.bfloat16(), v, key_mask, eps, c, state, form)
        phi_q, phi_k, v = _float32_inputs(phi_q, phi_k, v, key_mask)
        state0 = _state_with_normaliser(state, batch, heads, m, d_v, phi_q)
        v1 = _with_ones(v)
        if form == "scan":
            out, final = _CausalLinearAttentionScan.apply(
                _flat(phi_q), _flat(phi_k), _flat(v1), _flat(state0), c
            )
            out, final = out.view(batch, heads, n, d_v + 1), final.view(batch, heads, m, d_v + 1)
        elif form == "prefix-sum":
            out, final = _prefix_sum_form(phi_q, phi_k, v1, state0)
        else:
            out, final = _chunkwise_parallel(phi_q, phi_k, v1, state0, c)
        return _split_output(out, final, d_v, eps, out_dtype)


@functools.lru_cache(maxsize=None)
def native_bf16(device_type: str) -> bool:
    """Whether this device computes bf16 products natively: CUDA, or a CPU with AVX512-BF16 or AMX.

    Without it (an AVX2-only CPU) a bf16 matmul falls back to a reference loop: measured 1.3 s for one 512 x 512
    product against 0.06 s in float32, so the bf16 compute path would be thousands of times slower there. oneDNN's
    own answer (`_is_mkldnn_bf16_supported`) is not enough: it is yes on any AVX-512 CPU, where it emulates bf16
    products with float32 instructions. On an Intel Xeon with AVX-512 but neither AVX512-BF16 nor AMX (2026-12-07)
    bf16 matmuls ran about 5x slower than float32 (docs/benchmarks.md), so the instruction sets themselves are asked
    too (torch's own CPU query, the flags /proc/cpuinfo shows).
    """
    if device_type == "cpu":
        return _cpu_computes_bf16()
    return device_type == "cuda"


@torch.compiler.assume_constant_result  # a fact about the machine: torch.compile bakes it in instead of breaking
def _cpu_computes_bf16() -> bool:  # the graph at an op that returns a bool
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(native and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Below this many positions (batch x heads x n) a causal forward without gradients takes the bf16 path on a CPU
# with native bf16 (see _bf16_compute); from it, the float32 path.
CPU_BF16_FORWARD_BELOW = 98304


def _bf16_compute(precision: str, *tensors: torch.Tensor, causal: bool = False, needs_grad: bool = False,
                  positions: int = 0) -> bool:
    """Whether the bf16 compute path applies: the values V (the last tensor) bf16, the features bf16 or float32, and
    ``precision`` "bfloat16", or "auto" where bf16 products are native (:func:`native_bf16`) and measured to pay
    (below). V's dtype is the compute dtype: under autocast or with bf16 weights V leaves its projection in bf16, while
    the feature maps return float32 features (their elu / exp computed in float32), which the bf16 path rounds to bf16.
    Keyed on every input being bf16, as it once was, the path was never reached from a model."""
    if precision not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"precision must be 'auto', 'float32' or 'bfloat16', got {precision!r}.")
    *features, values = tensors
    if (precision == "float32" or values.dtype != torch.bfloat16
            or not all(t.dtype in (torch.bfloat16, torch.float32) for t in features)):
        return False
    if precision == "bfloat16":
        return True
    # "auto": bf16 products where they are native and measured to pay. Without native bf16 (AVX2) a bf16 product is
    # a reference loop, thousands of times slower: the float32 path. On CUDA: the bf16 path (fla's kernel or the torch
    # forms). On a CPU with AVX512-BF16 (Zen 5 EPYC, `python scripts/bf16_kernel_check.py`, results/benchmarks/
    # bf16-kernel-zen5-2026-11-26-b and -b-long, H 12, d 64, batch 1): the causal bf16 path wins forward + backward at
    # every n measured (the default call 11.1 against 21.4 ms for the float32 path at n 1,024, 44.8 against 90.4 at
    # 4,096, 201 against 453 at 16,384, 2,010 against 2,481 at 65,536), so training takes it; the forward alone it
    # wins up to 4,096 (parallel C=64 4.3 / 16.3 ms against 5.6 / 21.1 at 1,024 / 4,096) and loses from 16,384 (the
    # best bf16 form 169 / 789 ms against 152 / 653 at 16,384 / 65,536: there its dtype conversions and float32
    # normaliser cost more than the bf16 products save), so a forward takes it below CPU_BF16_FORWARD_BELOW
    # positions (98,304: between 4,096 and 16,384 at 12 heads). The bidirectional form is unmeasured: float32.
    device = tensors[0].device.type
    if not native_bf16(device):
        return False
    return device != "cpu" or (causal and (needs_grad or positions < CPU_BF16_FORWARD_BELOW))


def _causal_bf16(phi_q, phi_k, v, key_mask, eps, c, state, form):
    """The bf16 compute path of :func:`causal_linear_attention` (call with autocast off).

    Numerator tril(phi(Q) phi(K)^T) V + phi(Q) S_0: bf16 products, float32 state and output. Normaliser
    phi(q_t) . (z_0 + sum_{j<=t} phi(k_j)) in float32: in the scan and prefix-sum forms a float32 prefix sum and dot
    product (:func:`_float32_normaliser`); in the parallel form the float32 row sums of the chunk's own bf16 scores
    (the very weights the numerator applies to the values) plus phi(q_t) . z before the chunk in float32
    (:func:`_chunkwise_parallel_bf16`); in the fla form fla's kernel accumulates it in float32 and writes it in bf16
    (:func:`_causal_fla`).
    """
    batch, heads, n, m = phi_q.shape
    d_v = v.shape[-1]
    phi_k, v = mask_keys(phi_k, v, key_mask)
    if state is None:
        s0 = phi_q.new_zeros(batch, heads, m, d_v, dtype=torch.float32)
        z0 = phi_q.new_zeros(batch, heads, 1, m, dtype=torch.float32)
    else:
        s0, z0 = state[0].float(), state[1].float().unsqueeze(2)
    if form == "fla":  # numerator and normaliser both from fla's kernel (see _causal_fla)
        y, final = _causal_fla(phi_q, phi_k, v, s0, z0.squeeze(2), eps)
        return y.to(v.dtype), final
    if form == "scan":
        numerator, s_n = _CausalLinearAttentionScan.apply(_flat(phi_q), _flat(phi_k), _flat(v), _flat(s0), c)
        numerator, s_n = numerator.view(batch, heads, n, d_v), s_n.view(batch, heads, m, d_v)
    elif form == "prefix-sum":
        numerator, s_n = _prefix_sum_form(phi_q, phi_k, v, s0)
    else:  # the parallel form computes its normaliser from its own scores (see _chunkwise_parallel_bf16)
        y, final = _chunkwise_parallel_bf16(phi_q, phi_k, v, s0, z0.squeeze(2), c, eps)
        return y.to(v.dtype), final
    normaliser, z_n = _float32_normaliser(phi_q, phi_k, z0.squeeze(2), c)
    normaliser += eps
    y = numerator / normaliser
    return y.to(v.dtype), (s_n, z_n)


def _float32_normaliser(phi_q, phi_k, z0, c: int):
    """phi(q_t) . (z_0 + sum_{j<=t} phi(k_j)) in float32 (B, H, n, 1), and z_n (B, H, m): a prefix sum in two levels.

    One torch.cumsum over the n axis is a sequential walk along the sequence per (batch, head, feature) column on a
    GPU: measured on an H200 at B 4, H 12, n 65,536, m 64, it took ~25 ms of a 31 ms call, against 4 ms for fla's
    whole kernel. Here the scans are short: inside chunks of C (parallel over every chunk) and over the n / C chunk
    sums, the latter along the last axis (the fast, block-parallel scan). The chunk prefix is an exclusive sum built
    directly, never an inclusive sum minus the chunk's own (which would cancel when one chunk dwarfs the earlier ones).
    """
    batch, heads, n, m = phi_q.shape
    if c is None:  # torch.export's prefix-sum form: shapes linear in n, no chunk count (see causal_linear_attention)
        z_t = torch.cumsum(phi_k.float(), dim=2) + z0.float().unsqueeze(2)
        return (phi_q.float() * z_t).sum(-1, keepdim=True), z_t[:, :, -1]
    if n == 0:
        return phi_q.new_zeros(batch, heads, 0, 1, dtype=torch.float32), z0.float()
    padded = -n % c
    q, k = phi_q, phi_k
    if padded:  # zero keys add nothing; the padded query rows are dropped at the end
        q, k = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (q, k))
    chunks = (n + padded) // c
    q_c, k_c = q.view(batch, heads, chunks, c, m), k.view(batch, heads, chunks, c, m)
    # float32 from here on without a float32 copy of q or k: cumsum upcasts as it reads (dtype=float32), and the
    # bf16 x float32 product below computes in float32; each copy saved is a pass over the (B, H, n, m) features
    within = torch.cumsum(k_c, dim=3, dtype=torch.float32)  # (B, H, N, C, m): prefix sums inside each chunk
    totals = within[:, :, :, -1]  # (B, H, N, m)
    before = torch.cat([z0.float().unsqueeze(2), totals[:, :, :-1]], dim=2)  # z_0, then each chunk's own sum
    before = torch.cumsum(before.transpose(2, 3).contiguous(), dim=3).transpose(2, 3)  # what precedes each chunk
    z_n = before[:, :, -1] + totals[:, :, -1]  # before the in-place add below, which changes totals (a view)
    within += before.unsqueeze(3)  # in place: the inclusive prefix z_t of every position
    normaliser = (q_c * within).sum(-1)  # (B, H, N, C), in float32
    return normaliser.reshape(batch, heads, -1)[:, :, :n, None], z_n


@functools.lru_cache(maxsize=None)
def fla_chunk_kernel(device_type: str):
    """flash-linear-attention's Triton chunk kernel (``fla.ops.linear_attn.chunk_linear_attn``) where it can run
    here (CUDA, the package installed: the optional ``fla`` extra), else None. ``HF_LINEAR_ATTN_FLA=0`` turns it off.

    Transformers picks kernels the same way (a Hub kernel, then an installed package, then its torch reference):
    the torch forms stay the fallback everywhere and the reference the tests compare fla with.
    """
    import os

    if device_type != "cuda" or os.environ.get("HF_LINEAR_ATTN_FLA", "1") == "0":
        return None
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception:  # not installed, or no Triton / no usable GPU: the torch forms run instead
        return None
    return chunk_linear_attn


# The width of the block of ones whose fla "numerator" is the normaliser (fla's smallest value tile is 16 wide).
FLA_ONES_WIDTH = 16


def _causal_fla(phi_q, phi_k, v, s0, z0, eps):
    """The bf16 path by fla's Triton chunk kernel: y (B, H, n, d_v) in float32 (a transposed view) and the final
    (S_n, z_n) in float32, the same function as the torch forms of the bf16 path.

    Two calls of ``chunk_linear_attn``, without its own normalisation (``normalize=False``: it sums the keys in bf16)
    and with ``scale=1`` (phi(Q), phi(K) are already features; pads already zeroed in phi(K) and V by the caller, so
    fla's own masking, which covers only V, is not relied on):
    - the numerator tril(phi(Q) phi(K)^T) V + phi(Q) S_0, with S_n;
    - the normaliser phi(q_t) . (z_0 + sum_{j<=t} phi(k_j)), which is the numerator of a block of ones started from
      z_0, with z_n as its final state.
    fla accumulates both in float32 and writes each in bf16; the division is in float32. Measured on an
    H100 (results/benchmarks/gpu-h100-2026-11-27, n 4,096 and B 4, H 12, d 64): error against float64 2.55e-3, against
    2.65e-3 for the float32 normaliser in torch that this replaced (elementwise passes over the features and a prefix
    sum around one call: 0.99-1.89x the time of fla's own call over n 4,096-65,536, against 0.72-1.54x for two calls).
    """
    kernel = fla_chunk_kernel(phi_q.device.type)
    # fla takes (B, T, H, K): the head axis after the sequence
    q, k, val = (t.transpose(1, 2).contiguous() for t in (phi_q, phi_k, v))
    numerator, s_n = kernel(q, k, val, scale=1.0, initial_state=s0.float().contiguous(), output_final_state=True,
                            normalize=False)
    ones = val.new_ones(*val.shape[:-1], FLA_ONES_WIDTH)
    z_start = z0.float().unsqueeze(-1).expand(*z0.shape, FLA_ONES_WIDTH).contiguous()  # (B, H, m, 16)
    normaliser, z_n = kernel(q, k, ones, scale=1.0, initial_state=z_start, output_final_state=True, normalize=False)
    y = numerator / (normaliser[..., :1].float() + eps)  # bf16 / float32: divided in float32 as it is read
    return y.transpose(1, 2), (s_n.float(), z_n[..., 0].float())


def _chunkwise_parallel(q, k, v, state, c: int):
    """The same product as the scan with all chunks at once: O = tril(Q K^T) V + Q S_0, S_n (autograd's backward).

    bf16 q, k, v: bf16 products; the per-chunk states are summed in float32 and the output is float32.
    """
    batch, heads, n, _ = q.shape
    d = v.shape[-1]
    low = q.dtype != torch.float32
    padded = -n % c
    if padded:  # zero keys and values add nothing; the padded query rows are dropped at the end
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (q, k, v))
    chunks = (n + padded) // c
    q_c, k_c, v_c = (t.reshape(batch, heads, chunks, c, t.shape[-1]) for t in (q, k, v))
    scores = torch.matmul(q_c, k_c.transpose(-1, -2)).tril()  # (B, H, N, C, C), causal inside the chunk
    chunk_kv = torch.matmul(k_c.transpose(-1, -2), v_c).float()  # (B, H, N, m, d): one state per chunk
    kv_before = exclusive_chunk_prefix(state.float(), chunk_kv)  # the state before each chunk
    if low:
        out = torch.matmul(scores, v_c).float() + torch.matmul(q_c, kv_before.to(q.dtype)).float()
    else:
        out = torch.matmul(scores, v_c) + torch.matmul(q_c, kv_before)
    return out.reshape(batch, heads, n + padded, d)[:, :, :n], kv_before[:, :, -1] + chunk_kv[:, :, -1]


def _chunkwise_parallel_bf16(q, k, v, s0, z0, c: int, eps: float):
    """The bf16 path's parallel form: outputs (numerator / normaliser) of every position, all chunks at once.

    bf16 q, k, v (B, H, n, m / d); float32 s0 (B, H, m, d), z0 (B, H, m). Returns y (B, H, n, d) in float32 and the
    final (S, z) in float32; gradients by :class:`_ChunkwiseParallelBF16`'s hand-written backward.

    The normaliser inside a chunk is the float32 row sum of the chunk's bf16 scores tril(phi(Q) phi(K)^T): the same
    rounded weights the numerator applies to the values, so numerator and normaliser weigh every key alike (the output
    is a weighted average of the values with weights off by bf16 rounding; measured against float64 at n 4,096, H 12,
    d 64: relative error 2.5e-3 forward, where a separate float32 prefix sum of phi(K) gave 2.7e-3). Across chunks:
    phi(q_t) . z before the chunk, a float32 product. No prefix sum over the n axis: a float32 cumsum over every
    position and its backward (flip, cumsum, flip) were about a fifth of a CPU forward + backward at n 4,096.
    """
    batch, heads, n, m = q.shape
    d = v.shape[-1]
    padded = -n % c
    if padded:  # zero keys and values add nothing; the padded query rows are dropped at the end
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (q, k, v))
    chunks = (n + padded) // c
    q_c, k_c, v_c = (t.reshape(batch, heads, chunks, c, t.shape[-1]) for t in (q, k, v))
    y, s_n, z_n = _ChunkwiseParallelBF16.apply(q_c, k_c, v_c, s0.float(), z0.float(), eps)
    return y.reshape(batch, heads, n + padded, d)[:, :, :n], (s_n, z_n)


class _ChunkwiseParallelBF16(torch.autograd.Function):
    """y = (tril(Q K^T) V + Q S_before) / (rowsum tril(Q K^T) + Q . z_before + eps) per chunk, and (S_n, z_n).

    Inputs in chunks (B, H, N, C, .): bf16 Q, K, V; float32 S_0, z_0. Every product is a bf16 product; the states,
    the normaliser and y are float32. The backward is written out, because autograd's spent much of a CPU call in
    dtype conversions and in accumulating the gradients of Q and K from three uses each (``python
    scripts/bf16_kernel_check.py --profile`` shows where the time goes). The gradients of Q, K and V are returned in
    bf16, so their two bf16 products are added in bf16, not converted to float32 and back. With A = tril(Q K^T),
    V1 = [V, 1] and
    [S_before, z_before] (m, d + 1), the numerator and the normaliser are one product A V1 + Q [S, z]_before, so the
    gradient of both is one (C, d + 1) matrix G1 = [dy / den, -(dy / den) . y]:

    dA = tril(G1 V1^T);  dQ = dA K + G1 [S, z]_before^T;  dK = dA^T Q + V1 d[S, z]_chunk^T;  dV = A^T G + K dS_chunk,
    with d[S, z]_before = Q^T G1 per chunk and d[S, z]_chunk (what a chunk's own state receives) the sum of those of
    every later chunk and of the final state's gradient; dS_0, dz_0 the sum over every chunk and the final state.
    """

    @staticmethod
    def forward(ctx, q_c, k_c, v_c, s0, z0, eps):
        scores = torch.matmul(q_c, k_c.transpose(-1, -2)).tril_()  # (B, H, N, C, C) bf16, causal inside the chunk
        chunk_kv = torch.matmul(k_c.transpose(-1, -2), v_c).float()  # (B, H, N, m, d): one state per chunk
        kv_before = exclusive_chunk_prefix(s0, chunk_kv)
        chunk_z = k_c.float().sum(3)  # (B, H, N, m): float32 sums of the chunk's keys
        z_before = exclusive_chunk_prefix(z0, chunk_z)
        kv_before_low = kv_before.to(q_c.dtype)
        numerator = torch.matmul(scores, v_c).float().add_(torch.matmul(q_c, kv_before_low).float())
        normaliser = scores.float().sum(-1, keepdim=True)
        normaliser.add_(torch.matmul(q_c.float(), z_before.unsqueeze(-1))).add_(eps)
        y = numerator.div_(normaliser)
        if any(ctx.needs_input_grad):
            before = torch.cat([kv_before_low, z_before.unsqueeze(-1).to(q_c.dtype)], dim=-1)  # [S, z]_before
            ctx.save_for_backward(q_c, k_c, v_c, scores, before, normaliser, y)
        return y, kv_before[:, :, -1] + chunk_kv[:, :, -1], z_before[:, :, -1] + chunk_z[:, :, -1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_y, d_s_n, d_z_n):
        q_c, k_c, v_c, scores, before, normaliser, y = ctx.saved_tensors
        low, d = q_c.dtype, v_c.shape[-1]  # unused outputs' gradients arrive as zeros (materialised), never None
        d_numerator = d_y / normaliser
        d_normaliser = -(d_numerator * y).sum(-1, keepdim=True)
        g1 = torch.cat([d_numerator, d_normaliser], dim=-1).to(low)  # (B, H, N, C, d + 1)
        v1 = torch.cat([v_c, v_c.new_ones(*v_c.shape[:-1], 1)], dim=-1)
        d_scores = torch.matmul(g1, v1.transpose(-1, -2)).tril_()
        d_q = torch.matmul(d_scores, k_c).add_(torch.matmul(g1, before.transpose(-1, -2)))
        d_k = torch.matmul(d_scores.transpose(-1, -2), q_c)
        d_v = torch.matmul(scores.transpose(-1, -2), g1[..., :d])
        d_before = torch.matmul(q_c.transpose(-1, -2), g1).float()  # (B, H, N, m, d + 1)
        d_final = torch.cat([d_s_n.float(), d_z_n.float().unsqueeze(-1)], dim=-1)
        d_chunk, d_first = exclusive_chunk_suffix(d_before, d_final)
        d_chunk_low = d_chunk.to(low)
        d_k.add_(torch.matmul(v1, d_chunk_low.transpose(-1, -2)))
        d_v.add_(torch.matmul(k_c, d_chunk_low[..., :d]))
        return d_q, d_k, d_v, d_first[..., :d], d_first[..., d], None


class _ExclusivePrefixSum(torch.autograd.Function):
    """out[:, :, 0] = x_0, out[:, :, i] = x_0 + sum_{j<i} x[:, :, j] along dim 2, by a loop of in-place adds.

    Why not torch.cumsum: on a CPU it walked about 2 GB/s here (6.2 ms for 12 heads x 64 chunks x a 64 x 64 float32
    state, 2-core Zen 5), and its backward adds two flips; this loop of N adds of one chunk state each runs at memory
    speed. Summed in order, so the result equals the cumsum's.
    """

    @staticmethod
    def forward(ctx, x0, x):
        out = torch.empty_like(x)
        out[:, :, 0] = x0
        for i in range(1, x.shape[2]):
            torch.add(out[:, :, i - 1], x[:, :, i - 1], out=out[:, :, i])
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        # d x_j = sum_{i > j} grad_i (an exclusive suffix sum); d x_0 = sum_i grad_i
        grad = grad.contiguous()
        d_x, d_x0 = exclusive_chunk_suffix(grad, grad.new_zeros(grad[:, :, 0].shape))
        return d_x0, d_x


def exclusive_chunk_prefix(x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What precedes each chunk: x_0, x_0 + x_1, ... along dim 2 of x (B, H, N, ...), x0 (B, H, ...), both float32.

    Summed directly, never an inclusive sum minus the chunk's own term (which would cancel catastrophically when one
    chunk dwarfs the ones before it). A loop of adds on a CPU (:class:`_ExclusivePrefixSum`); on other devices, where
    every add is a kernel launch, one cumsum.
    """
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _ExclusivePrefixSum.apply(x0, x)
    return torch.cumsum(torch.cat([x0.unsqueeze(2), x[:, :, :-1]], dim=2), dim=2)


def exclusive_chunk_suffix(g: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`exclusive_chunk_prefix` with a final total: for g (B, H, N, ...) and final (B, H, ...),
    out[:, :, j] = final + sum_{i > j} g[:, :, i] (what chunk j's own term receives) and final + sum_i g[:, :, i]
    (what x_0 receives). A loop of adds on a CPU (no torch.cumsum, see :class:`_ExclusivePrefixSum`), flipped cumsums
    elsewhere."""
    if g.device.type == "cpu" and not torch.compiler.is_compiling():
        out = torch.empty_like(g)
        last = g.shape[2] - 1
        out[:, :, last] = final
        for i in range(last - 1, -1, -1):
            torch.add(out[:, :, i + 1], g[:, :, i + 1], out=out[:, :, i])
        return out, out[:, :, 0] + g[:, :, 0]
    later = torch.cat([g[:, :, 1:], torch.zeros_like(g[:, :, :1])], dim=2)
    out = torch.cumsum(later.flip(2), dim=2).flip(2) + final.unsqueeze(2)
    return out, out[:, :, 0] + g[:, :, 0]


def _prefix_sum_form(q, k, v, state):
    """The same product in float32 with every position's state at once: S_t = S_0 + cumsum_j k_j^T v_j (B, H, n, m, d),
    O_t = q_t S_t; returns O and S_n. The form torch.export takes (see :func:`causal_linear_attention`).

    Its shapes are n or fixed, with no chunk count, padding or slicing to a multiple of C, so an exported program
    holds for every n. The cost: the per-position states, O(n m d) memory where the chunked forms hold O(n C + m d)
    per chunk (m = d = 64: 16 kB per position and head, 200 MB for 12 heads at n = 1,024, freed after the layer).
    """
    states = state.float().unsqueeze(2) + torch.cumsum(k.float().unsqueeze(-1) * v.float().unsqueeze(-2), dim=2)
    out = (q.float().unsqueeze(-1) * states).sum(-2)  # q_t S_t as a broadcast product: no batched matmul over n
    return out, states[:, :, -1]


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
        # S + phi(k) v^T in one pass over S (addcmul: no (B, H, m, d_v) temporary for the outer product, and exact
        # float32 on every device, where a K = 1 batched matmul could run in TF32 on CUDA). At a large batch the step
        # is a pass over the state, so passes are what it costs (an H200 at batch 65,536: 34 GB of state a step).
        s = torch.addcmul(state[0], phi_k.transpose(-1, -2), v)  # (B, H, m, d_v)
        z = state[1] + phi_k.squeeze(-2)
        numerator = _query_state_product(phi_q, s)  # phi(q) S: (B, H, 1, d_v)
        y = numerator / ((phi_q.squeeze(-2) * z).sum(-1)[..., None, None] + eps)
        return y.to(out_dtype), (s, z)


def _query_state_product(phi_q: torch.Tensor, s: torch.Tensor, by_matmul: bool | None = None) -> torch.Tensor:
    """phi(q) S for one token, (B, H, 1, m) x (B, H, m, d_v) -> (B, H, 1, d_v), in float32.

    On CPUs a broadcast product and sum: batched matmuls with a dimension of 1 hit slow paths there (measured up to
    8 ms for a 1 x 32 by 32 x 32 product per head, against microseconds). Elsewhere a batched matmul, which reads S
    once instead of writing and reading a (B, H, m, d_v) temporary. ``by_matmul`` forces either (the tests run both).
    """
    if by_matmul is None:
        by_matmul = phi_q.device.type != "cpu"
    if not by_matmul:
        return (phi_q.transpose(-1, -2) * s).sum(-2, keepdim=True)
    return torch.matmul(phi_q, s)
