"""Encoder models against stock RoBERTa, padding invariance, every head, and the errors users can hit."""

import pytest
import torch
from helpers import AUTO_HEADS, FAMILY_VARIANTS, TINY, random_ids
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    RobertaConfig,
    RobertaForMaskedLM,
)

from hf_linear_attn import LinearRobertaConfig, LinformerConfig, LinformerForMaskedLM, LinearRobertaForMaskedLM

def stock_roberta_masked_lm(seed=0):
    torch.manual_seed(seed)
    config = RobertaConfig(**TINY, type_vocab_size=1, layer_norm_eps=1e-5, attn_implementation="eager")
    return RobertaForMaskedLM(config).eval()


def test_linformer_with_k_equal_n_and_identity_projections_equals_stock_roberta():
    roberta = stock_roberta_masked_lm()
    config = LinformerConfig(**TINY, linformer_k=64, linformer_sharing="headwise")
    linformer = LinformerForMaskedLM(config).eval()
    missing, unexpected = linformer.load_state_dict(roberta.state_dict(), strict=False)
    assert not unexpected
    assert sorted(missing) == sorted(
        f"roberta.encoder.layer.{i}.attention.self.{name}_projection.weight" for i in range(2) for name in ("key", "value")
    )
    with torch.no_grad():
        for name in missing:
            linformer.get_parameter(name).copy_(torch.eye(64)[None])
    ids = random_ids(2, 64)  # n = n_max: the identity projection then keeps every key exactly
    torch.testing.assert_close(linformer(ids).logits, roberta(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_roberta_state_dict_maps_one_to_one(feature_map):
    roberta = stock_roberta_masked_lm()
    model = LinearRobertaForMaskedLM(LinearRobertaConfig(**TINY, feature_map=feature_map))
    assert set(model.state_dict()) == set(roberta.state_dict())
    model.load_state_dict(roberta.state_dict(), strict=True)
    for name, tensor in roberta.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_hybrid_with_every_layer_full_is_stock_roberta_and_adds_no_parameter():
    """layer_types all "full_attention": RoBERTa's softmax attention on the same weights, so stock RoBERTa's state
    dict loads one to one and its logits and attention weights come back, pads included in the batch."""
    roberta = stock_roberta_masked_lm()
    model = LinearRobertaForMaskedLM(LinearRobertaConfig(**TINY, feature_map="hedgehog",
                                                         layer_types=["full_attention"] * 2)).eval()
    assert set(model.state_dict()) == set(roberta.state_dict())  # no feature map, no band factor
    model.load_state_dict(roberta.state_dict(), strict=True)
    ids = random_ids(2, 24)
    mask = torch.ones_like(ids)
    ids[1, 15:], mask[1, 15:] = 1, 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, output_attentions=True)
        stock = roberta(ids, attention_mask=mask, output_attentions=True)
        fast = model(ids, attention_mask=mask).logits  # the SDPA path
    real = mask.bool()
    torch.testing.assert_close(ours.logits[real], stock.logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[real], stock.logits[real], atol=1e-5, rtol=1e-5)
    for a, b in zip(ours.attentions, stock.attentions):
        torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a[1][:, :15, :15], b[1][:, :15, :15], atol=1e-6, rtol=1e-5)


