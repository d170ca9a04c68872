"""Our causal kernels against a peer implementation: flash-linear-attention's own torch reference forms
(``fla/ops/<op>/naive.py``, fla-core 0.6.0 in the test extra; loaded by path, as the package's __init__ needs triton).

The float64 loops in the other math tests are written here from the papers; these check that we read the papers as
the field's reference code does: the conventions (where the decay multiplies, where beta goes, RetNet's rates, the
start state's layout), not only the algebra. Ops: linear attention, RetNet's retention, simple GLA, GLA, the delta
rule, Gated DeltaNet and Kimi Delta Attention (KDA: a decay per key feature).

fla's forms compute numerators only (no normaliser) and scale q by d^-1/2; our additive kernels divide by
phi(q) . z, so their numerator and normaliser are two fla calls (the second on values of ones, as our CUDA path calls
fla's kernel), and q is multiplied by d^1/2 where fla's scale is fixed."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.suites import load_fla_naive
from hf_linear_attn import causal_delta_rule, delta_rule_qk
from hf_linear_attn.configuration_linear_gpt2 import retnet_decay_rates
from hf_linear_attn.decayed_linear_attention import causal_decayed_linear_attention
from hf_linear_attn.linear_attention import causal_linear_attention

B, H, N, D, DV = 2, 3, 37, 8, 5


@pytest.fixture(scope="module")
def fla():
    try:
        return {op: load_fla_naive(op) for op in ("linear_attn", "simple_gla", "gla", "retention", "delta_rule",
                                                  "gated_delta_rule", "kda")}
    except ImportError as error:  # the test extra installs it; CI always has it
        import os

        if os.environ.get("CI"):
            raise
        pytest.skip(f"{error}")


def features(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    phi_q, phi_k = (F.elu(torch.randn(B, H, n, D, generator=g)) + 1 for _ in range(2))
    return phi_q, phi_k, torch.randn(B, H, n, DV, generator=g), g


def bthd(*tensors):
    """(B, H, n, d) -> fla's (B, n, H, d) layout."""
    return [t.transpose(1, 2).contiguous() for t in tensors]


def close(ours, peer, tol=2e-5):
    torch.testing.assert_close(ours, peer, atol=tol * max(1.0, peer.abs().max().item()), rtol=tol)


def test_linear_attention_equals_flas_normalised_recurrence_and_carries_its_state(fla):
    phi_q, phi_k, v, _ = features()
    ours, (s, z) = causal_linear_attention(phi_q, phi_k, v)
    peer, (s_peer, k_sum) = fla["linear_attn"].naive_recurrent_linear_attn(
        *bthd(phi_q, phi_k, v), scale=1.0, normalize=True, output_final_state=True)
    close(ours, peer.transpose(1, 2))
    close(s, s_peer)
    close(z, k_sum[:, 0])
    # a second call from the first's state, as a prompt then its continuation
    q2, k2, v2, _ = features(n=11, seed=1)
    ours2, _ = causal_linear_attention(q2, k2, v2, state=(s, z))
    peer2, _ = fla["linear_attn"].naive_recurrent_linear_attn(
        *bthd(q2, k2, v2), scale=1.0, normalize=True, initial_state=(s_peer, k_sum), output_final_state=True)
    close(ours2, peer2.transpose(1, 2))


def numerator_over_normaliser(peer_call, phi_q, phi_k, v, decay, eps=1e-6):
    """fla's numerator phi(q)^T S_t over its normaliser phi(q)^T z_t (the same recurrence on values of ones)."""
    numerator = peer_call(phi_q, phi_k, v, decay)
    normaliser = peer_call(phi_q, phi_k, torch.ones_like(v[..., :1]), decay)
    return numerator / (normaliser + eps)


@pytest.mark.parametrize("form", ["chunks", "scan"])
def test_the_fixed_decay_is_retnets_as_flas_retention_computes_it(fla, form):
    """state_decay="fixed": per head the rate 1 - 2^(-5-h) (retnet_decay_rates), as fla's naive_retention builds
    its decay matrix itself; so this checks our rates as well as the kernel."""
    phi_q, phi_k, v, _ = features()
    log_rates = torch.tensor(retnet_decay_rates(H)).log().view(1, H, 1, 1).expand(1, H, N, 1)
    ours, _ = causal_decayed_linear_attention(phi_q, phi_k, v, log_rates, chunk_size=16, form=form)

    def retention(q, k, values, _):
        return fla["retention"].naive_retention(q * D ** 0.5, k, values)

    close(ours, numerator_over_normaliser(retention, phi_q, phi_k, v, None))


