"""Causal FAVOR+ with a running-maximum stabiliser (FavorFeatureMap.causal_pair + the decayed kernel) against the
float64 FAVOR+ estimator computed without any stabiliser: exact at key norms where the unstabilised float32 path
collapses, continued across calls, token by token, with padding, and with gradients."""

import pytest
import torch

from hf_linear_attn.decayed_linear_attention import (
    causal_decayed_linear_attention,
    recurrent_decayed_linear_attention_step,
)
from hf_linear_attn.feature_maps import FavorFeatureMap
from hf_linear_attn.linear_attention import causal_linear_attention


def estimator_float64(feature_map, q, k, v, key_mask=None):
    """sum_{j<=t} A_tj v_j / sum_{j<=t} A_tj with A_tj = sum_i exp(w_i.q' - |q'|^2/2 + w_i.k' - |k'|^2/2), in float64
    with no stabiliser at all (float64 holds these exponents): the function both float32 paths approximate."""
    w = feature_map.projection.double()
    scale = feature_map.head_dim**-0.25

    def logits(x):
        x = x.double() * scale
        return x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)

    lq, lk = logits(q), logits(k)  # (B, H, n, m)
    scores = torch.logsumexp(lq[:, :, :, None, :] + lk[:, :, None, :, :], dim=-1)  # log A (B, H, n, n)
    n = q.shape[2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1)
    return torch.nan_to_num(weights) @ v.double()


def inputs(batch=2, heads=2, n=96, d=64, std=3.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, generator=generator) for _ in range(3))
    return q * std, k * std, v


def stabilised(feature_map, q, k, v, key_mask=None, chunk_size=16, state=None, running_max=None):
    phi_q, phi_k, log_decay, running = feature_map.causal_pair(q, k, key_mask, running_max)
    out, state = causal_decayed_linear_attention(phi_q, phi_k, v, log_decay, key_mask, chunk_size=chunk_size,
                                                 state=state)
    return out, state, running[:, :, -1]


def test_large_key_norms_stay_exact_where_the_unstabilised_path_collapses():
    torch.manual_seed(0)
    feature_map = FavorFeatureMap(64, 64, causal=True)
    q, k, v = inputs(std=3.0)  # |k'|^2 / 2 ~ 36: unstabilised key features ~e^-36 and below
    mask = torch.ones(2, 96, dtype=torch.bool)
    mask[1, :10] = False  # left padding in the second row
    reference = estimator_float64(feature_map, q, k, v, mask)

    out, _, _ = stabilised(feature_map, q, k, v, mask)
    real = mask[:, None, :, None].expand_as(out)
    error = (out - reference).abs()[real]
    assert error.max() < 1e-3 and error.mean() < 1e-4  # float32 exponents of ~50, and eps against phi(q).z >= 1/m

    # the unstabilised float32 path (what causal FAVOR+ did before): most rows shrink towards 0
    phi_q, phi_k = feature_map.pair(q, k, mask)
    old, _ = causal_linear_attention(phi_q, phi_k, v, mask)
    off = ((old - reference).norm(dim=-1) > 0.01 * reference.norm(dim=-1))[mask[:, None, :].expand(-1, 2, -1)]
    assert off.float().mean() > 0.5


def test_the_maxima_only_grow_the_decays_are_at_most_one_and_features_at_most_their_scale():
    feature_map = FavorFeatureMap(16, 32, causal=True)
    q, k, _ = inputs(n=40, d=16, std=2.0)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, 20:23] = False
    phi_q, phi_k, log_decay, running = feature_map.causal_pair(q, k, mask)
    assert (log_decay <= 0).all()
    assert (log_decay[0, :, :6] == 0).all()  # before (and at) the first real key: nothing to rescale
    assert (log_decay[1, :, 20:23] == 0).all()  # a pad changes no maximum
    assert (phi_k <= 32**-0.5 + 1e-7).all() and (phi_k[~mask[:, None, :, None].expand_as(phi_k)] == 0).all()
    assert torch.allclose(phi_q.amax(-1), torch.full_like(phi_q[..., 0], 32**-0.5))
    assert (running[:, :, 1:] >= running[:, :, :-1]).all() and torch.isfinite(running[:, :, -1]).all()


