"""Checkpoints travel: save_pretrained -> a fresh Python process that never imports hf_linear_attn -> same outputs."""

import json
import os

import pytest
import torch
from helpers import AUTO_HEADS, FAMILY_VARIANTS, random_ids, run_fresh_python
from transformers import AutoModel, AutoModelForSequenceClassification

# Every case's checkpoint opened with its saved code, and what it gives against what the package gave before saving:
# greedy generate() for a causal LM (12 new tokens), else the first output of a forward.
FRESH_PROCESS_LOADER = r"""
import json, sys, torch
import transformers
cases = json.load(open(sys.argv[1]))
results = {}
for case in cases:
    auto = getattr(transformers, case["auto"])
    model = auto.from_pretrained(case["path"], trust_remote_code=True).eval()
    inputs = torch.load(case["inputs"])
    with torch.no_grad():
        if case["auto"] == "AutoModelForCausalLM":
            got = model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=1)
        else:
            got = model(**inputs)[0]
    results[case["path"]] = {
        "class": type(model).__module__ + "." + type(model).__name__,
        "equal": bool(torch.equal(got, torch.load(case["expected"]))),
    }
assert "hf_linear_attn" not in sys.modules, "the fresh process imported the package"
print(json.dumps(results))
"""


def save_case(model, auto, path, inputs, expected) -> dict:
    """``model`` saved to ``path`` with its inputs and its expected output: the case the fresh process checks."""
    model.save_pretrained(path)
    torch.save(expected, path / "expected.pt")
    torch.save(inputs, path / "inputs.pt")
    return {"auto": auto.__name__, "path": str(path), "inputs": str(path / "inputs.pt"),
            "expected": str(path / "expected.pt")}


def check_in_a_fresh_process(tmp_path, cases) -> None:
    """Every case loaded by its saved code (not the package) in one fresh process gives its expected output exactly."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "loader.py").write_text(FRESH_PROCESS_LOADER)
    stdout = run_fresh_python(tmp_path / "loader.py", tmp_path / "cases.json", cwd=tmp_path, timeout=600,
                              HF_MODULES_CACHE=str(tmp_path / "modules"))
    results = json.loads(stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for path, result in results.items():
        assert result["class"].startswith("transformers_modules."), result  # the copied code, not the package
        assert result["equal"], (path, result)


@pytest.mark.slow
def test_every_head_of_both_families_loads_in_a_fresh_process(tmp_path):
    cases = []
    encoder_variants = ("linformer-layerwise", "linformer-none", "linear-favor", "linear-hedgehog", "linear-window",
                        "linear-hybrid")
    for variant in encoder_variants:
        for auto in AUTO_HEADS:
            torch.manual_seed(0)
            model = auto.from_config(FAMILY_VARIANTS[variant]()).eval()
            with torch.no_grad():  # make the learned maps non-trivial so a wrong load would show
                for name, param in model.named_parameters():
                    if "feature_map" in name or "window_factor" in name:
                        param.add_(0.1 * torch.randn_like(param))
            ids = random_ids(2, 12)
            if auto.__name__ == "AutoModelForMultipleChoice":
                ids = ids[None].expand(2, 2, 12)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            with torch.no_grad():
                expected = model(**inputs)[0]
            path = tmp_path / f"{variant}-{auto.__name__}"
            cases.append(save_case(model, auto, path, inputs, expected))
            saved = set(os.listdir(path))
            assert {"config.json", "model.safetensors", "modeling_roberta_style.py"} <= saved, saved
    assert len(cases) == len(AUTO_HEADS) * len(encoder_variants)
    check_in_a_fresh_process(tmp_path, cases)


def test_saved_config_opens_every_head_and_weights_reload_exactly(tmp_path):
    model = AutoModelForSequenceClassification.from_config(FAMILY_VARIANTS["linear-favor"]()).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config["auto_map"]) == {
        "AutoConfig", "AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModelForMultipleChoice",
    }
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    for name, tensor in model.state_dict().items():  # the FAVOR+ random matrix included
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    base = AutoModel.from_pretrained(tmp_path, device_map="auto")  # accelerate's big-model loading path
    ids = random_ids(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(base(ids).last_hidden_state, model.roberta(ids).last_hidden_state)


def test_a_checkpoint_with_misshaped_weights_is_refused(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    model = AutoModel.from_config(FAMILY_VARIANTS["linformer-headwise"]())
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "encoder.layer.0.attention.self.key_projection.weight"
    weights[name] = weights[name][:, :, :10].contiguous()  # wrong length: a checkpoint of another max length
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModel.from_pretrained(tmp_path)
    assert "key_projection" in caplog.text and "MISMATCH" in caplog.text  # the report names the bad weight


@pytest.mark.slow
def test_decoders_load_in_a_fresh_process_and_generate_the_same_tokens(tmp_path):
    from helpers import CONV_VARIANTS, DECODER_VARIANTS, causal_lm, left_padded_batch
    from transformers import AutoModelForCausalLM

    cases = []
    prompts = [random_ids(1, 9)[0], random_ids(1, 5, seed=1)[0]]
    ids, mask = left_padded_batch(prompts)
    inputs = {"input_ids": ids, "attention_mask": mask}
    variants = ("linear-favor", "linear-hedgehog", "linear-window", "linear-hybrid", "linear-gated",
                "linear-window-conv", "linear-delta-conv", "linear-kda-conv", "gpt2-conv", "linformer-layerwise",
                "linformer-none")
    for variant in variants:
        for auto in (AutoModelForCausalLM, AutoModel, AutoModelForSequenceClassification):
            if auto is AutoModelForCausalLM:
                model = causal_lm(variant)
                with torch.no_grad():
                    expected = model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                              pad_token_id=1)
            else:
                torch.manual_seed(0)
                model = auto.from_config({**DECODER_VARIANTS, **CONV_VARIANTS}[variant]()).eval()
                with torch.no_grad():
                    expected = model(**inputs)[0]
            path = tmp_path / f"{variant}-{auto.__name__}"
            cases.append(save_case(model, auto, path, inputs, expected))
            saved = set(os.listdir(path))
            assert {"modeling_gpt2_style.py", "recurrent_cache.py", "block_linformer.py", "sliding_window_attention.py",
                    "short_convolution.py", "delta_rule.py"} <= saved, saved
            config = json.loads((path / "config.json").read_text())
            assert set(config["auto_map"]) == {
                "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification"
            }
    assert len(cases) == 3 * len(variants)
    check_in_a_fresh_process(tmp_path, cases)
