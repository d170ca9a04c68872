"""Wrong inputs to the models get a ValueError that names the fix, never a silent wrong answer: configs (also values
assigned after construction), masks in the other convention or with other values; and two Transformers
conventions the decoders keep (shift_labels, attention maps that carry gradients)."""

import pytest
import torch
from helpers import DECODER_VARIANTS, FAMILY_VARIANTS, TINY_DECODER, causal_lm, random_ids
from transformers import AutoModel, GPT2Config, GPT2LMHeadModel

ALL_VARIANTS = {**{f"encoder-{k}": v for k, v in FAMILY_VARIANTS.items()},
                **{f"decoder-{k}": v for k, v in DECODER_VARIANTS.items()}}


@pytest.mark.parametrize("variant, bad", [
    ("encoder-linformer-headwise", dict(linformer_k=0)),
    ("encoder-linformer-headwise", dict(num_attention_heads=0)),
    ("encoder-linear-elu", dict(num_hidden_layers=0)),
    ("encoder-linear-elu", dict(hidden_dropout_prob=1.5)),
    ("decoder-linear-elu", dict(n_head=0)),
    ("decoder-linformer-headwise", dict(linformer_block_size=0)),
])
def test_a_bad_config_value_is_a_plain_value_error_naming_the_field(variant, bad):
    with pytest.raises(ValueError, match=next(iter(bad))) as caught:
        ALL_VARIANTS[variant](**bad)
    assert type(caught.value) is ValueError  # not the dataclass library's wrapper, which is no ValueError


@pytest.mark.parametrize("variant, field, value", [
    ("encoder-linformer-headwise", "linformer_k", 0),
    ("encoder-linear-favor", "num_attention_heads", 0),
    ("decoder-linformer-headwise", "linformer_k", 0),
    ("decoder-linear-elu", "attn_pdrop", 2.0),
])
def test_a_value_assigned_after_construction_is_checked_when_a_model_is_built(variant, field, value):
    config = ALL_VARIANTS[variant]()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        AutoModel.from_config(config)


@pytest.mark.parametrize("variant", list(ALL_VARIANTS))
def test_masks_are_one_zero_in_any_dtype_and_other_values_are_refused(variant):
    torch.manual_seed(0)
    model = AutoModel.from_config(ALL_VARIANTS[variant]()).eval()
    ids = random_ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # right padding, which every family takes
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).last_hidden_state
        for same in (mask.bool(), mask.float()):
            torch.testing.assert_close(model(ids, attention_mask=same).last_hidden_state, reference)
    additive = torch.zeros(2, 12).masked_fill(mask == 0, float("-inf"))  # the other convention: 0 = real token
    with pytest.raises(ValueError, match="additive mask"):
        model(ids, attention_mask=additive)
    twos = mask.clone()
    twos[0, 3] = 2  # would shift every later position of a decoder
    with pytest.raises(ValueError, match=r"holds \[2.0\]"):
        model(ids, attention_mask=twos)


@pytest.mark.parametrize("variant", list(DECODER_VARIANTS))
def test_shift_labels_give_the_loss_of_labels_as_in_stock_gpt2(variant):
    model = causal_lm(variant)
    ids = random_ids(2, 10)
    labels = ids.clone()
    labels[1, :3] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    by_labels = model(ids, labels=labels).loss
    # as stock GPT-2 takes them (with labels present, the shifted targets are the ones used) ...
    torch.testing.assert_close(model(ids, labels=labels, shift_labels=shifted).loss, by_labels)
    torch.manual_seed(0)
    stock = GPT2LMHeadModel(GPT2Config(**TINY_DECODER)).eval()
    torch.testing.assert_close(stock(ids, labels=labels, shift_labels=shifted).loss, stock(ids, labels=labels).loss)
    # ... and alone, as sequence-parallel training passes them
    torch.testing.assert_close(model(ids, shift_labels=shifted).loss, by_labels)


