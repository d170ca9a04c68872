"""The GPU check prepared on the CPU (issue 40): the benchmark's every code path on its smoke preset, its report, its
argument handling, and the shell script's refusals, so that a lent GPU's minutes go to measuring."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_benchmark.py"


def run(*args, env=None, script=SCRIPT):
    command = ["bash", str(script), *args] if str(script).endswith(".sh") else [sys.executable, str(script), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=900)


@pytest.mark.slow
def test_smoke_preset_runs_every_section_and_renders_every_table(tmp_path):
    result = run("--preset", "smoke", "--device", "cpu", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    sections = [r["section"] for r in data["records"]]
    assert sections[0] == "machine" and not [r for r in data["records"] if r.get("skipped")], data["records"]
    kernel = [r for r in data["records"] if r["section"] == "kernel"]
    assert {r["mode"] for r in kernel} == {"fwd", "fwd+bwd"}
    for row in kernel:
        assert not row["failed"] and all(s > 0 for s in row["seconds"].values())
    # the default path and every torch form compute the same function: one error against float64, bf16-sized
    errors = next(r["errors"] for r in kernel if r["errors"])
    assert errors and all(1e-4 < e < 2e-2 for e in errors.values()), errors
    encoder = [r for r in data["records"] if r["section"] == "encoder"]
    assert encoder and all(len(r["seconds"]) == 3 and not r["failed"] for r in encoder)
    images = [r for r in data["records"] if r["section"] == "images"]
    assert {r["model"] for r in images} == {"gpt2", "linear_gpt2"}
    assert all(r.get("images_per_second", 0) > 0 for r in images), images
    # where the default kernel call's and each image model's decoding step's time goes, by op, summing to under 100%
    for profile in [next(r["profile"] for r in kernel if r.get("profile")), *(r["step_profile"] for r in images)]:
        assert profile["ops"] and profile["total_ms"] > 0 and 0 < sum(o["share"] for o in profile["ops"]) <= 1 + 1e-9
    decode = [r for r in data["records"] if r["section"] == "decode"]
    assert decode and all(r.get("tokens_per_second", 0) > 0 and r["cache_bytes"] > 0 for r in decode), decode
    # the recurrent state is the same size at every batch's context; GPT-2's cache grows with the batch
    linear = {r["batch"]: r["cache_bytes"] for r in decode if r["model"] == "linear_gpt2"}
    assert linear[2] == 2 * linear[1]
    train = next(r for r in data["records"] if r["section"] == "train")
    assert set(train["seconds"]) == {"gpt2", "linear_gpt2", "linformer_gpt2"} and not train["failed"]
    report = (tmp_path / "results.md").read_text()
    for heading in ("Causal attention kernel", "Encoder forward", "Image generation", "Training step", "Decoding",
                    "Where the default's time goes", "One decoding step of linear_gpt2"):
        assert heading in report
    # the report re-renders from its records alone, byte for byte
    before = report
    (tmp_path / "results.md").unlink()
    assert run("--output_dir", str(tmp_path), "--report_only").returncode == 0
    assert (tmp_path / "results.md").read_text() == before


def test_a_deadline_keeps_what_was_measured_and_names_what_was_not_run(tmp_path):
    result = run("--preset", "smoke", "--device", "cpu", "--output_dir", str(tmp_path), "--deadline_s", "0",
                 "--sections", "machine,kernel")
    assert result.returncode == 0, result.stderr[-2000:]
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert [r.get("skipped", "").split(" ")[0:2] for r in records] == [["the", "run's"], ["the", "run's"]]
    assert "Section kernel not run: the run's 0 s deadline had passed" in (tmp_path / "results.md").read_text()


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    result = run("--output_dir", str(tmp_path), "--sections", "kernel,warp_speed", "--device", "cpu")
    assert result.returncode == 2 and "unknown section(s) warp_speed; choose from machine" in result.stderr
    import torch

    if not torch.cuda.is_available():
        result = run("--output_dir", str(tmp_path), "--device", "cuda")
        assert result.returncode == 2 and "torch sees no CUDA device here" in result.stderr


def test_the_shell_script_refuses_a_machine_without_cuda_and_names_the_cpu_commands(tmp_path):
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run")
    # the script's python3 must be one with torch: the test's own interpreter first on PATH
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    (tmp_path / "python3").symlink_to(sys.executable)
    result = run(str(tmp_path / "out"), env=env, script=REPO_ROOT / "scripts" / "gpu_check.sh")
    assert result.returncode == 2
    assert "torch sees no CUDA device here" in result.stderr and "scripts/test.sh" in result.stderr
    help_text = run("--help", script=REPO_ROOT / "scripts" / "gpu_check.sh").stdout
    assert "--download" in help_text and "/tmp/site" in help_text


def test_the_fla_twice_candidate_computes_causal_linear_attention():
    """The dispatch candidate the lease times beside the default (numerator and normaliser both from fla's kernel, the
    normaliser as the numerator of a block of ones), with fla stood in for by this package's parallel form: against
    the quadratic form in float64, to bf16 rounding, and gradients reach every input."""
    from helpers import fla_stand_in

    from benchmarks.gpu import fla_normalised_by_fla

    calls = []
    candidate = fla_normalised_by_fla(fla_stand_in(calls))
    g = torch.Generator().manual_seed(3)
    phi_q, phi_k = (torch.rand(2, 3, 40, 8, generator=g) + 0.1 for _ in range(2))
    v = torch.randn(2, 3, 40, 8, generator=g)
    leaves = [t.bfloat16().transpose(1, 2).contiguous().requires_grad_(True) for t in (phi_q, phi_k, v)]
    out = candidate(None, None, None, fla_inputs=leaves)
    assert out.shape == (2, 3, 40, 8) and len(calls) == 2 and calls[1]["values"].eq(1).all()
    q64, k64, v64 = (t.detach().transpose(1, 2).double() for t in leaves)
    scores = (q64 @ k64.transpose(-1, -2)).tril()
    want = (scores @ v64) / scores.sum(-1, keepdim=True)
    assert ((out.double() - want).norm() / want.norm()).item() < 2 * 2.0**-8  # two bf16 roundings
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)


@pytest.mark.slow
def test_gpu_copy_trains_stages_to_a_deadline_and_brings_back_their_scores(tmp_path):
    """scripts/gpu_copy.sh's own paths on the CPU (COPY_DEVICE=cpu): two copy stages at once, one short enough to
    finish, one cut off at the deadline; what comes back holds the finished stage's record and the cut stage's
    scored checkpoint, never a checkpoint itself (too large to come back from a lease). The deadline leaves the short
    stage room for two processes' imports on a loaded 2-core AVX2 machine (20 s was too short there)."""
    import os
    import tarfile

    preset = json.loads((REPO_ROOT / "configs" / "long_range" / "copy-paper.json").read_text())
    copy = preset["tasks"]["copy"]
    copy.update(dims={"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32},
                 precision="float32", checkpoint_every=5,
                 settings=[{"length": 32, "steps": 10, "batch_size": 4},
                           {"length": 64, "steps": 10 ** 6, "batch_size": 4}])
    (tmp_path / "tiny.json").write_text(json.dumps(preset))
    out = tmp_path / "out"
    env = {**os.environ, "COPY_DEVICE": "cpu", "COPY_PRESET": str(tmp_path / "tiny.json"), "PYTHON": sys.executable,
           "COPY_STAGES": "gpt2_sdpa:32 linear_gpt2:64", "COPY_DEADLINE_S": "35", "COPY_SCORE_EVERY_S": "1000",
           "COPY_WORK_DIR": str(tmp_path / "work")}
    result = run(str(out), env=env, script=REPO_ROOT / "scripts" / "gpu_copy.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 stage(s) finished" in result.stdout
    with tarfile.open(out / "copy.tgz") as packed:
        names = packed.getnames()
        assert "./gpt2_sdpa-32/stages/copy-n32__gpt2_sdpa.json" in names
        assert not any(name.endswith(".pt") for name in names)
        scores = json.load(packed.extractfile("./linear_gpt2-64/checkpoints/copy-n64__linear_gpt2.eval.json"))
    assert scores["step"] >= 5 and scores["history"][-1][0] == scores["step"]
    assert (out / "linear_gpt2-64.log").is_file() and "checkpoint saved" in (out / "linear_gpt2-64.log").read_text()
