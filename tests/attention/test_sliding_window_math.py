"""Sliding-window + linear attention: the chunked causal and banded forms, the decoding step and the weights,
against a float64 reference written out query by query (independent of the module's masks and stabiliser)."""

import pytest
import torch
from helpers import normal, uniform

from hf_linear_attn.feature_maps import build_feature_map
from hf_linear_attn.sliding_window_attention import (
    advance_sliding_window_state,
    banded_sliding_window_attention,
    causal_sliding_window_attention,
    empty_sliding_window_state,
    sliding_window_attention_step,
    sliding_window_attention_weights,
)


pytestmark = pytest.mark.usefixtures("on_each_device")  # every test here on the CPU and on CUDA


def reference(q, k, v, phi_q, phi_k, window, causal, key_mask=None, theta=None, eps=1e-6):
    """y_i = (sum_win g exp(q.k / sqrt d) v + sum_out phi(q).phi(k) v) / (same sums without v + eps), in float64,
    one query at a time, no stabiliser (the inputs are small enough)."""
    q, k, v, phi_q, phi_k = (t.double() for t in (q, k, v, phi_q, phi_k))
    batch, heads, n, d = q.shape
    out = torch.zeros(batch, heads, n, v.shape[-1], dtype=torch.float64)
    rows = []
    for b in range(batch):
        for h in range(heads):
            g = 1.0 if theta is None else torch.exp(theta[h].double())
            per_query = []
            for i in range(n):
                terms = []
                for j in range(n):
                    if key_mask is not None and not key_mask[b, j]:
                        terms.append(torch.zeros((), dtype=torch.float64))
                        continue
                    distance = i - j if causal else abs(i - j)
                    if distance < 0:
                        terms.append(torch.zeros((), dtype=torch.float64))
                    elif distance < window:
                        terms.append(g * torch.exp(q[b, h, i] @ k[b, h, j] / d**0.5))
                    else:
                        terms.append(phi_q[b, h, i] @ phi_k[b, h, j])
                w = torch.stack(terms)
                per_query.append(w / (w.sum() + eps))
            rows.append(torch.stack(per_query))
    weights = torch.stack(rows).view(batch, heads, n, n)
    out = weights @ v
    return out, weights


