"""Conversion of RoBERTa / GPT-2 checkpoints, attention distillation and Linformer length extension."""

import json
import math

import convert as convert_script  # scripts/convert.py
import pytest
import torch
from helpers import (GLUE, REPO_ROOT, TINY, TINY_DECODER, needs_data, pretrain_args, random_ids, run_fresh_python,
                     run_pretrain, script_error, tiny_preset)
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForMaskedLM,
    DistilBertConfig,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
)

from hf_linear_attn.linformer_projection import project_sequence
from hf_linear_attn.conversion.convert import convert, extend_max_length
from hf_linear_attn.training.errors import UsageError
from hf_linear_attn.conversion.distill import (CALIBRATION_GRID, calibrate_window_factors, distill,
                                              distillation_distance, layer_losses, output_agreement,
                                              teacher_targets)

STOCK_ROBERTA = dict(TINY, type_vocab_size=1, layer_norm_eps=1e-5)
STOCK_GPT2 = {k: v for k, v in TINY_DECODER.items() if k != "initializer_range"}


@pytest.fixture
def roberta_folder(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = RobertaForMaskedLM(RobertaConfig(**STOCK_ROBERTA)).eval()
    model.save_pretrained(tmp_path / "roberta")
    tokenizer.save_pretrained(tmp_path / "roberta")
    return tmp_path / "roberta", model


@pytest.fixture
def gpt2_folder(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**STOCK_GPT2)).eval()
    model.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2", model


def test_roberta_to_linformer_copies_every_weight_and_identity_projection_gives_roberta(roberta_folder):
    folder, roberta = roberta_folder
    n = TINY["max_position_embeddings"] - 2
    model, report = convert(folder, "linformer", linformer_k=n, linformer_sharing="layerwise")
    source = roberta.state_dict()
    assert report.head == "masked-lm" and type(model).__name__ == "LinformerForMaskedLM"
    assert set(report.copied) == set(model.state_dict()) - {"roberta.encoder.shared_projection.weight"}
    assert set(report.copied) >= {name for name, _ in roberta.named_parameters()}
    assert list(report.new) == ["roberta.encoder.shared_projection.weight"] and "xavier" in report.new[
        "roberta.encoder.shared_projection.weight"]
    for name in report.copied:
        assert torch.equal(model.state_dict()[name], source[name]), name
    with torch.no_grad():  # k = n and E = F = I: Linformer attention is softmax attention
        model.roberta.encoder.shared_projection.weight.copy_(torch.eye(n)[None])
    ids = random_ids(2, n)
    torch.testing.assert_close(model.eval()(ids).logits, roberta(ids).logits, atol=1e-5, rtol=1e-5)


def test_gpt2_to_both_decoders_copies_weights_and_one_block_linformer_is_gpt2(gpt2_folder):
    folder, gpt2 = gpt2_folder
    model, report = convert(folder, "linformer_gpt2", linformer_k=4, linformer_block_size=TINY_DECODER["n_positions"])
    assert sorted(report.new) == sorted(
        f"transformer.h.{i}.attn.{name}_projection.weight" for i in range(2) for name in ("key", "value"))
    assert not [n for n in report.dropped if not report.dropped[n].startswith("buffer")]
    ids = random_ids(2, 40)
    torch.testing.assert_close(model.eval()(ids).logits, gpt2(ids).logits, atol=1e-4, rtol=1e-4)
    linear, report = convert(folder, "linear_gpt2", feature_map="hedgehog")
    assert len(report.new) == 2 and all("hedgehog" in how for how in report.new.values())
    source = gpt2.state_dict()
    assert all(torch.equal(linear.state_dict()[name], source[name]) for name in report.copied)
    assert report.copied_parameters == sum(p.numel() for p in gpt2.parameters())


