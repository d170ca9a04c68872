"""The quick demo (`bash scripts/demo.sh`) on real WikiText-2, at its smallest size, in a real subprocess."""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, SHARED_DATA, data_missing

WIKITEXT = SHARED_DATA / "wikitext-2"


def run_demo(script: str, output_dir, *flags: str) -> tuple[dict, str]:
    """A demo script at its smallest size on real WikiText-2 in a fresh process: its results.json's results (one per
    model, three) and its printed table."""
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / script), "--dataset", str(WIKITEXT), "--output_dir",
           str(output_dir), "--steps", "3", "--batch_size", "4", "--seq_len", "64", "--eval_batches", "2",
           "--vocab_size", "2000", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((output_dir / "results.json").read_text())["results"]
    assert len(results) == 3
    return results, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(data_missing(WIKITEXT / "wiki.train.tokens"), reason=f"WikiText-2 not found at {WIKITEXT}")
def test_demo_trains_saves_and_reloads_every_encoder(tmp_path):
    results, stdout = run_demo("demo_encoders.py", tmp_path, "--linformer_k", "16")
    for name, result in results.items():
        assert result["reload_identical"] is True, name
        assert 0 < result["mlm_loss"] < 10 and 0 <= result["mlm_accuracy"] <= 1
    assert "| linformer k=16 |" in stdout


def test_demo_names_a_missing_data_folder(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "demo_encoders.py"), "--dataset",
                           str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "WikiText-2 files not found" in proc.stderr and "--dataset hub" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(data_missing(WIKITEXT / "wiki.train.tokens"), reason=f"WikiText-2 not found at {WIKITEXT}")
def test_decoder_demo_trains_generates_and_reloads_every_decoder(tmp_path):
    results, _ = run_demo("demo_decoders.py", tmp_path, "--new_tokens", "40", "--block_size", "16")
    for name, result in results.items():
        assert result["reload_generates_same"] is True, name
        assert 0 < result["val_loss"] < 10
    gpt2 = results["gpt2 (softmax)"]
    linear = results["linear attention (elu+1)"]
    linformer = results["causal linformer k=8 b=16"]
    assert gpt2["cache_bytes_after_generation"] > gpt2["cache_bytes_after_prompt"]  # a key/value row per token
    assert linear["cache_bytes_after_generation"] == linear["cache_bytes_after_prompt"]  # a fixed-size state
    # 63-token prompt + 39 steps = 102 tokens: 3 -> 6 completed blocks of 16, 8 rows each, + the current block
    kv_row = 2 * 2 * 4 * 32 * 4  # keys and values, 2 layers, 4 heads x 32 dims, float32
    assert linformer["cache_bytes_after_prompt"] == (3 * 8 + 16) * kv_row + 2 * (3 + 8)  # + masks and fill counters
    assert linformer["cache_bytes_after_generation"] == (6 * 8 + 16) * kv_row + 2 * (6 + 8)
