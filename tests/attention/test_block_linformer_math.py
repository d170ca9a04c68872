"""Causal block Linformer (layer 1) against a per-token reference; and why plain Linformer cannot be causal."""

import pytest
import torch
from helpers import qkv

from hf_linear_attn.block_linformer import (
    block_linformer_step,
    causal_block_linformer_attention,
    empty_block_linformer_state,
)
from hf_linear_attn.linformer_projection import project_sequence


def per_token_reference(q, k, v, key_projection, value_projection, b):
    """Token t: one softmax over E K_i, F V_i of every complete block i < t // b, then its own block's keys <= t."""
    n, d = q.shape[2], q.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    e, f = key_projection.double(), value_projection.double()
    for t in range(n):
        j = t // b
        keys = [e @ k[:, :, i * b:(i + 1) * b] for i in range(j)] + [k[:, :, j * b:t + 1]]
        values = [f @ v[:, :, i * b:(i + 1) * b] for i in range(j)] + [v[:, :, j * b:t + 1]]
        weights = (q[:, :, t:t + 1] @ torch.cat(keys, 2).transpose(-1, -2) / d**0.5).softmax(-1)
        out[:, :, t:t + 1] = weights @ torch.cat(values, 2)
    return out


def projections(heads, k, b, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, k, b, generator=g) / b**0.5, torch.randn(1, k, b, generator=g) / b**0.5


@pytest.mark.parametrize("n, b, k", [(24, 8, 4), (21, 8, 4), (5, 8, 3), (17, 1, 1), (30, 6, 6)])
def test_block_form_equals_per_token_reference_values_and_gradients(n, b, k):
    q, k_, v = qkv(n=n)
    e, f = projections(3, k, b)  # per-head E, shared F: both broadcast forms
    for t in (q, k_, v, e, f):
        t.requires_grad_(True)
    out, _, _ = causal_block_linformer_attention(q, k_, v, e, f, b)
    ref = per_token_reference(q, k_, v, e, f, b)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k_, v, e, f), grad)
    want = torch.autograd.grad(ref, (q, k_, v, e, f), grad.double(), allow_unused=True)
    for g, w, x in zip(got, want, (q, k_, v, e, f)):
        w = torch.zeros_like(x) if w is None else w  # n < b: no complete block, E and F unused
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-4)


def test_future_tokens_do_not_change_earlier_outputs():
    q, k, v = qkv(n=30)
    e, f = projections(3, 4, 8)
    out, _, _ = causal_block_linformer_attention(q, k, v, e, f, 8)
    for t in (13, 16, 23):  # inside a block, at a block boundary, in a later block
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, :, t + 1:] = 3 * torch.randn_like(x[:, :, t + 1:])
        out2, _, _ = causal_block_linformer_attention(q2, k2, v2, e, f, 8)
        torch.testing.assert_close(out2[:, :, :t + 1], out[:, :, :t + 1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(out2[:, :, t + 1:], out[:, :, t + 1:])


def test_masking_plain_linformer_scores_still_sees_the_future():
    """The pitfall the block form avoids: a tril mask on the n x k scores does not make E K causal."""
    q, k, v = qkv(n=16)
    e = torch.randn(1, 16, 16)  # k = n, so a "causal" mask on the n x k scores is expressible at all

    def masked_plain_linformer(q, k, v):
        scores = (q @ project_sequence(k, e).transpose(-1, -2) / 8**0.5).masked_fill(~torch.ones(16, 16).tril().bool(), -torch.inf)
        return scores.softmax(-1) @ project_sequence(v, e)

    out = masked_plain_linformer(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 10:], v2[:, :, 10:] = torch.randn_like(k2[:, :, 10:]), torch.randn_like(v2[:, :, 10:])
    assert not torch.allclose(masked_plain_linformer(q, k2, v2)[:, :, :10], out[:, :, :10])


def test_prefill_then_steps_equal_one_pass_with_staggered_left_padding():
    q, k, v = qkv(b=3, n=29)
    e, f = projections(3, 4, 8)
    mask = torch.ones(3, 29, dtype=torch.bool)
    mask[1, :3] = False  # rows complete their blocks at different steps
    mask[2, :8] = False
    full, _, _ = causal_block_linformer_attention(q, k, v, e, f, 8, key_mask=mask)
    prefix, _, state = causal_block_linformer_attention(
        q[:, :, :12], k[:, :, :12], v[:, :, :12], e, f, 8, key_mask=mask[:, :12], return_state=True
    )
    outputs = [prefix]
    for t in range(12, 29):
        y, state = block_linformer_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, e, f)
        outputs.append(y)
    steps = torch.cat(outputs, dim=2)
    real = mask[:, None, :, None].expand_as(full)
    torch.testing.assert_close(steps[real], full[real], atol=1e-5, rtol=1e-5)
    # each padded row equals the same row alone
    for row, pads in ((1, 3), (2, 8)):
        alone, _, _ = causal_block_linformer_attention(q[row:row + 1, :, pads:], k[row:row + 1, :, pads:],
                                                       v[row:row + 1, :, pads:], e, f, 8)
        torch.testing.assert_close(full[row:row + 1, :, pads:], alone, atol=1e-5, rtol=1e-5)
    # the cache holds k rows per completed block plus one block, not one row per token
    assert state.summary_valid.sum(-1).tolist() == [29 // 8, 26 // 8, 21 // 8]
    assert state.num_cached_rows() == 3 * 4 + 8


def test_steps_from_an_empty_state_equal_one_pass():
    q, k, v = qkv(n=19)
    e, f = projections(3, 2, 4)
    state = empty_block_linformer_state(2, 3, 8, 2, 4, torch.float32, "cpu")
    outputs = []
    for t in range(19):
        y, state = block_linformer_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, e, f)
        outputs.append(y)
    full, _, _ = causal_block_linformer_attention(q, k, v, e, f, 4)
    torch.testing.assert_close(torch.cat(outputs, dim=2), full, atol=1e-5, rtol=1e-5)


def test_attention_weights_see_only_completed_blocks():
    q, k, v = qkv(n=20)
    e, f = projections(3, 4, 8)
    out, weights, _ = causal_block_linformer_attention(q, k, v, e, f, 8, need_weights=True)
    assert weights.shape == (2, 3, 20, 3 * 4 + 8)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 20))
    for t in range(20):
        j = t // 8
        assert weights[:, :, t, j * 4:12].abs().sum() < 1e-12  # summaries of the own and later blocks: no weight
        assert weights[:, :, t, 12 + t % 8 + 1:].abs().sum() < 1e-12  # later keys of the own block: no weight
