"""The delta rule (DeltaNet) against an independent float64 reference written from the update as the papers state it,
S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, y_t = S_t^T q_t, with explicit d x d matrices: the chunked
form at every chunk length, with a starting state and pads, its gradients, the n x n weights, and the property the
rule exists for (a key written twice reads back its last value, where the additive sum mixes both); and Gated
DeltaNet's decay, S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, the same way, and KDA's decay
per key feature, S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T."""

import pytest
import torch

from hf_linear_attn import causal_delta_rule, delta_rule_qk, delta_rule_weights, naive_delta_rule


def reference(q, k, v, beta, state=None, key_mask=None, log_decay=None):
    """Float64, one position and one head at a time, the update as a d_k x d_k matrix times the state (after
    Diag(alpha_t), alpha_t one number per head or one per key feature, where there is a decay)."""
    batch, heads, n, d_k = q.shape
    y = torch.zeros(batch, heads, n, v.shape[-1], dtype=torch.float64)
    final = torch.zeros(batch, heads, d_k, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            s = torch.zeros(d_k, v.shape[-1], dtype=torch.float64) if state is None else state[b, h].double()
            for t in range(n):
                pad = key_mask is not None and not key_mask[b, t]
                step = 0.0 if pad else float(beta[b, h, t])
                alpha = torch.ones(d_k, dtype=torch.float64)
                if not pad and log_decay is not None:
                    alpha = alpha * log_decay[b, h, t].double().exp()  # a number, or d_k of them
                kt = k[b, h, t].double()[:, None]
                s = (torch.eye(d_k, dtype=torch.float64) - step * kt @ kt.T) @ torch.diag(alpha) @ s
                s = s + step * kt @ v[b, h, t].double()[None]
                y[b, h, t] = s.T @ q[b, h, t].double()
            final[b, h] = s
    return y, final


def inputs(batch=2, heads=3, n=19, d_k=8, d_v=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = delta_rule_qk(torch.randn(batch, heads, n, d_k, generator=g), torch.randn(batch, heads, n, d_k, generator=g))
    return q, k, torch.randn(batch, heads, n, d_v, generator=g), torch.rand(batch, heads, n, generator=g)


@pytest.mark.parametrize("chunk", [1, 3, 4, 19, 64])
def test_the_chunked_form_equals_the_update_step_by_step_from_a_state_and_with_pads(chunk):
    q, k, v, beta = inputs()
    state = torch.randn(2, 3, 8, 5, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :6] = False  # left padding: the rule must leave the state as it was at those positions
    want_y, want_s = reference(q, k, v, beta, state, mask)
    y, s = causal_delta_rule(q, k, v, beta, mask, state, chunk_size=chunk)
    torch.testing.assert_close(y.double(), want_y, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), want_s, atol=2e-5, rtol=1e-5)
    y, s = naive_delta_rule(q, k, v, beta, mask, state)
    torch.testing.assert_close(y.double(), want_y, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), want_s, atol=2e-5, rtol=1e-5)


# one decay per head and token (Gated DeltaNet), alpha in (e^-2, 1]; one per key feature (KDA), at 2 and at 12 a
# token (a chunk of 19 then decays past GLA's matmul split, so the C x C x d_k form runs)
DECAYS = {"per head": (2.0, ()), "per feature": (2.0, (8,)), "per feature, strong": (12.0, (8,))}


@pytest.mark.parametrize("chunk", [1, 4, 19, 64])
@pytest.mark.parametrize("decay", list(DECAYS))
def test_with_a_decay_the_chunked_form_equals_the_gated_update(chunk, decay):
    strength, features = DECAYS[decay]
    q, k, v, beta = inputs()
    log_decay = -strength * torch.rand(2, 3, 19, *features, generator=torch.Generator().manual_seed(2))
    state = torch.randn(2, 3, 8, 5, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :6] = False
    want_y, want_s = reference(q, k, v, beta, state, mask, log_decay)
    for y, s in (causal_delta_rule(q, k, v, beta, mask, state, chunk_size=chunk, log_decay=log_decay),
                 naive_delta_rule(q, k, v, beta, mask, state, log_decay=log_decay)):
        torch.testing.assert_close(y.double(), want_y, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(s.double(), want_s, atol=2e-5, rtol=1e-5)
    weights = delta_rule_weights(q, k, beta, log_decay=log_decay)  # from an empty state
    torch.testing.assert_close(weights.double() @ v.double(), reference(q, k, v, beta, log_decay=log_decay)[0],
                               atol=2e-5, rtol=1e-5)
    if not features:  # a decay of 1 everywhere is the rule without one, exactly
        plain = causal_delta_rule(q, k, v, beta, mask, state, chunk_size=chunk)
        ones = causal_delta_rule(q, k, v, beta, mask, state, chunk_size=chunk, log_decay=torch.zeros(2, 3, 19))
        torch.testing.assert_close(ones, plain, atol=0, rtol=0)
    else:  # the same decay on every feature is the decay per head
        per_head = log_decay[..., :1]
        same = [causal_delta_rule(q, k, v, beta, mask, state, chunk_size=chunk, log_decay=decays)[0]
                for decays in (per_head.expand(-1, -1, -1, 8), per_head[..., 0])]
        torch.testing.assert_close(*same, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strength", [4.0, 12.0])  # past the chunk's split: each block's split holds / does not
@pytest.mark.parametrize("chunk", [32, 64])
def test_kdas_decay_in_chunks_of_blocks_equals_the_update_values_and_gradients(chunk, strength):
    """Chunks of 32 and 64 (blocks of 16) where a chunk decays too strongly for one split, so its products come in
    blocks: the outputs and state against the float64 update, the gradients against the recurrence's."""
    q, k, v, beta = inputs(batch=1, heads=2, n=70)
    log_decay = -strength * torch.rand(1, 2, 70, 8, generator=torch.Generator().manual_seed(2))
    want_y, want_s = reference(q, k, v, beta, log_decay=log_decay)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, beta, log_decay)]
    y, s = causal_delta_rule(*leaves[:4], chunk_size=chunk, log_decay=leaves[4])
    torch.testing.assert_close(y.double(), want_y, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), want_s, atol=2e-5, rtol=1e-5)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    ours = torch.autograd.grad((y * weights).sum() + s.sum(), leaves)
    steps = [t.clone().requires_grad_() for t in (q, k, v, beta, log_decay)]
    y_steps, s_steps = naive_delta_rule(*steps[:4], log_decay=steps[4])
    theirs = torch.autograd.grad((y_steps * weights).sum() + s_steps.sum(), steps)
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_decay_of_the_wrong_shape_is_refused_with_the_shapes_that_work():
    q, k, v, beta = inputs()
    with pytest.raises(ValueError, match=r"\(batch, heads, n, d_k\) \(one per key feature, KDA\)"):
        causal_delta_rule(q, k, v, beta, log_decay=torch.zeros(2, 3, 19, 5))


