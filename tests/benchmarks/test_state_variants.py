"""The variants' kernel benchmark (scripts/state_variants_benchmark.py): a small real run times every method in both
modes, including the delta rule's, and its report lists them; each method computes what the model's kernel does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.state_variants import FORM_METHODS, METHODS, call, inputs
from hf_linear_attn import causal_delta_rule, delta_rule_qk, naive_delta_rule
from hf_linear_attn.decayed_linear_attention import _split_scores

ROOT = Path(__file__).resolve().parents[2]


def test_the_delta_methods_compute_the_delta_rule_on_the_models_q_and_k():
    (q, k, v, gate, beta, head_gate, feature_gate), log_rates = inputs(130, grad=False)
    q_unit, k_unit = delta_rule_qk(q, k)
    args = (q, k, v, gate, beta, head_gate, feature_gate, log_rates)
    assert torch.allclose(call("delta rule", *args), naive_delta_rule(q_unit, k_unit, v, beta)[0], atol=1e-4)
    gated = call("gated delta rule", *args)
    assert torch.allclose(gated, naive_delta_rule(q_unit, k_unit, v, beta, log_decay=head_gate)[0], atol=1e-4)
    assert not torch.allclose(gated, causal_delta_rule(q_unit, k_unit, v, beta)[0], atol=1e-2)  # the decay acts
    kda = call("KDA (delta rule, per feature)", *args)
    assert feature_gate.shape == (1, 12, 130, 64)
    chunks = [t[:, :, :128].reshape(1, 12, 2, 64, 64) for t in (k_unit, feature_gate)]
    assert _split_scores(chunks[0], chunks[0], chunks[1].cumsum(-2)) is None  # the chunks of 64 take the blocks
    assert torch.allclose(kda, naive_delta_rule(q_unit, k_unit, v, beta, log_decay=feature_gate)[0], atol=1e-4)


def test_a_small_run_times_every_method_in_both_modes(tmp_path):
    subprocess.run([sys.executable, "scripts/state_variants_benchmark.py", "--output_dir", str(tmp_path), "--n", "64",
                    "--repeats", "1", "--forms"], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads((tmp_path / "results.json").read_text())
    methods = [*METHODS, *FORM_METHODS]
    for mode in ("forward", "forward + backward"):
        assert set(result["seconds"][mode]["64"]) == set(methods)
        assert all(seconds > 0 for seconds in result["seconds"][mode]["64"].values())
    report = (tmp_path / "README.md").read_text()
    assert report.count("| n | " + " | ".join(methods) + " |") == 2 and report.count("| 64 |") == 2
    assert result["hardware"]["matmul_peak_gflops"]["float32"] > 0