def test_gpt2_converts_into_each_linear_variant_and_distils_the_new_parts(gpt2_folder):
    """Issue 41: a window covering the positions and an all-softmax schedule are GPT-2 itself after conversion; the
    gate of a gated student is new, described, and distillation trains it (and only it) closer to the teacher."""
    folder, gpt2 = gpt2_folder
    ids = random_ids(2, 40)
    window, report = convert(folder, "linear_gpt2", attention_window=TINY_DECODER["n_positions"])
    assert sorted(report.new) == [f"transformer.h.{i}.attn.window_factor.log_factor" for i in range(2)]
    assert all("theta = 0" in how for how in report.new.values())
    torch.testing.assert_close(window.eval()(ids).logits, gpt2(ids).logits, atol=1e-4, rtol=1e-4)
    full, report = convert(folder, "linear_gpt2", layer_types=["full_attention"] * 2)
    assert not report.new
    torch.testing.assert_close(full.eval()(ids).logits, gpt2(ids).logits, atol=1e-5, rtol=1e-5)
    gated, report = convert(folder, "linear_gpt2", state_decay="gated", feature_map="hedgehog",
                            layer_types=["full_attention", "linear_attention"])
    assert sorted(report.new) == sorted(
        ["transformer.h.1.attn.feature_map.weight"]
        + [f"transformer.h.1.attn.gk_proj.{p}" for p in ("0.weight", "1.weight", "1.bias")])
    assert "GLA gate" in report.new["transformer.h.1.attn.gk_proj.1.bias"]
    frozen = {name: p.detach().clone() for name, p in gated.named_parameters() if name not in report.new}
    before = gated.transformer.h[1].attn.gk_proj[1].weight.detach().clone()
    rows = random_ids(16, 32, seed=3)
    distance = distillation_distance(gated, gpt2, rows)
    distill(gated, gpt2, list(report.new), rows, steps=30, batch_size=8, progress=False)
    assert distillation_distance(gated, gpt2, rows) < 0.8 * distance, distance
    assert not torch.equal(gated.transformer.h[1].attn.gk_proj[1].weight, before)
    assert all(torch.equal(p, frozen[name]) for name, p in gated.named_parameters() if name in frozen)


def test_roberta_converts_into_an_encoder_hybrid_whose_full_layers_stay_exact_and_distils_the_rest(roberta_folder):
    """Issue 41 on the encoder side: an all-softmax schedule is RoBERTa itself after conversion (nothing new); a
    hybrid's new parts are the linear layer's feature map only, and distillation moves them (and only them) closer
    to the teacher."""
    folder, roberta = roberta_folder
    ids = random_ids(2, 40)
    full, report = convert(folder, "linear_roberta", layer_types=["full_attention"] * 2)
    assert not report.new
    torch.testing.assert_close(full.eval()(ids).logits, roberta(ids).logits, atol=1e-5, rtol=1e-5)
    hybrid, report = convert(folder, "linear_roberta", feature_map="hedgehog",
                             layer_types=["linear_attention", "full_attention"])
    assert sorted(report.new) == ["roberta.encoder.layer.0.attention.self.feature_map.weight"]
    frozen = {name: p.detach().clone() for name, p in hybrid.named_parameters() if name not in report.new}
    rows = random_ids(16, 32, seed=3)
    # the last hidden state's agreement with the source: 1 for the model that is RoBERTa; the fresh teacher's rows
    # are near uniform, which linear attention gets nearly right, so a teacher with sharp rows (weights of scale
    # 0.5) shows the gap: elu + 1 then agrees far less
    assert output_agreement(full, roberta, rows) == pytest.approx(1.0, abs=1e-6)
    torch.manual_seed(0)
    sharp = RobertaForMaskedLM(RobertaConfig(**STOCK_ROBERTA, initializer_range=0.5)).eval()
    assert output_agreement(convert(sharp, "linear_roberta")[0], sharp, rows) < 0.9
    distance = distillation_distance(hybrid, roberta, rows)
    distill(hybrid, roberta, list(report.new), rows, steps=30, batch_size=8, progress=False)
    assert distillation_distance(hybrid, roberta, rows) < 0.8 * distance, distance
    assert all(torch.equal(p, frozen[name]) for name, p in hybrid.named_parameters() if name in frozen)