@pytest.mark.parametrize("split", [1, 37, 95])
def test_two_calls_carrying_state_and_maximum_equal_one_call(split):
    feature_map = FavorFeatureMap(64, 64, causal=True)
    q, k, v = inputs(std=2.5, seed=1)
    whole, (s, z), last = stabilised(feature_map, q, k, v)
    first, state, running = stabilised(feature_map, q[:, :, :split], k[:, :, :split], v[:, :, :split])
    second, (s2, z2), last2 = stabilised(feature_map, q[:, :, split:], k[:, :, split:], v[:, :, split:],
                                         state=state, running_max=running)
    assert torch.allclose(torch.cat([first, second], dim=2), whole, atol=1e-5)
    assert torch.equal(last, last2)
    assert torch.allclose(s2, s, rtol=1e-4, atol=1e-6) and torch.allclose(z2, z, rtol=1e-4, atol=1e-6)


def test_token_by_token_decoding_equals_the_chunked_call():
    feature_map = FavorFeatureMap(64, 64, causal=True)
    q, k, v = inputs(n=30, std=3.0, seed=2)
    whole, _, _ = stabilised(feature_map, q, k, v, chunk_size=8)
    state = (torch.zeros(2, 2, 64, 64), torch.zeros(2, 2, 64))
    running = torch.full((2, 2, 64), -torch.inf)
    outputs = []
    for t in range(30):
        phi_q, phi_k, log_decay, running = feature_map.causal_pair(
            q[:, :, t : t + 1], k[:, :, t : t + 1], None, running
        )
        running = running[:, :, -1]
        out, state = recurrent_decayed_linear_attention_step(phi_q, phi_k, v[:, :, t : t + 1], log_decay, state)
        outputs.append(out)
    assert torch.allclose(torch.cat(outputs, dim=2), whole, atol=1e-5)


def test_gradients_equal_the_float64_estimators():
    feature_map = FavorFeatureMap(16, 32, causal=True)
    q, k, v = inputs(batch=1, n=24, d=16, std=2.0, seed=3)
    grads = []
    for run in ("stabilised", "reference"):
        leaves = [t.clone().double().requires_grad_() if run == "reference" else t.clone().requires_grad_()
                  for t in (q, k, v)]
        if run == "stabilised":
            out = stabilised(feature_map, *leaves, chunk_size=8)[0]
        else:
            out = estimator_float64(feature_map, *leaves)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        grads.append([t.grad.float() for t in leaves])
    for ours, reference in zip(*grads):  # float32 against float64: within 1e-4 of the largest gradient
        assert (ours - reference).abs().max() <= 1e-4 * (1 + reference.abs().max())


def test_exported_running_maximum_serves_every_length_and_equals_eager():
    """Under torch.export the running maximum is a doubling scan (ONNX has no cummax) and the maximum one position
    back an index: one program, traced at n = 29, equals the eager pair at n = 1, 2, 5 and 100 (with a pad)."""
    feature_map = FavorFeatureMap(8, 16, causal=True)

    class Pair(torch.nn.Module):
        def forward(self, q, k, key_mask, running_max):
            return feature_map.causal_pair(q, k, key_mask, running_max)

    q, k, _ = inputs(batch=2, heads=2, n=100, d=8, std=2.0, seed=4)
    mask = torch.ones(2, 100, dtype=torch.bool)
    mask[1, :3] = False
    start = torch.randn(2, 2, 16)
    start[0] = -torch.inf
    length = torch.export.Dim("length", min=1, max=128)
    program = torch.export.export(  # traced on copies: views of the 100-row tensors would tie n to their strides
        Pair(), (q[:, :, :29].clone(), k[:, :, :29].clone(), mask[:, :29].clone(), start),
        dynamic_shapes=({2: length}, {2: length}, {1: length}, None),
    ).module()
    for n in (1, 2, 5, 100):
        args = (q[:, :, :n].clone(), k[:, :, :n].clone(), mask[:, :n].clone(), start)
        for got, want in zip(program(*args), feature_map.causal_pair(*args), strict=True):
            assert torch.equal(got, want)
