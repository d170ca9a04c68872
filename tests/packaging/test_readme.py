"""The README's usage snippet runs as written, in a fresh process, and keeps its two promises: the decoder's cache
has one size whatever the context, and the saved encoder opens with `trust_remote_code=True` where this package
cannot be imported, giving the same logits."""

import json
import re

import pytest
from helpers import REPO_ROOT, run_fresh_python

# The snippet leaves the prompt to the reader; the test supplies one and adds its checks after the snippet's lines.
PROMPT = """import torch
input_ids = torch.tensor([[11, 12, 13]])
mask = torch.ones_like(input_ids)
"""
CHECKS = """
import json
short_state = out.past_key_values.state_bytes()
long_ids = torch.arange(20, 420)[None]
longer = model.generate(long_ids, attention_mask=torch.ones_like(long_ids), max_new_tokens=2,
                        return_dict_in_generate=True)
encoder = AutoModelForSequenceClassification.from_pretrained("my-model").eval()
logits = encoder(torch.tensor([[0, 5, 6, 7, 2]])).logits
print(json.dumps({"short_state": short_state, "long_state": longer.past_key_values.state_bytes(),
                  "new_tokens": out.sequences.shape[1] - input_ids.shape[1], "logits": logits.tolist()}))
"""
# Where the package cannot be imported: the checkpoint's own code must do everything.
WITHOUT_PACKAGE = """import json, sys
sys.modules["hf_linear_attn"] = None  # any import of the package fails
import torch
from transformers import AutoModelForSequenceClassification
model = AutoModelForSequenceClassification.from_pretrained("my-model", trust_remote_code=True).eval()
print(json.dumps({"logits": model(torch.tensor([[0, 5, 6, 7, 2]])).logits.tolist(),
                  "module": type(model).__module__}))
"""


def readme_snippet() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text[text.index("## Use"):], re.DOTALL).group(1)


@pytest.mark.slow
def test_the_readme_usage_snippet_runs_and_its_checkpoint_opens_without_the_package(tmp_path):
    snippet = readme_snippet()
    assert "from_config" in snippet and "generate" in snippet and "save_pretrained" in snippet
    (tmp_path / "snippet.py").write_text(PROMPT + snippet + CHECKS)
    ran = json.loads(run_fresh_python("snippet.py", cwd=tmp_path, timeout=600).splitlines()[-1])
    assert ran["short_state"] == ran["long_state"] > 0  # 3 tokens of context or 400: one size
    assert 1 <= ran["new_tokens"] <= 50
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "my-model").iterdir()}
    (tmp_path / "without.py").write_text(WITHOUT_PACKAGE)
    remote = json.loads(run_fresh_python("without.py", cwd=tmp_path).splitlines()[-1])
    assert not remote["module"].startswith("hf_linear_attn")  # the checkpoint's copy of the code
    assert remote["logits"] == ran["logits"]
