"""The training pipeline on real data: pretraining (accelerate), fine-tuning (Trainer), metrics, cards, Hub push.

Pretraining runs as users run it, in real subprocesses (one, two under `accelerate launch`, one killed with
SIGKILL); fine-tuning runs in-process where the test swaps the Hub client for a recording stand-in.
"""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    ENV, GLUE, PRESET_ENCODER_SIZE, REPO_ROOT, SHARED_DATA, data_missing, needs_data, pretrain_args, replaced,
    run_pretrain, script_error, tiny_preset, weights,
)

# ------------------------------------------------------------------------------------------------- pretraining


@pytest.mark.slow
@needs_data
def test_killed_and_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(corpus, tmp_path):
    """Masked LM with dropout and dynamic masking: SIGKILL mid-run, --resume, bit-identical final weights."""
    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    common = ("--max_steps", 16, "--save_steps", 4, "--eval_steps", 8, "--gradient_accumulation_steps", 2)
    run_pretrain(pretrain_args(corpus, config, tmp_path / "straight", *common))

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "pretrain.py"),
                             *pretrain_args(corpus, config, killed, *common)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_0000008").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "model.safetensors").exists()
    # a save interrupted by a crash leaves a partial folder; it must never be taken for a checkpoint
    (killed / "checkpoints" / ".partial-step_0000012").mkdir(exist_ok=True)

    resumed = run_pretrain(pretrain_args(corpus, config, killed, *common, "--resume"))
    assert "resumed from" in resumed.stdout + resumed.stderr
    straight, again = weights(tmp_path / "straight"), weights(killed)
    assert straight.keys() == again.keys()
    for name in straight:
        assert torch.equal(straight[name], again[name]), name
    first = json.loads((tmp_path / "straight" / "train_results.json").read_text())
    second = json.loads((killed / "train_results.json").read_text())
    assert first["eval_loss"] == second["eval_loss"]


@pytest.mark.slow
@needs_data
def test_two_processes_under_accelerate_train_like_one_process_with_twice_the_batch(corpus, tmp_path):
    """Causal LM without dropout: 2 processes x batch 4 (gradients averaged by DDP on gloo) == 1 x batch 8."""
    config = tiny_preset(tmp_path, "linear-gpt2-elu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    common = ("--max_steps", 6, "--save_steps", 3, "--eval_steps", 3)
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                "29517")
    two = run_pretrain(pretrain_args(corpus, config, tmp_path / "two", *common), launcher=launcher)
    assert "2 process(es)" in two.stdout + two.stderr
    run_pretrain(replaced(pretrain_args(corpus, config, tmp_path / "one", *common), per_device_train_batch_size=8))
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "step_0000003").iterdir()) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin",
        "trainer_state.json"]
    one, two_w = weights(tmp_path / "one"), weights(tmp_path / "two")
    for name in one:
        assert torch.allclose(one[name], two_w[name], atol=2e-5, rtol=1e-4), name
    r1 = json.loads((tmp_path / "one" / "train_results.json").read_text())
    r2 = json.loads((tmp_path / "two" / "train_results.json").read_text())
    assert r2["num_processes"] == 2 and r1["eval_tokens"] == r2["eval_tokens"]
    assert r1["eval_loss"] == pytest.approx(r2["eval_loss"], rel=1e-5)


@pytest.mark.slow
@needs_data
@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO_ROOT / "configs" / "models" / "cpu").glob("*.json")))
def test_every_cpu_preset_pretrains_and_its_checkpoint_reloads(corpus, tmp_path, preset):
    """Every model of the package and the stock RoBERTa / GPT-2 baselines go through the same script."""
    from pretrain import main
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    config = tiny_preset(tmp_path, preset, **({"linformer_k": 16} if "linformer-k" in preset else {}))
    main(pretrain_args(corpus, config, tmp_path / "out", "--max_steps", 2, "--save_steps", 100, "--eval_steps", 2))
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    decoder = "gpt2" in preset
    assert results["objective"] == ("clm" if decoder else "mlm") and results["steps"] == 2
    model = (AutoModelForCausalLM if decoder else AutoModelForMaskedLM).from_pretrained(tmp_path / "out")
    assert model.config.model_type == json.loads(config.read_text())["model_type"]
    assert model.config.vocab_size == len(__import__("transformers").AutoTokenizer.from_pretrained(tmp_path / "out"))


# ---------------------------------------------------------------------------------------- pretrain -> fine-tune


