"""FSDP for fine-tuning (scripts/finetune.py, the Transformers Trainer): the documented commands, sharded checkpoints,
their resume and the final model; what cannot run is refused before any data is read.

The slow tests run the documented commands with 2 processes on this CPU-only machine, where accelerate alone would
run plain data parallel and the script switches Trainer to torch's FSDP2 on gloo (hf_linear_attn/training/fsdp.py
says why and how). A tiny Linformer classifies the 12 short reviews of the review_files fixture.
"""

import json
import re
import shutil
import types

import pytest
import torch
from helpers import (
    REPO_ROOT, SHARDED_FILES, TINY, fsdp_command, launch_command, load_in_fresh_process, replaced, run_fsdp, run_launch,
    script_error, weights,
)
from safetensors.torch import load_file

# Trainer's own flags for what configs/accelerate/fsdp-encoder.yaml says (Trainer's default layout is whole files)
TRAINER_FSDP = ["--fsdp", "--fsdp_config",
                '{"transformer_layer_cls_to_wrap": "RobertaStyleLayer", "state_dict_type": "SHARDED_STATE_DICT"}']
REPORT = re.compile(r"FSDP: (\w+) sharded over 2 processes in (\d+) units: this process holds ([\d,]+) of ([\d,]+) "
                    r"parameter values \((\d+) parameters unsharded\)")


def finetune_args(base_model, train, out, *extra):
    """6 steps of 2 rows per process, a checkpoint every 2 steps (the newest 2 kept), evaluation on the 12 training
    rows: 2 x 2 rows a step divide them evenly (Trainer's distributed evaluation loss counts the rows that pad an
    uneven last batch, without FSDP too, so another split would not compare with one process)."""
    return [str(a) for a in (
        "--model_name_or_path", base_model, "--output_dir", out, "--train_file", train, "--validation_file", train,
        "--text_columns", "review", "--label_column", "verdict", "--max_seq_length", 32, "--learning_rate", "1e-3",
        "--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 2, "--max_steps", 6, "--save_steps", 2,
        "--save_total_limit", 2, "--logging_steps", 1, "--seed", 7, "--report_to", "none", "--do_train", "--do_eval",
        *extra)]


def losses(out) -> list[float]:
    return [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]


