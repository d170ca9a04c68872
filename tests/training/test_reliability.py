"""Issue 30 (training side): no silent wrong answer, no run only a person can unstick, a clear error for every bad
input. Checkpoints are whole or skipped by name, resumes are exact or refused, a full disk says so."""

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import GLUE, TINY, needs_data, pretrain_args, replaced, script_error, tiny_preset, weights

from hf_linear_attn.training.errors import DiskFullError, UsageError


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


# ------------------------------------------------------------------------------------------ bad numbers, bad text

@needs_data
def test_pretraining_refuses_out_of_range_flags_before_writing_anything(corpus, tmp_path):
    from pretrain import main

    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    args = pretrain_args(corpus, config, tmp_path / "out")
    cases = [  # (flag, value, what the message must say): each used to crash mid-run or train on nonsense
        ("max_seq_length", -5, "--max_seq_length must be at least 3"),
        ("max_seq_length", 2, "--max_seq_length must be at least 3"),
        ("max_eval_samples", 0, "--max_eval_samples must be at least 1"),
        ("logging_steps", 0, "--logging_steps must be at least 1"),
        ("save_steps", 0, "--save_steps must be at least 1"),
        ("eval_steps", 0, "--eval_steps must be at least 1"),
        ("mlm_probability", 0, "--mlm_probability must be in (0, 1]"),
        ("tokenizer_vocab_size", 0, "--tokenizer_vocab_size must be at least 261"),
        ("warmup_ratio", 5, "--warmup_ratio must be between 0 and 1"),
    ]
    for flag, value, expected in cases:
        argv = replaced(args, **{flag: value}) if f"--{flag}" in args else [*args, f"--{flag}", str(value)]
        assert expected in script_error(main, argv), (flag, value)
        assert not (tmp_path / "out").exists(), (flag, value)


@needs_data
def test_a_refused_pretraining_run_leaves_the_folder_it_was_to_replace_as_it_found_it(corpus, tmp_path):
    """--overwrite_output_dir with inputs that are refused only once the data is packed: the old run survives."""
    from pretrain import main

    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old_run.txt").write_text("keep me")
    argv = [*replaced(pretrain_args(corpus, config, out), per_device_train_batch_size=100000),
            "--overwrite_output_dir"]
    assert "do not make one batch" in script_error(main, argv)
    assert _listing(out) == ["old_run.txt"] and not list(tmp_path.glob(".replaced-*"))


def test_text_files_with_bad_bytes_or_non_text_fields_are_refused_by_name(tmp_path):
    from hf_linear_attn.training.data.corpus import load_text_corpus
    from hf_linear_attn.training.data.tasks import get_task, load_task_data

    files = {
        "latin1.jsonl": (b'{"text": "fine", "label": 1}\n{"text": "caf\xe9", "label": 0}\n', "not UTF-8 text"),
        "null.jsonl": (b'{"text": "fine", "label": 1}\n{"text": null, "label": 0}\n', "is empty (null) in 1 row"),
        "mixed.jsonl": (b'{"text": "fine", "label": 1}\n{"text": 5, "label": 0}\n', "must hold text"),
        "latin1.txt": (b"fine\ncaf\xe9\n", "not UTF-8 text"),
    }
    for name, (content, expected) in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(UsageError, match=re.escape(expected)) as corpus_error:
            load_text_corpus(train_file=str(path), validation_file=str(path))
        assert name in str(corpus_error.value) or "column 'text'" in str(corpus_error.value)
        if name.endswith(".jsonl"):
            with pytest.raises(UsageError, match=re.escape(expected)):
                load_task_data(get_task("imdb"), train_file=str(path), validation_file=str(path))
    with pytest.raises(UsageError, match=r"line 2"):
        load_text_corpus(train_file=str(tmp_path / "latin1.txt"))


