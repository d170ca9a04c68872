"""--push_to_hub in scripts/convert.py (issue 27): checked before the source is loaded; the converted checkpoint
goes up with a card that names `base_model` (a Hub id; a local path only in the text), what was copied and what
is new, and the distillation's figures when distillation ran. The Hub client is the recording stand-in of
tests/hub_stand_in.py; a Hub id is served offline from a local Hub cache, as a downloaded model is."""

import json

import convert as convert_script  # scripts/convert.py
import pytest
import torch
from helpers import TINY, needs_data, script_error
from hub_stand_in import TOKEN, front_matter, recorded, use_recording_hub
from transformers import RobertaConfig, RobertaForMaskedLM

STOCK_ROBERTA = dict(TINY, type_vocab_size=1, layer_norm_eps=1e-5)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return use_recording_hub(tmp_path, monkeypatch)


def save_roberta(folder, tokenizer):
    torch.manual_seed(0)
    RobertaForMaskedLM(RobertaConfig(**STOCK_ROBERTA)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def hub_model(tmp_path, monkeypatch, tokenizer):
    """`someone/tiny-roberta`, a Hub id that loads offline: a snapshot in a local Hub cache that refs/main points
    to, where from_pretrained looks for a downloaded model."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    repo = cache / "models--someone--tiny-roberta"
    revision = "3f2a9c0e1b4d5a6f7e8c9d0a1b2c3d4e5f6a7b8c"
    save_roberta(repo / "snapshots" / revision, tokenizer)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return "someone/tiny-roberta"


def test_convert_refuses_a_bad_push_target_before_loading_the_source(tmp_path, hub):
    """The source does not exist: an error naming it would mean the Hub was checked too late."""
    out = tmp_path / "out"
    run = ["--model_name_or_path", str(tmp_path / "absent"), "--target", "linformer", "--output_dir", str(out),
           "--push_to_hub"]
    assert "Cannot read a model config" in script_error(convert_script.main, run[:-1])  # without the push: what would fail next
    assert "--push_to_hub needs a Hub token" in script_error(convert_script.main, run)
    assert "not a valid Hub repo name" in script_error(convert_script.main, [*run, "--hub_token", TOKEN, "--hub_model_id", "me/x y"])
    assert not out.exists() and not recorded(hub)


def test_a_conversion_from_a_hub_id_pushes_a_card_naming_its_base_model(tmp_path, hub, hub_model):
    out = tmp_path / "converted"
    result = convert_script.main(["--model_name_or_path", hub_model, "--target", "linformer", "--linformer_k", "8",
                                  "--output_dir", str(out), "--push_to_hub", "--hub_model_id", "tiny-linformer",
                                  "--hub_token", TOKEN])
    assert result["hub_commit"] == "https://huggingface.co/someone/tiny-linformer/commit/0123abc"
    (whoami, create, upload) = [c["call"] for c in recorded(hub)]
    assert whoami == ["whoami", TOKEN] and create[:2] == ["create_repo", "someone/tiny-linformer"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "conversion_report.json",
            "modeling_linformer.py", "configuration_linformer.py"} <= set(upload[2])

    header = front_matter(out / "README.md")
    assert header["base_model"] == hub_model and header["library_name"] == "transformers"
    assert header["pipeline_tag"] == "fill-mask" and {"hf-linear-attn", "linformer", "conversion"} <= set(header["tags"])
    assert "model-index" not in header and "datasets" not in header  # no distillation: no figures, no data
    report = json.loads((out / "conversion_report.json").read_text())
    card = (out / "README.md").read_text()
    assert f"Copied exactly: {len(report['copied'])} tensors, {report['copied_parameters']:,} parameters" in card
    assert f"New: {len(report['new'])} tensors, {report['new_parameters']:,} parameters" in card
    assert "Linformer projection E/F, xavier_uniform init" in card and "(RobertaForMaskedLM, a Hub model)" in card
    assert TOKEN not in card and "--hub_model_id tiny-linformer" in card


@pytest.mark.slow
@needs_data
def test_a_distilled_conversion_card_carries_the_distillation_figures(tmp_path, hub, tokenizer, corpus):
    """A local source (no base_model: a path is no Hub id; the text names it), hedgehog distillation on real
    WikiText-2 lines: the card's model-index holds the figures conversion_report.json records."""
    source = save_roberta(tmp_path / "roberta", tokenizer)
    out = tmp_path / "distilled"
    convert_script.main(["--model_name_or_path", str(source), "--target", "linear_roberta", "--feature_map",
                         "hedgehog", "--distill_steps", "3", "--distill_max_length", "32", "--eval_rows", "16",
                         "--train_file", str(corpus / "train.txt"), "--validation_file", str(corpus / "valid.txt"),
                         "--output_dir", str(out), "--push_to_hub", "--hub_model_id", "someone/distilled",
                         "--hub_token", TOKEN])
    assert [c["call"][0] for c in recorded(hub)] == ["whoami", "create_repo", "upload_folder"]
    distilled = json.loads((out / "conversion_report.json").read_text())["distillation"]
    header = front_matter(out / "README.md")
    assert "base_model" not in header and "distillation" in header["tags"]
    (result,) = header["model-index"][0]["results"]
    assert result["task"]["type"] == "fill-mask"
    assert result["dataset"] == {"name": "train.txt", "type": "local", "split": "valid.txt"}
    metrics = {m["type"]: m["value"] for m in result["metrics"]}
    expected = {"attention_kl": distilled["distance_after"], **{k: distilled["distilled"][k] for k in
                                                                 ("loss", "perplexity", "accuracy")}}
    assert metrics == pytest.approx(expected, rel=1e-4) and metrics["attention_kl"] > 0  # not rounded away
    card = (out / "README.md").read_text()
    assert f"converted from `{source}`" in card and "a local checkpoint" in card
    assert f"{distilled['distance_before']:.4g} after conversion -> {distilled['distance_after']:.4g}" in card
    assert f"| teacher (`{source}`) | {distilled['teacher']['loss']:.4f} |" in card
