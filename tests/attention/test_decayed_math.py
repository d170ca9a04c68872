"""Decayed causal linear attention (RetNet's fixed decay, GLA's per-feature gate; issue 41): the chunked form, the
recurrent step, the export form and the rollback replay against the float64 recurrence, values and gradients."""

import pytest
import torch
from helpers import normal, uniform

from hf_linear_attn import (
    causal_decayed_linear_attention,
    causal_linear_attention,
    naive_decayed_linear_attention,
    recurrent_decayed_linear_attention_step,
)
from hf_linear_attn.decayed_linear_attention import (
    _blocked_scores,
    _decayed_scores,
    _pairwise_form,
    _split_scores,
    advance_decayed_state,
    decayed_linear_attention_weights,
)


pytestmark = pytest.mark.usefixtures("on_each_device")  # every test here on the CPU and on CUDA


def inputs(b=2, h=3, n=23, m=6, d=5, per_feature=False, strength=1.0, seed=0):
    """Positive features (as every feature map gives), values, and log decays <= 0, float64."""
    g = torch.Generator().manual_seed(seed)
    phi_q = uniform(g, b, h, n, m, dtype=torch.float64) + 0.05
    phi_k = uniform(g, b, h, n, m, dtype=torch.float64) + 0.05
    v = normal(g, b, h, n, d, dtype=torch.float64)
    log_decay = -strength * uniform(g, b, h, n, m if per_feature else 1, dtype=torch.float64)
    return phi_q, phi_k, v, log_decay


