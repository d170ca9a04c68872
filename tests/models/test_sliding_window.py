"""Window + linear attention and hybrid layer schedules in the models (issue 41): a window covering the input, or a
schedule of full-attention layers, is exactly GPT-2 / RoBERTa; a window of 0 is today's model; the learned factor,
the caches, and the configs refused with the reason."""

import pytest
import torch
from helpers import DECODER_VARIANTS, TINY, TINY_DECODER, causal_lm, random_ids
from transformers import GPT2Config, GPT2LMHeadModel, RobertaConfig, RobertaForMaskedLM

from hf_linear_attn import (
    KeyValueStateLayer,
    LinearAttentionStateLayer,
    LinearGPT2Config,
    LinearGPT2ForCausalLM,
    LinearRobertaConfig,
    LinearRobertaForMaskedLM,
    SlidingWindowStateLayer,
)


def load_stock_weights(model, stock, factor_name: str) -> None:
    """``stock``'s weights into ``model``, whose only other parameters are the two layers' window factors (named
    ``factor_name`` with the layer index): set to 0, g = 1."""
    missing, unexpected = model.load_state_dict(stock.state_dict(), strict=False)
    assert not unexpected
    assert sorted(missing) == [factor_name.format(i) for i in range(2)]
    with torch.no_grad():
        for name in missing:
            model.get_parameter(name).zero_()


def test_a_decoder_window_covering_the_context_is_stock_gpt2():
    """W = n_positions and g = 1: every key is in the window, so each token's weights are softmax's exactly."""
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(**TINY_DECODER, attn_implementation="eager")).eval()
    model = LinearGPT2ForCausalLM(LinearGPT2Config(**TINY_DECODER, attention_window=TINY_DECODER["n_positions"])).eval()
    load_stock_weights(model, gpt2, "transformer.h.{}.attn.window_factor.log_factor")
    ids = random_ids(2, 40)
    torch.testing.assert_close(model(ids).logits, gpt2(ids).logits, atol=1e-4, rtol=1e-4)


def test_an_encoder_band_covering_the_input_is_stock_roberta():
    torch.manual_seed(0)
    roberta = RobertaForMaskedLM(RobertaConfig(**TINY, type_vocab_size=1, layer_norm_eps=1e-5, attn_implementation="eager")).eval()
    model = LinearRobertaForMaskedLM(LinearRobertaConfig(**TINY, attention_window=64, linear_attention_chunk_size=16)).eval()
    load_stock_weights(model, roberta, "roberta.encoder.layer.{}.attention.self.window_factor.log_factor")
    ids = random_ids(2, 64)
    torch.testing.assert_close(model(ids).logits, roberta(ids).logits, atol=1e-4, rtol=1e-4)


def test_window_zero_is_plain_linear_attention_bit_for_bit():
    base = causal_lm("linear-elu")
    off = causal_lm("linear-elu", attention_window=0)
    assert base.state_dict().keys() == off.state_dict().keys()
    ids = random_ids(2, 21)
    assert torch.equal(base(ids).logits, off(ids).logits)
    assert type(base(ids, use_cache=True).past_key_values.layers[0]).__name__ == "LinearAttentionStateLayer"


def test_the_window_matters_and_the_factor_is_learned():
    """Beyond the window the outputs differ from plain linear attention and from a wider window; the factor gets a
    gradient and changes the outputs."""
    ids = random_ids(2, 30)
    window = causal_lm("linear-window")
    assert not torch.allclose(window(ids).logits, causal_lm("linear-elu")(ids).logits, atol=1e-3)
    assert not torch.allclose(window(ids).logits, causal_lm("linear-window", attention_window=9)(ids).logits, atol=1e-3)
    window.train()
    window(ids, labels=ids).loss.backward()
    assert window.transformer.h[0].attn.window_factor.log_factor.grad.abs().sum() > 0


def test_the_cache_holds_the_window_and_a_fixed_size_state():
    model = causal_lm("linear-window")
    sizes = []
    for n in (3, 30, 90):
        cache = model(random_ids(2, n), use_cache=True).past_key_values
        assert all(isinstance(layer, SlidingWindowStateLayer) for layer in cache.layers)
        sizes.append(cache.state_bytes())
        s, z, keys, phi_keys, values, valid = cache.layers[0].state
        assert keys.shape == (2, 4, 5, 8) and valid.shape == (2, 5)
        assert valid.sum().item() == 2 * min(n, 5)
    assert sizes[0] == sizes[1] == sizes[2]
    # per layer: S 8 x 8 + z 8, and 5 slots of key 8 + phi(key) 8 + value 8, per head, float32, plus 5 bools per row
    assert sizes[0] == 2 * 2 * (4 * 4 * (64 + 8 + 5 * 24) + 5)


