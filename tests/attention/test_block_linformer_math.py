"""Causal block Linformer (layer 1) against a per-token reference; and why plain Linformer cannot be causal."""

import pytest
import torch
from helpers import draw, qkv

from hf_linear_attn.block_linformer import (
    block_linformer_step,
    causal_block_linformer_attention,
    empty_block_linformer_state,
)
from hf_linear_attn.linformer_projection import project_sequence

pytestmark = pytest.mark.usefixtures("on_each_device")  # every test here on the CPU and on CUDA


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
    return draw(g, heads, k, b) / b**0.5, draw(g, 1, k, b) / b**0.5


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
    state = empty_block_linformer_state(2, 3, 8, 2, 4, torch.float32, torch.get_default_device())
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


def _saved_bytes(n, b=64, k=16, heads=2, d=16, dropout=0.0):
    """Bytes autograd keeps for the backward of one causal block Linformer call (inputs excluded)."""
    q, k_, v = (t.requires_grad_(True) for t in qkv(b=1, h=heads, n=n, d=d))
    e, f = projections(heads, k, b)
    inputs = {id(t) for t in (q, k_, v, e, f)}
    saved = {}

    def pack(t):
        if id(t) not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _, _ = causal_block_linformer_attention(q, k_, v, e, f, b, dropout=dropout)
    out.sum().backward()
    return sum(saved.values())


def test_training_memory_grows_linearly_in_n():
    """Nothing n x (n / b) k is kept for the backward: doubling n at most doubles what autograd stores (the
    materialised form stored the n x (S k + b) weights, 3.3x more at each doubling here)."""
    small, large = _saved_bytes(2048), _saved_bytes(4096)
    assert large <= 2.1 * small, (small, large)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_form_equals_per_token_reference_with_left_padding(dtype):
    """The fused path (two flash-attention calls merged by log-sum-exp) with a left-padded row, in float32 and bf16,
    values and gradients against the per-token reference in float64; dropout > 0 takes the materialised form."""
    n, b, k = 45, 8, 4
    q, k_, v = (t.to(dtype) for t in qkv(n=n))
    e, f = projections(3, k, b)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :6] = False
    for t in (q, k_, v):
        t.requires_grad_(True)
    out, _, _ = causal_block_linformer_attention(q, k_, v, e, f, b, key_mask=mask)
    alone = per_token_reference(q[1:, :, 6:], k_[1:, :, 6:], v[1:, :, 6:], e, f, b)
    ref = torch.cat([per_token_reference(q[:1], k_[:1], v[:1], e, f, b)[:, :, 6:], alone])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[:, :, 6:].double(), ref, **tol)
    grad = torch.randn_like(out[:, :, 6:], dtype=torch.float32)
    got = torch.autograd.grad(out[:, :, 6:], (q, k_, v), grad.to(dtype))
    ref_q, ref_k, ref_v = (t.detach().double().requires_grad_(True) for t in (q, k_, v))
    ref = torch.cat([per_token_reference(ref_q[:1], ref_k[:1], ref_v[:1], e, f, b)[:, :, 6:],
                     per_token_reference(ref_q[1:, :, 6:], ref_k[1:, :, 6:], ref_v[1:, :, 6:], e, f, b)])
    want = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), grad.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g[:, :, 6:].double(), w[:, :, 6:], **tol)
        assert torch.isfinite(g).all()
    torch.manual_seed(0)
    dropped, _, _ = causal_block_linformer_attention(q, k_, v, e, f, b, key_mask=mask, dropout=0.5)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped.float(), out.float())


def test_materialised_form_in_checkpointed_groups_equals_the_reference(monkeypatch):
    """With dropout or padding the materialised form runs; split into groups of query blocks (a tiny group budget
    forces one block per group) it still gives the per-token reference's values and gradients."""
    import hf_linear_attn.block_linformer as block_linformer

    monkeypatch.setattr(block_linformer, "_GROUP_SCORE_BYTES", 1)
    n, b, k = 37, 8, 4
    q, k_, v = qkv(n=n)
    e, f = projections(3, k, b)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :5] = False  # padding: the materialised form
    for t in (q, k_, v, e, f):
        t.requires_grad_(True)
    out, _, _ = causal_block_linformer_attention(q, k_, v, e, f, b, key_mask=mask)
    ref = torch.cat([per_token_reference(q[:1], k_[:1], v[:1], e, f, b)[:, :, 5:],
                     per_token_reference(q[1:, :, 5:], k_[1:, :, 5:], v[1:, :, 5:], e, f, b)])
    torch.testing.assert_close(out[:, :, 5:].double(), ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out[:, :, 5:], (q, k_, v, e, f), grad.float())
    want = torch.autograd.grad(ref, (q, k_, v, e, f), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-4)