@pytest.mark.slow
def test_fsdp_finetuning_shards_trains_like_one_process_resumes_exactly_and_saves_a_whole_model(
        tmp_path, base_model, review_files):
    """`accelerate launch --config_file configs/accelerate/fsdp-encoder.yaml scripts/finetune.py ...`: every
    parameter a DTensor shard; 2 processes x 2 rows == 1 process x 4 rows (weights, losses, evaluation); the
    checkpoints hold one shard per process and are rotated; a run "killed" after step 4, with a newer checkpoint cut
    short, resumed with Trainer's own flags (`accelerate launch --num_processes 2 ... --fsdp --fsdp_config ...`)
    skips that one and ends bit-identical to the uninterrupted run, so the two ways of asking for FSDP are one; the
    final model is an ordinary model.safetensors that loads in a fresh process without this package."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune import main

    train = review_files[0]
    out = tmp_path / "fsdp"
    args = finetune_args(base_model, train, out)
    said = run_fsdp("fsdp-encoder.yaml", args, script="finetune.py")
    model_class, units, local, total, whole = REPORT.search(said).groups()
    local, total = int(local.replace(",", "")), int(total.replace(",", ""))
    assert model_class == "FSDPLinformerForSequenceClassification"  # the class fully_shard gives an FSDPModule
    # a unit per layer, one for the word embeddings (accelerate carves them out), the root
    assert int(units) == TINY["num_hidden_layers"] + 2 and int(whole) == 0
    assert total / 2 <= local < 0.55 * total  # half of each parameter's rows (the odd one to process 0)

    # sharded checkpoints, rotated (--save_total_limit 2) as whole ones
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    checkpoint = out / "checkpoint-4"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "optimizer_0", "pytorch_model_fsdp_0", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
        "trainer_state.json"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (checkpoint / folder).iterdir()) == SHARDED_FILES

    # an independent reference: the same training, unsharded, in one process with the two batches as one
    one = tmp_path / "one"
    main([*replaced(finetune_args(base_model, train, one), per_device_train_batch_size=4,
                    per_device_eval_batch_size=4), "--save_strategy", "no"])
    sharded, reference = weights(out), weights(one)
    assert sharded.keys() == reference.keys()
    for name in reference:
        assert torch.allclose(sharded[name], reference[name], atol=2e-5, rtol=1e-4), name
    base = weights(base_model)
    moved = [name for name in base if name in sharded and not torch.allclose(base[name], sharded[name], atol=1e-4)]
    assert len(moved) > len(sharded) // 2  # training changed the encoder: the comparison means something
    assert losses(out) == pytest.approx(losses(one), rel=1e-5) and len(losses(out)) == 6
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_loss"] == pytest.approx(json.loads((one / "eval_results.json").read_text())["eval_loss"],
                                                 rel=1e-5)

    # a kill after the step-4 checkpoint (the step-6 one and the model gone), and a newer checkpoint cut short
    shutil.rmtree(out / "checkpoint-6")
    (out / "model.safetensors").unlink()
    damaged = out / "checkpoint-5"
    shutil.copytree(checkpoint, damaged)
    shard = damaged / "optimizer_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    resumed = run_launch(launch_command(["--num_processes", "2"], "finetune.py",
                                        [*args, *TRAINER_FSDP, "--resume_from_checkpoint", "True"]))
    said = resumed.stdout + resumed.stderr
    assert "starting 2 processes (gloo)" in said and REPORT.search(said)
    assert f"skipping the incomplete checkpoint {damaged} (optimizer state: optimizer_0 has a truncated " \
           "__1_0.distcp (shorter than its .metadata says))" in said
    assert f"resuming from {checkpoint}" in said
    again = weights(out)
    for name in sharded:
        assert torch.equal(sharded[name], again[name]), name
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] == results["eval_loss"]

    # the final model: whole, with the model's own code, in a fresh process that does not import this package
    rows = [line.split("\t") for line in train.read_text().splitlines()[1:]]
    texts = [text for text, _ in rows]
    seen = load_in_fresh_process(out, "AutoModelForSequenceClassification", tmp_path / "loaded.safetensors", texts)
    assert seen["class"] == "LinformerForSequenceClassification" and seen["module"].startswith("transformers_modules")
    assert not seen["package_imported"] and seen["missing"] == [] and seen["unexpected"] == []
    loaded = load_file(tmp_path / "loaded.safetensors")
    assert loaded.keys() == again.keys()
    for name in again:
        assert torch.equal(loaded[name], again[name]), name
    logits = torch.tensor(seen["logits"])
    single = AutoModelForSequenceClassification.from_pretrained(one).eval()
    with torch.no_grad():
        expected = single(**AutoTokenizer.from_pretrained(one)(texts, padding=True, return_tensors="pt")).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # and its loss on the 12 rows is the loss the sharded model reported when evaluated during the run
    labels = torch.tensor([single.config.label2id[verdict] for _, verdict in rows])
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert loss == pytest.approx(results["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_an_fsdp_config_for_another_family_is_refused_before_training(tmp_path, base_model, review_files):
    """fsdp-decoder.yaml on an encoder: named with the config that fits, before any step or checkpoint."""
    out = tmp_path / "wrong"
    proc = run_launch(fsdp_command("fsdp-decoder.yaml", finetune_args(base_model, review_files[0], out),
                                   "finetune.py"), check=False)
    assert proc.returncode != 0
    assert ("error: the accelerate FSDP config wraps GPT2StyleBlock, which this linformer model does not have (its "
            "layers: RobertaStyleLayer): use configs/accelerate/fsdp-encoder.yaml for encoders") in proc.stderr
    assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------- refused, in one process


def test_fsdp1_without_gpus_and_fsdp_flags_in_one_process_are_refused_before_any_data_is_read(
        tmp_path, base_model, monkeypatch):
    """Each refused with its fix before any data is read (the training file does not exist)."""
    from finetune import main

    from hf_linear_attn.training import fsdp

    monkeypatch.setattr(fsdp, "without_gpus", lambda: True)
    args = finetune_args(base_model, tmp_path / "no-such.csv", tmp_path / "out")

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch --config_file sets
    monkeypatch.setenv("FSDP_VERSION", "1")
    message = script_error(main, args)
    assert "the accelerate config asks for FSDP1 (fsdp_version 1), which needs GPUs" in message
    assert "use fsdp_version: 2, as configs/accelerate/fsdp-encoder.yaml and fsdp-decoder.yaml do" in message
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.delenv("FSDP_VERSION")

    message = script_error(main, [*args, "--fsdp", "--fsdp_config", '{"version": 1}'])
    assert "--fsdp_config asks for FSDP1 (version 1), which needs GPUs" in message and "use version 2" in message
    message = script_error(main, [*args, *TRAINER_FSDP])
    assert "--fsdp shards the model over several processes, and this is one" in message
    assert "accelerate launch --num_processes N scripts/finetune.py" in message


def test_fsdp_evaluation_alone_is_refused(tmp_path, base_model, monkeypatch):
    """Trainer cannot prepare an FSDP2 model without an optimizer: --do_eval alone under FSDP is refused, naming
    accelerate's own error and the fix."""
    from transformers import TrainingArguments

    from hf_linear_attn.training import finetuning
    from hf_linear_attn.training.errors import UsageError

    monkeypatch.setattr(finetuning, "trainer_checkpoint_layout", lambda training: "SHARDED_STATE_DICT")
    training = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(UsageError, match="--do_eval / --do_predict without --do_train under FSDP: .*'When using "
                                         "FSDP2, a model and optimizer must be passed together"):
        finetuning.fsdp_layout(training, do_train=False)
    assert finetuning.fsdp_layout(training, do_train=True) == "SHARDED_STATE_DICT"


