"""The presets in configs/models load through AutoConfig and describe the models they name."""

import json

import pytest
import torch
from helpers import REPO_ROOT
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from hf_linear_attn.families import max_model_length

PRESETS = sorted((REPO_ROOT / "configs" / "models").glob("*.json"))
ENCODER_PRESETS = [p for p in PRESETS if "gpt2" not in p.stem]
DECODER_PRESETS = [p for p in PRESETS if "gpt2" in p.stem]
DECODER_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
                  "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range")
CPU_PRESETS = sorted((REPO_ROOT / "configs" / "models" / "cpu").glob("*.json"))
ENCODER_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_dropout_prob",
                  "attention_probs_dropout_prob", "pad_token_id", "bos_token_id", "eos_token_id")


@pytest.mark.parametrize("path", ENCODER_PRESETS, ids=lambda p: p.stem)
def test_encoder_preset_loads_with_roberta_base_dimensions(path):
    config = AutoConfig.from_pretrained(str(path))
    raw = json.loads(path.read_text())
    assert config.model_type == raw["model_type"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 12, 12)
    assert max_model_length(config) == 512
    if config.model_type == "linformer":
        assert f"k{config.linformer_k}" in path.stem
    # the softmax baseline (stock RoBERTa) has exactly these dimensions
    control = AutoConfig.from_pretrained(str(REPO_ROOT / "configs" / "models" / "roberta-base-softmax.json"))
    assert {f: getattr(config, f) for f in ENCODER_FIELDS} == {f: getattr(control, f) for f in ENCODER_FIELDS}


@pytest.mark.parametrize("path", CPU_PRESETS, ids=lambda p: p.stem)
def test_cpu_presets_share_their_softmax_baselines_dimensions_and_build(path):
    """configs/models/cpu: small models for 2-core CPUs, each variant with its softmax baseline's exact dimensions."""
    config = AutoConfig.from_pretrained(str(path))
    decoder = "gpt2" in path.stem
    control = AutoConfig.from_pretrained(str(path.parent / ("gpt2-softmax.json" if decoder else "roberta-softmax.json")))
    fields = DECODER_FIELDS if decoder else ENCODER_FIELDS
    assert {f: getattr(config, f) for f in fields} == {f: getattr(control, f) for f in fields}
    assert max_model_length(config) >= 128  # the CPU recipes train at n = 128
    auto = AutoModelForCausalLM if decoder else AutoModelForMaskedLM
    with torch.device("meta"):
        parameters = sum(p.numel() for p in auto.from_config(config).parameters())
    assert parameters < 10_000_000
    if config.model_type == "linformer":  # n / k = 4 and 2, as 512 / 128 and 512 / 256 in the paper's Table 2
        assert 128 // config.linformer_k in (2, 4) and f"k{config.linformer_k}" in path.stem


def test_presets_cover_the_papers_table_2_variants():
    assert {p.stem for p in PRESETS} >= {
        "linformer-base-k128", "linformer-base-k256", "linformer-base-k256-shared-kv",
        "linformer-base-k256-shared-kv-layer",
    }


def _parameter_count(config) -> int:
    with torch.device("meta"):  # shapes only, no memory
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


@pytest.mark.parametrize("path", DECODER_PRESETS, ids=lambda p: p.stem)
def test_decoder_preset_has_the_softmax_controls_dimensions(path):
    """The softmax control is stock GPT-2 (gpt2-small-softmax.json): every decoder preset matches it field by field."""
    control = AutoConfig.from_pretrained(str(REPO_ROOT / "configs" / "models" / "gpt2-small-softmax.json"))
    config = AutoConfig.from_pretrained(str(path))
    assert {f: getattr(config, f) for f in DECODER_FIELDS} == {f: getattr(control, f) for f in DECODER_FIELDS}
    extra = _parameter_count(config) - _parameter_count(control)
    if config.model_type == "linformer_gpt2":  # E and F per layer: 2 x 12 x k x block
        assert extra == 2 * 12 * config.linformer_k * config.linformer_block_size
    else:  # FAVOR+ features are a buffer, not parameters: identical parameter count
        assert extra == 0
