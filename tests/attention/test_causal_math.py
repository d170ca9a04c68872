"""Causal linear attention: chunked (scan and parallel) and recurrent forms against the quadratic masked form."""

import pytest
import torch
from helpers import draw, fla_stand_in, qkv

from hf_linear_attn.feature_maps import build_feature_map
from hf_linear_attn.linear_attention import causal_linear_attention, recurrent_linear_attention_step

pytestmark = pytest.mark.usefixtures("on_each_device")  # every test here on the CPU and on CUDA


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


@pytest.mark.parametrize("by_matmul", [False, True], ids=["broadcast", "matmul"])
def test_both_forms_of_the_steps_query_state_product_equal_float64(by_matmul):
    """The recurrent step's phi(q) S: a broadcast product and sum on CPUs, a batched matmul elsewhere (which the CPU
    run would never reach by itself, so both are forced here), against float64."""
    from hf_linear_attn.linear_attention import _query_state_product

    g = torch.Generator().manual_seed(5)
    phi_q, s = draw(g, 3, 4, 1, 8).exp(), draw(g, 3, 4, 8, 6)
    got = _query_state_product(phi_q, s, by_matmul=by_matmul)
    assert got.shape == (3, 4, 1, 6) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), phi_q.double() @ s.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [False, True])
def test_causal_form_accumulates_in_float32_under_bf16(monkeypatch, native):
    """Under autocast with bf16 values and the float32 features a feature map returns: without native bf16 the
    float32 path (the output is the float64 result rounded to bf16 almost everywhere); with it, the bf16 compute path
    (bf16 features and products, within bf16 rounding of the float32 path's error). The state and z stay float32."""
    import hf_linear_attn.linear_attention as la

    monkeypatch.setattr(la, "native_bf16", lambda device_type: native)
    phi = build_feature_map("elu", 2, 16)
    q, k, v = qkv(b=1, h=2, n=2048, d=16, dtype=torch.bfloat16)
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        phi_q, phi_k = phi(q, True), phi(k, False)
        out, (s, z) = causal_linear_attention(phi_q, phi_k, v, chunk_size=64)
    assert phi_q.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert s.dtype == torch.float32 and z.dtype == torch.float32
    exact = causal_quadratic_reference(phi_q.double(), phi_k.double(), v.double(), 1e-6)
    if native:
        full, _ = causal_linear_attention(phi_q, phi_k, v.float(), chunk_size=64)
        assert _relative(out, exact) <= _relative(full, exact) + BF16_ROUNDING
    else:
        assert (out == exact.to(torch.bfloat16)).float().mean().item() > 0.95


# ------------------------------------------------------------------------- the bf16 compute path (issue 29)

def _bf16_features(b, h, n, m, seed):
    g = torch.Generator().manual_seed(seed)
    phi_q = (torch.nn.functional.elu(draw(g, b, h, n, m)) + 1).bfloat16()
    phi_k = (torch.nn.functional.elu(draw(g, b, h, n, m)) + 1).bfloat16()
    return phi_q, phi_k, draw(g, b, h, n, m).bfloat16()


