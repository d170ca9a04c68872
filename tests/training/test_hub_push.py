"""--push_to_hub in scripts/pretrain.py (issue 27): checked before any data or model work; after training, the
model, tokenizer and a model card go up in one commit, from the main process alone; the card's YAML front matter
names the data, the base model and the metrics the run produced. Also the command a card prints.

The Hub is unreachable here: `RecordingHub` stands in for huggingface_hub.HfApi (in this process by monkeypatch,
in launched processes through a sitecustomize module); every step up to HfApi's calls is the real code."""

import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import ENV, REPO_ROOT, needs_data, pretrain_args, script_error, tiny_preset
from hub_stand_in import TOKEN, RecordingHub, front_matter, recorded, use_recording_hub


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return use_recording_hub(tmp_path, monkeypatch)



# ------------------------------------------------------------------------------------------ before any work


def test_pretrain_refuses_a_bad_push_target_before_reading_anything(tmp_path, hub, monkeypatch):
    """The model config and the data do not exist: an error naming them would mean the Hub was checked too late."""
    from pretrain import main

    out = tmp_path / "out"
    run = ["--model_config", str(tmp_path / "absent.json"), "--train_file", str(tmp_path / "absent.txt"),
           "--output_dir", str(out), "--push_to_hub"]
    assert "no such file or folder" in script_error(main, run[:-1])  # without the push: what would fail next
    assert "--push_to_hub needs a Hub token" in script_error(main, run)
    assert "not a valid Hub repo name" in script_error(main, [*run, "--hub_token", TOKEN, "--hub_model_id", "a/b/c"])
    unnamed = [*run[:4], "--output_dir", str(tmp_path / "two words"), "--push_to_hub", "--hub_token", TOKEN]
    message = script_error(main, unnamed)
    assert "names the repo after the output folder" in message and "'two words'" in message
    monkeypatch.setattr(RecordingHub, "answer", OSError("Cannot reach https://huggingface.co: offline mode"))
    message = script_error(main, [*run, "--hub_token", TOKEN])
    assert "does not accept this token or cannot be reached" in message and "offline mode" in message
    monkeypatch.setattr(RecordingHub, "answer", {"name": "someone", "auth": {"accessToken": {"role": "read"}}})
    assert "the token is read-only" in script_error(main, [*run, "--hub_token", TOKEN])
    assert not out.exists() and not (tmp_path / "two words").exists()  # refused at once: nothing written
    assert [c["call"] for c in recorded(hub)] == [["whoami", TOKEN]] * 2  # the Hub was asked, nothing uploaded


def test_a_cards_command_repeats_the_run_without_the_token():
    """The card's command parses back into the same arguments (a --config file's values written out), less the
    token; finetune.py's card drops a --hub_token given on its command line too."""
    from hf_linear_attn.training.arguments import parse_arguments
    from hf_linear_attn.training.model_cards import command_line, without_token
    from hf_linear_attn.training.pretraining_arguments import PretrainArguments

    argv = ["--config", str(REPO_ROOT / "configs" / "pretrain" / "cpu-mlm.json"), "--model_config", "m.json",
            "--output_dir", "out dir", "--max_steps", "7", "--push_to_hub", "--hub_token", TOKEN,
            "--hub_private_repo", "True"]
    args, _ = parse_arguments((PretrainArguments,), argv)
    command = command_line("scripts/pretrain.py", args)
    assert TOKEN not in command and "--max_steps 7" in command and "'out dir'" in command
    words = shlex.split(command)
    assert words[:2] == ["python", "scripts/pretrain.py"]
    again, _ = parse_arguments((PretrainArguments,), words[2:])
    assert again == replace(args, hub_token=None)
    assert without_token(f"python scripts/finetune.py --push_to_hub --hub_token {TOKEN} --seed 3 "
                         f"--hub-token={TOKEN}") == "python scripts/finetune.py --push_to_hub --seed 3"


# ------------------------------------------------------------------------------------------- a pushed run


