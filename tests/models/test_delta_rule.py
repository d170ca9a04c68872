"""The delta rule (DeltaNet, ``state_update="delta"``), Gated DeltaNet (with ``state_decay``) and Kimi Delta
Attention (``delta_gate="feature"``) in the decoder: each
layer computes the rule on its own q, k, v, step sizes and gates (checked against the update written out in float64),
the rule adds only the step-size projection to the weights (the gate its own three), generation carries one d x d
state per head, and bad configs are refused with the fix. The decoder test
matrix (helpers.DECODER_VARIANTS / CONV_VARIANTS: linear-delta, linear-delta-conv, linear-gated-delta-conv,
linear-kda-conv) covers
the cache, padding, rollback, beam search, export and checkpoints."""

import math

import pytest
import torch
from helpers import DECODER_VARIANTS, causal_lm, random_ids

from hf_linear_attn import DeltaRuleStateLayer, LinearGPT2Config
from hf_linear_attn.configuration_linear_gpt2 import retnet_decay_rates


@pytest.mark.parametrize("variant,overrides", [
    ("linear-delta", {}), ("linear-gated-delta-conv", {}), ("linear-kda-conv", {}),  # KDA's: with its output gate
    ("linear-delta", {"delta_output_norm": "rms"}), ("linear-gated-delta-conv", {"delta_output_norm": "rms_gated"}),
])
def test_each_layer_applies_the_rule_to_its_own_q_k_v_step_sizes_and_gates(variant, overrides):
    """The layer against the rule written out in float64, then fla's o_norm where configured: RMSNorm per head
    (weights perturbed from ones, so a dropped weight fails), times silu(x W_g) (Gated DeltaNet's output gate) or
    KDA's sigmoid(x W_down W_up + b)."""
    model = causal_lm(variant, **overrides)
    attn = model.transformer.h[1].attn
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = attn(x)[0]
        qkv = attn.c_attn(x)
        if attn.has_short_conv:
            qkv = attn.short_conv(qkv, None, None)[0]
        q, k, v = (attn._split_heads(t).double() for t in qkv.split(32, dim=-1))
        beta = torch.sigmoid(attn.b_proj(x).double()).transpose(1, 2)  # (B, H, n)
        alpha = torch.ones(*beta.shape, 8, dtype=torch.float64)  # per key feature
        if variant == "linear-gated-delta-conv":  # Gated DeltaNet's gate, written out
            gate = attn.delta_gate
            alpha = torch.exp(-gate.A_log.double().exp() * torch.nn.functional.softplus(
                gate.a_proj(x).double() + gate.dt_bias.double())).transpose(1, 2)[..., None].expand(-1, -1, -1, 8)
            assert alpha.min() < 0.99  # the gate fades the state here: a dropped decay would fail the comparison
        if variant == "linear-kda-conv":  # KDA's: low-rank logits, dt_bias per head and feature, A per head
            gate = attn.delta_gate
            logits = (gate.f_proj[1](gate.f_proj[0](x)).double() + gate.dt_bias.double()).view(2, 11, 4, 8)
            alpha = torch.exp(-gate.A_log.double().exp()[:, None] * torch.nn.functional.softplus(logits))
            alpha = alpha.transpose(1, 2)  # (B, H, n, d_k)
            spread = alpha.std(-1)  # features of one head fade at different rates: a per-head gate fails this
            assert alpha.min() < 0.99 and spread.max() > 1e-3
    q, k = (torch.nn.functional.normalize(torch.nn.functional.silu(t), dim=-1) for t in (q, k))
    y = torch.zeros(v.shape, dtype=torch.float64)
    for b in range(2):
        for h in range(4):
            s = torch.zeros(8, 8, dtype=torch.float64)
            for t in range(11):
                kt, step = k[b, h, t][:, None], beta[b, h, t]
                s = (torch.eye(8, dtype=torch.float64) - step * kt @ kt.T) @ torch.diag(alpha[b, h, t]) @ s
                s = s + step * kt @ v[b, h, t][None]
                y[b, h, t] = s.T @ q[b, h, t]
    norm = attn.o_norm
    assert (norm is None) == (model.config.delta_output_norm is None)
    if norm is not None:
        with torch.no_grad():
            norm.weight.add_(0.3 * torch.randn(8, generator=torch.Generator().manual_seed(1)))
            got = attn(x)[0]
            y = y / (y.pow(2).mean(-1, keepdim=True) + model.config.layer_norm_epsilon).sqrt() * norm.weight.double()
            if model.config.delta_output_norm == "rms_gated":
                if variant == "linear-kda-conv":
                    g = torch.sigmoid(norm.g_proj[1](norm.g_proj[0](x)).double())
                else:
                    g = torch.nn.functional.silu(norm.g_proj(x).double())
                y = y * g.view(2, 11, 4, 8).transpose(1, 2)
    want = attn.c_proj(y.transpose(1, 2).reshape(2, 11, 32).float())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_rule_adds_only_a_step_size_projection_and_keeps_one_state_per_head():
    additive, delta = causal_lm("linear-elu"), causal_lm("linear-delta")
    extra = set(delta.state_dict()) - set(additive.state_dict())
    assert extra == {f"transformer.h.{i}.attn.b_proj.weight" for i in range(2)}
    assert set(additive.state_dict()) <= set(delta.state_dict())
    assert delta.transformer.h[0].attn.b_proj.weight.shape == (4, 32)  # one step size per head
    sizes = []
    for n in (5, 60):
        cache = delta(random_ids(2, n), use_cache=True).past_key_values
        layer = cache.layers[0]
        assert type(layer) is DeltaRuleStateLayer and [tuple(t.shape) for t in layer.state] == [(2, 4, 8, 8)]
        sizes.append(cache.state_bytes())
    assert sizes[0] == sizes[1] == 2 * 2 * 4 * 8 * 8 * 4  # layers x batch x heads x d x d x float32: not n