class RecordingHubApi:
    """Stands in for huggingface_hub.HfApi: records the calls and the files upload_folder would send."""

    calls = []

    def __init__(self, token=None):
        self.token = token

    def whoami(self):  # finetune.py checks the token and the Hub before training
        return {"name": "someone", "auth": {"accessToken": {"role": "write"}}}

    def create_repo(self, repo_id, private=None, exist_ok=False, repo_type=None):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, repo_id, folder_path, commit_message=None, ignore_patterns=None, repo_type=None):
        from huggingface_hub.utils import filter_repo_objects  # the filter the real upload_folder applies

        files = sorted(str(p.relative_to(folder_path)) for p in __import__("pathlib").Path(folder_path).rglob("*")
                       if p.is_file())
        uploaded = sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))
        self.calls.append(("upload_folder", repo_id, uploaded, commit_message))
        return f"https://huggingface.co/{repo_id}/commit/0123abc"


@pytest.mark.slow
@needs_data
def test_pretrain_finetune_evaluate_and_push_end_to_end(corpus, tmp_path, monkeypatch):
    """Linformer MLM pretraining -> SST-2 fine-tuning (official TSVs) -> metrics, card, push; reload in a fresh
    process and recompute the accuracy independently."""
    from hf_linear_attn.training import hub
    from finetune import main as finetune_main

    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    run_pretrain(pretrain_args(corpus, config, tmp_path / "pretrained", "--max_steps", 6, "--save_steps", 100,
                               "--eval_steps", 6))
    pretrained = json.loads((tmp_path / "pretrained" / "train_results.json").read_text())
    assert pretrained["objective"] == "mlm" and 1 < pretrained["perplexity"] < 1000

    RecordingHubApi.calls = []
    monkeypatch.setattr(hub, "HfApi", RecordingHubApi)
    out = tmp_path / "sst2"
    metrics = finetune_main([
        "--config", str(REPO_ROOT / "configs" / "finetune" / "cpu-sst2.json"),
        "--model_name_or_path", str(tmp_path / "pretrained"), "--output_dir", str(out),
        "--train_file", str(GLUE / "sst2" / "train.tsv"), "--validation_file", str(GLUE / "sst2" / "dev.tsv"),
        "--max_train_samples", "64", "--max_eval_samples", "48", "--max_seq_length", "128",
        "--num_train_epochs", "1", "--per_device_train_batch_size", "16", "--save_strategy", "no",
        "--push_to_hub", "--hub_model_id", "someone/linformer-sst2", "--hub_token", "hf_test"])
    results = json.loads((out / "eval_results.json").read_text())
    assert set(metrics) >= {"eval_accuracy", "eval_loss"} and 0 <= results["eval_accuracy"] <= 1
    assert results["eval_samples"] == 48 and results["eval_split"] == "dev.tsv"
    assert results["hub_commit"].endswith("/commit/0123abc")

    (create, repo, private, exist_ok), upload = RecordingHubApi.calls
    assert (create, repo, exist_ok) == ("create_repo", "someone/linformer-sst2", True)
    assert upload[0:2] == ("upload_folder", "someone/linformer-sst2")
    files = set(upload[2])
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    code = {ref.split(".")[0] + ".py" for ref in auto_map.values()}
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "eval_results.json", *code} <= files
    assert {"modeling_linformer.py", "configuration_linformer.py"} <= files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) or f.startswith("checkpoint-") for f in files)

    card = (out / "README.md").read_text()
    from huggingface_hub import ModelCard

    index = ModelCard(card).data.to_dict()["model-index"][0]["results"][0]
    assert index["metrics"][0] == {"type": "accuracy", "value": round(results["eval_accuracy"], 4)}
    assert index["dataset"]["split"] == "dev.tsv" and "linformer" in card and "trust_remote_code=True" in card

    # a fresh process without the package on its path: load from the folder and score the same 48 dev rows
    check = """
import csv, json, sys
from transformers import AutoModelForSequenceClassification, AutoTokenizer
import torch
folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
rows = list(csv.reader(open(sys.argv[2]), delimiter="\\t", quoting=csv.QUOTE_NONE))[1:49]
correct = 0
for text, label in rows:
    batch = tok(text, return_tensors="pt")
    assert batch["input_ids"].shape[1] <= 128  # no truncation rule involved
    with torch.no_grad():
        correct += int(model(**batch).logits.argmax(-1).item() == int(label))
print(json.dumps({"accuracy": correct / len(rows)}))
"""
    env = {**ENV, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", check, str(out), str(GLUE / "sst2" / "dev.tsv")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((l for l in proc.stdout.splitlines() if l.startswith("{\"accuracy\"")), proc.stdout[-2000:])
    assert json.loads(line)["accuracy"] == pytest.approx(results["eval_accuracy"])