@needs_data
def test_finetuning_refuses_flags_that_would_train_nothing_or_crash_later(tmp_path, tokenizer):
    from finetune import main

    from hf_linear_attn.training.data.tasks import encode_task, get_task, load_task_data

    sst2 = ["--model_name_or_path", "unused", "--output_dir", str(tmp_path / "out"), "--report_to", "none",
            "--task_name", "sst2", "--train_file", str(GLUE / "sst2" / "dev.tsv")]
    cases = [
        (["--max_seq_length", "0"], "--max_seq_length must be at least 1"),
        (["--max_seq_length", "-5"], "--max_seq_length must be at least 1"),
        (["--num_train_epochs", "-1", "--max_steps", "-1"], "nothing to train"),
        # 0 steps: TrainingArguments turned an --eval_steps of 0 into --logging_steps (500) without a word, Trainer
        # saved no checkpoint for a --save_steps of 0; each is refused naming the flag and the way to have none
        (["--eval_steps", "0", "--eval_strategy", "steps"], "--eval_steps must be positive (got 0)"),
        (["--eval_steps", "0", "--eval_strategy", "steps"], "pass --eval_strategy no"),
        (["--eval_steps", "0"], "--eval_steps must be positive (got 0)"),
        (["--eval_steps", "-2", "--eval_strategy", "steps"], "--eval_steps must be positive (got -2)"),
        (["--save_steps", "0"], "--save_steps must be positive (got 0)"),
        (["--save_steps", "0"], "pass --save_strategy no"),
        (["--save_steps", "0", "--save_strategy", "no"], "--save_steps must be positive"),
        (["--logging_steps", "0"], "--logging_steps must be positive (got 0)"),
        (["--logging_steps", "0"], "pass --logging_strategy no"),
        (["--max_eval_samples", "0"], "--max_eval_samples must be at least 1"),
    ]
    for extra, expected in cases:
        assert expected in script_error(main, [*sst2, *extra]), extra
        assert not (tmp_path / "out").exists(), extra
    config = tmp_path / "finetune.json"  # the same from a --config file
    config.write_text(json.dumps({"eval_strategy": "steps", "eval_steps": 0}))
    assert "--eval_steps must be positive (got 0)" in script_error(main, [*sst2, "--config", str(config)])
    assert "must be positive" not in script_error(main, [*sst2, "--eval_steps", "0.25", "--eval_strategy", "steps"])
    # a length that fits only the special tokens: <s></s> would be all the model sees
    data, _ = load_task_data(get_task("sst2"), train_file=str(GLUE / "sst2" / "dev.tsv"))
    with pytest.raises(UsageError, match="leaves no room for text"):
        encode_task(data, get_task("sst2"), tokenizer, 2)
    pairs, _ = load_task_data(get_task("qnli"), train_file=str(GLUE / "qnli" / "dev.tsv"))
    with pytest.raises(UsageError, match="leaves no room for both texts"):
        encode_task(pairs, get_task("qnli"), tokenizer, 5)


def test_model_card_templates_are_rendered_in_a_sandbox(tmp_path):
    from hf_linear_attn import LinformerConfig
    from hf_linear_attn.training.data.tasks import get_task
    from hf_linear_attn.training.model_cards import DEFAULT_TEMPLATE, write_model_card

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.md"
    evil.write_text("---\n{{ card_data }}\n---\n{{ cycler.__init__.__globals__.os.popen('touch " + str(marker)
                    + "').read() }}{{ ''.__class__.__mro__[1].__subclasses__() }}\n")
    card = {"repo_id": "me/model", "config": LinformerConfig(**TINY, linformer_k=8), "base_model": "base",
            "task": get_task("sst2"), "metrics": {"eval_accuracy": 0.5, "eval_samples": 2}, "eval_split": "dev.tsv",
            "dataset_id": "nyu-mll/glue", "command": "python scripts/finetune.py", "data_description": "sst2",
            "truncation_rule": "rule", "max_seq_length": 32, "hyperparameters": {"seed": 1}, "machine": "cpu"}
    with pytest.raises(UsageError, match="cannot render the model card template"):
        write_model_card(tmp_path, template=evil, **card)
    assert not marker.exists() and not (tmp_path / "README.md").exists()
    written = write_model_card(tmp_path, template=DEFAULT_TEMPLATE, **card)  # the real template still renders
    assert "model-index" in (tmp_path / "README.md").read_text() and written.data.eval_results


# ------------------------------------------------------------------------------- checkpoints: whole or skipped

def _tiny_accelerated():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return accelerator


