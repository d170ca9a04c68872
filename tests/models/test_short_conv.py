"""The short causal convolution on q, k, v (``use_short_conv``): its math against a per-position loop, where it sits in
the model, padding, the cache (steps, generate, beams, rollback, bytes), checkpoints, init and the refusals.

The variants (helpers.CONV_VARIANTS) combine it with plain, windowed, fixed-decay, gated and hybrid layers, and put it
on softmax attention (gpt2-conv: every layer full_attention, short_conv_on_full_attention, GPT-2 + short conv)."""

import copy

import pytest
import torch
from helpers import CONV_VARIANTS, TINY_DECODER, causal_lm, left_padded_batch, normal, random_ids
from transformers import AutoModelForCausalLM

from hf_linear_attn import LinearGPT2Config, LinearGPT2ForCausalLM
from hf_linear_attn.short_convolution import causal_short_convolution, mask_pad_inputs, short_convolution_step

VARIANTS = list(CONV_VARIANTS)


def per_position_reference(x, weight, buffer=None):
    """y_t = silu(sum_j w_j x_{t-K+1+j}), one position at a time in float64, zeros (or ``buffer``) before the start."""
    kernel = weight.shape[-1]
    history = torch.zeros(x.shape[0], kernel - 1, x.shape[-1], dtype=torch.float64) if buffer is None else buffer
    history = history.double()
    padded = torch.cat([history, x.double()], dim=1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[1]):
        for j in range(kernel):
            out[:, t] += weight[:, 0, j].double() * padded[:, t + j]
    return torch.nn.functional.silu(out)


# ---------------------------------------------------------------------------------------------------- the math


@pytest.mark.parametrize("kernel", [2, 4, 7])
def test_the_convolution_equals_the_per_position_loop_whole_in_pieces_and_token_by_token(kernel, on_each_device):
    g = torch.Generator().manual_seed(kernel)
    x, weight = normal(g, 2, 11, 6), normal(g, 6, 1, kernel)
    assert x.device.type == on_each_device.type  # drawn on the CPU, moved to the device under test
    want = per_position_reference(x, weight)
    got, buffer = causal_short_convolution(x, weight)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buffer, x[:, -(kernel - 1):])  # the last K-1 inputs, carried as they are
    pieces, buffer = [], None
    for start, stop in ((0, 2), (2, 3), (3, 9), (9, 10), (10, 11)):  # pieces shorter and longer than the kernel
        y, buffer = causal_short_convolution(x[:, start:stop], weight, buffer)
        pieces.append(y.double())
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=1e-5, rtol=1e-5)
    # the one-token step on its own, from a random buffer, against the loop continuing from that buffer
    history = normal(g, 2, kernel - 1, 6)
    y, new = short_convolution_step(x[:, :1], weight, history)
    torch.testing.assert_close(y.double(), per_position_reference(x[:, :1], weight, history), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new, torch.cat([history, x[:, :1]], dim=1)[:, 1:])


def test_pads_are_zeroed_so_a_left_padded_row_is_convolved_as_the_row_alone():
    g = torch.Generator().manual_seed(0)
    x, weight = normal(g, 1, 5, 4), normal(g, 4, 1, 4)
    padded = torch.cat([torch.full((1, 3, 4), 7.0), x], dim=1)  # three pad rows of garbage before the row
    mask = torch.tensor([[False] * 3 + [True] * 5])
    y, buffer = causal_short_convolution(mask_pad_inputs(padded, mask), weight)
    alone, alone_buffer = causal_short_convolution(x, weight)
    torch.testing.assert_close(y[:, 3:], alone)
    torch.testing.assert_close(buffer, alone_buffer)
    unmasked, _ = causal_short_convolution(padded, weight)
    assert not torch.allclose(unmasked[:, 3:], alone)  # without the zeroing the pads would leak in


# ------------------------------------------------------------------------------------------------ the model