def inputs(n, batch=2, heads=3, d=8, seed=0, scale=1.0):
    """The same numbers on every device (a CPU generator; CUDA's own draws other numbers from the same seed)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (normal(g, batch, heads, n, d) * scale for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("n, window, chunk", [(37, 5, 8), (32, 8, 8), (40, 17, 8), (9, 64, 4), (1, 3, 4), (25, 1, 8)])
@pytest.mark.parametrize("name", ["elu", "hedgehog"])
def test_causal_chunked_form_against_float64_reference_values_and_gradients(n, window, chunk, name):
    torch.manual_seed(0)
    feature_map = build_feature_map(name, 3, 8, causal=True)
    q, k, v = inputs(n)
    theta = torch.randn(3) * 0.5
    leaves = (q, k, v, theta)
    for t in leaves:
        t.requires_grad_(True)
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    out, _ = causal_sliding_window_attention(q, k, v, phi_q, phi_k, window, log_factor=theta, chunk_size=chunk)
    ref, _ = reference(q, k, v, phi_q, phi_k, window, True, theta=theta)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    want = torch.autograd.grad(ref, leaves, grad.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n, window, chunk", [(37, 5, 8), (33, 9, 8), (20, 64, 8), (12, 1, 4)])
def test_banded_form_against_float64_reference_with_padding(n, window, chunk):
    feature_map = build_feature_map("elu", 3, 8)
    q, k, v = inputs(n, seed=1)
    key_mask = torch.ones(2, n, dtype=torch.bool)
    key_mask[1, n - n // 3 :] = False  # right padding in row 1
    for t in (q, k, v):
        t.requires_grad_(True)
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    out = banded_sliding_window_attention(q, k, v, phi_q, phi_k, window, key_mask, chunk_size=chunk)
    ref, weights = reference(q, k, v, phi_q, phi_k, window, False, key_mask=key_mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), torch.autograd.grad(ref, (q, k, v), grad.double())):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-4)
    got = sliding_window_attention_weights(q, k, phi_q, phi_k, window, key_mask, causal=False)
    torch.testing.assert_close(got.double(), weights, atol=1e-6, rtol=1e-5)


def test_left_padding_and_pad_keys_that_are_nan_leave_real_rows_exact():
    """Pads are removed after the feature map with torch.where: a NaN pad key changes nothing, and a left-padded
    row equals the same row alone."""
    feature_map = build_feature_map("elu", 3, 8, causal=True)
    q, k, v = inputs(20, seed=2)
    key_mask = torch.ones(2, 20, dtype=torch.bool)
    key_mask[1, :7] = False
    k[1, :, :7] = float("nan")
    v[1, :, :7] = float("nan")
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    out, state = causal_sliding_window_attention(q, k, v, phi_q, phi_k, 6, key_mask, chunk_size=8)
    alone, alone_state = causal_sliding_window_attention(
        q[1:, :, 7:], k[1:, :, 7:], v[1:, :, 7:], phi_q[1:, :, 7:], phi_k[1:, :, 7:], 6, chunk_size=8
    )
    torch.testing.assert_close(out[1:, :, 7:], alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state[0][1:], alone_state[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out[0]).all()


@pytest.mark.parametrize("window, prompt", [(5, 13), (5, 3), (8, 8), (1, 6)])
def test_prefill_then_steps_then_prefill_again_equal_one_full_pass(window, prompt):
    """Prompt through the chunked form, then single-token steps, then a few tokens at once from the state: every
    output and the final state equal one pass over the whole sequence."""
    feature_map = build_feature_map("elu", 3, 8, causal=True)
    n = prompt + 9
    q, k, v = inputs(n, seed=3)
    key_mask = torch.ones(2, n, dtype=torch.bool)
    key_mask[0, :2] = False  # left padding
    theta = torch.tensor([0.3, -0.2, 1.0])
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    full, full_state = causal_sliding_window_attention(q, k, v, phi_q, phi_k, window, key_mask, theta, chunk_size=4)
    pieces = []
    out, state = causal_sliding_window_attention(
        q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], phi_q[:, :, :prompt], phi_k[:, :, :prompt], window,
        key_mask[:, :prompt], theta, chunk_size=4,
    )
    pieces.append(out)
    for t in range(prompt, prompt + 5):
        sl = slice(t, t + 1)
        out, state = sliding_window_attention_step(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], phi_q[:, :, sl], phi_k[:, :, sl], state, key_mask[:, sl], theta
        )
        pieces.append(out)
    sl = slice(prompt + 5, n)
    out, state = causal_sliding_window_attention(
        q[:, :, sl], k[:, :, sl], v[:, :, sl], phi_q[:, :, sl], phi_k[:, :, sl], window, key_mask[:, sl], theta,
        chunk_size=4, state=state,
    )
    pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=2), full, atol=1e-5, rtol=1e-5)
    for got, want in zip(state, full_state):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_steps_from_the_empty_state_equal_the_chunked_form():
    feature_map = build_feature_map("relu", 3, 8, causal=True)
    q, k, v = inputs(11, seed=4)
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    full, _ = causal_sliding_window_attention(q, k, v, phi_q, phi_k, 4, chunk_size=8)
    state = empty_sliding_window_state(2, 3, 4, 8, 8, 8)
    steps = []
    for t in range(11):
        sl = slice(t, t + 1)
        out, state = sliding_window_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], phi_q[:, :, sl], phi_k[:, :, sl], state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=2), full, atol=1e-5, rtol=1e-5)


def state_after_prefix(n, seed, padded_row, pads, window, prefix):
    """Causal elu-feature inputs of n tokens, row ``padded_row`` left-padded by ``pads``, run through the chunked form
    for their first ``prefix`` tokens: that decoding state, the rest's (q, k, v, phi_q, phi_k) and the rest's mask."""
    feature_map = build_feature_map("elu", 3, 8, causal=True)
    q, k, v = inputs(n, seed=seed)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[padded_row, :pads] = False
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    tensors = (q, k, v, phi_q, phi_k)
    _, state = causal_sliding_window_attention(*(t[:, :, :prefix] for t in tensors), window, mask[:, :prefix])
    return state, [t[:, :, prefix:] for t in tensors], mask[:, prefix:]


def test_advancing_a_state_equals_running_the_tokens():
    """The rollback replay (state + recorded keys / values, no outputs) gives the state the forward gives."""
    state, rest, mask = state_after_prefix(15, seed=5, padded_row=1, pads=4, window=5, prefix=6)
    _, want = causal_sliding_window_attention(*rest, 5, mask, state=state)
    _, k, v, _, phi_k = rest
    keep = mask[:, None, :, None]
    got = advance_sliding_window_state(state, k, torch.where(keep, phi_k, 0.0), torch.where(keep, v, 0.0), mask)
    for g, w in zip(got, want):
        if g.dtype == torch.bool:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g[..., :], w, atol=1e-5, rtol=1e-5)


def test_window_covering_the_sequence_is_softmax_attention_and_large_scores_do_not_overflow():
    """With W >= n, g = 1 and eps = 0 every term is exact: softmax attention. Scores of several hundred either way
    (exp overflows float32 at 89, underflows below -104) stay exact thanks to the stabiliser, which cancels. (With
    the default eps a row whose every score is about -300 gives ~0, as the formula with eps says.)"""
    feature_map = build_feature_map("elu", 3, 8, causal=True)
    q, k, v = inputs(24, seed=6, scale=8.0)
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    out, _ = causal_sliding_window_attention(q, k, v, phi_q, phi_k, 24, chunk_size=8, eps=0.0)
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert (q @ k.transpose(-1, -2)).abs().max() / 8**0.5 > 200
    # float32 scores of ~300 carry ~2e-5 absolute error, so the weights ~2e-5 relative
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=1e-4)


def test_stabiliser_cancels_against_the_unstabilised_formula_with_a_large_window_score():
    """One window score far above the feature-map terms: the output is the plain formula (computed in float64
    without any stabiliser), not LoLCATs' rescaled one."""
    feature_map = build_feature_map("elu", 1, 4, causal=True)
    q = torch.zeros(1, 1, 6, 4, dtype=torch.float64)
    k = torch.zeros(1, 1, 6, 4, dtype=torch.float64)
    q[..., -1, 0] = 6.0
    k[..., -1, 0] = 6.0  # the last key: score 36 / 2 = 18 with itself
    v = torch.arange(24, dtype=torch.float64).view(1, 1, 6, 4)
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    out, _ = causal_sliding_window_attention(q.float(), k.float(), v.float(), phi_q, phi_k, 2, chunk_size=4)
    ref, _ = reference(q, k, v, phi_q, phi_k, 2, True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-6)