def _relative(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


BF16_ROUNDING = 2.0**-8  # unit roundoff of bf16: what rounding the inputs (or the output) to bf16 costs


def test_bf16_compute_path_against_float64_at_n_16384():
    """bf16 products with the state, z and the normaliser in float32: at n = 16,384 the final state S stays within bf16
    rounding (2^-8, relative L2) of float64 and its error does not grow with n (each chunk's product is rounded once,
    then summed in float32), z within 1e-6; the outputs are never worse than the all-float32 path by more than bf16
    rounding."""
    phi_q, phi_k, v = _bf16_features(1, 2, 16384, 16, seed=3)
    out, (s, z) = causal_linear_attention(phi_q, phi_k, v, chunk_size=64, form="scan", precision="bfloat16")
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32 and z.dtype == torch.float32
    ref, (s_ref, z_ref) = causal_linear_attention(phi_q.double(), phi_k.double(), v.double(), chunk_size=64)
    full, _ = causal_linear_attention(phi_q, phi_k, v, chunk_size=64, form="scan", precision="float32")
    assert _relative(s, s_ref) < BF16_ROUNDING and _relative(z, z_ref) < 1e-6  # z: float32 sums, never bf16 products
    _, (s_short, _) = causal_linear_attention(phi_q[:, :, :1024], phi_k[:, :, :1024], v[:, :, :1024], chunk_size=64,
                                              form="scan", precision="bfloat16")
    _, (s_short_ref, _) = causal_linear_attention(*(t[:, :, :1024].double() for t in (phi_q, phi_k, v)), chunk_size=64)
    assert _relative(s, s_ref) <= 1.5 * _relative(s_short, s_short_ref)  # 16x longer, no larger error
    assert _relative(out, ref) <= _relative(full, ref) + BF16_ROUNDING
    parallel, (s_par, _) = causal_linear_attention(phi_q, phi_k, v, chunk_size=256, form="parallel",
                                                   precision="bfloat16")
    assert _relative(parallel, ref) <= _relative(full, ref) + BF16_ROUNDING and _relative(s_par, s_ref) < BF16_ROUNDING


@pytest.mark.parametrize("form", ["scan", "parallel"])
def test_bf16_compute_path_gradients_against_float64(form):
    """Gradients of the bf16 path (three bf16 scans, a float32 normaliser) against autograd in float64, including a
    continued state; stated tolerance: relative L2 error 2e-2 (the all-float32 path's plus bf16 roundings)."""
    phi_q, phi_k, v = _bf16_features(2, 3, 300, 16, seed=4)
    s0 = torch.rand(2, 3, 16, 16, dtype=torch.float32)
    z0 = torch.rand(2, 3, 16, dtype=torch.float32)
    leaves = [t.clone().requires_grad_(True) for t in (phi_q, phi_k, v)]
    out, (s, z) = causal_linear_attention(*leaves, chunk_size=64, state=(s0, z0), form=form, precision="bfloat16")
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    ref, (s_ref, _) = causal_linear_attention(*exact, chunk_size=64, state=(s0.double(), z0.double()))
    assert _relative(out, ref) < 1e-2 and _relative(s, s_ref) < BF16_ROUNDING
    g, g_s = torch.randn_like(out, dtype=torch.float32), torch.randn_like(s)
    got = torch.autograd.grad((out.float() * g).sum() + (s * g_s).sum(), leaves)
    want = torch.autograd.grad((ref * g.double()).sum() + (s_ref * g_s.double()).sum(), exact)
    for a, b in zip(got, want):
        assert _relative(a, b) < 2e-2


def test_bf16_parallel_form_normaliser_and_state_gradients_against_float64():
    """The bf16 parallel form takes its normaliser from its own bf16 scores (row sums in float32) and z before each
    chunk: outputs, the final z and gradients for every input (the float32 S_0, z_0 included, with a loss on the final
    S and z) against float64 autograd, at a length that pads the last chunk."""
    phi_q, phi_k, v = _bf16_features(2, 3, 203, 16, seed=8)
    s0 = torch.rand(2, 3, 16, 16, dtype=torch.float32, requires_grad=True)
    z0 = torch.rand(2, 3, 16, dtype=torch.float32, requires_grad=True)
    leaves = [t.clone().requires_grad_(True) for t in (phi_q, phi_k, v)] + [s0, z0]
    out, (s, z) = causal_linear_attention(*leaves[:3], chunk_size=32, state=(s0, z0), form="parallel",
                                          precision="bfloat16")
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    ref, (s_ref, z_ref) = causal_linear_attention(*exact[:3], chunk_size=32, state=(exact[3], exact[4]), form="scan")
    assert _relative(out, ref) < 1e-2 and _relative(s, s_ref) < BF16_ROUNDING and _relative(z, z_ref) < 1e-6
    g, g_s, g_z = torch.randn_like(out, dtype=torch.float32), torch.randn_like(s), torch.randn_like(z)
    got = torch.autograd.grad((out.float() * g).sum() + (s * g_s).sum() + (z * g_z).sum(), leaves)
    want = torch.autograd.grad((ref * g.double()).sum() + (s_ref * g_s.double()).sum() + (z_ref * g_z.double()).sum(),
                               exact)
    for a, b in zip(got, want):
        assert _relative(a, b) < 2e-2


@pytest.mark.parametrize("chunks", [1, 2, 7])
def test_exclusive_chunk_prefix_against_cumsum_values_and_gradients(chunks):
    """What precedes each chunk, x_0 then x_0 + x_1 ... (a loop of adds on the CPU, a cumsum elsewhere): equal to the
    explicit exclusive cumsum, and torch.autograd.gradcheck passes in float64."""
    from hf_linear_attn.linear_attention import exclusive_chunk_prefix

    g = torch.Generator(device="cpu").manual_seed(9)
    x0 = draw(g, 2, 3, 4, 5).double().requires_grad_(True)
    x = draw(g, 2, 3, chunks, 4, 5).double().requires_grad_(True)
    want = torch.cumsum(torch.cat([x0.unsqueeze(2), x[:, :, :-1]], dim=2), dim=2)
    torch.testing.assert_close(exclusive_chunk_prefix(x0, x), want)
    assert torch.autograd.gradcheck(exclusive_chunk_prefix, (x0, x))


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("chunks", [1, 2, 7])
def test_exclusive_chunk_suffix_both_forms_against_explicit_sums(monkeypatch, chunks, compiling):
    """The backward's suffix sums (what each chunk's own state receives: the final gradient and every later chunk's;
    what x_0 receives: all of them): the loop of adds and the flipped-cumsum form (taken off the CPU and under
    torch.compile) both equal the explicit sums."""
    import hf_linear_attn.linear_attention as la

    monkeypatch.setattr(la.torch.compiler, "is_compiling", lambda: compiling)
    g = torch.Generator(device="cpu").manual_seed(11)
    grads, final = draw(g, 2, 3, chunks, 4, 5).double(), draw(g, 2, 3, 4, 5).double()
    out, first = la.exclusive_chunk_suffix(grads, final)
    for j in range(chunks):
        torch.testing.assert_close(out[:, :, j], final + grads[:, :, j + 1:].sum(2))
    torch.testing.assert_close(first, final + grads.sum(2))


def test_bidirectional_bf16_compute_path_against_float64():
    from hf_linear_attn.linear_attention import bidirectional_linear_attention

    phi_q, phi_k, v = _bf16_features(1, 2, 4096, 16, seed=5)
    mask = torch.ones(1, 4096, dtype=torch.bool)
    mask[:, 4000:] = False
    out = bidirectional_linear_attention(phi_q, phi_k, v, key_mask=mask, precision="bfloat16")
    ref = bidirectional_linear_attention(phi_q.double(), phi_k.double(), v.double(), key_mask=mask)
    full = bidirectional_linear_attention(phi_q, phi_k, v, key_mask=mask, precision="float32")
    assert out.dtype == torch.bfloat16
    assert _relative(out, ref) <= _relative(full, ref) + BF16_ROUNDING


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("native", [False, True])
def test_auto_precision_takes_the_bf16_path_exactly_where_bf16_is_native_and_pays(monkeypatch, native, training, long):
    """"auto" on bf16 inputs: the bf16 compute path on a device with native bf16 products (CUDA always; AVX512-BF16 /
    AMX CPUs when training, and for a forward below CPU_BF16_FORWARD_BELOW positions, where it was measured faster
    than the float32 path), the float32 path elsewhere (an AVX2 CPU would emulate every bf16 product); explicit
    choices are kept."""
    import hf_linear_attn.linear_attention as la

    monkeypatch.setattr(la, "native_bf16", lambda device_type: native)
    n = la.CPU_BF16_FORWARD_BELOW // 2 if long else 200  # batch 1 x 2 heads x n positions: at the bound, or far below
    phi_q, phi_k, v = _bf16_features(1, 2, n, 8, seed=6)
    if training:
        phi_q.requires_grad_(True)
    kw = dict(chunk_size=64, form="scan")
    auto, (s_auto, _) = causal_linear_attention(phi_q, phi_k, v, **kw)
    bf16, (s_bf16, _) = causal_linear_attention(phi_q, phi_k, v, precision="bfloat16", **kw)
    f32, (s_f32, _) = causal_linear_attention(phi_q, phi_k, v, precision="float32", **kw)
    assert not torch.equal(s_bf16, s_f32)  # the two paths differ, so the comparison below can tell them apart
    takes_bf16 = native and (training or not long or torch.get_default_device().type != "cpu")
    assert torch.equal(s_auto, s_bf16 if takes_bf16 else s_f32) and torch.equal(auto, bf16 if takes_bf16 else f32)
    both = (phi_q.float(), phi_k.float(), v.float())  # float32 inputs: the float32 path whatever the device
    assert torch.equal(causal_linear_attention(*both, **kw)[0], causal_linear_attention(*both, precision="float32",
                                                                                         **kw)[0])


def test_native_bf16_on_a_cpu_is_what_its_instruction_sets_say_not_onednns_emulation(monkeypatch):
    """"auto" precision takes the bf16 path only where the CPU multiplies bf16 natively (AVX512-BF16 / AMX). oneDNN says
    yes to bf16 on any AVX-512 CPU, which emulates it: on an Intel Xeon with AVX-512 alone bf16 matmuls ran about 5x
    slower than float32, and native_bf16 said yes there. The independent reference: /proc/cpuinfo's flags, as the training
    precision reads them."""
    import hf_linear_attn.linear_attention as la
    from hf_linear_attn.training.accelerator import CPUINFO, cpu_has_native_bf16

    la.native_bf16.cache_clear()
    try:
        if CPUINFO.is_file():
            assert la.native_bf16("cpu") == cpu_has_native_bf16()
        # an AVX-512 CPU without bf16 products, as the Xeon above: oneDNN's yes is not enough
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
        for avx512_bf16, amx, native in ((False, False, False), (True, False, True), (False, True, True)):
            monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
            monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
            la.native_bf16.cache_clear()
            assert la.native_bf16("cpu") is native
    finally:
        monkeypatch.undo()
        la.native_bf16.cache_clear()  # the machine's own answer again for the tests after this one


def test_auto_precision_and_form_follow_the_device_and_the_table():
    from hf_linear_attn.linear_attention import CAUSAL_FORM_TABLE, choose_causal_form, native_bf16

    phi_q, phi_k, v = _bf16_features(1, 2, 200, 8, seed=6)
    assert isinstance(native_bf16("cpu"), bool)
    for (device, bf16, grad), rows in CAUSAL_FORM_TABLE.items():
        assert [r[0] for r in rows] == sorted(r[0] for r in rows) and rows[0][0] == 0
        for shortest, form, chunk in rows:
            assert choose_causal_form(device, bf16, shortest, grad) == (form, chunk)
    with pytest.raises(ValueError, match="precision must be"):
        causal_linear_attention(phi_q, phi_k, v, precision="fp8")


def test_auto_form_is_chosen_by_batch_times_heads_times_length(monkeypatch):
    """The forms' cost grows with every (batch, head) pair's sequence, so the table counts positions, not n."""
    import hf_linear_attn.linear_attention as la

    asked = []
    monkeypatch.setattr(la, "choose_causal_form", lambda *args: asked.append(args) or ("scan", 16))
    phi_q, phi_k, v = (torch.rand(3, 2, 40, 8) + 0.1 for _ in range(3))
    out, _ = la.causal_linear_attention(phi_q, phi_k, v)
    assert asked == [(torch.get_default_device().type, False, 3 * 2 * 40, False)]
    ref, _ = la.causal_linear_attention(phi_q, phi_k, v, form="parallel", chunk_size=64)
    torch.testing.assert_close(out, ref)  # every form computes the same function


# ------------------------------------------- flash-linear-attention's Triton kernel as the CUDA form (issue 40)

def test_auto_dispatches_the_bf16_path_to_the_fla_kernel_with_our_masking_and_normaliser(monkeypatch):
    """Where fla's kernel can run, "auto" gives it the bf16 path: two calls (the numerator, then the normaliser as
    the numerator of a block of ones started from z_0), features in (B, T, H, K), scale 1, no normalisation of its
    own, pads already zeroed in phi(K) and V, the float32 states in and out; the result equals the torch forms of the
    same path, values, states and gradients, also continuing from a state."""
    import hf_linear_attn.linear_attention as la

    calls = []
    monkeypatch.setattr(la, "fla_chunk_kernel", lambda device_type: fla_stand_in(calls))
    phi_q, phi_k, v = _bf16_features(2, 3, 45, 8, seed=7)
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, :6] = False  # left padding
    g = torch.Generator().manual_seed(8)
    s0, z0 = draw(g, 2, 3, 8, 8).abs(), draw(g, 2, 3, 8).abs()
    leaves = [t.clone().requires_grad_(True) for t in (phi_q, phi_k, v)]
    out, (s, z) = causal_linear_attention(*leaves, key_mask=mask, state=(s0, z0), precision="bfloat16")
    assert len(calls) == 2
    for call in calls:
        assert call["shape"] == (2, 45, 3, 8) and call["scale"] == 1.0 and call["normalize"] is False
        assert call["dtype"] == torch.bfloat16 and call["state_dtype"] == torch.float32
        assert not call["keys"][1, :6].any()  # pads zeroed before the kernel
    assert not calls[0]["values"][1, :6].any()
    assert calls[1]["values"].shape == (2, 45, 3, la.FLA_ONES_WIDTH) and (calls[1]["values"] == 1).all()
    torch_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    ref, (s_ref, z_ref) = causal_linear_attention(*torch_leaves, key_mask=mask, state=(s0, z0), precision="bfloat16",
                                                  form="parallel", chunk_size=16)
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    ref64, (s64, z64) = causal_linear_attention(*exact, key_mask=mask, state=(s0.double(), z0.double()),
                                                form="parallel", chunk_size=16)
    # the stand-in rounds the numerator and the normaliser to bf16 once each, as fla does
    assert _relative(out, ref.double()) < 2 * BF16_ROUNDING
    assert _relative(out, ref64) <= _relative(ref, ref64) + BF16_ROUNDING
    # the states are summed in float32, as fla sums them (the torch parallel form rounds each chunk's K^T V to bf16)
    assert _relative(s, s64) < 1e-6 and _relative(z, z64) < 1e-6
    assert _relative(s_ref, s64) < BF16_ROUNDING and _relative(z_ref, z64) < 1e-6
    cotangent = draw(g, *out.shape)
    got = torch.autograd.grad((out.float() * cotangent).sum() + s.sum(), leaves)
    want = torch.autograd.grad((ref.float() * cotangent).sum() + s_ref.sum(), torch_leaves)
    # Gradients against float64: two bf16 paths each land about 2 roundings from it (dphi(Q) up to ~0.009 on
    # some draws), so they can differ from each other by more than either differs from the truth. The dispatch rounds
    # fla's numerator to bf16 (so its backward meets one rounding more): within 2x of the torch form's error (1.56x at
    # worst of 30 draws) and under 3 bf16 roundings. (Comparing the two paths with each other failed on 17 of 40
    # draws of these inputs.)
    truth = torch.autograd.grad((ref64 * cotangent.double()).sum() + s64.sum(), exact)
    for a, b, c in zip(got, want, truth):
        assert _relative(a, c) <= 2 * _relative(b, c) + 1e-4 and _relative(a, c) < 3 * BF16_ROUNDING
    # float32 inputs never go to fla (its float32 dots may run in tf32); neither does an explicit torch form
    causal_linear_attention(phi_q.float(), phi_k.float(), v.float())
    causal_linear_attention(phi_q, phi_k, v, precision="bfloat16", form="scan")
    assert len(calls) == 2