@pytest.mark.parametrize("variant", ["linformer-headwise", "linformer-layerwise"])
def test_the_causal_linformer_attention_maps_receive_gradients_from_the_output(variant):
    model = causal_lm(variant)
    ids = random_ids(2, 20)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row: its maps are rolled back into the caller's order
    out = model(ids, attention_mask=mask, output_attentions=True)
    for maps in out.attentions:
        maps.retain_grad()
    out.logits.sum().backward()
    assert all(maps.grad is not None and maps.grad.abs().sum() > 0 for maps in out.attentions)
    with torch.no_grad():  # the maps are still the weights the output was computed with
        again = model(ids, attention_mask=mask, output_attentions=False).logits
    torch.testing.assert_close(out.logits, again, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- shapes stock GPT-2 / RoBERTa crash on
# Stock GPT-2 and RoBERTa fail on these with an IndexError or a reshape error from deep inside (checked by hand with
# transformers 5.23); this package's decoders and encoders name the input and the fix instead.

DECODER_NAMES = ["linear-elu", "linformer-headwise"]


@pytest.mark.parametrize("variant", DECODER_NAMES)
def test_decoders_name_a_1d_input_an_empty_sequence_and_an_empty_prompt(variant):
    model = causal_lm(variant)
    with pytest.raises(ValueError, match=r"shape \(5,\).*add the batch dimension"):
        model(random_ids(1, 5)[0])
    with pytest.raises(ValueError, match=r"shape \(2, 0\): a sequence of 0 tokens.*bos token"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"a sequence of 0 tokens"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(2, 32\)"):
        model(inputs_embeds=torch.zeros(2, 32))


@pytest.mark.parametrize("variant", ["linformer-headwise", "linear-elu"])
def test_encoders_name_a_1d_input_and_an_empty_sequence(variant):
    model = AutoModel.from_config(FAMILY_VARIANTS[variant]()).eval()
    with pytest.raises(ValueError, match=r"input_ids has shape \(5,\).*add the batch dimension"):
        model(random_ids(1, 5)[0])
    with pytest.raises(ValueError, match=r"shape \(2, 0\): a sequence of 0 tokens.*special tokens"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(2, 32\).*inputs_embeds\[None\]"):
        model(inputs_embeds=torch.zeros(2, 32))
    assert model(random_ids(1, 5)).last_hidden_state.shape[:2] == (1, 5)


@pytest.mark.parametrize("variant", DECODER_NAMES)
def test_a_cache_of_one_batch_size_refuses_input_of_another(variant):
    model = causal_lm(variant)
    with torch.no_grad():
        cache = model(random_ids(2, 5), use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"state of 2 sequence\(s\) but the input has 3 row\(s\)"):
            model(random_ids(3, 1), past_key_values=cache, use_cache=True)
        assert model(random_ids(2, 1), past_key_values=cache).logits.shape == (2, 1, TINY_DECODER["vocab_size"])


def test_an_empty_batch_is_named_by_the_linformers_and_passes_through_linear_attention():
    from transformers import AutoModelForCausalLM

    empty = torch.zeros(0, 5, dtype=torch.long)
    for model in (AutoModel.from_config(FAMILY_VARIANTS["linformer-headwise"]()),
                  AutoModelForCausalLM.from_config(DECODER_VARIANTS["linformer-headwise"]())):
        with pytest.raises(ValueError, match="0 sequences"):
            model(empty)
    # linear attention has no projection along the sequence: a batch of 0 gives 0 rows, as before
    assert AutoModel.from_config(FAMILY_VARIANTS["linear-elu"]())(empty).last_hidden_state.shape == (0, 5, 32)
    assert causal_lm("linear-elu")(empty).logits.shape == (0, 5, TINY_DECODER["vocab_size"])


@pytest.mark.parametrize("variant", DECODER_NAMES)
def test_prepare_inputs_for_generation_forwards_custom_kwargs_as_stock_gpt2(variant):
    """Transformers' common test test_prepare_inputs_for_generation_kwargs_forwards (it failed for every decoder
    variant): custom keyword arguments pass through prepare_inputs_for_generation, and the forward takes them, as
    stock GPT-2's does (a generation loop of a subclass relies on that); generate() itself refuses an argument no
    forward names, for both alike."""
    model = causal_lm(variant)
    stock = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY_DECODER.items() if k != "initializer_range"})).eval()
    ids = random_ids(2, 3)
    for lm in (stock, model):
        inputs = lm.prepare_inputs_for_generation(ids, attention_mask=torch.ones_like(ids), custom_arg="test_value",
                                                  output_attentions=True, use_cache=False)
        assert inputs["custom_arg"] == "test_value" and inputs["output_attentions"] is True, type(lm).__name__
        with torch.no_grad():
            out = lm(**inputs)  # the forward takes them: custom_arg ignored, attention maps returned (not by SDPA)
        assert lm is stock or len(out.attentions) == 2
        with pytest.raises(ValueError, match=r"not used by the model: \['custom_arg'\]"):
            lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, custom_arg="test_value")
