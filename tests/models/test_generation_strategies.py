"""generate() strategies a GPT-2 user has: stop strings, token healing, assisted and prompt-lookup decoding, all
resting on an exact rollback (crop) of the recurrent state."""

import pytest
import torch
from helpers import TINY_DECODER, causal_lm, left_padded_batch, random_ids
from transformers import GPT2Config, GPT2LMHeadModel

from hf_linear_attn import LinformerGPT2Config, LinformerGPT2ForCausalLM

# with a short convolution (helpers.CONV_VARIANTS) on each kind of linear cache layer and on softmax attention
# (gpt2-conv): the replay rebuilds its buffer
DECODERS = [
    "linear-elu", "linear-favor", "linear-window", "linear-hybrid", "linear-decay", "linear-gated", "linear-delta",
    "linear-conv", "linear-window-conv", "linear-decay-conv", "linear-delta-conv", "linear-gated-delta-conv",
    "linear-kda-conv",
    "gpt2-conv", "linformer-headwise",
    "linformer-key-value",
]


def gpt2_and_its_one_block_linformer():
    """Stock GPT-2 and the causal Linformer holding its weights with one block as long as the table: the same model."""
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(**TINY_DECODER)).eval()
    config = LinformerGPT2Config(**TINY_DECODER, linformer_k=4, linformer_block_size=TINY_DECODER["n_positions"])
    ours = LinformerGPT2ForCausalLM(config).eval()
    ours.load_state_dict(gpt2.state_dict(), strict=False)
    return gpt2, ours


# ------------------------------------------------------------------------------ stop strings, token healing


def a_word_the_model_writes(tokenizer, generated, start):
    """The first generated token from ``start`` on that decodes to letters (a random model also writes bytes)."""
    for token in generated[start + 2 :]:
        text = tokenizer.decode(token)
        if text.strip().isalpha():
            return text
    raise AssertionError("the model wrote no word to stop at")


def test_stop_strings_stop_where_they_stop_stock_gpt2(tokenizer):
    gpt2, ours = gpt2_and_its_one_block_linformer()
    prompt = tokenizer(["The quick brown"], return_tensors="pt", add_special_tokens=False).input_ids
    free = gpt2.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=1)
    # a stop string from the middle of what the model writes anyway, so stopping changes the output
    text = a_word_the_model_writes(tokenizer, free[0].tolist(), prompt.shape[1])
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=1, stop_strings=[text], tokenizer=tokenizer)
    theirs, mine = gpt2.generate(prompt, **kwargs), ours.generate(prompt, **kwargs)
    assert theirs.shape[1] < free.shape[1]
    assert mine.tolist() == theirs.tolist()


@pytest.mark.parametrize("variant", ["linear-elu", "linformer-headwise"])
def test_stop_strings_end_the_greedy_text_at_the_first_stop_string(tokenizer, variant):
    model = causal_lm(variant)
    prompt = tokenizer(["Linear attention"], return_tensors="pt", add_special_tokens=False).input_ids
    free = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=1)
    stop = a_word_the_model_writes(tokenizer, free[0].tolist(), prompt.shape[1])
    stopped = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=1, stop_strings=[stop],
                             tokenizer=tokenizer)
    assert stopped.tolist()[0] == free.tolist()[0][: stopped.shape[1]] and stopped.shape[1] < free.shape[1]
    assert tokenizer.decode(stopped[0, prompt.shape[1]:]).endswith(stop)


def test_token_healing_heals_the_prompt_as_stock_gpt2_then_generates_as_it(tokenizer):
    """Stock GPT-2's own generate(token_healing=True) fails in Transformers 5.23 with this tokenizer (positions made
    before healing re-tokenizes the prompt); its heal_tokens followed by a plain generate is the reference."""
    gpt2, ours = gpt2_and_its_one_block_linformer()
    for text in ("The quick bro", "Linear attention repl"):
        prompt = tokenizer([text], return_tensors="pt", add_special_tokens=False).input_ids
        healed = gpt2.heal_tokens(prompt, tokenizer)
        assert healed.shape != prompt.shape or (healed != prompt).any()  # healing changed the prompt
        # generate() keeps the mask it made before healing (none: no pad in the prompt), so every healed id is read
        want = gpt2.generate(healed, attention_mask=torch.ones_like(healed), max_new_tokens=8, do_sample=False,
                             pad_token_id=1)
        got = ours.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=1, token_healing=True,
                            tokenizer=tokenizer)
        assert got.tolist() == want.tolist()