@pytest.mark.slow
@needs_data
def test_decoder_pretrains_and_finetunes_on_a_sentence_pair_task(corpus, tmp_path):
    """Causal-LM pretraining of the linear decoder, then QQP (pairs, accuracy + F1) from the real train subset."""
    from finetune import main as finetune_main

    config = tiny_preset(tmp_path, "linear-gpt2-elu")
    run_pretrain(pretrain_args(corpus, config, tmp_path / "lm", "--max_steps", 4, "--save_steps", 100,
                               "--eval_steps", 4))
    assert json.loads((tmp_path / "lm" / "train_results.json").read_text())["objective"] == "clm"
    metrics = finetune_main([
        "--model_name_or_path", str(tmp_path / "lm"), "--task_name", "qqp", "--output_dir", str(tmp_path / "qqp"),
        "--train_file", str(GLUE / "qqp" / "train_subset.tsv"), "--validation_file",
        str(GLUE / "qqp" / "dev_subset.tsv"), "--max_train_samples", "32", "--max_eval_samples", "40",
        "--max_seq_length", "48", "--num_train_epochs", "1", "--per_device_train_batch_size", "8",
        "--save_strategy", "no", "--report_to", "none"])
    assert {"eval_accuracy", "eval_f1"} <= set(metrics) and metrics["eval_samples"] == 40
    card = (tmp_path / "qqp" / "README.md").read_text()
    assert "dev_subset.tsv" in card and "type: f1" in card


