"""Layer-1 math against independent references: softmax attention, the quadratic form, hand-made sums."""

import math
import os
import socket

import pytest
import torch
from helpers import draw, qkv
import torch.multiprocessing as mp

from hf_linear_attn.feature_maps import FavorFeatureMap, build_feature_map
from hf_linear_attn.linear_attention import bidirectional_linear_attention, linear_attention_weights
from hf_linear_attn.linformer_projection import linformer_attention, project_sequence

pytestmark = pytest.mark.usefixtures("on_each_device")  # every test here on the CPU and on CUDA


def softmax_attention(q, k, v, key_mask=None):
    """Plain materialised softmax attention, the reference."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v


def quadratic_reference(phi_q, phi_k, v, key_mask, eps):
    """out_i = sum_j a_ij v_j / (sum_j a_ij + eps), a_ij = phi(q_i).phi(k_j) over real keys j: explicit sums."""
    a = torch.einsum("bhim,bhjm->bhij", phi_q.double(), phi_k.double())
    if key_mask is not None:
        a = a * key_mask[:, None, None, :].double()
    return torch.einsum("bhij,bhjd->bhid", a, v.double()) / (a.sum(-1, keepdim=True) + eps)


def test_linformer_with_identity_projection_equals_softmax_attention():
    q, k, v = qkv(n=12)
    eye = torch.eye(12)[None]  # k = n, E = F = I
    out, weights = linformer_attention(q, k, v, eye, eye, need_weights=True)
    torch.testing.assert_close(out, softmax_attention(q, k, v), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 12))
    fast, _ = linformer_attention(q, k, v, eye, eye)  # the SDPA path
    torch.testing.assert_close(fast, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("matrices", [3, 1])  # one matrix per head, or one shared by the heads
@pytest.mark.parametrize("layout", ["contiguous", "head-split view"])
def test_linformer_projection_slices_first_columns_and_drops_pads(matrices, layout):
    g = torch.Generator().manual_seed(1)
    x = draw(g, 2, 3, 5, 4)
    if layout == "head-split view":  # as the models make it: (B, n, H * d) -> (B, H, n, d) without a copy
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    e = draw(g, matrices, 7, 9)  # max length 9
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    x[1, :, 3:] = float("nan")  # pad rows must not leak, even as NaN
    for key_mask, real in ((mask, (5, 3)), (None, (5, 5))):
        out = project_sequence(x.nan_to_num() if key_mask is None else x, e, key_mask)
        assert out.shape == (2, 3, 7, 4)
        for b, n_real in enumerate(real):
            for h in range(3):
                expected = sum(e[h % matrices, :, j, None] * x[b, h, j].nan_to_num() for j in range(n_real))
                torch.testing.assert_close(out[b, h], expected)
    with pytest.raises(ValueError, match="exceeds the Linformer projection length 9"):
        project_sequence(torch.randn(1, 1, 10, 4), e)


@pytest.mark.parametrize("name", ["elu", "relu", "favor", "hedgehog"])
def test_linear_attention_equals_quadratic_form_values_and_gradients(name):
    torch.manual_seed(0)
    feature_map = build_feature_map(name, num_heads=3, head_dim=8, num_random_features=16)
    if name == "hedgehog":  # move off the identity start so the test covers a general W
        feature_map.weight.data += 0.3 * torch.randn_like(feature_map.weight)
    q, k, v = qkv()
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    phi_q, phi_k = feature_map(q, is_query=True), feature_map(k, is_query=False, key_mask=mask)
    out = bidirectional_linear_attention(phi_q, phi_k, v, mask, eps=1e-6)
    reference = quadratic_reference(phi_q, phi_k, v, mask, eps=1e-6)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-4)
    weights = linear_attention_weights(phi_q, phi_k, mask, eps=1e-6)
    torch.testing.assert_close((weights @ v).double(), reference, atol=1e-5, rtol=1e-4)

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    phi_q2, phi_k2 = feature_map(q, is_query=True), feature_map(k, is_query=False, key_mask=mask)
    ref_grads = torch.autograd.grad(quadratic_reference(phi_q2, phi_k2, v, mask, 1e-6), (q, k, v), grad_out.double())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-4)
    assert grads[1][1, :, 6:].abs().max() == 0 and grads[2][1, :, 6:].abs().max() == 0  # pads get no gradient


def test_pads_are_removed_after_the_feature_map():
    """elu + 1 maps a zeroed key to ones: masking K before phi would leave pads in the normaliser."""
    q, k, v = qkv(b=1, n=6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    phi = build_feature_map("elu", 3, 8)
    padded = bidirectional_linear_attention(phi(q, True), phi(k, False), v, mask)
    alone = bidirectional_linear_attention(phi(q, True), phi(k[:, :, :4], False), v[:, :, :4])
    torch.testing.assert_close(padded[:, :, :4], alone[:, :, :4])
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[..., 4:, :], v_nan[..., 4:, :] = float("nan"), float("inf")
    with_nan = bidirectional_linear_attention(phi(q, True), phi(k_nan, False), v_nan, mask)
    torch.testing.assert_close(with_nan, padded)


def test_favor_error_against_softmax_shrinks_with_more_features():
    torch.manual_seed(0)
    q, k, v = (0.5 * t for t in qkv(b=1, h=4, n=64, d=16, seed=3))
    exact = softmax_attention(q, k, v)
    errors = {}
    for m in (8, 64, 512):
        errs = []
        for seed in range(4):
            fm = FavorFeatureMap(16, m)
            fm.redraw(torch.Generator().manual_seed(seed))
            out = bidirectional_linear_attention(fm(q, True), fm(k, False), v)
            errs.append((out - exact).pow(2).mean().sqrt())
        errors[m] = torch.stack(errs).mean().item()
    assert errors[64] < errors[8] and errors[512] < errors[64], errors
    assert errors[512] < errors[8] / 3, errors


def test_favor_key_stabiliser_ignores_pads_and_eval_is_deterministic():
    fm = FavorFeatureMap(8, 16)
    q, k, v = qkv(b=1)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 7:] = False
    k_big = k.clone()
    k_big[..., 7:, :] = 40.0  # huge pad keys would swamp an unmasked maximum and underflow the real ones
    out = bidirectional_linear_attention(fm(q, True), fm(k_big, False, mask), v, mask)
    alone = bidirectional_linear_attention(fm(q, True), fm(k[:, :, :7], False), v[:, :, :7])
    torch.testing.assert_close(out, alone)
    torch.testing.assert_close(fm(q, True), fm(q, True))  # fixed buffer: no hidden redraw


@pytest.mark.parametrize("scale", [1.0, 2.0, 3.0])
def test_favor_pair_equals_its_exact_estimator_whatever_the_norms(scale):
    """The attention layers map queries and keys together (FeatureMap.pair): FAVOR+ then equals, in float32, its
    own estimator computed in float64 without eps (weights proportional to sum_i exp(a_i(q) + b_i(k)), normalised
    over the real keys). Mapped separately, each side with its own stabiliser, eps swamps the normaliser once
    the norms grow (scale 2: most rows off by more than 1%), which the last check shows this test would catch."""
    torch.manual_seed(0)
    fm = FavorFeatureMap(64, 256)
    q, k = (scale * torch.randn(1, 2, 128, 64) for _ in range(2))
    v = torch.randn(1, 2, 128, 64)
    mask = torch.ones(1, 128, dtype=torch.bool)
    mask[:, 100:] = False

    def logits(x):  # w_i . x' - |x'|^2 / 2 in float64, x' = x / d^(1/4)
        x = x.double() * 64**-0.25
        return x @ fm.projection.double().T - 0.5 * (x * x).sum(-1, keepdim=True)

    scores = torch.logsumexp(logits(q)[:, :, :, None, :] + logits(k)[:, :, None, :, :], dim=-1)
    reference = scores.masked_fill(~mask[:, None, None, :], -torch.inf).softmax(-1) @ v.double()
    relative = lambda out: ((out.double() - reference).norm(dim=-1) / reference.norm(dim=-1))  # noqa: E731
    joint = bidirectional_linear_attention(*fm.pair(q, k, mask), v, mask)
    assert relative(joint).max() < 1e-3
    separate = bidirectional_linear_attention(fm(q, True), fm(k, False, mask), v, mask)
    assert scale < 2 or (relative(separate) > 0.01).float().mean() > 0.5


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_accumulation_is_float32_under_bf16(precision):
    """Both compute paths sum the 4,096 keys in float32 under bf16 autocast. ("auto" takes the bf16 path on CUDA,
    where this test, then comparing every path with the float32 path's reference, failed: the bf16 path rounds the
    features and S to bf16, and on the CPU, forced onto it, only 65% of its outputs equal that reference.)"""
    q, k, v = qkv(b=1, h=2, n=4096, d=16, dtype=torch.bfloat16)
    phi = build_feature_map("elu", 2, 16)
    phi_q, phi_k = phi(q, True), phi(k, False)
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        out = bidirectional_linear_attention(phi_q, phi_k, v, precision=precision)
    assert out.dtype == torch.bfloat16
    if precision == "float32":
        reference = quadratic_reference(phi_q, phi_k, v, None, 1e-6).to(torch.bfloat16)
        # Summing 4096 terms in bf16 drifts by many ulps; float32 sums round to the same bf16 value almost everywhere.
        agree = (out == reference).float().mean().item()
        assert agree > 0.95, agree
        return
    # The bf16 path rounds the features, and S = phi(K)^T V once, to bf16 (its documented roundings): against float64
    # sums of the same bf16 features it is off by a few roundings (0.021 of the mean |output| at most, on the CPU),
    # where the same function with S and z summed key by key in bf16, the drift this test guards against, is off by
    # 10x the mean.
    phi_q, phi_k = phi_q.bfloat16(), phi_k.bfloat16()
    exact = quadratic_reference(phi_q, phi_k, v, None, 1e-6)
    scale = exact.abs().mean()

    def error(o):
        return ((o.double() - exact).abs().max() / scale).item()

    state = torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16)
    z = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
    for j in range(4096):
        state = state + phi_k[:, :, j, :, None] * v[:, :, j, None, :]
        z = z + phi_k[:, :, j, None]
    drifted = (phi_q @ state).float() / ((phi_q.float() * z.float()).sum(-1, keepdim=True) + 1e-6)
    assert error(out) < 0.1 < error(drifted), (error(out), error(drifted))


def _redraw_worker(rank, port, path):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # different local RNG on each process
    fm = FavorFeatureMap(8, 16)
    fm.redraw()
    torch.save(fm.projection, os.path.join(path, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_favor_redraw_is_identical_on_every_distributed_process(tmp_path):
    if torch.get_default_device().type != "cpu":
        pytest.skip("the gloo processes and their draws live on the CPU: the [cpu] instance is this test")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_redraw_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    p0, p1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)
    torch.manual_seed(100)
    local = FavorFeatureMap(8, 16)
    local.redraw()
    torch.testing.assert_close(p0, local.projection, rtol=0, atol=0)  # rank 0's own draw was broadcast


@pytest.mark.parametrize("init", ["pooling", "multiscale"])
def test_row_starts_are_the_first_column_each_structured_row_covers(init):
    """row_starts (plain ints, for models built on the meta device) against the matrices themselves; an input reaches
    a row once its length passes the row's start."""
    from hf_linear_attn.linformer_projection import multiscale_matrix, pooling_matrix, reached_rows, row_starts

    build = multiscale_matrix if init == "multiscale" else pooling_matrix
    for k, n in ((64, 512), (12, 16), (7, 100), (16, 16), (1, 9)):
        covered = build(k, n) > 0
        assert row_starts(init, k, n) == [int(row.nonzero()[0]) for row in covered]
    starts = torch.tensor(row_starts(init, 12, 16))
    mask = torch.arange(16)[None, :] < torch.tensor([16, 7, 0])[:, None]  # full, 7 real tokens, all pads
    reached = reached_rows(starts, mask, 16)
    assert reached[0].all() and reached[2].tolist() == [True] + [False] * 11  # an all-pad row keeps row 0
    assert reached[1].tolist() == (starts < 7).tolist()