@pytest.mark.slow
@needs_data
def test_pretraining_pushes_the_model_and_a_card_naming_its_data_and_metrics(corpus, tmp_path, hub, monkeypatch):
    """A Hub dataset (`load_dataset` answered with real WikiText-2 lines) -> 4 steps of Linformer MLM -> one commit
    of the model, tokenizer and card, without the resume checkpoints; the card's metrics are the run's own."""
    from datasets import Dataset, DatasetDict
    from huggingface_hub import ModelCard
    from pretrain import main

    from hf_linear_attn.training import data
    from hf_linear_attn.training.arguments import parse_arguments
    from hf_linear_attn.training.model_cards import write_pretraining_card
    from hf_linear_attn.training.pretraining_arguments import PretrainArguments

    requested = []

    def hub_dataset(name, config=None):
        requested.append((name, config))
        return DatasetDict({split: Dataset.from_dict({"text": (corpus / file).read_text().splitlines(True)})
                            for split, file in (("train", "train.txt"), ("validation", "valid.txt"))})

    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    out = tmp_path / "tiny-linformer"
    flags = [*pretrain_args(corpus, config, out, "--max_steps", 4, "--save_steps", 2, "--eval_steps", 4)]
    flags = flags[:4] + flags[8:]  # the Hub dataset instead of --train_file / --validation_file
    with monkeypatch.context() as patch:
        patch.setattr(data.files, "load_dataset", hub_dataset)
        main([*flags, "--dataset_name", "Salesforce/wikitext", "--dataset_config_name", "wikitext-2-raw-v1",
              "--push_to_hub", "--hub_token", TOKEN])
    assert requested == [("Salesforce/wikitext", "wikitext-2-raw-v1")]

    (whoami, create, upload) = [c["call"] for c in recorded(hub)]
    assert whoami == ["whoami", TOKEN] and create == ["create_repo", "someone/tiny-linformer", None, True]
    assert upload[:2] == ["upload_folder", "someone/tiny-linformer"]
    files = set(upload[2])
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "train_results.json",
            "trainer_state.json", "modeling_linformer.py", "configuration_linformer.py"} <= files
    assert (out / "checkpoints" / "step_0000002").is_dir()  # it exists and stays home
    assert not any(f.startswith("checkpoints/") or f.endswith((".bin", ".pkl")) for f in files)
    for name in files:  # no uploaded file carries the token (run_args.json records the arguments)
        assert TOKEN not in (out / name).read_text(errors="ignore"), name

    record = json.loads((out / "train_results.json").read_text())
    header = front_matter(out / "README.md")
    assert header["library_name"] == "transformers" and header["pipeline_tag"] == "fill-mask"
    assert header["datasets"] == ["Salesforce/wikitext"] and "base_model" not in header
    assert {"hf-linear-attn", "linformer", "pretraining"} <= set(header["tags"])
    (result,) = header["model-index"][0]["results"]
    assert result["dataset"] == {"name": "Salesforce/wikitext (wikitext-2-raw-v1)", "type": "Salesforce/wikitext",
                                 "split": "validation"}
    metrics = {m["type"]: m["value"] for m in result["metrics"]}
    assert metrics == pytest.approx({"loss": record["eval_loss"], "perplexity": record["perplexity"]}, rel=1e-4)
    card = (out / "README.md").read_text()
    assert "pretrained from scratch" in card and f"{record['train_rows']:,} rows of 32 tokens" in card
    assert "4 optimizer steps of 4 rows" in card and "--dataset_name Salesforce/wikitext" in card
    assert ModelCard.load(out / "README.md").data.eval_results[1].metric_value == metrics["perplexity"]

    # continued from that folder (a local path, whose card names no Hub model): no base_model, the text says
    # where it started; from a Hub id the card names it
    again = tmp_path / "continued"
    argv = ["--model_name_or_path", str(out), "--output_dir", str(again), "--train_file",
            str(corpus / "train.txt"), "--validation_file", str(corpus / "valid.txt"), "--max_steps", "2",
            "--eval_steps", "2", "--save_steps", "10", "--max_seq_length", "32", "--mixed_precision", "no",
            "--per_device_train_batch_size", "4", "--max_eval_samples", "16"]
    main(argv)
    header = front_matter(again / "README.md")
    assert "base_model" not in header and "datasets" not in header
    assert f"continued from `{out}`" in (again / "README.md").read_text()
    assert header["model-index"][0]["results"][0]["dataset"]["split"] == "valid.txt"
    args, _ = parse_arguments((PretrainArguments,), argv)
    write_pretraining_card(again, replace(args, model_name_or_path="FacebookAI/roberta-base"), "someone/x")
    assert front_matter(again / "README.md")["base_model"] == "FacebookAI/roberta-base"


SITECUSTOMIZE = """
import huggingface_hub
from hub_stand_in import RecordingHub

huggingface_hub.HfApi = RecordingHub  # before hf_linear_attn imports it
"""


@pytest.mark.slow
@needs_data
def test_a_two_process_run_checks_and_pushes_from_the_main_process_only(corpus, tmp_path):
    """`accelerate launch --num_processes 2`: one whoami, one create_repo, one upload, all from rank 0."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    calls = tmp_path / "hub_calls.jsonl"
    path = os.pathsep.join([str(site), str(REPO_ROOT / "tests"), str(REPO_ROOT), ENV.get("PYTHONPATH", "")])
    env = {**ENV, "PYTHONPATH": path, "HUB_CALLS": str(calls)}
    config = tiny_preset(tmp_path, "linear-gpt2-elu")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                "29533"]
    args = pretrain_args(corpus, config, tmp_path / "two", "--max_steps", 2, "--save_steps", 10, "--eval_steps", 2,
                         "--push_to_hub", "--hub_model_id", "someone/two", "--hub_token", TOKEN)
    proc = subprocess.run([*launcher, str(REPO_ROOT / "scripts" / "pretrain.py"), *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((tmp_path / "two" / "train_results.json").read_text())["num_processes"] == 2
    made = recorded(calls)
    assert [(c["rank"], c["call"][0]) for c in made] == [(0, "whoami"), (0, "create_repo"), (0, "upload_folder")]
    assert "model.safetensors" in made[2]["call"][2]
    assert "accelerate launch --num_processes 2 scripts/pretrain.py" in (tmp_path / "two" / "README.md").read_text()
