"""FSDP through accelerate: the configs in configs/accelerate/, sharded checkpoints, resume and the final model.

The slow tests run the documented command (`accelerate launch --config_file configs/accelerate/fsdp-*.yaml
scripts/pretrain.py ...`) with 2 processes on this CPU-only machine, where the script runs torch's FSDP2 on gloo
(hf_linear_attn/training/fsdp.py says why accelerate alone would not).
"""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from helpers import (
    ENV, REPO_ROOT, SHARDED_FILES, fsdp_command, load_in_fresh_process, needs_data, pretrain_args, replaced,
    run_fsdp, run_pretrain, tiny_preset, weights,
)
from safetensors.torch import load_file

from hf_linear_attn.training.checkpoints import sharded_folder_problem
from hf_linear_attn.training.run_state import RUN_ARGS

CONFIGS = REPO_ROOT / "configs" / "accelerate"


# ----------------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name, preset, layer", [
    ("fsdp-encoder.yaml", "linformer-k64-shared-kv-layer", "RobertaStyleLayer"),
    ("fsdp-encoder.yaml", "linear-roberta-elu", "RobertaStyleLayer"),
    ("fsdp-decoder.yaml", "linear-gpt2-elu", "GPT2StyleBlock"),
    ("fsdp-decoder.yaml", "linformer-gpt2-k16-b64", "GPT2StyleBlock"),
])
def test_fsdp_configs_are_fsdp2_sharded_and_wrap_the_layers_of_their_family(name, preset, layer):
    """accelerate reads each file as FSDP2 with sharded checkpoints, and the layer class it names is the class of
    every hidden layer of that family's models (accelerate stops on a class the model lacks)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    from hf_linear_attn.training.fsdp import layer_classes

    config = load_config_from_file(str(CONFIGS / name))
    assert config.distributed_type == "FSDP" and not config.use_cpu  # use_cpu would start a single process
    fsdp = config.fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == layer
    model_config = AutoConfig.from_pretrained(REPO_ROOT / "configs" / "models" / "cpu" / f"{preset}.json")
    auto = AutoModelForCausalLM if "gpt2" in preset else AutoModelForMaskedLM
    with torch.device("meta"):
        model = auto.from_config(model_config)
    assert layer_classes(model) == [layer]


def test_a_sharded_folder_is_whole_only_with_its_metadata_and_every_shard(tmp_path):
    """A torch.distributed.checkpoint folder (what FSDP's sharded save_state writes) is checked against the shard
    files and byte ranges its .metadata records."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "pytorch_model_fsdp_0"
    dcp.save({"model": {"weight": torch.randn(64, 64), "bias": torch.randn(64)}}, checkpoint_id=str(folder))
    shard = next(folder.glob("*.distcp"))
    assert sharded_folder_problem(folder) is None

    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    assert sharded_folder_problem(folder) == f"has a truncated {shard.name} (shorter than its .metadata says)"
    shard.unlink()
    assert sharded_folder_problem(folder) == f"lacks {shard.name}"
    shard.write_bytes(whole)
    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(metadata[:10])
    assert sharded_folder_problem(folder).startswith("has an unreadable .metadata")
    (folder / ".metadata").unlink()
    assert sharded_folder_problem(folder) == "holds no .metadata"


def test_a_run_is_resumed_only_with_the_checkpoint_layout_it_was_trained_with(tmp_path):
    """A sharded (FSDP) run resumed without FSDP, or the other way round, is refused before anything loads: the
    one's checkpoints have files the other cannot read."""
    from hf_linear_attn.training.errors import UsageError
    from hf_linear_attn.training.pretraining_arguments import PretrainArguments
    from hf_linear_attn.training.run_state import check_output_dir, run_record

    args = PretrainArguments(output_dir=str(tmp_path), model_config="m.json", resume=True)
    (tmp_path / RUN_ARGS).write_text(json.dumps(run_record(args, 2, "SHARDED_STATE_DICT")))
    with pytest.raises(UsageError, match="trained under FSDP \\(SHARDED_STATE_DICT\\) and this launch is without"):
        check_output_dir(args, 2, layout=None)
    (tmp_path / RUN_ARGS).write_text(json.dumps(run_record(args, 2)))
    with pytest.raises(UsageError, match="trained without FSDP and this launch is under FSDP"):
        check_output_dir(args, 2, layout="SHARDED_STATE_DICT")
    # the same layout passes the check and goes on to look for a checkpoint: none yet, so the run starts again
    assert check_output_dir(args, 2, layout=None) is None


# ------------------------------------------------------------------------------------------ 2 processes, FSDP


@pytest.mark.slow
@needs_data
def test_fsdp_decoder_trains_like_one_process_saves_shards_resumes_exactly_and_saves_a_whole_model(corpus, tmp_path):
    """Causal LM with FAVOR+ features (a buffer every process draws) and no dropout, under fsdp-decoder.yaml:
    2 processes x batch 4 == 1 process x batch 8; the step-3 checkpoint holds one shard per process; --resume from
    it retrains steps 4-6 to the same weights; the final model is whole and loads in a fresh process."""
    config = tiny_preset(tmp_path, "linear-gpt2-elu", feature_map="favor", num_random_features=16, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
    out = tmp_path / "fsdp"
    args = pretrain_args(corpus, config, out, "--max_steps", 6, "--save_steps", 3, "--eval_steps", 3)
    assert "2 process(es)" in run_fsdp("fsdp-decoder.yaml", args)
    checkpoint = out / "checkpoints" / "step_0000003"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin",
        "trainer_state.json"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (checkpoint / folder).iterdir()) == SHARDED_FILES
    assert json.loads((out / RUN_ARGS).read_text())["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"

    # an independent reference: the same training, unsharded, in one process with the two batches as one
    run_pretrain(replaced(pretrain_args(corpus, config, tmp_path / "one", "--max_steps", 6, "--save_steps", 3,
                                        "--eval_steps", 3), per_device_train_batch_size=8))
    one, sharded = weights(tmp_path / "one"), weights(out)
    assert one.keys() == sharded.keys()  # whole, tied head dropped as in any save_pretrained
    for name in one:
        assert torch.allclose(one[name], sharded[name], atol=2e-5, rtol=1e-4), name
    first = json.loads((out / "train_results.json").read_text())
    assert first["eval_loss"] == pytest.approx(json.loads((tmp_path / "one" / "train_results.json").read_text())[
        "eval_loss"], rel=1e-5)

    (out / "model.safetensors").unlink()  # what the resumed run writes, compared below
    assert f"resumed from {checkpoint} at step 3" in run_fsdp("fsdp-decoder.yaml", [*args, "--resume"])
    again = weights(out)
    for name in sharded:
        assert torch.equal(sharded[name], again[name]), name
    assert json.loads((out / "train_results.json").read_text())["eval_loss"] == first["eval_loss"]

    seen = load_in_fresh_process(out, "AutoModelForCausalLM", tmp_path / "loaded.safetensors")
    assert seen["class"] == "LinearGPT2ForCausalLM" and seen["module"].startswith("transformers_modules")
    assert not seen["package_imported"] and seen["missing"] == [] and seen["unexpected"] == []
    loaded = load_file(tmp_path / "loaded.safetensors")
    for name in again:
        assert torch.equal(loaded[name], again[name]), name
    assert torch.equal(loaded["lm_head.weight"], again["transformer.wte.weight"])  # the tie restored


@pytest.mark.slow
@needs_data
def test_fsdp_encoder_killed_mid_run_resumes_from_its_shards_to_the_weights_of_an_uninterrupted_run(corpus, tmp_path):
    """Masked LM with dropout, dynamic masking and Linformer's layerwise-shared projection (read by every layer,
    held by the root unit), under fsdp-encoder.yaml with gradient accumulation: every process SIGKILLed after the
    step-3 checkpoint, --resume, bit-identical final weights and validation loss; a damaged shard is named and its
    checkpoint skipped."""
    config = tiny_preset(tmp_path, "linformer-k64-shared-kv-layer", linformer_k=16)
    common = ("--max_steps", 12, "--save_steps", 3, "--eval_steps", 6, "--gradient_accumulation_steps", 2)
    run_fsdp("fsdp-encoder.yaml", pretrain_args(corpus, config, tmp_path / "straight", *common))

    killed = tmp_path / "killed"
    args = pretrain_args(corpus, config, killed, *common)
    proc = subprocess.Popen(fsdp_command("fsdp-encoder.yaml", args), cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_0000003").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    kill_with_workers(proc)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "model.safetensors").exists()
    newest = max((killed / "checkpoints").glob("step_*"))

    # a shard cut short (by hand: a save in progress never carries a checkpoint's name) is found and skipped
    damaged = killed / "checkpoints" / "step_0000099"
    shutil.copytree(newest, damaged)
    shard = damaged / "optimizer_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    said = run_fsdp("fsdp-encoder.yaml", [*args, "--resume"])
    assert f"skipping the incomplete checkpoint {damaged} (optimizer state: optimizer_0 has a truncated " \
           "__1_0.distcp (shorter than its .metadata says))" in said
    assert f"resumed from {newest}" in said

    straight, again = weights(tmp_path / "straight"), weights(killed)
    assert straight.keys() == again.keys()
    for name in straight:
        assert torch.equal(straight[name], again[name]), name
    first = json.loads((tmp_path / "straight" / "train_results.json").read_text())
    assert json.loads((killed / "train_results.json").read_text())["eval_loss"] == first["eval_loss"]

    seen = load_in_fresh_process(killed, "AutoModelForMaskedLM", tmp_path / "loaded.safetensors")
    assert seen["class"] == "LinformerForMaskedLM" and seen["missing"] == [] and seen["unexpected"] == []
    loaded = load_file(tmp_path / "loaded.safetensors")
    for name in again:
        assert torch.equal(loaded[name], again[name]), name


def kill_with_workers(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and its worker processes at once, as a machine failure would (torchrun starts workers in
    sessions of their own, so killing the launcher's process group would leave them training)."""
    import psutil

    family = [proc.pid] + [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_documented_fsdp_commands_are_the_tested_ones():
    """docs/training.md shows the launcher command these tests run (plus a free port)."""
    docs = (REPO_ROOT / "docs" / "training.md").read_text()
    for name in ("fsdp-encoder.yaml", "fsdp-decoder.yaml"):
        assert f"accelerate launch --config_file configs/accelerate/{name} scripts/pretrain.py" in docs