def test_window_factor_calibration_finds_each_heads_best_start(roberta_folder, gpt2_folder):
    """The window factor's start is set per head to the grid value nearest the teacher. Against a fresh RoBERTa
    (near-uniform rows, q.k near 0) elu + 1's phi(q).phi(k) is near the head size m, so the keys weigh evenly at
    g = m: theta near log(m), issue 41's analysis. Per head it is at least as good as any one value for all heads;
    full layers of a hybrid are left alone; without a window there is nothing to calibrate."""
    folder, roberta = roberta_folder
    rows = random_ids(8, 32, seed=5)
    student, _ = convert(folder, "linear_roberta", attention_window=4)
    start = distillation_distance(student, roberta, rows)
    thetas = calibrate_window_factors(student, roberta, rows)
    head_size = STOCK_ROBERTA["hidden_size"] // STOCK_ROBERTA["num_attention_heads"]
    assert len(thetas) == 2 and all(len(layer) == 4 for layer in thetas)
    assert all(abs(theta - math.log(head_size)) <= 0.5 for layer in thetas for theta in layer), thetas
    assert distillation_distance(student, roberta, rows) < start
    mask = torch.ones_like(rows)
    hidden, attentions = teacher_targets(roberta, rows, mask)
    with torch.no_grad():
        calibrated = [float(x) for x in layer_losses(student, hidden, attentions, mask, "attention")]
    factors = [layer.attention.self.window_factor.log_factor for layer in student.roberta.encoder.layer]
    chosen = [f.detach().clone() for f in factors]
    for value in (CALIBRATION_GRID[0], -2.0, 0.0, 1.0, 2.0, 3.0, CALIBRATION_GRID[-1]):
        with torch.no_grad():
            for f in factors:
                f.fill_(value)
            uniform = layer_losses(student, hidden, attentions, mask, "attention")
        assert all(c <= float(u) + 1e-6 for c, u in zip(calibrated, uniform)), (value, calibrated, uniform)
    with torch.no_grad():
        for f, c in zip(factors, chosen):
            f.copy_(c)
    # a decoder hybrid: the softmax layer has no factor (None), the windowed linear layer gets its thetas
    gpt2_dir, gpt2 = gpt2_folder
    hybrid, _ = convert(gpt2_dir, "linear_gpt2", attention_window=8, layer_types=["full_attention", "linear_attention"])
    thetas = calibrate_window_factors(hybrid, gpt2, random_ids(4, 40, seed=6))
    assert thetas[0] is None and len(thetas[1]) == 4
    assert torch.equal(hybrid.transformer.h[1].attn.window_factor.log_factor, torch.tensor(thetas[1]))
    plain, _ = convert(folder, "linear_roberta", feature_map="hedgehog")
    assert calibrate_window_factors(plain, roberta, rows) is None


def test_end_to_end_distillation_brings_the_last_hidden_state_closer_and_trains_only_the_new_parts():
    """The "output" objective: the student's whole stack on its own states against the teacher's last hidden state.
    On a teacher with sharp attention rows (weights of scale 0.5, where linear attention is far from softmax) it
    must raise the last hidden state's cosine with the teacher's, touching only the new parts (hedgehog's maps)."""
    torch.manual_seed(0)
    sharp = RobertaForMaskedLM(RobertaConfig(**STOCK_ROBERTA, initializer_range=0.5)).eval()
    student, report = convert(sharp, "linear_roberta", feature_map="hedgehog")
    frozen = {name: p.detach().clone() for name, p in student.named_parameters() if name not in report.new}
    rows = random_ids(32, 32, seed=7)
    before = output_agreement(student, sharp, rows)
    losses = distill(student, sharp, list(report.new), rows, steps=80, batch_size=8, progress=False,
                     objective="output")
    assert output_agreement(student, sharp, rows) > before + 0.02, before
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[name]) for name, p in student.named_parameters() if name in frozen)
    with pytest.raises(UsageError, match="Unknown distillation objective 'logits'"):
        distill(student, sharp, list(report.new), rows, steps=1, objective="logits")


def test_a_new_head_is_reported_new_not_copied(roberta_folder):
    folder, _ = roberta_folder
    model, report = convert(folder, "linear_roberta", head="sequence-classification")
    assert type(model).__name__ == "LinearRobertaForSequenceClassification"
    assert {"classifier.dense.weight", "classifier.out_proj.weight"} <= set(report.new)
    assert not [name for name in report.copied if name.startswith("classifier")]
    # an already loaded model converts too, with the head of its class
    loaded = RobertaForSequenceClassification(RobertaConfig(**STOCK_ROBERTA, num_labels=3))
    model, report = convert(loaded, "linformer", linformer_k=8)
    assert model.config.num_labels == 3 and "classifier.out_proj.weight" in report.copied


