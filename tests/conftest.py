"""Shared fixtures: tiny configs of the encoder and decoder families and a small byte-level BPE tokenizer."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a Hub miss otherwise costs ~25 s of retries
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import hf_linear_attn  # noqa: F401  (registers the Auto classes)
from hf_linear_attn import LinearGPT2Config, LinearRobertaConfig, LinformerConfig, LinformerGPT2Config

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # the scripts' helpers are tested as users run them

TINY = dict(
    vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=66, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)

# (name, config factory): every sharing mode and feature map of the two families
FAMILY_VARIANTS = {
    "linformer-none": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_sharing": "none", **kw}),
    "linformer-headwise": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": [8, 12], **kw}),
    "linformer-key-value": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_sharing": "key-value", **kw}),
    "linformer-layerwise": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_sharing": "layerwise", **kw}),
    "linformer-rows": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_normalize_rows": True, **kw}),
    "linear-elu": lambda **kw: LinearRobertaConfig(**{**TINY, **kw}),
    "linear-relu": lambda **kw: LinearRobertaConfig(**{**TINY, "feature_map": "relu", **kw}),
    "linear-favor": lambda **kw: LinearRobertaConfig(**{**TINY, "feature_map": "favor", "num_random_features": 32, **kw}),
    "linear-hedgehog": lambda **kw: LinearRobertaConfig(**{**TINY, "feature_map": "hedgehog", **kw}),
}

# GPT-2-shaped decoders; token ids follow the test tokenizer (<s>=0, <pad>=1, </s>=2). A wider init than GPT-2's
# makes random models produce varied tokens, so generation comparisons are not trivially equal.
TINY_DECODER = dict(
    vocab_size=300, n_positions=128, n_embd=32, n_layer=2, n_head=4, n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0,
    attn_pdrop=0.0, bos_token_id=0, eos_token_id=2, pad_token_id=1, initializer_range=0.3,
)

# (name, config factory): every feature map and every sharing mode of the two decoder families. The causal
# Linformer uses blocks of 8 and k = 4, so short sequences already span several blocks.
DECODER_VARIANTS = {
    "linear-elu": lambda **kw: LinearGPT2Config(**{**TINY_DECODER, "linear_attention_chunk_size": 8, **kw}),
    "linear-relu": lambda **kw: LinearGPT2Config(**{**TINY_DECODER, "feature_map": "relu", **kw}),
    "linear-favor": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "feature_map": "favor", "num_random_features": 32, "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-hedgehog": lambda **kw: LinearGPT2Config(**{**TINY_DECODER, "feature_map": "hedgehog", **kw}),
    "linformer-none": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 4, "linformer_block_size": 8, "linformer_sharing": "none", **kw}
    ),
    "linformer-headwise": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 4, "linformer_block_size": 8, **kw}
    ),
    "linformer-key-value": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 3, "linformer_block_size": 5, "linformer_sharing": "key-value", **kw}
    ),
    "linformer-layerwise": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 4, "linformer_block_size": 8, "linformer_sharing": "layerwise", **kw}
    ),
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Linear attention replaces the softmax by a feature map, so its cost grows linearly with the length.",
    "Linformer projects keys and values along the sequence to a fixed number of rows.",
    "This movie was wonderful, the acting was great and the story moved me.",
    "A terrible film: boring, too long and badly written.",
    "Transformers are RNNs: a causal linear attention model generates with a state of constant size.",
] * 20


@pytest.fixture(scope="session")
def tokenizer():
    """A RoBERTa-style byte-level BPE tokenizer (<s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4), trained offline
    by the training pipeline's own tokenizer trainer."""
    from hf_linear_attn.pipeline.data import train_bpe_tokenizer

    tok = train_bpe_tokenizer(CORPUS, vocab_size=TINY["vocab_size"], style="roberta", model_max_length=64)
    assert tok.pad_token_id == 1 and tok.mask_token_id == 4
    return tok


def random_ids(batch, n, vocab=TINY["vocab_size"], seed=0):
    """Random non-special token ids (batch, n)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, n), generator=g)