def test_the_fla_form_refuses_what_it_cannot_compute():
    phi_q, phi_k, v = _bf16_features(1, 2, 16, 8, seed=8)
    with pytest.raises(ValueError, match="bf16 path only"):
        causal_linear_attention(phi_q.float(), phi_k.float(), v.float(), form="fla")
    if torch.get_default_device().type != "cuda":
        with pytest.raises(ValueError, match="on a CUDA device"):
            causal_linear_attention(phi_q, phi_k, v, form="fla", precision="bfloat16")


def test_the_real_fla_kernel_equals_the_torch_forms_against_float64():
    """On CUDA with fla installed: fla's Triton chunk kernel, as dispatched, against float64 and the torch forms of
    the bf16 path (values within the torch form's error plus bf16 rounding; state within bf16 rounding; gradients)."""
    import hf_linear_attn.linear_attention as la

    if la.fla_chunk_kernel(torch.get_default_device().type) is None:
        pytest.skip("needs CUDA and flash-linear-attention (the 'fla' extra): scripts/gpu_check.sh runs it")
    phi_q, phi_k, v = _bf16_features(2, 4, 1000, 64, seed=9)
    mask = torch.ones(2, 1000, dtype=torch.bool)
    mask[0, :37] = False
    s0, z0 = torch.rand(2, 4, 64, 64), torch.rand(2, 4, 64)
    leaves = [t.clone().requires_grad_(True) for t in (phi_q, phi_k, v)]
    out, (s, z) = causal_linear_attention(*leaves, key_mask=mask, state=(s0, z0))  # auto: fla
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    ref, (s_ref, z_ref) = causal_linear_attention(*exact, key_mask=mask, state=(s0.double(), z0.double()))
    torch_out, (torch_s, _) = causal_linear_attention(*(t.detach() for t in leaves), key_mask=mask, state=(s0, z0),
                                                      form="scan", chunk_size=64)
    assert _relative(out, ref) <= _relative(torch_out, ref) + BF16_ROUNDING
    assert _relative(s, s_ref) < BF16_ROUNDING and _relative(z, z_ref) < 1e-6
    g = torch.randn_like(out, dtype=torch.float32)
    got = torch.autograd.grad((out.float() * g).sum(), leaves)
    want = torch.autograd.grad((ref * g.double()).sum(), exact)
    for a, b in zip(got, want):
        assert _relative(a, b) < 2e-2