def test_a_decay_far_beyond_float32s_range_neither_overflows_nor_loses_the_last_write():
    """log alpha = -100 a token: the decay across a chunk of 16 is e^-1,600. Every exponent the chunked form takes
    is <= 0, so nothing overflows; the state holds only the last token's write, beta_t k_t v_t^T."""
    q, k, v, beta = inputs(batch=1, heads=2, n=40)
    log_decay = torch.full((1, 2, 40), -100.0)
    y, s = causal_delta_rule(q, k, v, beta, chunk_size=16, log_decay=log_decay)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    last = beta[:, :, -1, None, None] * k[:, :, -1, :, None] * v[:, :, -1, None, :]
    torch.testing.assert_close(s, last, atol=1e-6, rtol=1e-5)


def test_a_prompt_in_pieces_equals_the_prompt_at_once():
    q, k, v, beta = inputs(n=30)
    whole, final = causal_delta_rule(q, k, v, beta, chunk_size=8)
    first, state = causal_delta_rule(q[:, :, :11], k[:, :, :11], v[:, :, :11], beta[:, :, :11], chunk_size=8)
    rest, state = causal_delta_rule(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], beta[:, :, 11:], state=state,
                                    chunk_size=8)
    torch.testing.assert_close(torch.cat([first, rest], 2), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_feature", [False, True])
def test_gradients_of_the_chunked_form_equal_those_of_the_recurrence(per_feature):
    log_decay = -torch.rand(2, 3, 13, *((8,) if per_feature else ()), generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (*inputs(n=13), log_decay)]
    y, s = causal_delta_rule(*leaves[:4], chunk_size=4, log_decay=leaves[4])
    (y.square().sum() + s.sum()).backward()
    chunked = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    y, s = naive_delta_rule(*leaves[:4], log_decay=leaves[4])
    (y.square().sum() + s.sum()).backward()
    for got, want in zip(chunked, (t.grad for t in leaves)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_weights_applied_to_the_values_give_the_outputs():
    q, k, v, beta = inputs()
    weights = delta_rule_weights(q, k, beta)
    assert weights.shape == (2, 3, 19, 19) and weights.triu(1).abs().max() == 0  # causal
    torch.testing.assert_close((weights.double() @ v.double()), reference(q, k, v, beta)[0], atol=2e-5, rtol=1e-5)


def test_a_key_written_twice_reads_back_its_last_value_where_the_sum_mixes_both():
    """The rule's reason to exist: at beta = 1 a unit key's second value replaces its first. The additive state
    S + k v^T reads back v1 + v2 for the same key."""
    d = 6
    keys = torch.eye(d)[[0, 1, 0]]  # key 0, key 1, key 0 again
    values = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    q = k = keys[None, None]
    y, s = causal_delta_rule(q, k, values[None, None], torch.ones(1, 1, 3))
    torch.testing.assert_close(y[0, 0, 2], values[2])  # key 0 reads its second value only
    torch.testing.assert_close(s[0, 0, 1], values[1])  # key 1's value is untouched by key 0's rewrite
    additive = (keys.T @ values)  # the sum of k v^T: key 0 holds v0 + v2
    torch.testing.assert_close(additive[0], values[0] + values[2])


def test_float32_chunks_stay_on_the_float64_reference_over_a_long_sequence():
    """The float32 chunked form's rounding does not grow along the sequence: 2,000 positions in chunks of 64 end on
    the float64 reference."""
    q, k, v, beta = inputs(batch=1, heads=1, n=2_000, d_k=4, d_v=4)
    y, s = causal_delta_rule(q, k, v, beta, chunk_size=64)
    want_y, want_s = reference(q, k, v, beta)
    torch.testing.assert_close(s.double(), want_s, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y.double(), want_y, atol=1e-4, rtol=1e-4)