def test_the_rule_changes_what_the_model_computes():
    additive, delta = causal_lm("linear-elu"), causal_lm("linear-delta")
    delta.load_state_dict(additive.state_dict(), strict=False)  # the same weights but b_proj
    ids = random_ids(1, 20)
    assert (delta(ids).logits - additive(ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize("options,message", [
    ({"state_update": "replace"}, "state_update must be 'add'"),
    ({"state_update": "delta", "feature_map": "hedgehog"}, "maps q and k itself"),
    ({"state_update": "delta", "attention_window": 4}, "with attention_window"),
    ({"state_update": "delta", "state_decay": "gated", "gate_low_rank_dim": 8}, "Gated DeltaNet's gate \\(one per"),
    ({"delta_gate": "channel"}, "delta_gate must be 'head'"),
    ({"delta_gate": "feature"}, "set state_update='delta' and state_decay='gated'"),
    ({"state_update": "delta", "state_decay": "fixed", "delta_gate": "feature"}, "state_decay='fixed'"),
    ({"delta_output_norm": "rms"}, "normalises the delta rule's output, but state_update='add'"),
    ({"state_update": "delta", "delta_output_norm": "layer"}, "delta_output_norm must be None, 'rms'"),
    ({"delta_gate_dt_range": [1e-4, 1e-3]}, "starts the delta rule's gate, but state_update='add'"),
    ({"state_update": "delta", "state_decay": "fixed", "delta_gate_dt_range": [1e-4, 1e-3]}, "state_decay='fixed'"),
    *[({"state_update": "delta", "state_decay": "gated", "delta_gate_dt_range": bad}, "0 < dt_min <= dt_max")
      for bad in ([1e-3, 1e-4], [0, 1e-3], [1e-3])],
])
def test_bad_delta_configs_are_refused_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        DECODER_VARIANTS["linear-elu"](**options)


def test_a_hybrid_of_softmax_and_delta_layers_keeps_a_cache_of_each_kind():
    config = LinearGPT2Config(**{**DECODER_VARIANTS["linear-delta"]().to_dict(),
                                 "layer_types": ["full_attention", "linear_attention"]})
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    ids = random_ids(1, 12)
    cache = model(ids[:, :7], use_cache=True).past_key_values
    assert [type(layer).__name__ for layer in cache.layers] == ["KeyValueStateLayer", "DeltaRuleStateLayer"]
    steps = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), model(ids).logits[:, 7:], atol=1e-5, rtol=1e-5)


def test_gated_deltanet_fades_the_state_by_its_gate_and_starts_as_mamba2():
    """state_decay="gated" with the rule: Gated DeltaNet's per-head gate (a_proj, A_log, dt_bias), A in [1, 16] and
    softplus(dt_bias) in [0.001, 0.1] at init, alpha_t = exp(-A softplus(x W_a + dt_bias)); "fixed" takes RetNet's
    rates and adds no weight."""
    model = causal_lm("linear-gated-delta-conv")
    attn = model.transformer.h[0].attn
    extra = set(model.state_dict()) - set(causal_lm("linear-delta-conv").state_dict())
    assert extra == {f"transformer.h.{i}.attn.delta_gate.{name}" for i in range(2)
                     for name in ("a_proj.weight", "A_log", "dt_bias")}
    fresh = LinearGPT2Config(**{**DECODER_VARIANTS["linear-delta"]().to_dict(), "state_decay": "gated"})
    from transformers import AutoModelForCausalLM

    gate = AutoModelForCausalLM.from_config(fresh).transformer.h[1].attn.delta_gate
    assert ((gate.A_log.exp() >= 1) & (gate.A_log.exp() <= 16)).all()
    dt = torch.nn.functional.softplus(gate.dt_bias)
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all()
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alpha = torch.exp(-attn.delta_gate.A_log.double().exp()
                          * torch.nn.functional.softplus(attn.delta_gate.a_proj(x).double()
                                                         + attn.delta_gate.dt_bias.double())).transpose(1, 2)
        inputs = attn.per_token_inputs(x)
    torch.testing.assert_close(inputs["log_decay"].double().exp(), alpha)
    assert (alpha < 1).all() and (alpha > 0).all()
    fixed = causal_lm("linear-delta", state_decay="fixed").transformer.h[0].attn
    assert fixed.decay_rates == retnet_decay_rates(4) and not hasattr(fixed, "delta_gate")
    assert fixed.per_token_inputs(x)["log_decay"].exp().flatten().tolist() == pytest.approx(retnet_decay_rates(4))