def test_a_hybrids_linear_layer_is_the_linear_models_and_its_full_layer_is_robertas():
    """Layer by layer against independent references: the hybrid's first layer (linear) gives what the all-linear
    model's first layer gives on the same weights; its second (full) gives stock RoBERTa's second layer applied to the
    same input."""
    roberta = stock_roberta_masked_lm()
    with torch.no_grad():  # sharper attention, so that softmax and linear attention differ visibly
        for layer in roberta.roberta.encoder.layer:
            for proj in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value):
                proj.weight.mul_(10)
    linear = LinearRobertaForMaskedLM(LinearRobertaConfig(**TINY)).eval()
    hybrid = LinearRobertaForMaskedLM(LinearRobertaConfig(**TINY, layer_types=["linear_attention", "full_attention"]))
    for model in (linear, hybrid.eval()):
        model.load_state_dict(roberta.state_dict(), strict=True)
    ids = random_ids(2, 24)
    with torch.no_grad():
        states = hybrid(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(states[1], linear(ids, output_hidden_states=True).hidden_states[1])
        second = roberta.roberta.encoder.layer[1](states[1])
        second = second[0] if isinstance(second, tuple) else second
    torch.testing.assert_close(states[2], second, atol=1e-5, rtol=1e-5)
    assert (states[2] - linear(ids, output_hidden_states=True).hidden_states[2]).abs().max() > 0.1


@pytest.mark.parametrize("layer_types, message", [
    (["full_attention"], r"num_hidden_layers"),
    (["full_attention", "sliding_attention"], "pure sliding-window softmax layer is not implemented"),
    (["chunked_attention", "linear_attention"], "is not a layer kind; choose one of linear_attention, full_attention"),
])
def test_bad_encoder_schedules_are_refused_at_construction(layer_types, message):
    with pytest.raises(ValueError, match=message):
        LinearRobertaConfig(**TINY, layer_types=layer_types)


def test_sharing_modes_have_the_paper_number_of_projections():
    base = dict(TINY, num_hidden_layers=12, num_attention_heads=12, hidden_size=96, linformer_k=8)
    expected = {"none": 288, "headwise": 24, "key-value": 12, "layerwise": 1}
    for sharing, count in expected.items():
        model = AutoModel.from_config(LinformerConfig(**base, linformer_sharing=sharing))
        matrices = sum(p.shape[0] for name, p in model.named_parameters() if "projection" in name)
        assert matrices == count, (sharing, matrices)


@pytest.mark.parametrize("sharing", ["headwise", "layerwise"])
def test_pooling_init_projects_to_window_means(sharing):
    """linformer_init="pooling": E x is the mean of each run of n / k consecutive rows (computed by reshaping)."""
    from hf_linear_attn import project_sequence

    torch.manual_seed(0)
    model = AutoModel.from_config(LinformerConfig(**TINY, linformer_k=8, linformer_sharing=sharing,
                                                  linformer_init="pooling"))
    projections = [p for name, p in model.named_parameters() if "projection" in name]
    assert projections
    x = torch.randn(2, 4, 64, 8)  # (batch, heads, n = the model's maximum length, head dim)
    expected = x.view(2, 4, 8, 8, 8).mean(dim=3)
    for weight in projections:
        assert weight.shape[-2:] == (8, 64)
        torch.testing.assert_close(project_sequence(x, weight.detach()), expected)
    assert projections[0].requires_grad  # a starting point: E and F are still learned


@pytest.mark.parametrize("heads_share", [True, False])
def test_normalized_rows_project_with_per_example_affine_rows(heads_share):
    """normalize_rows: each example's rows of E are shifted to sum 1 over its real tokens (formed here explicitly)."""
    from hf_linear_attn import project_sequence

    torch.manual_seed(0)
    projection = torch.randn(1 if heads_share else 4, 6, 32)
    x = torch.randn(3, 4, 20, 8)
    lengths = [20, 13, 7]
    mask = torch.arange(20)[None, :] < torch.tensor(lengths)[:, None]
    got = project_sequence(x, projection, mask, normalize_rows=True)
    for b, m in enumerate(lengths):
        rows = projection[..., :m]
        affine = rows - (rows.sum(-1, keepdim=True) - 1.0) / m
        torch.testing.assert_close(affine.sum(-1), torch.ones(affine.shape[:2]))
        torch.testing.assert_close(got[b], torch.matmul(affine, x[b, :, :m]), atol=1e-5, rtol=1e-4)
    # a constant sequence projects to itself, whatever E is; without the option it is scaled by E's row sums
    constant = torch.randn(1, 4, 1, 8).expand(1, 4, 20, 8)
    torch.testing.assert_close(project_sequence(constant, projection, normalize_rows=True),
                               constant[:, :, :6].expand(1, 4, 6, 8), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(project_sequence(constant, projection), constant[:, :, :6].expand(1, 4, 6, 8))


@pytest.mark.parametrize("variant", sorted(FAMILY_VARIANTS))
def test_padded_batch_equals_one_by_one(variant):
    torch.manual_seed(0)
    model = AutoModel.from_config(FAMILY_VARIANTS[variant]()).eval()
    lengths = [20, 13, 7]
    rows = [random_ids(1, n, seed=n)[0] for n in lengths]
    ids = torch.full((3, 20), 1)  # pad_token_id = 1, right padding
    mask = torch.zeros(3, 20, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).last_hidden_state
        for i, row in enumerate(rows):
            alone = model(row[None]).last_hidden_state[0]
            torch.testing.assert_close(batched[i, : len(row)], alone, atol=1e-5, rtol=1e-4)
        if variant.startswith("linear"):  # no absolute projection: left padding is honoured too
            left_ids, left_mask = ids.clone(), mask.clone()
            for i, row in enumerate(rows):
                left_ids[i], left_mask[i] = 1, 0
                left_ids[i, 20 - len(row):], left_mask[i, 20 - len(row):] = row, 1
            left = model(left_ids, attention_mask=left_mask).last_hidden_state
            for i, row in enumerate(rows):
                torch.testing.assert_close(left[i, 20 - len(row):], batched[i, : len(row)], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["linformer-none", "linformer-layerwise", "linear-favor", "linear-hedgehog", "linear-window",
                                     "linear-hybrid"])
def test_every_head_runs_trains_and_reports_attentions(variant):
    config = FAMILY_VARIANTS[variant]()  # num_labels = 2, as QA heads need
    ids = random_ids(2, 16)
    for auto in AUTO_HEADS:
        model = auto.from_config(config)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if auto is AutoModelForMaskedLM:
            inputs["labels"] = ids
        elif auto is AutoModelForSequenceClassification:
            inputs["labels"] = torch.tensor([0, 1])
        elif auto is AutoModelForTokenClassification:
            inputs["labels"] = torch.zeros_like(ids)
        elif auto is AutoModelForQuestionAnswering:
            inputs.update(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
        elif auto is AutoModelForMultipleChoice:
            inputs = {"input_ids": ids[None].expand(2, 2, 16), "labels": torch.tensor([0, 1])}
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
        assert len(out.hidden_states) == 3 and len(out.attentions) == 2
        k = 16 if variant.startswith("linear") else 8  # linear: the implicit n x n map; Linformer: n x k
        assert out.attentions[0].shape[-2:] == (16, k)
        torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(out.attentions[0].shape[:-1]), atol=1e-4, rtol=0)
        if auto is not AutoModel:
            out.loss.backward()
            grads = [p.grad for n, p in model.named_parameters() if "projection" in n or "feature_map" in n]
            assert all(g is not None and g.abs().sum() > 0 for g in grads if g is not None)
        tuple_out = model(**inputs, return_dict=False)
        assert isinstance(tuple_out, tuple)
        model.config.return_dict = False  # as in Transformers: the config's choice when the call makes none
        assert isinstance(model(**inputs), tuple) and not isinstance(model(**inputs, return_dict=True), tuple)
        model.config.return_dict = True


def test_multiple_choice_logits_shape_and_regression_head():
    config = FAMILY_VARIANTS["linear-elu"](num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config)
    out = model(random_ids(3, 10), labels=torch.tensor([0.5, -1.0, 2.0]))
    assert out.logits.shape == (3, 1) and model.config.problem_type == "regression"
    mc = AutoModelForMultipleChoice.from_config(config)
    assert mc(random_ids(2 * 4, 10).view(2, 4, 10)).logits.shape == (2, 4)


def masked_lm_step(model, ids):
    """One masked-LM training step from zeroed gradients: (logits, {parameter name: gradient})."""
    model.zero_grad()
    torch.manual_seed(1)  # the same draws in every step compared, should the model draw any
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def enable_checkpointing(model):
    model.activation_checkpointing_enable()


def chunk_feed_forward(model):
    for layer in model.roberta.encoder.layer:
        layer.chunk_size_feed_forward = 5  # 5 does not divide 24: the last chunk is shorter


@pytest.mark.parametrize("variant, saving", [
    ("linformer-layerwise", enable_checkpointing), ("linear-favor", enable_checkpointing),
    ("linformer-layerwise", chunk_feed_forward), ("linear-elu", chunk_feed_forward),
])
def test_memory_savings_give_the_same_training_step(variant, saving):
    """Gradient checkpointing and config.chunk_size_feed_forward (RoBERTa's option, as in stock RoBERTa) give the
    same logits and gradients as the plain step."""
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(FAMILY_VARIANTS[variant]()).train()
    ids = random_ids(2, 24)
    plain_logits, plain_grads = masked_lm_step(model, ids)
    saving(model)
    logits, grads = masked_lm_step(model, ids)
    torch.testing.assert_close(logits, plain_logits, atol=1e-6, rtol=1e-5)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], atol=1e-6, rtol=1e-5)


