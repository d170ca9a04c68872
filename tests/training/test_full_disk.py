"""A real full disk under every save path of both scripts (issue 43): the scripts run on a tmpfs sized, from an
uninterrupted run, to fill up half-way through one file of one save, so the libraries' own writers meet ENOSPC where
they meet it for users: safetensors (`SafetensorError ... No space left on device (os error 28)`) for model weights,
torch.save through its C++ stream for Trainer's optimizer state. Each run must stop with `error: the disk is full`
naming the folder, without a traceback and without a temporary folder left behind; the older checkpoints stay whole,
and --resume on a disk with room finishes as the uninterrupted run did, bit for bit.

The tmpfs lives in a private mount namespace (`unshare -rm`): no root on the host and nothing left mounted. Where
unprivileged user namespaces are off, the tests are skipped (the monkeypatched ENOSPC tests of test_reliability.py
and the kill loop still run)."""

import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ENV, REPO_ROOT, needs_data, pretrain_args, tiny_preset, weights

PAGE = 4096


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(not _namespaces_work(), reason="cannot mount a tmpfs in a user namespace here")
pytestmark = [pytest.mark.slow, needs_tmpfs]


def pages(paths) -> int:
    """Bytes the files take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in paths if p.is_file())


def on_full_disk(script: str, argv: list, mount, capacity: int, keep, start_from=None):
    """Run scripts/<script> with `argv` on a tmpfs of `capacity` bytes mounted at `mount` (holding a copy of the
    folder `start_from` first, if given); afterwards its content is copied to `keep` (the tmpfs goes with the
    namespace). Returns the finished process."""
    mount.mkdir(exist_ok=True)
    keep.mkdir()
    seed = f'cp -a "{start_from}/." "{mount}/" || exit 91; ' if start_from is not None else ""
    inner = (f'mount -t tmpfs -o size={-(-capacity // PAGE) * PAGE} tmpfs "{mount}" || exit 90; {seed}'
             f'"{sys.executable}" "{REPO_ROOT / "scripts" / script}" "$@"; status=$?; '
             f'cp -a "{mount}/." "{keep}/"; exit $status')
    return subprocess.run(["unshare", "-rm", "sh", "-c", inner, "sh", *map(str, argv)], capture_output=True,
                          text=True, timeout=600, env=ENV)


def said_disk_full(proc, folder) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "error: the disk is full" in output and str(folder) in output, output[-3000:]
    return output


@needs_data
def test_pretraining_checkpoint_and_final_model_on_a_full_disk(corpus, tmp_path):
    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)

    def argv(output_dir, *extra):
        return pretrain_args(corpus, config, output_dir, "--max_steps", 6, "--save_steps", 2, "--eval_steps", 6,
                             "--save_total_limit", 3, *extra)

    straight = tmp_path / "straight"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "pretrain.py"), *map(str, argv(straight))],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = straight / "checkpoints" / "step_0000002"
    before_saves = [straight / n for n in ("run_args.json", "tokenizer.json", "tokenizer_config.json")]
    model_bytes = (first / "model.safetensors").stat().st_size

    # 1. the second checkpoint's model.safetensors meets the full disk half-way (safetensors' Rust writer)
    mount, kept = tmp_path / "disk", tmp_path / "kept"
    capacity = pages(before_saves) + pages(first.iterdir()) + model_bytes // 2
    proc = on_full_disk("pretrain.py", argv(mount / "run"), mount, capacity, kept)
    said = said_disk_full(proc, mount / "run" / "checkpoints")
    assert "the checkpoint of step 4" in said and "(os error 28)" in said  # safetensors' SafetensorError
    checkpoints = kept / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_0000002"]  # no .partial- folder left
    for file in first.iterdir():  # the older checkpoint is untouched: as the uninterrupted run wrote it
        assert (checkpoints / first.name / file.name).read_bytes() == file.read_bytes(), file.name

    # space freed (the same folder on a larger disk): the same command with --resume ends as the straight run
    resumed = tmp_path / "resumed"
    proc = on_full_disk("pretrain.py", argv(mount / "run", "--resume"), mount, 256 * 2**20, resumed, start_from=kept)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {mount / 'run' / 'checkpoints' / first.name}" in proc.stdout + proc.stderr
    expected, got = weights(straight), weights(resumed / "run")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name

    # 2. the final model.safetensors meets it (no checkpoints in this run): the code files and config fit
    mount, kept = tmp_path / "disk2", tmp_path / "kept2"
    final_files = [p for p in straight.iterdir() if p.suffix == ".py" or p.name == "config.json"]
    capacity = pages(before_saves) + pages(final_files) + model_bytes // 2
    proc = on_full_disk("pretrain.py", argv(mount / "run", "--save_steps", 100), mount, capacity, kept)
    said = said_disk_full(proc, mount / "run")
    assert "the final model" in said and "(os error 28)" in said


@pytest.fixture
def finetuning_inputs(tmp_path, tokenizer):
    """A tiny Linformer encoder and 64 labelled rows (as the kill loop's)."""
    import json

    from transformers import AutoModelForMaskedLM

    from hf_linear_attn import LinformerConfig
    from helpers import CORPUS, TINY

    torch.manual_seed(0)
    AutoModelForMaskedLM.from_config(LinformerConfig(**{**TINY, "linformer_k": 8})).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    rows = [{"text": text, "label": i % 2} for i, text in enumerate(CORPUS[:64])]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return tmp_path


def test_finetuning_checkpoint_and_final_model_on_a_full_disk(finetuning_inputs):
    tmp = finetuning_inputs

    def argv(output_dir, *extra):
        return ["--model_name_or_path", tmp / "base", "--train_file", tmp / "train.jsonl", "--text_columns", "text",
                "--label_column", "label", "--do_train", "--output_dir", output_dir, "--max_steps", 4,
                "--save_steps", 2, "--per_device_train_batch_size", 8, "--max_seq_length", 32,
                "--report_to", "none", "--seed", 3, "--use_cpu", "True", *extra]

    straight = tmp / "straight"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "finetune.py"), *map(str, argv(straight))],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = straight / "checkpoint-2"
    state_files = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")

    # 1. the first checkpoint's optimizer.pt meets the full disk half-way (torch.save through its C++ stream);
    #    the weights, config, code and tokenizer written before it fit
    mount, kept = tmp / "disk", tmp / "kept"
    capacity = (pages(p for p in first.iterdir() if p.name not in state_files)
                + (first / "optimizer.pt").stat().st_size // 2)
    proc = on_full_disk("finetune.py", argv(mount / "run"), mount, capacity, kept)
    said_disk_full(proc, mount / "run")
    assert "the checkpoint checkpoint-2" in proc.stderr + proc.stdout
    assert sorted(p.name for p in (kept / "run").iterdir()) == []  # no .partial-checkpoint-2 left

    # 2. the fine-tuned model's model.safetensors meets it (no checkpoints): code and config fit
    mount, kept = tmp / "disk2", tmp / "kept2"
    final_files = [p for p in straight.iterdir() if p.suffix == ".py" or p.name == "config.json"]
    capacity = pages(final_files) + (straight / "model.safetensors").stat().st_size // 2
    proc = on_full_disk("finetune.py", argv(mount / "run", "--save_strategy", "no"), mount, capacity, kept)
    said = said_disk_full(proc, mount / "run")
    assert "the fine-tuned model" in said and "(os error 28)" in said
