"""Causal linear attention: chunkwise-parallel and recurrent forms against the quadratic masked form."""

import pytest
import torch
from test_attention_math import qkv

from hf_linear_attn.feature_maps import build_feature_map
from hf_linear_attn.linear_attention import causal_linear_attention, recurrent_linear_attention_step


def causal_quadratic_reference(phi_q, phi_k, v, eps):
    """(phi(Q) phi(K)^T * tril) V, normalised by its row sums + eps, in float64."""
    a = torch.einsum("bhim,bhjm->bhij", phi_q.double(), phi_k.double()).tril()
    return (a @ v.double()) / (a.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("n, chunk", [(32, 8), (37, 8), (5, 8), (64, 64), (1, 4)])
@pytest.mark.parametrize("name", ["elu", "favor", "hedgehog"])
def test_chunked_equals_quadratic_masked_form_values_and_gradients(n, chunk, name):
    torch.manual_seed(0)
    feature_map = build_feature_map(name, 3, 8, num_random_features=16, causal=True)
    q, k, v = qkv(n=n)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, (s, z) = causal_linear_attention(feature_map(q, True), feature_map(k, False), v, chunk_size=chunk)
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