# ---------------------------------------------------------------------------------------- rollback (crop)


@pytest.mark.parametrize("variant", DECODERS)
def test_cropping_the_state_equals_recomputing_it_from_scratch(variant):
    """Prefill, a 5-token forward and 3 single steps recorded, then crop back into each of them: the state and the
    next logits equal a cache built from scratch on the kept tokens (left-padded batch, float32 state)."""
    model = causal_lm(variant)
    ids, mask = left_padded_batch([random_ids(1, 30)[0], random_ids(1, 22, seed=1)[0]])
    for prefill, remove in ((12, 3), (12, 10), (20, 0), (20, 7)):
        cache = model.transformer.new_cache()
        cache.activate_past_recording()
        model(ids[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache)
        cache.crop(0)  # commit the prefill: crops go back to it at most
        model(ids[:, prefill:prefill + 5], attention_mask=mask[:, :prefill + 5], past_key_values=cache)
        for t in range(prefill + 5, prefill + 8):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache)
        if remove > 8:
            with pytest.raises(ValueError, match="no further back than the last crop"):
                cache.crop(-remove)
            continue
        cache.crop(-remove)
        kept = prefill + 8 - remove
        assert cache.get_seq_length() == kept
        fresh = model(ids[:, :kept], attention_mask=mask[:, :kept], use_cache=True).past_key_values
        for layer, reference in zip(cache.layers, fresh.layers):
            got, want = layer.state, reference.state
            assert len(got) == len(want)
            if variant.startswith("linformer"):  # the summaries of completed blocks and the current block's tokens
                slots = got.summary_valid.shape[1]
                assert got.summary_valid.tolist() == want.summary_valid[:, :slots].tolist()
                assert got.block_fill.tolist() == want.block_fill.tolist()
                valid = got.summary_valid[:, None, :, None, None]
                filled = (torch.arange(got.block_keys.shape[2]) < got.block_fill[:, None])[:, None, :, None]
                got = [got.summary_keys * valid, got.summary_values * valid, got.block_keys * filled,
                       got.block_values * filled]
                want = [want.summary_keys[:, :, :slots] * valid, want.summary_values[:, :, :slots] * valid,
                        want.block_keys * filled, want.block_values * filled]
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        step = dict(attention_mask=mask[:, :kept + 1])
        torch.testing.assert_close(model(ids[:, kept:kept + 1], past_key_values=cache, **step).logits,
                                   model(ids[:, kept:kept + 1], past_key_values=fresh, **step).logits,
                                   atol=1e-5, rtol=1e-5)


def test_a_state_without_recording_refuses_to_roll_back_and_says_how():
    model = causal_lm("linear-elu")
    cache = model(random_ids(1, 5), use_cache=True).past_key_values
    assert not cache.is_croppable and cache.rollback_bytes() == 0
    with pytest.raises(ValueError, match="drop the last 2 tokens only if it recorded them.*activate_past_recording"):
        cache.crop(-2)


@pytest.mark.parametrize(
    "variant", ["linear-elu", "linear-hedgehog", "linear-window", "linear-hybrid", "linear-gated", "linformer-headwise",
                "linformer-layerwise"]
)
def test_assisted_greedy_equals_plain_greedy_token_for_token(variant):
    """A different (smaller-seed) draft of the same family proposes tokens; the target's verified output must be
    exactly its own greedy output. generate() allows assisted decoding for one sequence at a time only."""
    one_layer = {"layer_types": ["full_attention"]} if variant == "linear-hybrid" else {}  # the schedule's length
    model, draft = causal_lm(variant), causal_lm(variant, seed=1, n_layer=1, **one_layer)
    prompt = random_ids(1, 9)
    plain = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=1)
    assisted = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=1,
                              assistant_model=draft)
    assert len(set(plain[0, 9:].tolist())) > 3
    assert assisted.tolist() == plain.tolist()


@pytest.mark.parametrize("variant", ["linear-favor", "linformer-key-value"])
def test_prompt_lookup_greedy_equals_plain_greedy_token_for_token(variant):
    model = causal_lm(variant)
    prompt = random_ids(1, 12).repeat(1, 3)  # repeats, so the lookup finds candidates
    plain = model.generate(prompt, max_new_tokens=25, min_new_tokens=25, do_sample=False, pad_token_id=1)
    lookup = model.generate(prompt, max_new_tokens=25, min_new_tokens=25, do_sample=False, pad_token_id=1,
                            prompt_lookup_num_tokens=4)
    assert lookup.tolist() == plain.tolist()
