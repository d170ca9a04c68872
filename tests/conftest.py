"""Fixtures: a small byte-level BPE tokenizer and a slice of real WikiText-2. Shared constants are in helpers.py."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a Hub miss otherwise costs ~25 s of retries
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import hf_linear_attn  # noqa: F401  (registers the Auto classes)
from helpers import CORPUS, REPO_ROOT, TINY, WIKITEXT

sys.path.insert(0, str(REPO_ROOT / "scripts"))  # the scripts' helpers are tested as users run them

# Devices the math tests run on: the CPU always, CUDA where there is one (scripts/gpu_check.sh runs `-k cuda`).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def on_each_device(request):
    """Run the test once per device with that device as torch's default, so every tensor and module the test
    makes (and the library makes for it) lives there; the float64 references too. Test ids end in [cpu] / [cuda]."""
    torch.set_default_device(request.param)
    try:
        yield torch.device(request.param)
    finally:
        torch.set_default_device("cpu")


@pytest.fixture(scope="session")
def tokenizer():
    """A RoBERTa-style byte-level BPE tokenizer (<s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4), trained offline
    by the training pipeline's own tokenizer trainer."""
    from hf_linear_attn.training.data.corpus import train_bpe_tokenizer

    tok = train_bpe_tokenizer(CORPUS, vocab_size=TINY["vocab_size"], style="roberta", model_max_length=64)
    assert tok.pad_token_id == 1 and tok.mask_token_id == 4
    return tok




@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 2,000 lines of WikiText-2 train and 300 of validation (real text, small enough for tests)."""
    folder = tmp_path_factory.mktemp("wikitext")
    for name, source, lines in (("train.txt", "wiki.train.tokens", 2000), ("valid.txt", "wiki.valid.tokens", 300)):
        with open(WIKITEXT / source) as handle:
            (folder / name).write_text("".join(next(handle) for _ in range(lines)))
    return folder