def test_bf16_inputs_accumulate_in_float32_and_return_bf16():
    feature_map = build_feature_map("elu", 3, 8, causal=True)
    q, k, v = inputs(40, seed=7)
    phi_q, phi_k = feature_map(q, True), feature_map(k, False)
    ref, _ = reference(q, k, v, phi_q, phi_k, 6, True)
    out, state = causal_sliding_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), phi_q, phi_k, 6, chunk_size=8)
    assert out.dtype == torch.bfloat16 and state[0].dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_windows_are_refused(bad):
    q, k, v = inputs(4)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        causal_sliding_window_attention(q, k, v, q, k, bad)


def test_quadratic_form_taken_under_export_equals_the_chunked_form_with_a_state():
    from hf_linear_attn.sliding_window_attention import _causal_forward

    state, rest, mask = state_after_prefix(19, seed=8, padded_row=0, pads=3, window=6, prefix=9)
    chunked = _causal_forward(*rest, 6, mask, None, 1e-6, 4, state, quadratic=False)
    quadratic = _causal_forward(*rest, 6, mask, None, 1e-6, 4, state, quadratic=True)
    torch.testing.assert_close(quadratic[0], chunked[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(quadratic[1], chunked[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "causal, window, chunk, far",
    [(True, 3, 4, False), (True, 4, 4, True), (True, 9, 4, True), (True, 1, 4, False), (True, 20, 4, True),
     (False, 4, 4, False), (False, 6, 4, False), (False, 1, 4, False)],
)
def test_written_out_backward_passes_gradcheck_in_float64(causal, window, chunk, far):
    """The chunked form's hand-written backward against finite differences: every input, the factor theta and the
    state from before position 0, with pads (left pads in row 1, a last chunk cut short) and windows shorter than,
    equal to and longer than a chunk."""
    from hf_linear_attn.sliding_window_attention import _chunked_form

    gen = torch.Generator().manual_seed(9)
    batch, heads, n, d, m = 2, 2, 13, 3, 4
    q, k, v = (normal(gen, batch, heads, n, d, dtype=torch.float64) for _ in range(3))
    phi_q, phi_k = (uniform(gen, batch, heads, n, m, dtype=torch.float64) + 0.1 for _ in range(2))
    theta = normal(gen, heads, dtype=torch.float64)
    far_state = uniform(gen, batch, heads, m, d + 1, dtype=torch.float64)
    valid = torch.ones(batch, n, dtype=torch.bool)
    valid[1, :3] = False
    keep = valid[:, None, :, None]

    def form(q, k, v, phi_q, phi_k, theta, far_state):
        v, phi_k = torch.where(keep, v, 0.0), torch.where(keep, phi_k, 0.0)
        far_state = far_state if far else None
        return _chunked_form(q, k, v, phi_q, phi_k, valid, window, causal, theta, 1e-6, chunk, far_state)

    leaves = [t.requires_grad_() for t in (q, k, v, phi_q, phi_k, theta, far_state)]
    assert torch.autograd.gradcheck(form, leaves)