def test_config_chunk_size_feed_forward_reaches_every_layer():
    config = FAMILY_VARIANTS["linear-elu"]()
    config.chunk_size_feed_forward = 6
    assert AutoModel.from_config(config).encoder.layer[-1].chunk_size_feed_forward == 6


def test_bf16_autocast_matches_float32():
    for variant in ("linformer-headwise", "linear-elu", "linear-favor"):
        torch.manual_seed(0)
        model = AutoModel.from_config(FAMILY_VARIANTS[variant]()).eval()
        ids = random_ids(2, 30)
        with torch.no_grad():
            ref = model(ids).last_hidden_state
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = model(ids).last_hidden_state
        assert torch.isfinite(low).all() and (low.float() - ref).abs().max() < 0.1, variant
        with torch.no_grad():
            pure = model.to(torch.bfloat16)(ids).last_hidden_state  # bf16 weights, no autocast
        assert pure.dtype == torch.bfloat16 and (pure.float() - ref).abs().max() < 0.15, variant


def test_torch_compile_runs_and_matches_eager():
    torch._dynamo.reset()
    for variant in ("linformer-key-value", "linear-favor"):
        model = AutoModel.from_config(FAMILY_VARIANTS[variant]()).eval()
        ids, mask = random_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
        compiled = torch.compile(model)  # inductor, the default backend
        with torch.no_grad():
            torch.testing.assert_close(
                compiled(ids, attention_mask=mask).last_hidden_state, model(ids, attention_mask=mask).last_hidden_state
            )
    model = AutoModelForMaskedLM.from_config(FAMILY_VARIANTS["linear-elu"]()).train()
    loss = torch.compile(model)(ids, labels=ids).loss  # a compiled training step, forward and backward
    loss.backward()
    assert torch.isfinite(loss) and model.roberta.embeddings.word_embeddings.weight.grad is not None


