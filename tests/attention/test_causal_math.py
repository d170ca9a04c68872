"""Causal linear attention: chunked (scan and parallel) and recurrent forms against the quadratic masked form."""

import pytest
import torch
from helpers import qkv

from hf_linear_attn.feature_maps import build_feature_map
from hf_linear_attn.linear_attention import causal_linear_attention, recurrent_linear_attention_step


def causal_quadratic_reference(phi_q, phi_k, v, eps):
    """(phi(Q) phi(K)^T * tril) V, normalised by its row sums + eps, in float64."""
    a = torch.einsum("bhim,bhjm->bhij", phi_q.double(), phi_k.double()).tril()
    return (a @ v.double()) / (a.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("n, chunk", [(32, 8), (37, 8), (5, 8), (64, 64), (1, 4)])
@pytest.mark.parametrize("name", ["elu", "favor", "hedgehog"])
@pytest.mark.parametrize("form", ["scan", "parallel"])
def test_chunked_equals_quadratic_masked_form_values_and_gradients(n, chunk, name, form):
    torch.manual_seed(0)
    feature_map = build_feature_map(name, 3, 8, num_random_features=16, causal=True)
    q, k, v = qkv(n=n)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, (s, z) = causal_linear_attention(feature_map(q, True), feature_map(k, False), v, chunk_size=chunk, form=form)
    ref = causal_quadratic_reference(feature_map(q, True), feature_map(k, False), v, 1e-6)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-4)
    phi_k = feature_map(k, False).double()
    torch.testing.assert_close(s.double(), phi_k.transpose(-1, -2) @ v.double(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(z.double(), phi_k.sum(-2), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("form", ["scan", "parallel"])
def test_gradients_through_the_initial_and_final_state(form):
    """Continuing from a state (S_0, z_0) with a loss on both the outputs and the final state: every gradient,
    state ones included, equals autograd through the explicit per-position sums in float64."""
    torch.manual_seed(1)
    phi = build_feature_map("elu", 3, 8)
    q, k, v = qkv(n=21)
    s0 = torch.rand(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    z0 = torch.rand(2, 3, 8, dtype=torch.float64, requires_grad=True)
    leaves = (q, k, v, s0, z0)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, (s, z) = causal_linear_attention(phi(q, True), phi(k, False), v, chunk_size=8, state=(s0, z0), form=form)
    phi_q, phi_k, vd = phi(q, True).double(), phi(k, False).double(), v.double()
    s_t = s0.unsqueeze(2) + torch.cumsum(phi_k.unsqueeze(-1) * vd.unsqueeze(-2), dim=2)  # (B, H, n, m, d)
    z_t = z0.unsqueeze(2) + torch.cumsum(phi_k, dim=2)
    ref = torch.einsum("bhnm,bhnmd->bhnd", phi_q, s_t) / ((phi_q * z_t).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    g_out, g_s, g_z = torch.randn_like(out), torch.randn_like(s), torch.randn_like(z)
    got = torch.autograd.grad((out * g_out).sum() + (s * g_s).sum() + (z * g_z).sum(), leaves)
    loss = (ref * g_out.double()).sum() + (s_t[:, :, -1] * g_s.double()).sum() + (z_t[:, :, -1] * g_z.double()).sum()
    want = torch.autograd.grad(loss, leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-4)


def test_scan_and_parallel_forms_agree_at_length():
    phi = build_feature_map("elu", 4, 16)
    q, k, v = qkv(b=1, h=4, n=1000, d=16)
    scan, (s1, z1) = causal_linear_attention(phi(q, True), phi(k, False), v, chunk_size=64, form="scan")
    par, (s2, z2) = causal_linear_attention(phi(q, True), phi(k, False), v, chunk_size=64, form="parallel")
    torch.testing.assert_close(scan, par, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s2, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(z1, z2, atol=1e-3, rtol=1e-5)
    with pytest.raises(ValueError, match="form must be"):
        causal_linear_attention(phi(q, True), phi(k, False), v, form="fast")


@pytest.mark.parametrize("form", ["scan", "parallel"])
def test_a_huge_key_late_in_a_chunk_leaves_the_earlier_rows_of_the_chunk_exact(form):
    """Positive features span many decades (FAVOR's unstabilised causal keys): one key 1e9 times the others. The
    rows before it in its chunk must still see the earlier chunks' state exactly (an inclusive prefix sum minus the
    chunk's own state cancels it away in float32)."""
    torch.manual_seed(2)
    phi_q, phi_k, v = torch.rand(1, 1, 16, 4), torch.rand(1, 1, 16, 4), torch.randn(1, 1, 16, 3)
    phi_k[:, :, 14] *= 1e9
    out, (s, z) = causal_linear_attention(phi_q, phi_k, v, chunk_size=4, form=form)
    ref = causal_quadratic_reference(phi_q, phi_k, v, 1e-6)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(z.double(), phi_k.double().sum(-2), atol=0, rtol=1e-5)


def test_future_tokens_do_not_change_earlier_outputs():
    feature_map = build_feature_map("favor", 3, 8, num_random_features=16, causal=True)
    q, k, v = qkv(n=40)
    out, _ = causal_linear_attention(feature_map(q, True), feature_map(k, False), v, chunk_size=16)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[:, :, 21:] = 5 * torch.randn_like(t[:, :, 21:])
    out2, _ = causal_linear_attention(feature_map(q2, True), feature_map(k2, False), v2, chunk_size=16)
    torch.testing.assert_close(out2[:, :, :21], out[:, :, :21], atol=1e-6, rtol=1e-6)  # rounding only
    assert not torch.allclose(out2[:, :, 21:], out[:, :, 21:])


def test_prefill_then_recurrent_steps_equal_one_full_pass():
    phi = build_feature_map("elu", 3, 8)
    q, k, v = qkv(n=30)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row
    full, final = causal_linear_attention(phi(q, True), phi(k, False), v, key_mask=mask, chunk_size=8)
    prefix, state = causal_linear_attention(phi(q[:, :, :17], True), phi(k[:, :, :17], False), v[:, :, :17],
                                            key_mask=mask[:, :17], chunk_size=8)
    steps = [prefix]
    for t in range(17, 30):
        y, state = recurrent_linear_attention_step(phi(q[:, :, t:t + 1], True), phi(k[:, :, t:t + 1], False),
                                                   v[:, :, t:t + 1], state, key_mask=mask[:, t:t + 1])
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=2), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], final[0], atol=1e-4, rtol=1e-5)
    # the left-padded row equals the same row without its pads
    alone, _ = causal_linear_attention(phi(q[1:, :, 4:], True), phi(k[1:, :, 4:], False), v[1:, :, 4:], chunk_size=8)
    torch.testing.assert_close(full[1:, :, 4:], alone, atol=1e-5, rtol=1e-5)


def test_causal_form_accumulates_in_float32_under_bf16():
    phi = build_feature_map("elu", 2, 16)
    q, k, v = qkv(b=1, h=2, n=2048, d=16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, (s, z) = causal_linear_attention(phi(q, True), phi(k, False), v, chunk_size=64)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32 and z.dtype == torch.float32
    ref = causal_quadratic_reference(phi(q, True), phi(k, False), v, 1e-6).to(torch.bfloat16)
    assert (out == ref).float().mean().item() > 0.95