@pytest.mark.parametrize("variant", ["linear-gated-delta-conv", "linear-kda-conv"])
def test_the_gate_starts_where_delta_gate_dt_range_says_and_loads_as_trained(variant, tmp_path):
    """delta_gate_dt_range: dt = softplus(dt_bias) drawn in the range (default: Mamba-2's, the same draws as naming
    [0.001, 0.1]), so [1e-4, 1e-3] starts every head's decay in [exp(-16e-3), exp(-1e-4)]; a checkpoint keeps the
    trained gate, not a new draw, and the range travels in its config."""
    from transformers import AutoModelForCausalLM

    default, named = causal_lm(variant), causal_lm(variant, delta_gate_dt_range=[0.001, 0.1])
    for (name, a), b in zip(default.state_dict().items(), named.state_dict().values()):
        assert torch.equal(a, b), name
    long = causal_lm(variant, delta_gate_dt_range=[1e-4, 1e-3])
    x = torch.zeros(1, 3, 32)  # the gate's start without the input's part: alpha = exp(-A dt)
    for layer, start in zip(long.transformer.h, default.transformer.h):
        dt = torch.nn.functional.softplus(layer.attn.delta_gate.dt_bias)
        assert ((dt >= 1e-4 * (1 - 1e-4)) & (dt <= 1e-3 * (1 + 1e-4))).all() and dt.std() > 0
        with torch.no_grad():
            alpha = layer.attn.per_token_inputs(x)["log_decay"].exp()
            alpha_default = start.attn.per_token_inputs(x)["log_decay"].exp()
        assert alpha.min() >= math.exp(-16e-3) - 1e-6 and alpha.max() <= math.exp(-1e-4) + 1e-6
        assert alpha_default.min() < 0.9  # Mamba-2's range starts some heads short
    with torch.no_grad():
        for layer in long.transformer.h:
            layer.attn.delta_gate.dt_bias.add_(1.0)  # "trained" away from any draw
    long.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.delta_gate_dt_range == [1e-4, 1e-3]
    for layer, saved in zip(loaded.transformer.h, long.transformer.h):
        assert torch.equal(layer.attn.delta_gate.dt_bias, saved.attn.delta_gate.dt_bias)
        assert torch.equal(layer.attn.delta_gate.A_log, saved.attn.delta_gate.A_log)


def test_kdas_gate_is_per_key_feature_and_starts_as_flas():
    """delta_gate="feature": f_proj (hidden -> head size -> heads x head size, no biases), A_log per head, dt_bias per
    head and feature (and, in this variant, fla's KDA output norm and gate, started at ones and a zero bias), A in
    [1, 16] and softplus(dt_bias) in [0.001, 0.1] at init; the cache is Gated DeltaNet's."""
    model = causal_lm("linear-kda-conv")
    extra = set(model.state_dict()) - set(causal_lm("linear-delta-conv").state_dict())
    assert extra == {f"transformer.h.{i}.attn.{name}" for i in range(2)
                     for name in ("delta_gate.f_proj.0.weight", "delta_gate.f_proj.1.weight", "delta_gate.A_log",
                                  "delta_gate.dt_bias", "o_norm.weight", "o_norm.g_proj.0.weight",
                                  "o_norm.g_proj.1.weight", "o_norm.g_proj.1.bias")}
    norm = model.transformer.h[0].attn.o_norm  # fla's KDA output gate: low rank (the head size), with a bias
    assert norm.g_proj[0].weight.shape == (8, 32) and norm.g_proj[1].weight.shape == (32, 8)
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.g_proj[1].bias, torch.zeros(32))
    gate = model.transformer.h[0].attn.delta_gate
    assert gate.f_proj[0].weight.shape == (8, 32) and gate.f_proj[1].weight.shape == (32, 8)
    assert gate.A_log.shape == (4,) and gate.dt_bias.shape == (32,)
    assert ((gate.A_log.exp() >= 1) & (gate.A_log.exp() <= 16)).all()
    dt = torch.nn.functional.softplus(gate.dt_bias)
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all() and dt.std() > 0  # drawn per feature
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    assert tuple(gate(x).shape) == (2, 4, 5, 8) and (gate(x) < 0).all()
    cache = model(random_ids(2, 9), use_cache=True).past_key_values
    assert [tuple(t.shape) for t in cache.layers[0].state] == [(2, 4, 8, 8), (2, 3, 96)]  # S, the conv's buffer