@pytest.mark.parametrize("failure", ["enospc", "torch-zip-writer"])
def test_a_full_disk_during_a_pretraining_checkpoint_is_reported_and_leaves_the_older_ones(tmp_path, monkeypatch,
                                                                                         failure):
    from hf_linear_attn.training.run_state import checkpoint_problems, checkpoints_in, save_checkpoint

    accelerator = _tiny_accelerated()
    save_checkpoint(accelerator, tmp_path, 1, keep=1)
    first = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "step_0000001").iterdir()}
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9856 vs 9750")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(DiskFullError, match="the disk is full") as error:
        save_checkpoint(accelerator, tmp_path, 2, keep=1)
    assert str(tmp_path / "checkpoints") in str(error.value)
    assert [p.name for p in checkpoints_in(tmp_path)] == ["step_0000001"]  # keep=1 did not delete it
    assert {p.name: p.read_bytes() for p in checkpoints_in(tmp_path)[0].iterdir()} == first
    assert "RNG state of process 0" not in checkpoint_problems(checkpoints_in(tmp_path)[0], 1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000001"]  # no temporary folder left


@needs_data
def test_pretraining_resume_is_exact_or_refused_naming_the_missing_rng_state(corpus, tmp_path, capsys):
    """A checkpoint without its RNG state used to be resumed silently (accelerate only logs at INFO level), ending
    with other weights. Now the newest whole checkpoint is taken and the damaged one named; with none whole the
    run stops naming the file and --allow_inexact_resume."""
    from pretrain import main

    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    out = tmp_path / "run"
    argv = pretrain_args(corpus, config, out, "--max_steps", 6, "--save_steps", 2, "--save_total_limit", 3)
    main(argv)
    straight = weights(out)
    newest, older = out / "checkpoints" / "step_0000004", out / "checkpoints" / "step_0000002"
    (newest / "random_states_0.pkl").unlink()
    capsys.readouterr()
    main([*argv, "--resume"])
    said = capsys.readouterr().out
    assert "skipping the incomplete checkpoint" in said and str(newest) in said and "random_states_0.pkl" in said
    assert f"resumed from {older}" in said
    again = weights(out)
    assert all(torch.equal(straight[k], again[k]) for k in straight)  # bit-exact from the older checkpoint

    for folder in (newest, older):  # truncated RNG states in every checkpoint
        data = (folder / "random_states_0.pkl").read_bytes()
        (folder / "random_states_0.pkl").write_bytes(data[: len(data) // 2])
    before = _listing(out)
    message = script_error(main, [*argv, "--resume"])
    assert "random_states_0.pkl truncated" in message and "--allow_inexact_resume" in message
    assert _listing(out) == before  # nothing deleted
    main([*argv, "--resume", "--allow_inexact_resume"])
    assert "without random_states_0.pkl" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- Trainer checkpoints

def _trainer(tmp_path, output_dir, max_steps=4, **overrides):
    from transformers import AutoModelForSequenceClassification, TrainingArguments, set_seed

    from hf_linear_attn import LinformerConfig
    from hf_linear_attn.training.trainer_checkpoints import AtomicCheckpointTrainer

    set_seed(0)
    model = AutoModelForSequenceClassification.from_config(LinformerConfig(**TINY, linformer_k=8, num_labels=2))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(5, 300, (16,), generator=g), "labels": i % 2} for i in range(32)]
    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8,
                             save_steps=1, save_total_limit=2, report_to="none", use_cpu=True, logging_steps=1,
                             seed=0, **overrides)
    return AtomicCheckpointTrainer(model=model, args=args, train_dataset=rows)


def test_trainer_checkpoints_are_whole_or_skipped_and_a_full_disk_is_named(tmp_path, monkeypatch, capsys):
    from hf_linear_attn.training.trainer_checkpoints import resolve_resume

    straight = _trainer(tmp_path, tmp_path / "straight")
    straight.train()
    expected = {k: v.clone() for k, v in straight.model.state_dict().items()}
    assert sorted(p.name for p in (tmp_path / "straight").iterdir()) == ["checkpoint-3", "checkpoint-4"]

    out = tmp_path / "out"
    trainer = _trainer(tmp_path, out)
    real_save = torch.save
    calls = {"n": 0}

    def full_disk_on_third_checkpoint(obj, f, *args, **kwargs):
        calls["n"] += 1
        real_save(obj, f, *args, **kwargs)
        if "checkpoint-3" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9856 vs 9750")

    monkeypatch.setattr(torch, "save", full_disk_on_third_checkpoint)
    with pytest.raises(DiskFullError, match="the disk is full") as error:
        trainer.train()
    monkeypatch.setattr(torch, "save", real_save)
    assert str(out) in str(error.value)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2"]  # no half checkpoint-3
    # a folder left by an older version (or a kill inside a plain Trainer save): no trainer_state.json
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-3")
    (out / "checkpoint-3" / "trainer_state.json").unlink()
    capsys.readouterr()
    chosen = resolve_resume("True", out, 1, allow_inexact=False)
    said = capsys.readouterr().out
    assert chosen == str(out / "checkpoint-2") and "checkpoint-3" in said and "trainer_state.json missing" in said
    with pytest.raises(UsageError, match="trainer_state.json missing"):
        resolve_resume(str(out / "checkpoint-3"), out, 1, allow_inexact=False)
    (out / "checkpoint-2" / "rng_state.pth").unlink()
    with pytest.raises(UsageError, match="rng_state.pth missing.*\n.*--allow_inexact_resume"):
        resolve_resume(str(out / "checkpoint-2"), out, 1, allow_inexact=False)
    assert resolve_resume(str(out / "checkpoint-2"), out, 1, allow_inexact=True) == str(out / "checkpoint-2")
    assert (out / "checkpoint-3").is_dir()  # skipped, never deleted

    resumed = _trainer(tmp_path, out)
    resumed.train(resume_from_checkpoint=resolve_resume(str(out / "checkpoint-1"), out, 1, allow_inexact=False))
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


