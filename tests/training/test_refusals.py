"""Issue 43 (training side): the raw tracebacks and the runs accepted without a word, each now refused by the script
with `error: ...` naming what is wrong and the fix, before anything is written; checkpoints whose files load in the
container check but not as the libraries read them (a refused pickle, RNG files of other content) are skipped by
name or refused naming --allow_inexact_resume, in pretraining and fine-tuning alike."""

import argparse
import json
import random
import shutil

import pytest
import torch
from helpers import GLUE, TINY, needs_data, pretrain_args, replaced, script_error, tiny_preset

from hf_linear_attn.training.errors import UsageError


def _absent_or_empty(folder) -> bool:
    return not folder.exists() or not any(folder.iterdir())


# ------------------------------------------------------------------------------------------------- pretraining

@needs_data
def test_pretraining_refuses_before_writing_anything(corpus, tmp_path):
    from pretrain import main

    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)
    out = tmp_path / "out"
    args = pretrain_args(corpus, config, out)
    one_line = tmp_path / "one.txt"
    one_line.write_text("A single sentence of training text.\n")
    no_type = tmp_path / "no-type.json"
    no_type.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "model_type"}))
    lone_config = tmp_path / "tokenizer-config-only"
    lone_config.mkdir()
    (lone_config / "tokenizer_config.json").write_text("{}")
    cases = [  # (argument changes, what the message must say): each was a traceback or a silent run
        (dict(lr_scheduler_type="bogus"), "--lr_scheduler_type 'bogus' is not a Transformers schedule"),
        (dict(report_to="bogus"), "--report_to 'bogus' is not an accelerate tracker"),
        (dict(model_config=tmp_path / "missing.json"), "--model_config " + str(tmp_path / "missing.json")
         + ": no such file or folder"),
        (dict(model_config=no_type), 'has no "model_type" key'),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(mixed_precision="fp16"), "--mixed_precision fp16 needs a GPU"))
    for changes, expected in cases:
        argv = replaced(args, **changes) if all(f"--{k}" in args for k in changes) else [
            *args, *(x for k, v in changes.items() for x in (f"--{k}", str(v)))]
        said = script_error(main, argv)
        assert expected in said, (changes, said)
        assert not out.exists(), changes  # nothing written: a fixed rerun needs no --overwrite_output_dir
    # a one-line corpus without a validation file: datasets' "With n_samples=1, test_size=0.05 ..." traceback
    argv = [a for a in args if a not in ("--validation_file", str(corpus / "valid.txt"))]
    said = script_error(main, replaced(argv, train_file=one_line))
    assert "has 1 non-empty row(s): too few to hold out 5%" in said and "--validation_file" in said
    assert not out.exists()
    said = script_error(main, [*args, "--tokenizer_name_or_path", str(lone_config)])
    assert "holds no tokenizer files" in said and "tokenizer.json" in said  # not "install sentencepiece"
    assert not out.exists()


# ------------------------------------------------------------------------------------------------- fine-tuning