def test_beam_search_reorders_the_window_and_the_state():
    """Beam search reorders every tensor of the state; with the cache it equals beam search recomputing everything."""
    model = causal_lm("linear-window")
    prompt = random_ids(1, 7)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=1)
    with_cache = model.generate(prompt, **kwargs)
    without = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.tolist() == without.tolist()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: LinearGPT2Config(attention_window=-1), "attention_window must be an integer >= 0"),
        (lambda: LinearGPT2Config(n_positions=64, attention_window=65), "larger than the positions this model has"),
        (lambda: LinearGPT2Config(attention_window=8, feature_map="favor"), "cannot be combined with feature_map='favor'"),
        (lambda: LinearRobertaConfig(attention_window=513), r"max_sequence_length = 512"),
        (lambda: LinearRobertaConfig(attention_window=4, feature_map="favor"), "Use 'elu', 'relu' or 'hedgehog'"),
        (lambda: LinearRobertaConfig(attention_window=4, linear_attention_chunk_size=0), "linear_attention_chunk_size"),
        (lambda: LinearGPT2Config(attention_window_factor_init=2.0), "without a window"),
        (lambda: LinearRobertaConfig(attention_window=4, attention_window_factor_init=float("nan")), "finite number"),
    ],
)
def test_bad_windows_are_refused_at_construction_with_the_reason(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_window_assigned_after_construction_is_checked_when_the_model_is_built():
    config = DECODER_VARIANTS["linear-window"]()
    config.attention_window = 1000
    with pytest.raises(ValueError, match="larger than the positions"):
        LinearGPT2ForCausalLM(config)


def test_the_factor_starts_where_the_config_says_and_log_m_starts_elu_bands_keys_even():
    """attention_window_factor_init is theta at init, in both families (and through save / load). Against the
    reference of uniform attention: with elu + 1 a fresh model gives its band about 1/m of a key's share at theta = 0
    (phi(q).phi(k) ~ m against exp(q.k / sqrt(d)) ~ 1), and about a key's share at theta = log(m)."""
    import math

    head = TINY["hidden_size"] // TINY["num_attention_heads"]  # m: elu + 1's feature width is the head size
    for config in (LinearGPT2Config(**TINY_DECODER, attention_window=4, attention_window_factor_init=1.5),
                   LinearRobertaConfig(**TINY, attention_window=4, attention_window_factor_init=1.5)):
        model = (LinearGPT2ForCausalLM if isinstance(config, LinearGPT2Config) else LinearRobertaForMaskedLM)(config)
        factors = [p for name, p in model.named_parameters() if "window_factor" in name]
        assert len(factors) == 2 and all(torch.equal(p, torch.full_like(p, 1.5)) for p in factors)
    n, band = 60, 5
    inside = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() < band
    uniform = inside.float().sum(-1).mean() / n  # the band's share if every key weighed the same
    shares = {}
    for init in (0.0, math.log(head)):
        torch.manual_seed(0)
        model = LinearRobertaForMaskedLM(LinearRobertaConfig(**TINY, attention_window=band, linear_attention_chunk_size=8,
                                                             attention_window_factor_init=init)).eval()
        with torch.no_grad():
            weights = model(random_ids(2, n), output_attentions=True).attentions[0]
        shares[init] = ((weights * inside).sum(-1).mean() / uniform).item()
    assert shares[0.0] < 2.0 / head and 0.8 < shares[math.log(head)] < 1.25, shares


# ------------------------------------------------------------------------------------------ hybrid schedules


def test_a_schedule_of_full_attention_layers_is_stock_gpt2_with_its_state_dict_one_to_one():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(**TINY_DECODER, attn_implementation="sdpa")).eval()
    config = LinearGPT2Config(**TINY_DECODER, layer_types=["full_attention"] * 2)
    model = LinearGPT2ForCausalLM(config).eval()
    model.load_state_dict(gpt2.state_dict(), strict=True)
    ids = random_ids(2, 40)
    torch.testing.assert_close(model(ids).logits, gpt2(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_hybrid_mixes_exact_and_linear_layers_and_caches_each_its_own_way():
    """Layer 0 full, layer 1 linear with a window: layer 0 equals GPT-2's layer (same weights), the cache holds a
    growing key/value layer and a fixed-size window layer, and prefill + steps equal one forward."""
    model = causal_lm("linear-hybrid", layer_types=["full_attention", "linear_attention"], attention_window=5)
    ids = random_ids(2, 24)
    cache = model(ids[:, :10], use_cache=True).past_key_values
    assert isinstance(cache.layers[0], KeyValueStateLayer) and cache.layers[0].state[0].shape[2] == 10
    assert type(cache.layers[1]).__name__ == "SlidingWindowStateLayer"
    logits = [model(ids[:, :10], use_cache=True).logits]
    cache = model(ids[:, :10], use_cache=True).past_key_values
    for t in range(10, 24):
        logits.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), model(ids).logits, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].state[0].shape[2] == 24 and cache.layers[1].state[2].shape[2] == 5


def test_a_linear_schedule_is_todays_model():
    base = causal_lm("linear-elu")
    scheduled = causal_lm("linear-elu", layer_types=["linear_attention"] * 2)
    ids = random_ids(2, 21)
    assert torch.equal(base(ids).logits, scheduled(ids).logits)
    assert all(isinstance(layer, LinearAttentionStateLayer) for layer in scheduled(ids, use_cache=True).past_key_values.layers)


@pytest.mark.parametrize(
    "layer_types, message",
    [
        # Transformers' own check of layer_types runs first: the length and its list of known kinds
        (["full_attention"], r"`num_hidden_layers` \(2\) must be equal to the number of `layer_types` \(1\)"),
        (["full_attention", "mamba2"], "The `layer_types` entries must be in"),
        # then ours: kinds Transformers knows but this family does not run
        (["full_attention", "sliding_attention"], "pure sliding-window softmax layer is not implemented"),
        (["chunked_attention", "linear_attention"], "is not a layer kind; choose one of linear_attention, full_attention"),
    ],
)
def test_bad_schedules_are_refused_at_construction(layer_types, message):
    with pytest.raises(ValueError, match=message):
        LinearGPT2Config(**TINY_DECODER, layer_types=layer_types)