def test_conversion_refuses_what_it_cannot_convert(roberta_folder, gpt2_folder, tmp_path):
    folder, _ = roberta_folder
    gfolder, _ = gpt2_folder
    DistilBertConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4, hidden_dim=64).save_pretrained(tmp_path / "distil")
    cases = [
        ((tmp_path / "distil", "linformer"), "DistilBERT names its weights differently"),  # BERT itself converts
        ((gfolder, "linear_roberta"), "converted from roberta / xlm-roberta / camembert / bert"),
        ((gfolder, "linformer"), "converted from roberta / xlm-roberta / camembert / bert"),
        ((folder, "linear_gpt2"), "converted from gpt2"),
        ((folder, "performer"), "Unknown target 'performer'"),
        ((tmp_path / "nowhere", "linformer"), "Cannot read a model config"),
    ]
    for (source, target), message in cases:
        with pytest.raises(UsageError, match=message):
            convert(source, target)
    with pytest.raises(UsageError, match="gpt2.* has no masked-lm head in transformers"):
        convert(gfolder, "linear_gpt2", head="masked-lm")
    with pytest.raises(UsageError, match="linformer has no causal-lm head"):  # RoBERTa has one, Linformer not
        convert(folder, "linformer", head="causal-lm", linformer_k=8)
    with pytest.raises(UsageError, match="Invalid options for linformer"):
        convert(folder, "linformer", linformer_k=10_000)
    # a checkpoint missing a body weight is refused, naming it (not re-drawn at random)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["roberta.encoder.layer.1.attention.self.key.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match="lacks weights .*layer.1.attention.self.key.weight"):
        convert(folder, "linformer", linformer_k=8)


def test_distilling_a_map_without_parameters_is_refused(roberta_folder):
    folder, roberta = roberta_folder
    model, report = convert(folder, "linear_roberta", feature_map="elu")
    with pytest.raises(UsageError, match="Nothing to distill.*'elu'.*hedgehog"):
        distill(model, roberta, report.new, random_ids(4, 16), steps=1)


def test_length_extension_stretches_projections_and_tiles_positions(roberta_folder):
    folder, _ = roberta_folder
    model, _ = convert(folder, "linformer", linformer_k=8, linformer_sharing="headwise")
    old = model.config.max_sequence_length  # 64
    longer = extend_max_length(model, 4 * old)
    assert longer.config.max_sequence_length == 4 * old
    e, e4 = (m.roberta.encoder.layer[0].attention.self.key_projection.weight for m in (model, longer))
    assert e4.shape == (1, 8, 4 * old)
    # each token repeated 4 times projects exactly as the original sequence
    x = torch.randn(2, 4, old, 8)
    torch.testing.assert_close(project_sequence(x.repeat_interleave(4, dim=2), e4), project_sequence(x, e))
    table, table4 = (m.roberta.embeddings.position_embeddings.weight for m in (model, longer))
    assert torch.equal(table4[: table.shape[0]], table)  # old positions unchanged
    assert torch.equal(table4[2 + old: 2 + 2 * old], table[2:])  # new positions tiled from the learned ones
    out = longer.eval()(random_ids(1, 4 * old)).logits
    assert out.shape == (1, 4 * old, TINY["vocab_size"]) and torch.isfinite(out).all()
    with pytest.raises(UsageError, match="must exceed the current maximum"):
        extend_max_length(model, old)


