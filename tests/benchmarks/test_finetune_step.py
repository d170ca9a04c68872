"""The fine-tuning step check (scripts/finetune_step_check.py): a small real run on a tiny BERT writes every
configuration's time, with the machine; a length beyond the model's positions is refused before any work."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import BertConfig, BertForSequenceClassification

from hf_linear_attn.linear_attention import native_bf16

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_small_run_times_every_configuration_and_refuses_a_length_beyond_the_positions(tmp_path):
    model = tmp_path / "bert"
    BertForSequenceClassification(BertConfig(vocab_size=2000, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64,
                                             max_position_embeddings=64)).save_pretrained(model)
    out = tmp_path / "out"
    subprocess.run([sys.executable, "scripts/finetune_step_check.py", "--output_dir", str(out), "--model", str(model),
                    "--batch_size", "2", "--length", "32", "--repeats", "2"], cwd=ROOT, check=True, capture_output=True)
    result = json.loads((out / "results.json").read_text())
    assert len(result["seconds"]) == (6 if native_bf16("cpu") else 3) and all(v > 0 for v in result["seconds"].values())
    assert all(len(v) == 2 for v in result["all_seconds"].values())
    assert result["attention_dropout"] == 0.1 and result["attention_implementation"] == "sdpa"
    assert result["hardware"]["matmul_peak_gflops"]["float32"] > 0
    report = (out / "results.md").read_text()
    assert "| train mode, attention dropout 0, float32 |" in report and "instruction sets" in report
    assert ("| train mode, attention dropout 0, bf16 autocast |" in report) == native_bf16("cpu")
    refused = subprocess.run([sys.executable, "scripts/finetune_step_check.py", "--output_dir", str(tmp_path / "x"),
                              "--model", str(model), "--length", "65"], cwd=ROOT, capture_output=True, text=True,
                             check=False)
    assert refused.returncode != 0 and "beyond the model's 64 positions" in refused.stderr
    assert not (tmp_path / "x").exists()