@pytest.fixture
def model_folder(tmp_path, tokenizer):
    from transformers import AutoModelForMaskedLM

    from hf_linear_attn import LinformerConfig

    torch.manual_seed(0)
    AutoModelForMaskedLM.from_config(LinformerConfig(**TINY, linformer_k=8)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


@needs_data
def test_finetuning_refuses_before_writing_anything(tmp_path, model_folder):
    from finetune import main

    out = tmp_path / "out"
    train = GLUE / "sst2" / "dev.tsv"
    args = ["--model_name_or_path", str(model_folder), "--output_dir", str(out), "--report_to", "none",
            "--task_name", "sst2", "--train_file", str(train), "--max_steps", "2", "--use_cpu", "True"]
    empty = tmp_path / "empty.tsv"
    empty.write_text("sentence\tlabel\n" + "".join(f" \t{i % 2}\n" for i in range(100)))
    cases = [  # (argv, what the message must say)
        ([*args, "--learning_rate", "-1"], "--learning_rate must be a positive number (got -1.0)"),
        ([*args, "--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be at least 1 (got 0)"),
        (replaced(args, train_file=empty), "every one of the 100 train rows has empty text in ['sentence']"),
    ]
    if not torch.cuda.is_available():  # accelerate ran it in float32 without a word
        cases.append(([*args, "--fp16"], "--fp16 needs a GPU"))
    for argv, expected in cases:
        said = script_error(main, argv)
        assert expected in said, (argv, said)
        assert _absent_or_empty(out), argv
    said = script_error(main, replaced(args, model_name_or_path=tmp_path / "no-such-model"))
    assert "no such file or folder" in said and "Repo id" not in said


def _tamper(path, how):
    """Replace a torch file by one that is whole (a valid zip) but not what the libraries read back."""
    if how == "refused pickle":  # a global weights_only refuses: the UnpicklingError of the issue
        torch.save(argparse.Namespace(x=1), path)
    else:  # valid content of the wrong kind
        torch.save({}, path)


def test_a_tampered_finetuning_checkpoint_is_skipped_by_name_or_refused(tmp_path, capsys):
    from test_reliability import _trainer

    from hf_linear_attn.training.trainer_checkpoints import resolve_resume

    out = tmp_path / "out"
    _trainer(tmp_path, out, max_steps=3).train()  # keeps checkpoint-2 and checkpoint-3
    newest, older = out / "checkpoint-3", out / "checkpoint-2"
    for name, how, piece in (("optimizer.pt", "refused pickle", "optimizer state"),
                             ("scheduler.pt", "refused pickle", "learning-rate scheduler"),
                             ("rng_state.pth", "refused pickle", "RNG state"),
                             ("rng_state.pth", "other content", "RNG state")):
        saved = (newest / name).read_bytes()
        _tamper(newest / name, how)
        capsys.readouterr()
        assert resolve_resume("True", out, 1, allow_inexact=False) == str(older), name
        said = capsys.readouterr().out
        assert f"skipping the incomplete checkpoint {newest}" in said and name in said, said
        with pytest.raises(UsageError, match=rf"{piece}: {name} (unreadable|holds no RNG state)") as refused:
            resolve_resume(str(newest), out, 1, allow_inexact=False)
        assert "--allow_inexact_resume" in str(refused.value)
        if piece == "RNG state":  # only RNG states may be done without, and only when asked
            assert resolve_resume(str(newest), out, 1, allow_inexact=True) == str(newest)
        else:
            with pytest.raises(UsageError):
                resolve_resume(str(newest), out, 1, allow_inexact=True)
        (newest / name).write_bytes(saved)
    assert resolve_resume("True", out, 1, allow_inexact=False) == str(newest)


def test_a_pretraining_checkpoint_with_other_rng_content_is_skipped_and_a_failed_restore_refused(tmp_path,
                                                                                                 capsys):
    """The issue's case: random_states_0.pkl replaced by torch.save({}) passed the zip check, accelerate logged the
    failed load at INFO level and the run resumed inexactly, exit 0."""
    from accelerate import Accelerator

    from hf_linear_attn.training.run_state import checkpoints_in, choose_checkpoint, save_checkpoint, \
        verify_restored_rng

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator.prepare(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    for step in (1, 2):
        save_checkpoint(accelerator, tmp_path, step, keep=3)
    older, newest = checkpoints_in(tmp_path)
    for how in ("other content", "refused pickle"):
        _tamper(newest / "random_states_0.pkl", how)
        capsys.readouterr()
        assert choose_checkpoint([newest, older], tmp_path, 1, False, explicit=False) == older
        assert "skipping the incomplete checkpoint" in capsys.readouterr().out
        rng_named = "(?s)RNG state of process 0: random_states_0.pkl.*--allow_inexact_resume"
        with pytest.raises(UsageError, match=rng_named):
            choose_checkpoint([newest], tmp_path, 1, False, explicit=True)
        assert choose_checkpoint([newest], tmp_path, 1, True, explicit=True) == newest

    # after load_state the process's RNGs must be the file's: a restore that did not happen is refused by name
    accelerator.load_state(str(older))
    verify_restored_rng(accelerator, older, allow_inexact=False)  # restored: silent
    torch.manual_seed(1234)
    random.random()
    with pytest.raises(UsageError, match="were not restored.*--allow_inexact_resume"):
        verify_restored_rng(accelerator, older, allow_inexact=False)
    with pytest.raises(UsageError, match="cannot be read back"):
        verify_restored_rng(accelerator, newest, allow_inexact=False)
    verify_restored_rng(accelerator, newest, allow_inexact=True)
    assert "--allow_inexact_resume" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "checkpoints")


@needs_data
def test_a_validation_file_that_is_the_training_file_is_said(corpus, tmp_path, capsys):
    """Accepted (a smoke test may want it), but no longer without a word: its scores measure memorisation."""
    from hf_linear_attn.training.data.corpus import load_text_corpus
    from hf_linear_attn.training.data.tasks import get_task, load_task_data

    train = corpus / "train.txt"
    load_text_corpus(train_file=str(train), validation_file=str(train))
    assert f"warning: --validation_file {train} is the training file" in capsys.readouterr().out
    load_text_corpus(train_file=str(train), validation_file=str(corpus / "valid.txt"))
    assert "training file" not in capsys.readouterr().out
    sst2 = GLUE / "sst2" / "dev.tsv"
    load_task_data(get_task("sst2"), train_file=str(sst2), validation_file=str(sst2))
    assert "is the training file: its scores measure memorisation" in capsys.readouterr().out