def test_wrap_classes_are_checked_against_the_model_and_a_bare_fsdp_wraps_its_layers(monkeypatch):
    """A class the model lacks is refused naming the config that fits (the launcher's or Trainer's flags); a class
    holding the word embeddings is refused (accelerate would shard them twice and stop); with no class named, the
    model's layers are wrapped instead of its _no_split_modules (which list the embeddings)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import AutoModelForSequenceClassification

    from hf_linear_attn import LinformerConfig
    from hf_linear_attn.training.errors import UsageError
    from hf_linear_attn.training.fsdp import check_wrap_classes

    for name in ("ACCELERATE_USE_FSDP", "FSDP_TRANSFORMER_CLS_TO_WRAP", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(LinformerConfig(**{**TINY, "linformer_k": 8}))

    def launch(names):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=names)
        return types.SimpleNamespace(distributed_type=DistributedType.FSDP, is_main_process=False,
                                     state=types.SimpleNamespace(fsdp_plugin=plugin))

    with pytest.raises(UsageError, match=r"the accelerate FSDP config wraps GPT2StyleBlock, which this linformer "
                                         r"model does not have \(its layers: RobertaStyleLayer\): use "
                                         r"configs/accelerate/fsdp-encoder.yaml"):
        check_wrap_classes(launch(["GPT2StyleBlock"]), model)
    with pytest.raises(UsageError, match="--fsdp_config wraps GPT2StyleBlock, .*: name RobertaStyleLayer in "
                                         "--fsdp_config's transformer_layer_cls_to_wrap"):
        check_wrap_classes(launch(["GPT2StyleBlock"]), model, trainer_flags=True)
    with pytest.raises(UsageError, match="wraps RobertaStyleEmbeddings, which holds the word embeddings"):
        check_wrap_classes(launch(["RobertaStyleEmbeddings", "RobertaStyleLayer"]), model)
    check_wrap_classes(launch(["RobertaStyleLayer"]), model)
    bare = launch(None)
    check_wrap_classes(bare, model, trainer_flags=True)
    assert bare.state.fsdp_plugin.transformer_cls_names_to_wrap == ["RobertaStyleLayer"]


def test_a_checkpoint_is_resumed_only_under_the_layout_that_wrote_it(tmp_path):
    """Sharded, whole-file FSDP and ordinary Trainer checkpoints cannot stand in for each other: refused by name
    before any data is read (Trainer would fail after reading them, or on a file it cannot find)."""
    from hf_linear_attn.training.errors import UsageError
    from hf_linear_attn.training.trainer_checkpoints import resolve_resume

    sharded, plain = tmp_path / "checkpoint-2", tmp_path / "checkpoint-1"
    (sharded / "pytorch_model_fsdp_0").mkdir(parents=True)
    plain.mkdir()
    (plain / "optimizer.pt").write_bytes(b"")
    with pytest.raises(UsageError, match=f"{sharded} was written under FSDP \\(SHARDED_STATE_DICT\\) and this "
                                         "launch is without FSDP"):
        resolve_resume("True", tmp_path, 2, allow_inexact=False)
    with pytest.raises(UsageError, match="was written under FSDP \\(SHARDED_STATE_DICT\\) and this launch is under "
                                         "FSDP \\(FULL_STATE_DICT\\)"):
        resolve_resume(str(sharded), tmp_path, 2, allow_inexact=False, layout="FULL_STATE_DICT")
    with pytest.raises(UsageError, match=f"{plain} was written without FSDP and this launch is under FSDP"):
        resolve_resume(str(plain), tmp_path, 2, allow_inexact=False, layout="SHARDED_STATE_DICT")


def test_the_documented_fine_tuning_fsdp_commands_are_the_tested_ones():
    """docs/training.md shows the two launch commands the slow test runs (plus a free port and its arguments)."""
    docs = (REPO_ROOT / "docs" / "training.md").read_text()
    assert "accelerate launch --config_file configs/accelerate/fsdp-encoder.yaml scripts/finetune.py" in docs
    assert "accelerate launch --num_processes 2 scripts/finetune.py ... --fsdp" in docs
    assert f"--fsdp_config '{TRAINER_FSDP[2]}'" in docs