def test_the_model_is_the_plain_model_with_the_convolution_after_c_attn():
    """The same weights without the convolution, its c_attn output passed through the per-position loop by a hook
    (q, k, v each by its own weights, in that order), give the same logits: the convolution sits exactly there."""
    conv = causal_lm("linear-conv")
    plain = LinearGPT2ForCausalLM(LinearGPT2Config(**{**conv.config.to_dict(), "use_short_conv": False})).eval()
    missing, unexpected = plain.load_state_dict(conv.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == sorted(
        f"transformer.h.{i}.attn.{name}_conv1d.weight" for i in range(2) for name in "qkv"
    )
    ids = random_ids(2, 23)
    without = plain(ids).logits
    for block, conv_block in zip(plain.transformer.h, conv.transformer.h):
        weight = torch.cat([getattr(conv_block.attn, f"{name}_conv1d").weight for name in "qkv"])
        block.attn.c_attn.register_forward_hook(lambda m, i, out, w=weight: per_position_reference(out, w).float())
    torch.testing.assert_close(conv(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)
    assert (conv(ids).logits - without).abs().max() > 1e-2  # and the convolution changes the model


def test_only_linear_layers_get_the_convolution_with_fla_names_and_a_seeded_nonzero_init():
    config = CONV_VARIANTS["linear-hybrid-conv"](initializer_range=0.02)
    torch.manual_seed(3)
    first = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(3)
    second = AutoModelForCausalLM.from_config(config)
    full, linear = first.transformer.h[0].attn, first.transformer.h[1].attn
    assert not any("conv1d" in name for name, _ in full.named_parameters())  # softmax layer: no convolution
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        weight = getattr(linear, name).weight
        assert weight.shape == (32, 1, 4)
        torch.testing.assert_close(weight, getattr(second.transformer.h[1].attn, name).weight, rtol=0, atol=0)
        # PyTorch's Conv1d init U(-1/2, 1/2) for K = 4, not transformers' N(0, initializer_range = 0.02)
        assert weight.abs().max() <= 0.5 and weight.abs().max() > 0.3 and weight.std() > 0.2
    torch.manual_seed(4)
    assert not torch.equal(AutoModelForCausalLM.from_config(config).transformer.h[1].attn.q_conv1d.weight,
                           linear.q_conv1d.weight)


def test_the_convolution_is_trained():
    model = causal_lm("linear-conv").train()
    ids = random_ids(2, 13)
    model(ids, labels=ids).loss.backward()
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        assert getattr(model.transformer.h[0].attn, name).weight.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_rows_equal_their_sequences_alone(variant):
    model = causal_lm(variant)
    prompts = [random_ids(1, 14)[0], random_ids(1, 3, seed=1)[0], random_ids(1, 9, seed=2)[0]]
    ids, mask = left_padded_batch(prompts)
    ids[mask == 0] = random_ids(1, int((mask == 0).sum()), seed=5)[0]  # pads of any token id: the mask decides
    batched = model(ids, attention_mask=mask).logits
    for row, prompt in enumerate(prompts):
        alone = model(prompt[None]).logits[0]
        torch.testing.assert_close(batched[row, -len(prompt):], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_steps_and_pieces_equal_one_full_forward(variant):
    model = causal_lm(variant)
    ids, mask = left_padded_batch([random_ids(1, 17)[0], random_ids(1, 6, seed=1)[0]])
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)  # the short row is still in its pads
    pieces, cache = [out.logits], out.past_key_values
    for start, stop in ((7, 8), (8, 9), (9, 14), (14, 15), (15, 17)):
        pieces.append(model(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, dim=1)[real], full[real], atol=1e-5, rtol=1e-5)


def gpt2_conv_reference(model, ids):
    """GPT-2 + short conv by hand in float64 from the model's weights: per block, ln_1, c_attn, the per-position
    convolution loop on q, k, v (each its own taps), causal softmax attention over the heads, c_proj, residual; then
    GPT-2's own MLP, LayerNorms and tied head (float64 copies: not the code under test). Logits (B, n, vocab)."""
    model = copy.deepcopy(model).double()
    body, heads = model.transformer, model.config.n_head
    n = ids.shape[1]
    x = body.wte(ids) + body.wpe(torch.arange(n))
    for block in body.h:
        attn = block.attn
        h = block.ln_1(x)
        qkv = h @ attn.c_attn.weight + attn.c_attn.bias  # transformers' Conv1D: x W + b, W (D, 3 D)
        weight = torch.cat([attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight])
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in per_position_reference(qkv, weight).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        x = x + out @ attn.c_proj.weight + attn.c_proj.bias
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(body.ln_f(x))


def test_gpt2_with_short_conv_equals_the_softmax_computation_by_hand_in_float64():
    model = causal_lm("gpt2-conv")
    assert all(block.attn.full_attention and block.attn.has_short_conv for block in model.transformer.h)
    ids = random_ids(2, 19)
    torch.testing.assert_close(model(ids).logits.double(), gpt2_conv_reference(model, ids), atol=1e-5, rtol=1e-5)
    # and the convolution matters: the same weights without it (stock all-full_attention linear_gpt2) differ
    plain = LinearGPT2ForCausalLM(LinearGPT2Config(**{**model.config.to_dict(), "use_short_conv": False,
                                                      "short_conv_on_full_attention": False})).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert (plain(ids).logits - model(ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["linear-gated-conv", "gpt2-conv"])
def test_generate_equals_the_full_forward_with_a_state_of_fixed_size(variant):
    model = causal_lm(variant)
    ids = random_ids(2, 10)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                         do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert len(set(out.sequences[:, 10:].flatten().tolist())) > 2  # varied tokens
    full = model(out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full[:, 9:-1], atol=1e-4, rtol=1e-4)
    assert (full[:, 9:-1].argmax(-1) == out.sequences[:, 10:]).all()  # greedy tokens of the full forward
    long, short = (model(t, use_cache=True).past_key_values for t in (out.sequences, ids))
    if variant == "gpt2-conv":  # softmax attention: keys and values grow by a row per token, the buffer stays
        grown = 2 * 2 * 12 * (2 * 32 * 4 + 1)  # 2 rows x 2 layers x 12 tokens: keys + values (32 float32) + a mask byte
        assert long.state_bytes() == short.state_bytes() + grown
        plain = causal_lm(variant, use_short_conv=False, short_conv_on_full_attention=False)
    else:
        assert long.state_bytes() == short.state_bytes()
        plain = causal_lm(variant, use_short_conv=False)
    buffers = 2 * 2 * (4 - 1) * 3 * 32 * 4  # 2 rows, 2 layers, K - 1 = 3 inputs of q, k, v (3 x 32), float32
    assert short.state_bytes() == plain(ids, use_cache=True).past_key_values.state_bytes() + buffers


@pytest.mark.parametrize("variant", ["linear-window-conv", "gpt2-conv"])
def test_beam_search_reorders_the_buffer_and_matches_recomputation_and_batch_one(variant):
    """Every beam and its score, not only the best (a random model's best beam barely depends on the others)."""
    model = causal_lm(variant)
    prompts = [random_ids(1, 8)[0], random_ids(1, 5, seed=1)[0]]
    ids, mask = left_padded_batch(prompts)
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=3,
                    pad_token_id=1, return_dict_in_generate=True, output_scores=True)
    beams = model.generate(ids, attention_mask=mask, **settings)
    recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert beams.sequences.tolist() == recomputed.sequences.tolist()
    torch.testing.assert_close(beams.sequences_scores, recomputed.sequences_scores, atol=1e-5, rtol=1e-5)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **settings)
        assert beams.sequences[3 * row:3 * row + 3, ids.shape[1]:].tolist() == alone.sequences[:, len(prompt):].tolist()
        torch.testing.assert_close(beams.sequences_scores[3 * row:3 * row + 3], alone.sequences_scores,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["linear-conv", "gpt2-conv"])
def test_recording_from_the_first_token_replays_from_a_zero_buffer(variant):
    """(Crops into recorded forwards and steps after a committed prefill: test_generation_strategies, conv variants.)"""
    model = causal_lm(variant)
    ids = random_ids(1, 9)
    cache = model.transformer.new_cache()
    cache.activate_past_recording()
    model(ids, past_key_values=cache)
    cache.crop(-4)
    fresh = model(ids[:, :5], use_cache=True).past_key_values
    for layer, reference in zip(cache.layers, fresh.layers):
        for got, want in zip(layer.state, reference.state, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_softmax_layers_crop_rolls_keys_values_and_buffer_back_after_a_committed_prefill():
    """GPT-2 + short conv: prefill, commit, 3 recorded steps, crop(-2), then the token that replaces them; the cache
    equals a fresh forward's over the kept tokens (keys and values truncated, the buffer replayed) and the next logits
    are the full forward's. Without past recording the crop is refused, naming the fix."""
    model = causal_lm("gpt2-conv")
    ids, other = random_ids(1, 12), random_ids(1, 1, seed=7)
    cache = model(ids[:, :8], use_cache=True).past_key_values
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-1)
    assert not cache.is_croppable
    cache.activate_past_recording()
    assert cache.is_croppable
    for t in range(8, 11):
        model(ids[:, t:t + 1], past_key_values=cache)
    cache.crop(-2)
    fresh = model(ids[:, :9], use_cache=True).past_key_values
    for layer, reference in zip(cache.layers, fresh.layers):
        assert layer.get_seq_length() == 9
        for got, want in zip(layer.state, reference.state, strict=True):
            # float32 keys from one-token steps against one 9-token forward: the matmuls block differently, so
            # they round differently (1.6e-6 apart on an AVX-512 Xeon, 2026-12-07); a wrong rollback is O(1) off
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    logits = model(other, past_key_values=cache).logits
    torch.testing.assert_close(logits[:, -1], model(torch.cat([ids[:, :9], other], 1)).logits[:, -1],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["linear-gated-conv", "gpt2-conv"])
def test_assisted_greedy_equals_plain_greedy_token_for_token(variant):
    one_layer = {"n_layer": 1, **({"layer_types": ["full_attention"]} if variant == "gpt2-conv" else {})}
    model, draft = causal_lm(variant), causal_lm(variant, seed=1, **one_layer)
    crops = []
    cache_class = type(model.transformer.new_cache().layers[0])
    original = cache_class.crop
    prompt = random_ids(1, 9)
    settings = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=1)
    plain = model.generate(prompt, **settings)
    try:  # count the main model's rollbacks: a draft that is always right would test no crop
        cache_class.crop = lambda self, r: (crops.append(r), original(self, r))[1]
        assisted = model.generate(prompt, assistant_model=draft, **settings)
    finally:
        cache_class.crop = original
    assert assisted.tolist() == plain.tolist()
    assert any(r < 0 for r in crops)