@pytest.mark.slow
@needs_data
def test_a_finetuning_seed_names_one_run_across_processes(corpus, tmp_path):
    """Two fresh processes with one seed end with identical weights (the new classification head included: torch
    starts every process from a random seed); another seed draws another head."""
    config = tiny_preset(tmp_path, "roberta-softmax")
    run_pretrain(pretrain_args(corpus, config, tmp_path / "lm", "--max_steps", 2, "--save_steps", 100,
                               "--eval_steps", 2))
    tuned = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        proc = subprocess.run([
            sys.executable, str(REPO_ROOT / "scripts" / "finetune.py"), "--model_name_or_path", str(tmp_path / "lm"),
            "--task_name", "sst2", "--output_dir", str(tmp_path / name), "--seed", str(seed),
            "--train_file", str(GLUE / "sst2" / "train.tsv"), "--validation_file", str(GLUE / "sst2" / "dev.tsv"),
            "--max_train_samples", "16", "--max_eval_samples", "16", "--max_seq_length", "32", "--max_steps", "2",
            "--per_device_train_batch_size", "8", "--save_strategy", "no", "--report_to", "none"],
            capture_output=True, text=True, timeout=600, env=ENV)
        assert proc.returncode == 0, proc.stderr[-4000:]
        tuned[name] = weights(tmp_path / name)
    head = [key for key in tuned["a"] if key.startswith("classifier.")]
    assert head and tuned["a"].keys() == tuned["b"].keys()
    for key in tuned["a"]:
        torch.testing.assert_close(tuned["a"][key], tuned["b"][key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(tuned["a"][key], tuned["c"][key]) for key in head)


# --------------------------------------------------------------------------------------------------- bad input



@needs_data
def test_pretraining_refuses_bad_input_with_clear_errors(corpus, tmp_path):
    from pretrain import main

    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    args = pretrain_args(corpus, config, tmp_path / "out")
    # a folder holding another run is never overwritten silently
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("someone else's")
    assert "not empty" in script_error(main, args) and (tmp_path / "out" / "notes.txt").exists()
    assert "nothing to resume" in script_error(main, [*args, "--resume"])
    # unreadable / unknown files
    fresh = pretrain_args(corpus, config, tmp_path / "fresh")
    assert "file not found" in script_error(main, replaced(fresh, train_file=tmp_path / "nowhere.txt"))
    odd = tmp_path / "corpus.xml"
    odd.write_text("<a/>")
    assert "unknown file type '.xml'" in script_error(main, replaced(fresh, train_file=odd, validation_file=odd))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    message = script_error(main, replaced(fresh, train_file=broken, validation_file=broken))
    assert "could not read" in message and "broken.jsonl" in message
    wrong_column = tmp_path / "wrong.jsonl"
    wrong_column.write_text('{"body": "a line"}\n' * 5)
    message = script_error(main, replaced(fresh, train_file=wrong_column, validation_file=wrong_column))
    assert "no column ['text']" in message and "['body']" in message and "--text_column" in message
    # too long for the model's positions
    assert "longer than the model allows (128" in script_error(main, replaced(fresh, max_seq_length=512))
    # a config key the script does not know
    bad_config = tmp_path / "bad.json"
    bad_config.write_text(json.dumps({"max_stpes": 3}))
    assert "max_stpes" in script_error(main, ["--config", str(bad_config), *args])
    # --overwrite_output_dir would delete an input that lies inside the folder it empties
    inside = tmp_path / "out" / "model.json"
    inside.write_text(config.read_text())
    message = script_error(main, [*replaced(args, model_config=inside), "--overwrite_output_dir"])
    assert "--model_config" in message and "lies inside --output_dir" in message
    assert inside.is_file() and (tmp_path / "out" / "notes.txt").exists()


def test_a_run_resumed_from_an_older_checkpoint_saves_over_the_steps_it_had_saved(tmp_path):
    """Resuming from step 1 of a run that had saved steps 1 and 2 reaches step 2 again: the new step 2 replaces
    the old one (the rename onto a full folder used to fail) and nothing temporary is left."""
    from accelerate import Accelerator

    from hf_linear_attn.training.run_state import checkpoints_in, save_checkpoint

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in (1, 2):
        save_checkpoint(accelerator, tmp_path, step, keep=3)
    with torch.no_grad():
        model.weight.fill_(7.0)
    save_checkpoint(accelerator, tmp_path, 2, keep=3)
    assert [p.name for p in checkpoints_in(tmp_path)] == ["step_0000001", "step_0000002"]
    saved = weights(tmp_path / "checkpoints" / "step_0000002")  # model.safetensors
    assert torch.equal(saved["weight"], torch.full((2, 2), 7.0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000001", "step_0000002"]


@pytest.mark.slow
@needs_data
def test_resume_and_tokenizer_mismatches_are_refused(corpus, tmp_path):
    from pretrain import main

    config = tiny_preset(tmp_path, "linear-roberta-elu")
    run_pretrain(pretrain_args(corpus, config, tmp_path / "run", "--max_steps", 2, "--save_steps", 1))
    changed = replaced(pretrain_args(corpus, config, tmp_path / "run", "--max_steps", 2, "--save_steps", 1,
                                     "--resume"), max_seq_length=24)
    assert "max_seq_length: 32 -> 24" in script_error(main, changed)
    # continuing from weights with a tokenizer bigger than the embedding
    big = pretrain_args(corpus, config, tmp_path / "big")
    big[big.index("--model_config"): big.index("--model_config") + 2] = ["--model_name_or_path", str(tmp_path / "run")]
    big += ["--tokenizer_name_or_path", str(tmp_path / "bigtok")]
    from hf_linear_attn.training.data.corpus import train_bpe_tokenizer

    lines = (corpus / "train.txt").read_text().splitlines()
    train_bpe_tokenizer(lines, 900, "roberta", 64).save_pretrained(tmp_path / "bigtok")
    message = script_error(main, big)
    assert "embedding has" in message and "use the model's own tokenizer" in message
    assert not (tmp_path / "big").exists()  # a run that never started leaves nothing to trip over
    from finetune import main as finetune_main

    message = script_error(finetune_main, [
        "--model_name_or_path", str(tmp_path / "run"), "--tokenizer_name_or_path", str(tmp_path / "bigtok"),
        "--task_name", "sst2", "--train_file", str(GLUE / "sst2" / "dev.tsv"), "--output_dir", str(tmp_path / "ft"),
        "--report_to", "none"])
    assert "900 tokens" in message or "tokens but the model's embedding has" in message


@pytest.mark.slow
@needs_data
def test_tensorboard_tracker_logs_loss_and_perplexity(corpus, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is installed by the test extra: pip install -e .[test]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny_preset(tmp_path, "linear-gpt2-elu")
    run_pretrain(pretrain_args(corpus, config, tmp_path / "tb", "--max_steps", 4, "--save_steps", 100,
                               "--eval_steps", 2, "--report_to", "tensorboard"))
    runs = [p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    assert runs, "no TensorBoard event file written"
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "learning_rate", "eval_loss", "perplexity"} <= tags
    assert [e.step for e in events.Scalars("perplexity")] == [2, 4]
    final = json.loads((tmp_path / "tb" / "train_results.json").read_text())["perplexity"]
    assert events.Scalars("perplexity")[-1].value == pytest.approx(final, rel=1e-6)


def test_hub_datasets_take_the_same_path_as_local_files(monkeypatch):
    """--dataset_name asks `datasets` for the Hub dataset and config; the Hub's schema (ClassLabel ints, an idx
    column, IMDB's test split as evaluation) comes out like local files do. The Hub itself is a stand-in here."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    from hf_linear_attn.training import data  # data.files reads every Hub dataset: the stand-in goes there

    requested = []

    def hub(name, config=None):
        requested.append((name, config))
        if name == "nyu-mll/glue":
            features = Features({"question1": Value("string"), "question2": Value("string"),
                                 "label": ClassLabel(names=["not_duplicate", "duplicate"]), "idx": Value("int32")})
            rows = {"question1": ["a?", "b?"], "question2": ["c?", "d?"], "label": [1, 0], "idx": [0, 1]}
            return DatasetDict({s: Dataset.from_dict(rows, features=features) for s in ("train", "validation", "test")})
        features = Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])})
        return DatasetDict({s: Dataset.from_dict({"text": [f"{s} review"], "label": [1]}, features=features)
                            for s in ("train", "test", "unsupervised")})

    monkeypatch.setattr(data.files, "load_dataset", hub)
    qqp, split = data.load_task_data(data.get_task("qqp"), dataset_name="nyu-mll/glue")
    assert requested[-1] == ("nyu-mll/glue", "qqp") and split == "nyu-mll/glue validation"
    assert qqp["train"].column_names == ["question1", "question2", "label"] and qqp["train"]["label"] == [1, 0]
    imdb, split = data.load_task_data(data.get_task("imdb"), dataset_name="stanfordnlp/imdb")
    assert requested[-1] == ("stanfordnlp/imdb", None) and split == "stanfordnlp/imdb test"
    assert imdb["validation"]["text"] == ["test review"]


@needs_data
def test_finetuning_refuses_bad_input_with_clear_errors(tmp_path):
    from finetune import main

    base = ["--model_name_or_path", "unused", "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert "unknown task 'cola'" in script_error(main, [*base, "--task_name", "cola", "--train_file", "x.tsv"])
    no_label = tmp_path / "no_label.jsonl"
    no_label.write_text('{"sentence": "good"}\n{"sentence": "bad"}\n')
    message = script_error(main, [*base, "--task_name", "sst2", "--train_file", str(no_label)])
    assert "needs the columns ['sentence'] and a label column" in message and "it has ['sentence']" in message
    # the QQP file given for SST-2
    message = script_error(main, [*base, "--task_name", "sst2", "--train_file", str(GLUE / "qqp" / "dev_subset.tsv")])
    assert "needs the columns ['sentence']" in message and "'question1'" in message
    # QNLI's text labels are not SST-2's
    message = script_error(main, [*base, "--task_name", "sst2", "--train_file", str(GLUE / "qnli" / "dev.tsv")])
    assert "labels ['entailment', 'not_entailment']" in message
    weird = tmp_path / "weird.jsonl"
    weird.write_text('{"text": "ok", "label": "maybe"}\n' * 3)
    assert "labels ['maybe']" in script_error(main, [*base, "--task_name", "imdb", "--train_file", str(weird)])
    one_label = tmp_path / "one_label.jsonl"
    one_label.write_text('{"text": "fine", "label": 1}\n' * 4)
    assert "has the same label" in script_error(main, [*base, "--task_name", "imdb", "--train_file", str(one_label)])
    sst2 = [*base, "--task_name", "sst2", "--train_file", str(GLUE / "sst2" / "dev.tsv")]
    assert "--head_fraction must be between 0 and 1" in script_error(main, [*sst2, "--head_fraction", "1.5"])
    assert "--max_train_samples must be at least 1" in script_error(main, [*sst2, "--max_train_samples", "0"])
    message = script_error(main, [*sst2, "--model_card_template", str(tmp_path / "no-template.md")])
    assert "model card template not found" in message  # before any training, not after it
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "eval_results.json").write_text("{}")
    message = script_error(main, sst2)
    assert "not empty" in message and (tmp_path / "out" / "eval_results.json").read_text() == "{}"
    # --overwrite_output_dir would delete the model it is to start from
    (tmp_path / "out" / "model").mkdir()
    message = script_error(main, [*replaced(sst2, model_name_or_path=tmp_path / "out" / "model"), "--overwrite_output_dir"])
    assert "--model_name_or_path" in message and "lies inside --output_dir" in message
    assert (tmp_path / "out" / "model").is_dir() and (tmp_path / "out" / "eval_results.json").is_file()


def test_subsets_of_hub_splits_are_drawn_at_random_and_of_local_files_taken_in_order():
    """IMDB's Hub splits are sorted by label: --max_train_samples must not take 1,000 negative reviews."""
    from datasets import Dataset

    from hf_linear_attn.training.finetuning_setup import subset as _subset

    rows = Dataset.from_dict({"text": [f"review {i}" for i in range(200)], "label": [0] * 100 + [1] * 100})
    drawn = _subset(rows, 20, hub=True, seed=42)
    assert len(drawn) == 20 and set(drawn["label"]) == {0, 1}
    assert drawn["text"] == _subset(rows, 20, hub=True, seed=42)["text"] != _subset(rows, 20, hub=True, seed=1)["text"]
    assert _subset(rows, 20, hub=False, seed=42)["text"] == [f"review {i}" for i in range(20)]
    assert _subset(rows, 500, hub=True, seed=42) is rows and _subset(rows, None, hub=True, seed=42) is rows


# ------------------------------------------------------------------------------------------ data, metrics, card


@needs_data
def test_glue_tsvs_are_read_with_quoting_disabled_and_labels_mapped():
    from hf_linear_attn.training.data.tasks import get_task, load_task_data

    qnli, split = load_task_data(get_task("qnli"), train_file=str(GLUE / "qnli" / "train_subset.tsv"),
                                 validation_file=str(GLUE / "qnli" / "dev.tsv"))
    assert len(qnli["validation"]) == 5463 and len(qnli["train"]) == 9999  # default quoting gives 5,267
    assert set(qnli["validation"].unique("label")) == {0, 1} and split == "dev.tsv"
    first = next(open(GLUE / "qnli" / "dev.tsv")).split("\t")
    assert first[-1].strip() == "label"
    rows = [line.rstrip("\n").split("\t") for line in open(GLUE / "qnli" / "dev.tsv")][1:4]
    for row, got in zip(rows, qnli["validation"].select(range(3))):
        assert (got["question"], got["sentence"]) == (row[1], row[2])
        assert got["label"] == ["entailment", "not_entailment"].index(row[3])
    qqp, split = load_task_data(get_task("qqp"), train_file=str(GLUE / "qqp" / "train_subset.tsv"))
    assert qqp["train"].column_names == ["question1", "question2", "label"]
    assert len(qqp["train"]) + len(qqp["validation"]) == 20497 and "held out (seed 42)" in split


@pytest.mark.skipif(data_missing(SHARED_DATA / "imdb" / "train.jsonl"), reason="IMDB not in ../shared/data")
def test_long_reviews_keep_head_and_tail(tokenizer):
    from datasets import Dataset, DatasetDict

    from hf_linear_attn.training.data.tasks import encode_task, get_task

    review = json.loads(next(open(SHARED_DATA / "imdb" / "train.jsonl")))["text"]
    full = tokenizer(review, add_special_tokens=False)["input_ids"]
    assert len(full) > 64
    encoded = encode_task(DatasetDict(train=Dataset.from_dict({"text": [review, "short"], "label": [1, 0]})),
                          get_task("imdb"), tokenizer, max_length=64, head_fraction=0.25)
    ids = encoded["train"][0]["input_ids"]
    # <s> + first 15 + last 47 + </s> (budget 62 = 64 - 2 special tokens; head = int(62 * 0.25))
    assert ids == [tokenizer.bos_token_id, *full[:15], *full[-47:], tokenizer.eos_token_id]
    assert encoded["train"][1]["input_ids"] == tokenizer("short")["input_ids"]


def test_offline_metrics_match_hand_computation_and_the_hub_keys():
    from hf_linear_attn.training.data.tasks import TASKS
    from hf_linear_attn.training.metrics import load_task_metric

    predictions, references = [1, 1, 0, 0, 1, 0, 1], [1, 0, 0, 1, 1, 0, 0]
    # by hand: 4 of 7 right; class 1: TP 2, predicted 4, actual 3 -> F1 = 2 * 2 / (4 + 3)
    expected = {"sst2": {"accuracy": 4 / 7}, "qnli": {"accuracy": 4 / 7}, "imdb": {"accuracy": 4 / 7},
                "qqp": {"accuracy": 4 / 7, "f1": 4 / 7}}
    for name, task in TASKS.items():
        scores = load_task_metric(task, "local").compute(predictions=predictions, references=references)
        assert scores == pytest.approx(expected[name]), name
    f1 = load_task_metric(TASKS["qqp"], "local").compute(predictions=[1, 1, 1, 0], references=[1, 0, 0, 0])["f1"]
    assert f1 == pytest.approx(2 * 1 / (3 + 1))


def test_push_refuses_a_folder_missing_model_code(tmp_path):
    from hf_linear_attn.training.errors import UsageError
    from hf_linear_attn.training.hub import check_push_folder

    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {
        "AutoModel": "modeling_linformer.LinformerModel"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "README.md").write_text("card")
    with pytest.raises(UsageError, match=r"lacks \['modeling_linformer.py'\]"):
        check_push_folder(tmp_path)
    (tmp_path / "modeling_linformer.py").write_text("")
    assert "modeling_linformer.py" in check_push_folder(tmp_path)


def test_presets_parse_as_script_arguments():
    from transformers import TrainingArguments

    from hf_linear_attn.training.arguments import parse_arguments
    from hf_linear_attn.training.finetuning_arguments import FinetuneArguments
    from hf_linear_attn.training.pretraining_arguments import PretrainArguments

    for path in sorted((REPO_ROOT / "configs" / "pretrain").glob("*.json")):
        args, config = parse_arguments((PretrainArguments,), ["--config", str(path), "--output_dir", "x"])
        assert config == str(path) and args.max_steps == json.loads(path.read_text())["max_steps"]
    for path in sorted((REPO_ROOT / "configs" / "finetune").glob("*.json")):
        args, training, _ = parse_arguments((FinetuneArguments, TrainingArguments),
                                            ["--config", str(path), "--model_name_or_path", "m", "--output_dir", "o"])
        raw = json.loads(path.read_text())
        assert training.learning_rate == raw["learning_rate"]
        if "task_name" in raw:  # a preset task (GLUE, IMDB); the others name their task type and data elsewhere
            assert args.task_name == raw["task_name"] and args.task_name in path.stem
        else:
            assert args.task_type == raw["task_type"] != "sequence_classification"


@pytest.mark.parametrize("script", ["pretrain", "finetune"])
def test_help_of_the_training_scripts_renders(script):
    """`--help` lists every flag: a bare '%' in a help string once made argparse crash on `pretrain.py --help`."""
    from transformers import HfArgumentParser, TrainingArguments

    from hf_linear_attn.training.finetuning_arguments import FinetuneArguments
    from hf_linear_attn.training.pretraining_arguments import PretrainArguments

    types = (PretrainArguments,) if script == "pretrain" else (FinetuneArguments, TrainingArguments)
    text = HfArgumentParser(types).format_help()
    assert "--validation_split_percentage" in text and "--output_dir" in text


@pytest.mark.parametrize("preset", ["roberta-softmax", "linformer-k32-rows", "linear-roberta-elu"])
def test_masked_tokens_loss_equals_the_models_own_loss_and_gradients(preset):
    """Pretraining runs the LM head on masked tokens only; loss and gradients must equal the model's full-logit
    loss (float64, so only the summation order differs). A model without an `lm_head` (BERT's `cls`) is not wrapped."""
    from transformers import AutoConfig, AutoModelForMaskedLM, BertConfig, BertForMaskedLM

    from hf_linear_attn.training.pretraining import MaskedTokensLoss

    config = json.loads((REPO_ROOT / "configs" / "models" / "cpu" / f"{preset}.json").read_text())
    config.update(PRESET_ENCODER_SIZE, vocab_size=500, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(AutoConfig.for_model(**config)).double()
    ids = torch.randint(5, 500, (3, 128), generator=torch.Generator().manual_seed(1))
    labels = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.15, ids, -100)
    params = [p for p in model.parameters() if p.requires_grad]
    full = model(input_ids=ids, labels=labels).loss
    full_grads = torch.autograd.grad(full, params)
    assert MaskedTokensLoss.supports(model)
    picked = MaskedTokensLoss(model)(input_ids=ids, labels=labels).loss
    picked_grads = torch.autograd.grad(picked, params)
    torch.testing.assert_close(picked, full, rtol=1e-12, atol=1e-12)
    for a, b in zip(picked_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert not MaskedTokensLoss.supports(BertForMaskedLM(BertConfig(**PRESET_ENCODER_SIZE, vocab_size=500)))


# --------------------------------------------------------------------------- accelerate launch --num_processes N


def test_a_single_process_start_of_accelerate_launch_num_processes_is_recognised():
    """accelerate's simple launcher (no --multi_gpu, no GPUs) drops --num_processes; the scripts see it in the
    launcher's command line."""
    from hf_linear_attn.training.launch import single_process_launch

    script = str(REPO_ROOT / "scripts" / "pretrain.py")
    launcher = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--num_processes", "2", script, "--max_steps", "3"]
    env = {"ACCELERATE_USE_CPU": "False"}
    assert single_process_launch(script, launcher, env) == (launcher, 2)
    assert single_process_launch(script, [*launcher[:3], "--num_processes=4", *launcher[5:]], env)[1] == 4
    module = ["python", "-m", "accelerate.commands.launch", "--num_processes", "2", script]
    assert single_process_launch(script, module, env) == (module, 2)
    assert single_process_launch(script, launcher, {**env, "WORLD_SIZE": "2"}) is None  # torchrun / --multi_gpu
    assert single_process_launch(script, launcher, {}) is None  # not under accelerate
    assert single_process_launch(script, [*launcher[:4], "1", *launcher[5:]], env) is None
    # a --num_processes given to the script itself is not the launcher's
    assert single_process_launch(script, [*launcher[:3], script, "--num_processes", "2"], env) is None


@pytest.mark.slow
@needs_data
def test_the_documented_accelerate_launch_command_runs_two_processes_on_cpu(corpus, tmp_path):
    """`accelerate launch --num_processes 2 scripts/pretrain.py ...`, the docstring's command as typed, used to run
    one process on a machine without GPUs (train_results.json: "num_processes": 1)."""
    import shutil

    accelerate = shutil.which("accelerate", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert accelerate, "the accelerate command is not installed beside this python"
    config = tiny_preset(tmp_path, "linear-gpt2-elu")
    out = tmp_path / "two"
    proc = subprocess.run([accelerate, "launch", "--num_processes", "2", "scripts/pretrain.py",
                           *pretrain_args(corpus, config, out, "--max_steps", 4, "--save_steps", 2, "--eval_steps", 4)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 process(es)" in proc.stdout + proc.stderr
    assert json.loads((out / "train_results.json").read_text())["num_processes"] == 2
    saved = {p.name for p in (out / "checkpoints" / "step_0000002").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= saved  # both ranks took part


@pytest.mark.slow
@needs_data
def test_pretraining_keeps_its_loss_history_and_a_resume_may_extend_max_steps(corpus, tmp_path):
    """trainer_state.json holds log_history without --report_to; checkpoint weights are safetensors; --resume with
    a larger --max_steps continues (the schedule change said), a smaller one is refused."""
    config = tiny_preset(tmp_path, "roberta-softmax")
    out = tmp_path / "out"
    args = pretrain_args(corpus, config, out, "--max_steps", 4, "--save_steps", 2, "--eval_steps", 2)
    run_pretrain(args)
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["max_steps"] == 4
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [2, 4]
    assert [e["step"] for e in state["log_history"] if "eval_loss" in e] == [2, 4]
    saved = {p.name for p in (out / "checkpoints" / "step_0000002").iterdir()}
    assert "model.safetensors" in saved and not any(n.startswith("pytorch_model") for n in saved)
    in_checkpoint = json.loads((out / "checkpoints" / "step_0000002" / "trainer_state.json").read_text())
    assert in_checkpoint["global_step"] == 2 and len(in_checkpoint["log_history"]) == 2

    resumed = run_pretrain([*replaced(args, max_steps=6), "--resume"])
    said = resumed.stdout + resumed.stderr
    assert "resumed from" in said and "--max_steps raised from 4 to 6" in said
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and [e["step"] for e in state["log_history"] if "loss" in e] == [2, 4, 6]
    assert json.loads((out / "train_results.json").read_text())["steps"] == 6
    shorter = run_pretrain([*replaced(args, max_steps=3), "--resume"], check=False)
    assert shorter.returncode != 0 and "can be extended, not shortened" in shorter.stderr
