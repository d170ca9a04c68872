"""The family registry (hf_linear_attn.families) is the one place that knows each family: registration with the
Auto classes, conversion targets, pretraining objectives and distillation modes all follow from it."""

import transformers
from helpers import DECODER_VARIANTS, FAMILY_VARIANTS

import hf_linear_attn
from hf_linear_attn import MODEL_FAMILIES, family_of
from hf_linear_attn.conversion.convert import TARGETS
from hf_linear_attn.conversion.distill import distillation_mode


def test_every_family_opens_with_each_of_its_auto_classes_as_the_registered_class():
    assert set(MODEL_FAMILIES) == {"linformer", "linear_roberta", "linear_gpt2", "linformer_gpt2"}
    configs = {c().model_type: c() for c in [*FAMILY_VARIANTS.values(), *DECODER_VARIANTS.values()]}
    for model_type, family in MODEL_FAMILIES.items():
        config = configs[model_type]
        assert isinstance(transformers.AutoConfig.for_model(model_type), family.config_class)
        for auto_name, model_class in family.models.items():
            model = getattr(transformers, auto_name).from_config(config)
            assert type(model) is model_class and family_of(model) is family
            assert model_class.__name__ in hf_linear_attn.__all__


def test_conversion_objectives_and_distillation_follow_the_registry():
    assert TARGETS == {"linformer": "encoder", "linear_roberta": "encoder", "linear_gpt2": "decoder",
                       "linformer_gpt2": "decoder"}
    expected = {"linformer": ("mlm", "layer_output"), "linear_roberta": ("mlm", "attention"),
                "linear_gpt2": ("clm", "attention"), "linformer_gpt2": ("clm", "layer_output")}
    for model_type, (objective, mode) in expected.items():
        family = MODEL_FAMILIES[model_type]
        model = family.models["AutoModel"](family.config_class(**_tiny(family)))
        assert family.objective == objective and distillation_mode(model) == mode


def test_a_stock_model_has_no_family():
    assert family_of(transformers.RobertaConfig()) is None and family_of(object()) is None


def _tiny(family):
    """Tiny dimensions of the family's kind, with Linformer's k where it has one."""
    linformer = family.attention == "linformer"
    if family.kind == "encoder":
        return dict(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    max_position_embeddings=34, **(dict(linformer_k=8) if linformer else {}))
    return dict(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_inner=32, n_positions=32,
                **(dict(linformer_k=4, linformer_block_size=8) if linformer else {}))
