"""Checkpoints saved by an earlier version of the package (tests/fixtures/old_checkpoints.tar.gz, written before the
package was restructured) still load and give the logits they gave then: with the code saved beside them
(trust_remote_code, in a fresh process that never imports the package) and with the installed package."""

import json
import tarfile

import pytest
import torch
from helpers import REPO_ROOT, run_fresh_python
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import hf_linear_attn  # noqa: F401  (registers the families, so the installed code is used without remote code)

ARCHIVE = REPO_ROOT / "tests" / "fixtures" / "old_checkpoints.tar.gz"
AUTO = {"linformer": AutoModelForMaskedLM, "linear_roberta": AutoModelForMaskedLM,
        "linear_gpt2": AutoModelForCausalLM, "linformer_gpt2": AutoModelForCausalLM}

# One fresh process for all four families (each process pays seconds of imports): every folder's saved code is its
# own dynamic module, so one family's code cannot stand in for another's.
FRESH_PROCESS = """
import json, sys, torch
import transformers
from safetensors.torch import load_file
differences = {}
for family, auto, folder in json.loads(sys.argv[1]):
    model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    expected = load_file(folder + "/expected.safetensors")
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    differences[family] = float((logits - expected["logits"]).abs().max())
assert "hf_linear_attn" not in sys.modules, "the package was imported: the saved code was not what ran"
print(json.dumps(differences))
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


def test_old_checkpoints_give_their_old_logits_with_their_own_code_in_a_fresh_process(old_checkpoints, tmp_path):
    jobs = [(family, auto.__name__, str(old_checkpoints / family)) for family, auto in AUTO.items()]
    differences = json.loads(run_fresh_python("-c", FRESH_PROCESS, json.dumps(jobs), cwd=tmp_path).splitlines()[-1])
    assert set(differences) == set(AUTO)
    assert all(value < 1e-5 for value in differences.values()), differences