def test_convert_script_writes_a_checkpoint_a_fresh_process_loads(roberta_folder, tmp_path):
    folder, _ = roberta_folder
    out = tmp_path / "converted"
    convert_script.main(["--model_name_or_path", str(folder), "--target", "linformer", "--linformer_k", "16",
                         "--extend_max_length", "128", "--output_dir", str(out)])
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["extended_to"] == 128 and report["new"] and report["copied_parameters"] > 0
    code = ("import sys, torch; from transformers import AutoModelForMaskedLM, AutoTokenizer;"
            "m = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval();"
            "t = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True);"
            "ids = torch.arange(5, 105)[None];"
            "print(t.model_max_length, type(m).__name__, m(ids).logits.sum().item())")
    max_length, name, total = run_fresh_python("-c", code, out, cwd=tmp_path).strip().splitlines()[-1].split()
    assert max_length == "128" and name == "LinformerForMaskedLM"
    here = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert float(total) == pytest.approx(here(torch.arange(5, 105)[None]).logits.sum().item(), rel=1e-5)
    with pytest.raises(SystemExit, match="exceeds the teacher's longest input"):
        convert_script.main(["--model_name_or_path", str(folder), "--target", "linformer", "--linformer_k", "8",
                             "--output_dir", str(tmp_path / "other"), "--distill_steps", "1",
                             "--distill_max_length", "999"])
    with pytest.raises(SystemExit, match="is not empty"):
        convert_script.main(["--model_name_or_path", str(folder), "--target", "linformer", "--output_dir", str(out)])


def test_convert_script_starts_the_window_factor_where_asked(roberta_folder, tmp_path):
    """--attention_window_factor_init reaches the saved config and the factor's weights (log(m) starts elu + 1's
    window even: issue 41); without a window it is refused, naming the fix."""
    folder, _ = roberta_folder
    out = tmp_path / "window"
    convert_script.main(["--model_name_or_path", str(folder), "--target", "linear_roberta", "--attention_window", "8",
                         "--attention_window_factor_init", "2.5", "--output_dir", str(out)])
    report = json.loads((out / "conversion_report.json").read_text())
    assert any("theta = 2.5" in how for how in report["new"].values())
    model = AutoModelForMaskedLM.from_pretrained(out)
    assert model.config.attention_window_factor_init == 2.5
    factors = [layer.attention.self.window_factor.log_factor for layer in model.roberta.encoder.layer]
    assert all(torch.equal(f, torch.full_like(f, 2.5)) for f in factors)
    with pytest.raises(SystemExit, match="attention_window"):
        convert_script.main(["--model_name_or_path", str(folder), "--target", "linear_roberta",
                             "--attention_window_factor_init", "2.5", "--output_dir", str(tmp_path / "no-window")])
    # with distillation the start is calibrated first (reported), unless --calibrate_window_factor False
    text = tmp_path / "text.txt"
    words = [f"w{i % 97}" for i in range(4000)]
    text.write_text("\n".join(" ".join(words[i:i + 40]) for i in range(0, len(words), 40)))
    distilled = {}
    for calibrate in ("True", "False"):
        out = tmp_path / f"distilled-{calibrate}"
        convert_script.main(["--model_name_or_path", str(folder), "--target", "linear_roberta", "--attention_window",
                             "4", "--attention_window_factor_init", "2.5", "--output_dir", str(out), "--distill_steps",
                             "2", "--distill_max_length", "32", "--train_file", str(text), "--eval_rows", "8",
                             "--calibrate_window_factor", calibrate])
        distilled[calibrate] = json.loads((out / "conversion_report.json").read_text())["distillation"]
    assert all(-1 <= distilled["True"][key] <= 1 for key in ("output_cosine_before", "output_cosine_after"))
    with pytest.raises(SystemExit, match="--distill_output_steps 5 needs"):
        convert_script.main(["--model_name_or_path", str(folder), "--target", "linear_roberta", "--output_dir",
                             str(tmp_path / "refused"), "--distill_output_steps", "5"])
    assert len(distilled["True"]["window_factor_calibrated"]) == 2
    assert distilled["True"]["distance_calibrated"] <= distilled["True"]["distance_before"]
    assert "window_factor_calibrated" not in distilled["False"]
    assert distilled["True"]["distance_before"] == distilled["False"]["distance_before"]


