"""Decayed and gated linear attention in the decoder (issue 41): rates of 1 are today's model, the decay and the
gate change what the model computes and are learned, generation runs them as an RNN, and bad configs are refused
with the reason. The decoder test matrix (helpers.DECODER_VARIANTS: linear-decay, linear-gated) covers the cache,
rollback, beam search, export and checkpoints."""

import pytest
import torch
from helpers import DECODER_VARIANTS, TINY_DECODER, causal_lm, random_ids

from hf_linear_attn import DecayedStateLayer, LinearGPT2Config, LinearGPT2ForCausalLM
from hf_linear_attn.configuration_linear_gpt2 import retnet_decay_rates


def test_rates_of_one_are_plain_linear_attention_with_the_same_weights():
    plain = causal_lm("linear-elu")
    undecayed = LinearGPT2ForCausalLM(DECODER_VARIANTS["linear-elu"](state_decay="fixed", decay_rates=[1.0] * 4)).eval()
    assert undecayed.state_dict().keys() == plain.state_dict().keys()  # a fixed decay adds no parameter
    undecayed.load_state_dict(plain.state_dict())
    ids = random_ids(2, 37)
    torch.testing.assert_close(undecayed(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)
    assert type(undecayed(ids, use_cache=True).past_key_values.layers[0]) is DecayedStateLayer


def test_the_default_rates_are_retnets_and_the_decay_changes_the_output():
    assert retnet_decay_rates(3) == [1 - 2**-5, 1 - 2**-6, 1 - 2**-7]
    plain = causal_lm("linear-elu")
    retnet = LinearGPT2ForCausalLM(DECODER_VARIANTS["linear-elu"](state_decay="fixed")).eval()
    retnet.load_state_dict(plain.state_dict())
    assert retnet.transformer.h[0].attn.decay_rates == retnet_decay_rates(4)
    ids = random_ids(1, 60)
    difference = (retnet(ids).logits - plain(ids).logits).abs().amax(-1)[0]
    # the first token has no past to decay; later ones differ more as the decayed past grows
    assert difference[0] < 1e-5 and difference[-1] > 1e-3


def test_the_gate_is_computed_from_the_input_and_learned():
    model = causal_lm("linear-gated").train()
    gate = model.transformer.h[0].attn.gk_proj
    assert gate[0].weight.shape == (8, 32) and gate[1].weight.shape == (4 * 16, 8)  # rank 8, 4 heads x m = 2 x 8
    ids = random_ids(2, 30)
    model(ids, labels=ids).loss.backward()
    assert gate[0].weight.grad.abs().sum() > 0 and gate[1].bias.grad.abs().sum() > 0
    with torch.no_grad():  # a gate pushed to 1 (no decay) is plain linear attention with the same projections
        before = model(ids).logits
        for block in model.transformer.h:
            block.attn.gk_proj[1].bias.fill_(1e4)
        opened = model(ids).logits
        plain = LinearGPT2ForCausalLM(DECODER_VARIANTS["linear-hedgehog"](linear_attention_chunk_size=4)).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        torch.testing.assert_close(opened, plain(ids).logits, atol=1e-4, rtol=1e-4)
    assert (before - opened).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["linear-decay", "linear-gated"])
def test_generation_keeps_a_fixed_size_state_and_matches_the_full_forward(variant):
    model = causal_lm(variant)
    ids = random_ids(2, 12)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    cache = model(out.sequences[:, :-1], use_cache=True).past_key_values
    short = model(ids, use_cache=True).past_key_values
    assert cache.state_bytes() == short.state_bytes()  # 31 tokens or 12: the same bytes
    full = model(out.sequences).logits[:, 11:-1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full, atol=1e-4, rtol=1e-4)


def test_a_long_decayed_past_is_forgotten():
    """With the rate of every head 0.5, tokens 40 back weigh 2^-40: two prompts that differ only there give the same
    next-token logits; without decay they differ."""
    decayed = causal_lm("linear-decay", decay_rates=[0.5] * 4)
    plain = causal_lm("linear-elu")
    a, b = random_ids(1, 50, seed=1), random_ids(1, 50, seed=1)
    b[0, :5] = random_ids(1, 5, seed=2)[0]
    torch.testing.assert_close(decayed(a).logits[:, -1], decayed(b).logits[:, -1], atol=1e-5, rtol=1e-5)
    assert (plain(a).logits[:, -1] - plain(b).logits[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("options,message", [
    (dict(state_decay="exponential"), "state_decay must be None, 'fixed'"),
    (dict(state_decay="fixed", decay_rates=[0.9, 0.9]), "decay_rates has 2 entries for n_head=4"),
    (dict(state_decay="fixed", decay_rates=[0.9, 0.9, 1.5, 0.0]), r"decay_rates must lie in \(0, 1\]"),
    (dict(decay_rates=[0.9] * 4), "state_decay is None"),
    (dict(state_decay="gated", decay_rates=[0.9] * 4), "decay_rates applies to state_decay='fixed'"),
    (dict(state_decay="gated", feature_map="favor"), "FAVOR\\+'s features are random draws"),
    (dict(state_decay="fixed", attention_window=8), "a decayed state beside a window is not implemented"),
    (dict(state_decay="gated", gate_low_rank_dim=0), "gate_low_rank_dim must be positive"),
    (dict(state_decay="gated", gate_logit_normalizer=0), "gate_logit_normalizer must be positive"),
])
def test_bad_decays_are_refused_at_construction_with_the_reason(options, message):
    with pytest.raises(ValueError, match=message):
        LinearGPT2Config(**{**TINY_DECODER, **options})


def test_a_hybrid_schedule_decays_only_its_linear_layers():
    model = causal_lm("linear-gated", layer_types=["full_attention", "linear_attention"])
    assert not hasattr(model.transformer.h[0].attn, "gk_proj") and hasattr(model.transformer.h[1].attn, "gk_proj")
    cache = model(random_ids(1, 9), use_cache=True).past_key_values
    assert [type(layer).__name__ for layer in cache.layers] == ["KeyValueStateLayer", "DecayedStateLayer"]