def test_checkpointed_groups_recompute_the_same_dropout_mask(monkeypatch):
    """Dropout in groups that are recomputed in the backward: the analytic gradient equals finite differences of the
    same function (a fixed seed per call), which fails if the recomputation drew another mask."""
    import hf_linear_attn.block_linformer as block_linformer

    monkeypatch.setattr(block_linformer, "_GROUP_SCORE_BYTES", 1)
    q, k_, v = (t.double().requires_grad_(True) for t in qkv(b=1, h=2, n=20, d=4))
    e, f = (t.double() for t in projections(2, 3, 8))

    def dropped(q, k_, v):
        torch.manual_seed(0)
        return causal_block_linformer_attention(q, k_, v, e, f, 8, dropout=0.3)[0]

    out = dropped(q, k_, v)
    assert (out == dropped(q, k_, v)).all()
    assert torch.autograd.gradcheck(dropped, (q, k_, v), eps=1e-6, atol=1e-6, fast_mode=True)


def test_training_memory_with_dropout_grows_linearly_in_n(monkeypatch):
    """With attention dropout (the materialised form), what autograd keeps outside the recomputed groups at most
    doubles when n doubles: nothing n x (n / b) k is stored for the backward."""
    import hf_linear_attn.block_linformer as block_linformer

    monkeypatch.setattr(block_linformer, "_GROUP_SCORE_BYTES", 1 << 16)
    small, large = _saved_bytes(2048, dropout=0.1), _saved_bytes(4096, dropout=0.1)
    assert large <= 2.1 * small, (small, large)


def test_bf16_decoding_keeps_float32_summaries_and_is_no_further_from_float64_than_the_whole_form(monkeypatch):
    """A bf16 decoder's block summaries stand for b tokens each and every later token reads them: the state keeps
    them in float32 (prompt pass and steps), and the step scores in float32, so decoding is no further from the
    float64 result of the same bf16 values than the whole-sequence bf16 form; the ablation with bf16 summaries (what
    the package did before) is measurably further (scripts/decode_precision.py measures it at scale)."""
    if torch.get_default_device().type != "cpu":
        pytest.skip("the measured margins are the CPU's bf16 kernels'")
    from hf_linear_attn import block_linformer

    g = torch.Generator().manual_seed(0)
    n, b, proj_k, prompt = 160, 16, 8, 40
    q, k, v = (draw(g, 1, 2, n, 32).mul(3).bfloat16() for _ in range(3))  # std 3: sharp attention
    e, f = (draw(g, 2, proj_k, b).div(b**0.5).bfloat16() for _ in range(2))
    reference = per_token_reference(q, k, v, e, f, b)
    whole, _, _ = causal_block_linformer_attention(q, k, v, e, f, b)

    def decoded():
        out, _, state = causal_block_linformer_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], e, f,
                                                         b, return_state=True)
        outputs = [out]
        for t in range(prompt, n):
            y, state = block_linformer_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, e, f)
            outputs.append(y)
        return torch.cat(outputs, dim=2), state

    def rms(x):
        return (x.double() - reference)[:, :, prompt:].pow(2).mean().sqrt().item()

    steps, state = decoded()
    assert steps.dtype == torch.bfloat16 and state.summary_keys.dtype == state.summary_values.dtype == torch.float32
    assert state.block_keys.dtype == torch.bfloat16  # raw keys of the current block: exact in the model's dtype
    monkeypatch.setattr(block_linformer, "state_dtype", lambda dtype: dtype)
    ablated, ablated_state = decoded()
    assert ablated_state.summary_keys.dtype == torch.bfloat16
    assert rms(steps) <= rms(whole), (rms(steps), rms(whole))
    assert rms(ablated) > 1.5 * rms(steps), (rms(ablated), rms(steps))