@pytest.mark.parametrize("variant", ["linear-window-conv", "gpt2-conv"])
def test_a_checkpoint_reloads_exactly_and_carries_the_convolution_module(tmp_path, variant):
    """In this process; test_checkpoints loads linear-window-conv and gpt2-conv in a fresh one with trust_remote_code."""
    model = causal_lm(variant)
    ids, mask = left_padded_batch([random_ids(1, 9)[0], random_ids(1, 4, seed=1)[0]])
    model.save_pretrained(tmp_path)
    assert (tmp_path / "short_convolution.py").is_file()  # the saved code's own copy of the math
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.use_short_conv and reloaded.config.conv_size == 4
    assert reloaded.config.short_conv_on_full_attention == (variant == "gpt2-conv")
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name  # loaded, not re-initialised
    torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                               rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ refusals


def test_a_config_without_the_fields_loads_as_before():
    saved = LinearGPT2Config(**TINY_DECODER).to_dict()
    del saved["use_short_conv"], saved["conv_size"], saved["short_conv_on_full_attention"]
    config = LinearGPT2Config(**saved)
    assert config.use_short_conv is False and config.conv_size == 4 and config.short_conv_on_full_attention is False
    model = LinearGPT2ForCausalLM(config)
    assert not any("conv1d" in name for name in model.state_dict())