def test_resume_latest_starts_a_run_killed_before_its_first_checkpoint_and_refuses_another_runs_folder(tmp_path,
                                                                                                      capsys):
    """One command for the first try and every retry: with nothing to resume from yet (no folder, or only the
    temporary folder of a save the kill interrupted), --resume_from_checkpoint True starts the run, saying so."""
    from hf_linear_attn.training.trainer_checkpoints import resolve_resume

    out = tmp_path / "out"
    assert resolve_resume("True", out, 1, allow_inexact=False) is None
    assert "holds no checkpoint yet; training from the start" in capsys.readouterr().out
    (out / ".partial-checkpoint-1" / "checkpoint-1").mkdir(parents=True)  # killed during the first save
    assert resolve_resume("latest", out, 1, allow_inexact=False) is None
    assert (out / ".partial-checkpoint-1" / "checkpoint-1").is_dir()
    (out / "model.safetensors").write_bytes(b"weights")  # a run saved without checkpoints: not to be trained over
    with pytest.raises(UsageError, match=r"no checkpoint-N folder to resume from, but other files \(model.safet"):
        resolve_resume("True", out, 1, allow_inexact=False)


def test_the_rotation_keeps_the_newest_whole_checkpoints_by_step_and_no_incomplete_one_is_deleted(tmp_path):
    """Trainer's rotate_checkpoints orders by modification time and deletes in place: a kill part-way through
    deleting checkpoint-1 left it half deleted and, its folder just changed, the newest by time, so the next
    rotations kept it and deleted the whole checkpoint-2 and checkpoint-3 (save_total_limit 2 left one whole).
    Now the newest whole ones by step are kept, the incomplete one is left alone, and a deletion is a rename first."""
    out = tmp_path / "out"
    _trainer(tmp_path, out, max_steps=2).train()
    half = out / "checkpoint-1"
    (half / "optimizer.pt").unlink()
    later = time.time() + 3600
    os.utime(half, (later, later))
    left = _listing(half)
    (out / ".deleting-checkpoint-0").mkdir()  # what a kill during an atomic deletion leaves: swept at the next one
    (out / ".deleting-checkpoint-0" / "model.safetensors").write_bytes(b"part")
    _trainer(tmp_path, out, max_steps=4).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
    assert _listing(half) == left


class _Killed(BaseException):
    """Stands for SIGKILL in-process: no `except Exception` or `except OSError` of the code under test catches it."""


def test_a_kill_while_pretraining_deletes_an_old_checkpoint_leaves_no_part_of_it_under_its_name(tmp_path, monkeypatch):
    from hf_linear_attn.training.run_state import checkpoints_in, save_checkpoint

    accelerator = _tiny_accelerated()
    for step in (1, 2):
        save_checkpoint(accelerator, tmp_path, step, keep=2)
    whole = sorted(p.name for p in checkpoints_in(tmp_path)[0].iterdir())
    real_rmtree = shutil.rmtree

    def killed_part_way(path, *args, **kwargs):  # deletes one file of a checkpoint, then the process is gone
        files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else []
        if not files or Path(path).name.startswith(".partial-"):
            return real_rmtree(path, *args, **kwargs)
        files[0].unlink()
        raise _Killed

    monkeypatch.setattr(shutil, "rmtree", killed_part_way)
    with pytest.raises(_Killed):
        save_checkpoint(accelerator, tmp_path, 3, keep=2)  # its rotation deletes step 1
    monkeypatch.undo()
    assert [p.name for p in checkpoints_in(tmp_path)][-2:] == ["step_0000002", "step_0000003"]
    for folder in checkpoints_in(tmp_path):  # every folder named step_N holds all its files
        assert sorted(p.name for p in folder.iterdir()) == whole, folder.name
