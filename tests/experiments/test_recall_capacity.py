"""The capacity probe (issue 42, item 4): each memory's read against its explicit sum in float64, a construction
that stores as many keys as the state has features exactly, learning, refusals, and the runner end to end."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

from experiments.recall.capacity import (MEMORIES, NORMALISED, StateMemory, evaluate, pair_batch, state_bytes,
                                         train_capacity)
from experiments.recall.capacity_runner import load_preset
from hf_linear_attn.training.errors import UsageError


def explicit_read(model: StateMemory, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The memory's output (B, H, D, d) by sums over the stored pairs, one query at a time, in float64."""
    m = model.double()
    emb = m.key_embed(keys)
    q, k = m._heads(m.q_proj(emb)), m._heads(m.k_proj(emb))
    v = m._heads(m.v_proj(m.value_embed(values)))
    out = torch.zeros_like(q)
    d = q.shape[-1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                qi = q[b, h, i]
                if model.memory == "softmax":
                    w = torch.softmax(torch.stack([qi @ k[b, h, j] / d ** 0.5 for j in range(k.shape[2])]), 0)
                elif model.memory == "identity":
                    w = torch.stack([qi @ k[b, h, j] for j in range(k.shape[2])])
                elif model.memory == "delta":  # the pairs written in order with the rule, then the read q S
                    unit = [torch.nn.functional.normalize(torch.nn.functional.silu(x), dim=-1) for x in (qi, *k[b, h])]
                    beta = torch.sigmoid(m.b_proj(emb[b]))[:, h]
                    state = torch.zeros(d, d, dtype=torch.float64)
                    for j, kj in enumerate(unit[1:]):
                        state = state + beta[j] * torch.outer(kj, v[b, h, j] - state.T @ kj)
                    out[b, h, i] = state.T @ unit[0]
                    continue
                else:
                    if model.memory.startswith("hedgehog"):  # [softmax(x W_h), softmax(-x W_h)], written out
                        weight = m.feature_map.weight[h]

                        def phi(x):
                            e, f = torch.exp(x @ weight), torch.exp(-(x @ weight))
                            return torch.cat([e / e.sum(), f / f.sum()])
                    else:
                        def phi(x):  # elu + 1, written out
                            return torch.where(x > 0, x + 1, torch.exp(x))
                    w = torch.stack([phi(qi) @ phi(k[b, h, j]) for j in range(k.shape[2])])
                    if model.memory in NORMALISED:
                        w = w / (w.sum() + 1e-6)
                out[b, h, i] = sum(w[j] * v[b, h, j] for j in range(k.shape[2]))
    return out


@pytest.mark.parametrize("memory", MEMORIES)
def test_each_memory_reads_as_its_explicit_sum(memory):
    torch.manual_seed(0)
    model = StateMemory(memory, 12, 7, 2, 4)
    keys, values = pair_batch(3, 5, 12, 7, torch.Generator().manual_seed(1))
    got = model.read(keys, values).double()
    want = explicit_read(model, keys, values)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_a_state_stores_as_many_orthogonal_keys_as_it_has_features_exactly():
    """Identity memory, one-hot keys: head h holds keys h*d .. h*d + d - 1 and returns exactly their values, so a
    state of H heads x d recalls all H*d keys. The construction checks the probe's read, read-out and scoring."""
    heads, d = 3, 4
    width = num_keys = heads * d
    num_values = d
    model = StateMemory("identity", num_keys, num_values, heads, d)
    with torch.no_grad():
        model.key_embed.weight.copy_(torch.eye(width))
        for proj in (model.q_proj, model.k_proj, model.v_proj):
            proj.weight.copy_(torch.eye(width))
        model.value_embed.weight.copy_(torch.eye(d).repeat(1, heads))  # value c: e_c in every head
        model.readout.weight.copy_(torch.eye(d).repeat(1, heads))  # the heads' outputs summed
        model.readout.bias.zero_()
    assert evaluate(model, num_keys, num_keys, num_values, 4, 8, seed=0)["accuracy"] == 1.0
    assert state_bytes("identity", num_keys, heads, d) == 4 * heads * d * d
    assert state_bytes("elu", num_keys, heads, d) == 4 * heads * (d * d + d)
    assert state_bytes("softmax", 10, heads, d) == 4 * 2 * 10 * heads * d
    assert state_bytes("hedgehog", num_keys, heads, d) == 4 * heads * (2 * d * d + 2 * d)
    assert state_bytes("hedgehog_narrow", num_keys, heads, d) == state_bytes("elu", num_keys, heads, d)
    assert StateMemory("hedgehog_narrow", 12, 7, heads, d).read(*pair_batch(2, 5, 12, 7, torch.Generator())).shape[-1] \
        == d


def test_training_recalls_few_pairs_and_reports_its_curve():
    result = train_capacity("elu", 16, 16, 4, 1, 16, steps=300, batch_size=32, lr=1e-2, seed=0, eval_batches=4,
                            log_every=50)
    assert result["accuracy"] > 0.9, result
    assert [s for s, _ in result["loss_curve"]] == [50, 100, 150, 200, 250, 300]
    assert result["loss_curve"][-1][1] < result["loss_curve"][0][1] / 5
    assert result["queries"] == 4 * 32 * 4


def test_bad_settings_are_refused_with_the_fix(tmp_path):
    with pytest.raises(UsageError, match="unknown memory"):
        train_capacity("cosine", 16, 16, 4, 1, 8, 1, 2, 1e-3, 0)
    with pytest.raises(UsageError, match="raise num_keys"):
        train_capacity("elu", 16, 16, 17, 1, 8, 1, 2, 1e-3, 0)
    with pytest.raises(UsageError, match="heads and head_size"):
        train_capacity("elu", 16, 16, 4, 0, 8, 1, 2, 1e-3, 0)
    preset = json.loads((REPO_ROOT / "configs/recall/capacity.json").read_text())
    del preset["lr"]
    (tmp_path / "p.json").write_text(json.dumps(preset))
    with pytest.raises(UsageError, match="missing lr"):
        load_preset(tmp_path / "p.json")
    preset = json.loads((REPO_ROOT / "configs/recall/capacity.json").read_text())
    preset["settings"][0]["pairs"] = 500
    (tmp_path / "p.json").write_text(json.dumps(preset))
    with pytest.raises(UsageError, match="between 1 and num_keys"):
        load_preset(tmp_path / "p.json")


@pytest.mark.slow
def test_the_script_runs_a_preset_reuses_its_stages_and_reads_the_decoder_beside_it(tmp_path):
    mqar = tmp_path / "mqar"
    mqar.mkdir()
    (mqar / "results.json").write_text(json.dumps({"rows": [
        {"model": "linear_gpt2_conv", "length": 64, "pairs": 4, "width": 16, "accuracy": 0.25, "state_bytes": 1}]}))
    preset = {"task": "capacity", "seed": 0, "head_size": 8, "memories": ["elu", "softmax"], "steps": 40,
              "batch_size": 8, "lr": 0.01, "eval_batches": 2, "log_every": 20,
              "settings": [{"num_keys": 8, "num_values": 8, "pairs": 4, "heads": [1, 2],
                            "compare": {"results": str(mqar), "length": 64}}]}
    (tmp_path / "tiny.json").write_text(json.dumps(preset))
    out = tmp_path / "out"
    command = [sys.executable, str(REPO_ROOT / "scripts/recall.py"), "--preset", str(tmp_path / "tiny.json"),
               "--output_dir", str(out)]
    first = subprocess.run(command, check=False, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count(": done in") == 4
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["finished"] == results["meta"]["total"] == 4
    by_heads = {r["heads"]: r for r in results["rows"]}
    assert by_heads[2]["decoder"]["accuracy"] == 0.25 and "decoder" not in by_heads[1]  # width 16 = 2 heads of 8
    assert set(by_heads[1]["memories"]) == {"elu", "softmax"}
    assert by_heads[2]["memories"]["elu"]["state_bytes"] == state_bytes("elu", 4, 2, 8)
    table = (out / "results.md").read_text()
    assert "25.0% at n = 64" in table and (out / "capacity.png").is_file()
    again = subprocess.run(command, check=False, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert again.returncode == 0 and again.stdout.count("finished earlier, reused") == 4
    refused = subprocess.run(command + ["--pairs", "4"], check=False, capture_output=True, text=True, cwd=REPO_ROOT,
                             timeout=300)
    assert refused.returncode != 0 and "capacity preset has neither" in refused.stderr
