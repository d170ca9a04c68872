"""scripts/inspect_linformer.py: the E / F report and the row-renormalised copy, run as a user runs them."""

import subprocess
import sys

import pytest
import torch
from helpers import FAMILY_VARIANTS, REPO_ROOT, script_error
from inspect_linformer import main as inspect_main  # scripts/ is on sys.path (conftest.py)
from transformers import AutoModelForMaskedLM

from experiments.projection_report import renormalise_rows, report
from hf_linear_attn.linformer_projection import pooling_matrix
from hf_linear_attn.training.errors import UsageError

SCRIPT = str(REPO_ROOT / "scripts" / "inspect_linformer.py")


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=120)


def projections(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith("projection.weight")}


@pytest.mark.parametrize("variant", ["linformer-none", "linformer-headwise", "linformer-key-value", "linformer-layerwise"])
def test_report_of_pooling_init_and_of_centred_values(tmp_path, variant):
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(FAMILY_VARIANTS[variant](linformer_init="pooling"))
    names = list(projections(model))
    assert names, "the variant has projections"
    model.save_pretrained(tmp_path / "pooling")
    for row in report(tmp_path / "pooling"):
        assert row["row_sum_mean"] == pytest.approx(1.0, abs=1e-5)
        assert row["distance_to_pooling"] == pytest.approx(0.0, abs=1e-6)
        assert row["off_window_mean"] == 0.0
    # centre every projection by hand: row i becomes pooling row i minus 1 / n_max, so its row sum is 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("projection.weight"):
                p.sub_(1.0 / p.shape[-1])
    model.save_pretrained(tmp_path / "centred")
    rows = {row["name"]: row for row in report(tmp_path / "centred")}
    assert set(rows) == set(names)
    for name, row in rows.items():
        k, n = rows[name]["shape"][1:]
        assert row["row_sum_mean"] == pytest.approx(0.0, abs=1e-5)
        assert row["off_window_mean"] == pytest.approx(-1.0 / n, rel=1e-5)
        expected = (torch.full((k, n), 1.0 / n).norm() / pooling_matrix(k, n).norm()).item()
        assert row["distance_to_pooling"] == pytest.approx(expected, rel=1e-5)


def test_script_renormalises_value_rows_only_and_keeps_the_source(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(FAMILY_VARIANTS["linformer-headwise"](linformer_init="xavier_uniform"))
    model.save_pretrained(tmp_path / "model")
    before = projections(model)
    source_bytes = (tmp_path / "model" / "model.safetensors").read_bytes()

    proc = run_script(tmp_path / "model", "--renormalise", "value", "--output_dir", tmp_path / "fixed")
    assert proc.returncode == 0, proc.stderr
    assert "row sums set to 1 in 2 tensors" in proc.stdout
    assert "value_projection.weight" in proc.stdout  # the report was printed first
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == source_bytes

    fixed = AutoModelForMaskedLM.from_pretrained(tmp_path / "fixed")
    after = projections(fixed)
    for name, weight in before.items():
        if "value_projection" in name:
            n = weight.shape[-1]  # hand computation: every entry of row i moves by (1 - row sum i) / n
            torch.testing.assert_close(after[name], weight + (1 - weight.sum(-1, keepdim=True)) / n)
            torch.testing.assert_close(after[name].sum(-1), torch.ones(weight.shape[:-1]))
        else:
            torch.testing.assert_close(after[name], weight, rtol=0, atol=0)
    reference = dict(model.named_parameters())
    for name, p in fixed.named_parameters():
        if not name.endswith("projection.weight"):
            torch.testing.assert_close(p, reference[name], rtol=0, atol=0)


def test_bad_inputs_get_clear_errors(tmp_path, capsys):
    from transformers import RobertaConfig, RobertaForMaskedLM

    RobertaForMaskedLM(RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)).save_pretrained(tmp_path / "roberta")
    # the script's own main (a fresh process each would cost seconds of imports; one run as a user runs it is above)
    assert "not a Linformer checkpoint" in script_error(inspect_main, [str(tmp_path / "roberta")])
    assert "is not a folder" in script_error(inspect_main, [str(tmp_path / "missing")])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not safetensors")
    assert "cannot read" in script_error(inspect_main, [str(tmp_path / "broken")])
    assert script_error(inspect_main, [str(tmp_path / "roberta"), "--renormalise", "value"]) == "2"  # argparse's
    assert "needs --output_dir" in capsys.readouterr().err

    model = AutoModelForMaskedLM.from_config(FAMILY_VARIANTS["linformer-layerwise"]())
    model.save_pretrained(tmp_path / "layerwise")
    with pytest.raises(UsageError, match="differ from the model folder"):
        renormalise_rows(tmp_path / "layerwise", tmp_path / "layerwise", ("shared",))
    with pytest.raises(UsageError, match="no value projections"):
        renormalise_rows(tmp_path / "layerwise", tmp_path / "out", ("value",))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        renormalise_rows(tmp_path / "layerwise", tmp_path / "full", ("shared",))
    config = tmp_path / "layerwise" / "config.json"  # a truncated config: the copy would not load, so none is written
    config.write_text(config.read_text()[:40])
    with pytest.raises(UsageError, match="not readable JSON.*truncated"):
        renormalise_rows(tmp_path / "layerwise", tmp_path / "truncated", ("shared",))
    assert not (tmp_path / "truncated").exists()