@pytest.mark.parametrize("form", ["chunks", "scan"])
def test_a_decay_per_head_and_token_equals_flas_simple_gla(fla, form):
    phi_q, phi_k, v, g = features()
    log_decay = F.logsigmoid(torch.randn(B, H, N, 1, generator=g) + 2)  # about 0.9 a token, varying
    ours, (s, _) = causal_decayed_linear_attention(phi_q, phi_k, v, log_decay, chunk_size=16, form=form)

    def simple_gla(q, k, values, decay):
        out, _ = fla["simple_gla"].naive_recurrent_simple_gla(*bthd(q, k, values), decay[..., 0].transpose(1, 2),
                                                              scale=1.0)
        return out.transpose(1, 2)

    close(ours, numerator_over_normaliser(simple_gla, phi_q, phi_k, v, log_decay))


@pytest.mark.parametrize("form", ["chunks", "scan"])
def test_a_decay_per_feature_equals_flas_gla(fla, form):
    """GLA's gate: one decay per key feature and token, log a <= 0, applied to the state's rows."""
    phi_q, phi_k, v, g = features()
    log_decay = F.logsigmoid(torch.randn(B, H, N, D, generator=g)) / 16
    ours, _ = causal_decayed_linear_attention(phi_q, phi_k, v, log_decay, chunk_size=16, form=form)

    def gla(q, k, values, decay):  # fla's naive GLA scales q by d^-1/2 without a parameter
        out, _ = fla["gla"].naive_recurrent_gla(*bthd(q * D ** 0.5, k, values, decay))
        return out.transpose(1, 2)

    close(ours, numerator_over_normaliser(gla, phi_q, phi_k, v, log_decay))


def delta_inputs(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = delta_rule_qk(torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g))
    return q, k, torch.randn(B, H, n, DV, generator=g), torch.rand(B, H, n, generator=g), g


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_the_delta_rule_equals_flas_recurrence_from_a_start_state(fla, chunk):
    q, k, v, beta, g = delta_inputs()
    start = torch.randn(B, H, D, DV, generator=g)
    ours, s = causal_delta_rule(q, k, v, beta, state=start, chunk_size=chunk)
    peer, s_peer = fla["delta_rule"].delta_rule_recurrence(q * D ** 0.5, k, v, beta, initial_state=start.clone())
    close(ours, peer)
    close(s, s_peer)


def test_the_delta_rule_equals_flas_chunkwise_wy_form(fla):
    """fla's chunk form (the WY representation by forward substitution; ours solves the triangular system)."""
    q, k, v, beta, _ = delta_inputs(n=64)
    ours, s = causal_delta_rule(q, k, v, beta, chunk_size=16)
    peer, s_peer = fla["delta_rule"].delta_rule_chunkwise(q * D ** 0.5, k, v, beta, chunk_size=16)
    close(ours, peer)
    close(s, s_peer)


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_gated_deltanet_equals_flas_recurrence_from_a_start_state(fla, chunk):
    """Gated DeltaNet: the state fades by alpha_t = exp(g_t) before the rule writes, as fla's reference orders it."""
    q, k, v, beta, g = delta_inputs()
    log_decay = F.logsigmoid(torch.randn(B, H, N, generator=g) + 1)
    start = torch.randn(B, H, D, DV, generator=g)
    ours, s = causal_delta_rule(q, k, v, beta, state=start, chunk_size=chunk, log_decay=log_decay)
    peer, s_peer = fla["gated_delta_rule"].naive_recurrent_gated_delta_rule(
        *bthd(q, k, v), beta.transpose(1, 2), log_decay.transpose(1, 2), scale=1.0, initial_state=start.clone(),
        output_final_state=True)
    close(ours, peer.transpose(1, 2))
    close(s, s_peer)
    # and fla's chunk reference at a length its chunks divide
    q, k, v, beta, g = delta_inputs(n=64, seed=1)
    log_decay = F.logsigmoid(torch.randn(B, H, 64, generator=g) + 1)
    ours, s = causal_delta_rule(q, k, v, beta, chunk_size=chunk, log_decay=log_decay)
    peer, s_peer = fla["gated_delta_rule"].naive_chunk_gated_delta_rule(
        *bthd(q, k, v), log_decay.transpose(1, 2), beta.transpose(1, 2), chunk_size=16, scale=1.0,
        output_final_state=True)
    close(ours, peer.transpose(1, 2))
    close(s, s_peer)


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_a_decay_per_key_feature_equals_flas_kda(fla, chunk):
    """Kimi Delta Attention: each row of the state fades at its own rate, Diag(alpha_t), before the rule writes."""
    q, k, v, beta, g = delta_inputs(n=64)
    log_decay = F.logsigmoid(torch.randn(B, H, 64, D, generator=g) + 2)
    start = torch.randn(B, H, D, DV, generator=g)
    ours, s = causal_delta_rule(q, k, v, beta, state=start, chunk_size=chunk, log_decay=log_decay)
    fla_args = (*bthd(q, k, v, log_decay), beta.transpose(1, 2))
    for form in (fla["kda"].naive_recurrent_kda, fla["kda"].naive_chunk_kda):
        peer, s_peer = form(*fla_args, scale=1.0, initial_state=start.clone(), output_final_state=True)
        close(ours, peer.transpose(1, 2))
        close(s, s_peer)