@pytest.mark.parametrize("form", ["chunks", "scan"])
@pytest.mark.parametrize("per_feature", [False, True], ids=["per-head", "per-feature"])
@pytest.mark.parametrize("n,chunk", [(1, 4), (23, 4), (23, 64), (40, 8), (17, 1)])
def test_chunked_forms_against_the_float64_recurrence_values_state_and_gradients(per_feature, n, chunk, form):
    phi_q, phi_k, v, log_decay = inputs(n=n, per_feature=per_feature)
    leaves = [t.clone().requires_grad_() for t in (phi_q, phi_k, v, log_decay)]
    reference, (s_ref, z_ref) = naive_decayed_linear_attention(*leaves)
    ours_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ours, (s, z) = causal_decayed_linear_attention(*ours_leaves, chunk_size=chunk, form=form)
    torch.testing.assert_close(ours.double(), reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(z.double(), z_ref, atol=2e-5, rtol=1e-4)
    weights = torch.randn_like(reference)
    grads_ref = torch.autograd.grad((reference * weights).sum(), leaves)
    grads = torch.autograd.grad((ours * weights.float()).sum(), ours_leaves)
    for name, ours_grad, ref_grad in zip(("phi_q", "phi_k", "v", "log_decay"), grads, grads_ref):
        torch.testing.assert_close(ours_grad.double(), ref_grad, atol=1e-4, rtol=1e-3, msg=name)


def test_no_decay_is_plain_causal_linear_attention():
    phi_q, phi_k, v, _ = (t.float() for t in inputs(n=30))
    plain, (s_plain, z_plain) = causal_linear_attention(phi_q, phi_k, v, chunk_size=8)
    ours, (s, z) = causal_decayed_linear_attention(phi_q, phi_k, v, torch.zeros(1, 3, 30, 1), chunk_size=8)
    torch.testing.assert_close(ours, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, s_plain, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(z, z_plain, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("form", ["chunks", "scan"])
@pytest.mark.parametrize("per_feature", [False, True], ids=["per-head", "per-feature"])
@pytest.mark.parametrize("strength", [1.0, 3.0, 50.0])
def test_any_decay_strength_stays_finite_and_exact(per_feature, strength, form):
    """Chunks of 64 decaying by up to e^-64, e^-192 and e^-3,200. Rescaling q by exp(B_t) and k by exp(-B_s), as a
    plain product would, overflows float32 beyond e^-88. One decay per feature takes, by strength: the matmul around
    the chunk's middle at 64; the same at 16 (64 would need factors up to e^96); the C x C x m product at 16."""
    phi_q, phi_k, v, log_decay = inputs(n=64, per_feature=per_feature, strength=strength)
    reference, _ = naive_decayed_linear_attention(phi_q, phi_k, v, log_decay)
    ours, (s, z) = causal_decayed_linear_attention(*(t.float() for t in (phi_q, phi_k, v, log_decay)), chunk_size=64,
                                                   form=form)
    assert torch.isfinite(ours).all() and torch.isfinite(s).all()
    torch.testing.assert_close(ours.double(), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strength,chunk,split", [(1.0, 64, True), (3.0, 64, False), (3.0, 16, True), (50.0, 16, False)])
def test_the_matmul_form_of_per_feature_gates_is_taken_only_where_its_factors_fit(strength, chunk, split):
    phi_q, phi_k, _, log_decay = (t.float() for t in inputs(b=1, n=chunk, per_feature=True, strength=strength))
    b = torch.cumsum(log_decay, dim=2)
    scores = _split_scores(phi_q, phi_k, b)
    assert (scores is not None) == split
    if split:
        torch.testing.assert_close(scores, _decayed_scores(phi_q, phi_k, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strength", [0.01, 3.0, 50.0])  # the chunk split holds / only each block's / neither
@pytest.mark.parametrize("chunk", [64, 48, 20])  # 20: not a multiple of the block, the plain product
def test_the_blocked_scores_equal_the_plain_product_values_and_gradients_at_any_decay(chunk, strength):
    """The matmul across blocks (each key decayed to its block's end, each query from it) and the blocks' own pairs
    give the C x C x m product's scores and gradients in float64, where the whole chunk decays far past what its
    split can take (50 a position: e^-3,200 across a chunk of 64) and nothing overflows."""
    phi_q, phi_k, _, log_decay = inputs(b=2, h=2, n=chunk, m=8, per_feature=True, strength=strength)
    b = torch.cumsum(log_decay, dim=2).requires_grad_()
    q, k = phi_q.clone().requires_grad_(), phi_k.clone().requires_grad_()
    got, want = _blocked_scores(q, k, b, block=16), _decayed_scores(q, k, b)
    assert torch.isfinite(got).all()
    if chunk == 64:  # past the chunk's split at 3 and 50 a position: the case the blocks are for
        assert (_split_scores(q, k, b) is None) == (strength > 1)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = [torch.autograd.grad((scores * weights).sum(), (q, k, b)) for scores in (got, want)]
    for ours, plain in zip(*grads):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, plain, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("per_feature", [False, True], ids=["per-head", "per-feature"])
def test_prefill_then_steps_then_prefill_again_equal_one_pass(per_feature):
    phi_q, phi_k, v, log_decay = (t.float() for t in inputs(n=30, per_feature=per_feature))
    full, (s_full, z_full) = causal_decayed_linear_attention(phi_q, phi_k, v, log_decay, chunk_size=4)
    out, state = causal_decayed_linear_attention(
        phi_q[:, :, :11], phi_k[:, :, :11], v[:, :, :11], log_decay[:, :, :11], chunk_size=4
    )
    pieces = [out]
    for t in range(11, 19):
        y, state = recurrent_decayed_linear_attention_step(
            phi_q[:, :, t : t + 1], phi_k[:, :, t : t + 1], v[:, :, t : t + 1], log_decay[:, :, t : t + 1], state
        )
        pieces.append(y)
    out, state = causal_decayed_linear_attention(
        phi_q[:, :, 19:], phi_k[:, :, 19:], v[:, :, 19:], log_decay[:, :, 19:], chunk_size=4, state=state
    )
    pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=2), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], s_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], z_full, atol=1e-5, rtol=1e-5)


def test_pad_keys_add_nothing_and_leave_the_state_undecayed():
    """Left pads (NaN keys and values among them) change neither the real rows nor the final state: the same rows
    run alone give the same numbers."""
    phi_q, phi_k, v, log_decay = (t.float() for t in inputs(b=1, n=20, per_feature=True))
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[:, :6] = False
    phi_k, v = phi_k.clone(), v.clone()
    phi_k[:, :, 2], v[:, :, 3] = float("nan"), float("nan")
    out, (s, z) = causal_decayed_linear_attention(phi_q, phi_k, v, log_decay, key_mask=mask, chunk_size=4)
    alone, (s_alone, z_alone) = causal_decayed_linear_attention(
        phi_q[:, :, 6:], phi_k[:, :, 6:], v[:, :, 6:], log_decay[:, :, 6:], chunk_size=4
    )
    torch.testing.assert_close(out[:, :, 6:], alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close((s, z), (s_alone, z_alone), atol=1e-6, rtol=1e-5)
    step_out, step_state = recurrent_decayed_linear_attention_step(
        phi_q[:, :, :1], phi_k[:, :, 2:3], v[:, :, 3:4], log_decay[:, :, :1], (s, z), key_mask=mask[:, :1]
    )
    assert torch.isfinite(step_out).all()
    torch.testing.assert_close(step_state, (s, z))


@pytest.mark.parametrize("per_feature", [False, True], ids=["per-head", "per-feature"])
def test_the_export_form_and_the_rollback_replay_equal_the_recurrence(per_feature):
    phi_q, phi_k, v, log_decay = inputs(n=19, per_feature=per_feature)
    g = torch.Generator().manual_seed(1)
    s0 = uniform(g, 2, 3, 6, 5, dtype=torch.float64)
    z0 = uniform(g, 2, 3, 6, dtype=torch.float64)
    reference, (s_ref, z_ref) = naive_decayed_linear_attention(phi_q, phi_k, v, log_decay, state=(s0, z0))
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).float()
    out, final = _pairwise_form(phi_q.float(), phi_k.float(), v1, log_decay.float(), torch.cat([s0, z0[..., None]], -1).float())
    torch.testing.assert_close((out[..., :5] / out[..., 5:]).double(), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[..., :5].double(), s_ref, atol=1e-5, rtol=1e-5)
    s, z = advance_decayed_state(phi_k, v, log_decay, (s0, z0))
    torch.testing.assert_close((s.double(), z.double()), (s_ref, z_ref), atol=1e-5, rtol=1e-5)


def test_the_implicit_weights_reproduce_the_output_and_sum_to_one():
    phi_q, phi_k, v, log_decay = (t.float() for t in inputs(n=15, per_feature=True))
    weights = decayed_linear_attention_weights(phi_q, phi_k, log_decay)
    out, _ = causal_decayed_linear_attention(phi_q, phi_k, v, log_decay)
    torch.testing.assert_close(weights @ v, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 15), atol=1e-5, rtol=1e-5)
    assert torch.equal(weights.triu(1), torch.zeros_like(weights))


def test_decays_of_the_wrong_shape_and_unknown_forms_are_refused_with_the_reason():
    phi_q, phi_k, v, _ = (t.float() for t in inputs(n=8))
    with pytest.raises(ValueError, match=r"\(batch, heads, n, 1\).*got \(2, 3, 8, 4\)"):
        causal_decayed_linear_attention(phi_q, phi_k, v, torch.zeros(2, 3, 8, 4))
    with pytest.raises(ValueError, match="form must be 'auto', 'chunks' or 'scan'"):
        causal_decayed_linear_attention(phi_q, phi_k, v, torch.zeros(2, 3, 8, 1), form="parallel")