@pytest.mark.parametrize("options,message", [
    (dict(use_short_conv=True, conv_size=1), "conv_size must be an integer of at least 2"),
    (dict(use_short_conv=True, conv_size=0), "conv_size must be an integer of at least 2"),
    (dict(conv_size=3), "use_short_conv is False: set use_short_conv=True"),
    (dict(use_short_conv=True, n_layer=1, layer_types=["full_attention"]),
     "linear_attention layers only.*set short_conv_on_full_attention=True"),
    (dict(short_conv_on_full_attention=True, n_layer=1, layer_types=["full_attention"]),
     "use_short_conv is False.*set use_short_conv=True"),
    (dict(use_short_conv=True, short_conv_on_full_attention=True), "no entry of layer_types is 'full_attention'"),
    (dict(use_short_conv=True, short_conv_on_full_attention=True, layer_types=["linear_attention"] * 2),
     "no entry of layer_types is 'full_attention'"),
])
def test_bad_convolutions_are_refused_at_construction_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        LinearGPT2Config(**{**TINY_DECODER, **options})


@pytest.mark.parametrize("value", [4.0, True, "4"])
def test_a_conv_size_of_another_type_is_refused_naming_the_field(value):
    with pytest.raises(Exception, match="conv_size") as caught:  # the dataclass library's own type check
        LinearGPT2Config(**TINY_DECODER, use_short_conv=True, conv_size=value)
    assert "expected int" in str(caught.value)


def test_a_conv_size_assigned_after_construction_is_checked_when_the_model_is_built():
    config = CONV_VARIANTS["linear-conv"]()
    config.conv_size = 1
    with pytest.raises(ValueError, match="conv_size must be an integer of at least 2"):
        LinearGPT2ForCausalLM(config)
