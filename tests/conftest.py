"""Fixtures: a small byte-level BPE tokenizer and a slice of real WikiText-2. Shared constants are in helpers.py."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a Hub miss otherwise costs ~25 s of retries
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import hf_linear_attn  # noqa: F401  (registers the Auto classes)
from helpers import CORPUS, NEGATIVE, POSITIVE, REPO_ROOT, TINY, WIKITEXT, write_rows

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


@pytest.fixture
def base_model(tmp_path, tokenizer):
    """A tiny Linformer masked LM with the test tokenizer, saved in a folder: what a fine-tuning test starts from."""
    from transformers import AutoModelForMaskedLM

    from hf_linear_attn import LinformerConfig

    folder = tmp_path / "base"
    config = LinformerConfig(**{**TINY, "linformer_k": 8, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2})
    AutoModelForMaskedLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def review_files(tmp_path):
    """(train.tsv, dev.csv, test.csv) of short reviews: 12 training rows of alternating labels ("review",
    "verdict": good / bad), 3 validation rows, 2 test rows without labels."""
    train = [("review", "verdict")] + [(t, "good") for t in POSITIVE] + [(t, "bad") for t in NEGATIVE]
    train = [train[0]] + [row for pair in zip(train[1:7], train[7:]) for row in pair]  # alternate labels
    dev = [("review", "verdict"), ("great acting", "good"), ("boring film", "bad"), ("loved it", "good")]
    test = [("review",), ("superb and warm",), ("a waste of time",)]  # no labels: predictions only
    return (write_rows(tmp_path / "train.tsv", [r for r in train], "\t"), write_rows(tmp_path / "dev.csv", dev),
            write_rows(tmp_path / "test.csv", test))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 2,000 lines of WikiText-2 train and 300 of validation (real text, small enough for tests)."""
    folder = tmp_path_factory.mktemp("wikitext")
    for name, source, lines in (("train.txt", "wiki.train.tokens", 2000), ("valid.txt", "wiki.valid.tokens", 300)):
        with open(WIKITEXT / source) as handle:
            (folder / name).write_text("".join(next(handle) for _ in range(lines)))
    return folder