@pytest.mark.slow
@needs_data
def test_distillation_brings_converted_students_closer_to_a_trained_teacher(corpus, tmp_path):  # noqa: F811
    """A small RoBERTa and GPT-2 pretrained on WikiText-2 here; their converted students after distillation are
    closer to them (attention KL, layer outputs, masked-LM loss) than after conversion alone."""
    # 250 teacher steps (was 600, measured: the distances shrink to 0.07-0.11 of their start at 250, 0.25-0.68 at
    # 600). At this size the masked-LM teacher stays close to word frequencies either way (loss 4.99 at 250 steps,
    # 4.96 at 600), so its students' loss gap is small from the start; the causal teacher's (0.011) is not.
    for preset, targets in (("roberta-softmax", (("linear_roberta", {"feature_map": "hedgehog"}),
                                                 ("linformer", {"linformer_k": 8}))),
                            ("gpt2-softmax", (("linear_gpt2", {"feature_map": "hedgehog"}),))):
        teacher_dir = tmp_path / preset
        run_pretrain(pretrain_args(corpus, tiny_preset(tmp_path, preset), teacher_dir, "--max_steps", 250,
                                   "--learning_rate", "2e-3", "--eval_steps", 250, "--save_steps", 250))
        for target, options in targets:
            out = tmp_path / f"{preset}-{target}"
            flags = [f"--{k}={v}" for k, v in options.items()]
            report = convert_script.main(
                ["--model_name_or_path", str(teacher_dir), "--target", target, *flags, "--output_dir", str(out),
                 "--train_file", str(corpus / "train.txt"), "--validation_file", str(corpus / "valid.txt"),
                 "--distill_steps", "60", "--distill_max_length", "32", "--eval_rows", "32"])
            result = report["distillation"]
            assert result["distance_after"] < 0.8 * result["distance_before"], (preset, target, result)
            if "converted" in result:  # the LM head came from the checkpoint: the loss gap to the teacher shrinks
                gap_before = abs(result["converted"]["loss"] - result["teacher"]["loss"])
                gap_after = abs(result["distilled"]["loss"] - result["teacher"]["loss"])
                assert gap_after < gap_before, (preset, target, result)
            saved = json.loads((out / "conversion_report.json").read_text())
            assert saved["distillation"] == result
    # the distilled student is an ordinary checkpoint: the fine-tuning script takes it as it is
    from finetune import main as finetune_main

    metrics = finetune_main([
        "--config", str(REPO_ROOT / "configs" / "finetune" / "cpu-sst2.json"),
        "--model_name_or_path", str(tmp_path / "roberta-softmax-linear_roberta"), "--output_dir", str(tmp_path / "ft"),
        "--train_file", str(GLUE / "sst2" / "train.tsv"), "--validation_file", str(GLUE / "sst2" / "dev.tsv"),
        "--max_train_samples", "32", "--max_eval_samples", "32", "--max_seq_length", "32", "--num_train_epochs", "1",
        "--per_device_train_batch_size", "16", "--save_strategy", "no"])
    assert 0 <= metrics["eval_accuracy"] <= 1 and (tmp_path / "ft" / "eval_results.json").is_file()


def test_a_damaged_weights_file_is_refused_by_name_and_a_full_disk_reported(roberta_folder, tmp_path, monkeypatch):
    """Issue 30: a truncated or garbled model.safetensors used to end in safetensors' header traceback."""
    import errno

    from hf_linear_attn.training.errors import DiskFullError

    folder, _ = roberta_folder
    data = (folder / "model.safetensors").read_bytes()
    for damaged, why in ((data[: len(data) // 2], "truncated"), (b"\xff" * 64 + data[64:], "unreadable header")):
        (folder / "model.safetensors").write_bytes(damaged)
        message = script_error(convert_script.main, ["--model_name_or_path", str(folder), "--target", "linformer", "--linformer_k", "8",
                                  "--output_dir", str(tmp_path / "out")])
        assert "model.safetensors is" in message and why in message and not (tmp_path / "out").exists()
    (folder / "model.safetensors").write_bytes(data)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("hf_linear_attn.conversion.cli.save_converted", full_disk)
    message = script_error(convert_script.main, ["--model_name_or_path", str(folder), "--target", "linformer", "--linformer_k", "8",
                              "--output_dir", str(tmp_path / "out")])
    assert "the disk is full" in message and str(tmp_path) in message
    assert not (tmp_path / "out").exists() and not (tmp_path / ".partial-out").exists()
    assert issubclass(DiskFullError, UsageError)


