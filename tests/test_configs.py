"""The paper-scale presets in configs/models load through AutoConfig and describe the models they name."""

import json

import pytest
from conftest import REPO_ROOT
from transformers import AutoConfig

PRESETS = sorted((REPO_ROOT / "configs" / "models").glob("*.json"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_with_roberta_base_dimensions(path):
    config = AutoConfig.from_pretrained(str(path))
    raw = json.loads(path.read_text())
    assert config.model_type == raw["model_type"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 12, 12)
    assert config.max_sequence_length == 512
    if config.model_type == "linformer":
        assert f"k{config.linformer_k}" in path.stem


def test_presets_cover_the_papers_table_2_variants():
    assert {p.stem for p in PRESETS} >= {
        "linformer-base-k128", "linformer-base-k256", "linformer-base-k256-shared-kv",
        "linformer-base-k256-shared-kv-layer",
    }