# ---------------------------------------------------------------- bad input: clear errors naming the fix


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(linformer_sharing="kv"), "Unknown linformer_sharing 'kv'"),
        (dict(linformer_init="kaiming"), "Unknown linformer_init"),
        (dict(linformer_k=65), "linformer_k=65 must be between 1 and the maximum sequence length 64"),
        (dict(linformer_k=[8, 8, 8]), "lists 3 values for 2 layers"),
        (dict(linformer_k=[8, 16], linformer_sharing="layerwise"), "needs a single k"),
        (dict(hidden_size=30), "must be a multiple of num_attention_heads"),
        (dict(is_decoder=True), "bidirectional"),
        (dict(hidden_dropout_prob=2.0), r"hidden_dropout_prob must be a probability in \[0, 1\), got 2.0"),
        (dict(classifier_dropout=-0.1), "classifier_dropout must be a probability"),
    ],
)
def test_invalid_linformer_configs_fail_at_config_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinformerConfig(**{**TINY, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(feature_map="softmax"), "Unknown feature_map 'softmax'; choose one of elu, relu, favor, hedgehog"),
        (dict(linear_attention_eps=0.0), "linear_attention_eps must be > 0"),
        (dict(num_random_features=0), "num_random_features must be positive"),
    ],
)
def test_invalid_linear_configs_fail_at_config_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutoConfig.for_model("linear_roberta", **{**TINY, **kwargs})
    assert AutoConfig.for_model("linear_roberta", **{**TINY, "linear_attention_eps": 1}).linear_attention_eps == 1


def test_too_long_input_left_padding_and_bad_masks_raise_clear_errors():
    linformer = AutoModel.from_config(FAMILY_VARIANTS["linformer-headwise"]())
    linear = AutoModel.from_config(FAMILY_VARIANTS["linear-elu"]())
    for model in (linformer, linear):
        with pytest.raises(ValueError, match="65 tokens but this model takes at most 64.*truncation=True"):
            model(random_ids(1, 65))
        with pytest.raises(ValueError, match="2-D 0/1 mask"):
            model(random_ids(2, 8), attention_mask=torch.ones(2, 1, 8, 8))
    left = torch.tensor([[0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        linformer(random_ids(1, 5), attention_mask=left)
    linear(random_ids(1, 5), attention_mask=left)  # fine for linear attention
