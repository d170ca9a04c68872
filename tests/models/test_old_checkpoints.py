"""Checkpoints saved by an earlier version of the package (tests/fixtures/old_checkpoints.tar.gz, written before the
package was restructured) still load and give the logits they gave then: with the code saved beside them
(trust_remote_code, in a fresh process that never imports the package) and with the installed package."""

import subprocess
import sys
import tarfile

import pytest
import torch
from helpers import ENV, REPO_ROOT
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import hf_linear_attn  # noqa: F401  (registers the families, so the installed code is used without remote code)

ARCHIVE = REPO_ROOT / "tests" / "fixtures" / "old_checkpoints.tar.gz"
AUTO = {"linformer": AutoModelForMaskedLM, "linear_roberta": AutoModelForMaskedLM,
        "linear_gpt2": AutoModelForCausalLM, "linformer_gpt2": AutoModelForCausalLM}

FRESH_PROCESS = """
import sys, torch
from safetensors.torch import load_file
from transformers import {auto}
folder = sys.argv[1]
model = {auto}.from_pretrained(folder, trust_remote_code=True).eval()
assert "hf_linear_attn" not in sys.modules, "the package was imported: the saved code was not what ran"
expected = load_file(folder + "/expected.safetensors")
with torch.no_grad():
    logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
print(float((logits - expected["logits"]).abs().max()))
"""


@pytest.fixture(scope="module")
def old_checkpoints(tmp_path_factory):
    """The archive unpacked: one folder per family."""
    folder = tmp_path_factory.mktemp("old_checkpoints")
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(folder, filter="data")
    return folder


@pytest.mark.parametrize("family", list(AUTO))
def test_an_old_checkpoint_gives_its_old_logits_with_the_installed_package(family, old_checkpoints):
    folder = old_checkpoints / family
    expected = load_file(str(folder / "expected.safetensors"))
    model = AUTO[family].from_pretrained(folder).eval()
    assert type(model).__module__.startswith("hf_linear_attn."), type(model).__module__
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(AUTO))
def test_an_old_checkpoint_gives_its_old_logits_with_its_own_code_in_a_fresh_process(family, old_checkpoints, tmp_path):
    folder = old_checkpoints / family
    code = FRESH_PROCESS.format(auto=AUTO[family].__name__)
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300,
                          env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split()[-1]) < 1e-5