def test_torch_compile_traces_the_causal_kernel_without_a_graph_break():
    """The machine check behind "auto" precision (native_bf16) is a constant to torch.compile: a user who compiles a
    model gets one graph for the kernel (it broke at the oneDNN bf16 query, an op that returns a bool, before)."""
    import hf_linear_attn.linear_attention as la

    from torch._dynamo.utils import counters

    la.native_bf16.cache_clear()  # traced from scratch, as in a fresh process
    torch._dynamo.reset()
    counters.clear()
    leaves = [t.requires_grad_(True) for t in _bf16_features(1, 2, 64, 8, seed=10)]
    compiled = torch.compile(lambda a, b, c: causal_linear_attention(a, b, c)[0], backend="eager")
    got = compiled(*leaves)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # against float64, not bit for bit against the eager call: on CUDA the compiled call took another path than the
    # eager one (the next test), 5.7% of the bf16 outputs one rounding step apart (an H100, the 2026-11-27 lease)
    eager = causal_linear_attention(*leaves)[0]
    ref = causal_linear_attention(*(t.detach().double() for t in leaves))[0]
    assert _relative(got, ref) <= _relative(eager, ref) + BF16_ROUNDING


def test_torch_compile_takes_the_path_the_eager_call_takes(monkeypatch, request):
    """A compiled call dispatches as the eager call does: the bf16 path, fla's kernel (here: real fla on CUDA; on the
    CPU a stand-in, with the bf16 path asked for, so the dispatch is traced on every CI machine)."""
    import hf_linear_attn.linear_attention as la

    device = torch.get_default_device().type
    if device == "cuda":
        if la.fla_chunk_kernel(device) is None:
            pytest.skip("needs flash-linear-attention (the 'fla' extra) on CUDA: scripts/gpu_check.sh runs it")
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "seen on an H100 (the 2026-11-27 lease, docs/gpu.md): the compiled call reached neither fla's kernel nor, "
            "by its error, the bf16 path; the cause is not found yet")))
    else:
        monkeypatch.setattr(la, "fla_chunk_kernel", lambda device_type: fla_stand_in([]))
    seen = []
    for name in ("_causal_bf16", "_causal_fla"):
        monkeypatch.setattr(la, name, lambda *a, _f=getattr(la, name), _n=name, **k: seen.append(_n) or _f(*a, **k))
    leaves = _bf16_features(1, 2, 64, 8, seed=10)
    precision = "auto" if device == "cuda" else "bfloat16"
    want = causal_linear_attention(*leaves, precision=precision)[0]
    assert seen == ["_causal_bf16", "_causal_fla"]
    seen.clear()
    torch._dynamo.reset()
    got = torch.compile(lambda a, b, c: causal_linear_attention(a, b, c, precision=precision)[0],
                        backend="eager")(*leaves)
    assert seen == ["_causal_bf16", "_causal_fla"], f"the compiled call reached {seen}"
    torch.testing.assert_close(got, want, rtol=BF16_ROUNDING, atol=0)
