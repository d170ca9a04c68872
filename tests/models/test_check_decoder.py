"""scripts/check_decoder.py: passes causal decoders of every state kind, fails one that sees later tokens."""

import check_decoder  # scripts/check_decoder.py
import pytest
import torch
from helpers import causal_lm

import hf_linear_attn.modeling_linear_gpt2 as modeling
from hf_linear_attn.linear_attention import bidirectional_linear_attention


@pytest.mark.parametrize("variant", ["linear-elu", "linear-gated", "linear-window", "linear-hybrid"])
def test_causal_decoders_of_every_state_kind_pass(variant, tmp_path, capsys):
    model = causal_lm(variant)
    model.save_pretrained(tmp_path / "model")
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--length", "48", "--prefix", "10", "--steps", "12"]
    assert check_decoder.main(argv) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.rstrip().endswith("passed")


def test_a_decoder_whose_forward_sees_later_tokens_fails(tmp_path, capsys, monkeypatch):
    causal_lm("linear-elu").save_pretrained(tmp_path / "model")

    def leaking(phi_q, phi_k, v, key_mask=None, eps=1e-6, chunk_size=None, state=None, **kwargs):
        # every position attends to every key, as a kernel with a lost causal mask would; the state is not kept
        batch, heads, m, d = *phi_k.shape[:2], phi_k.shape[-1], v.shape[-1]
        empty = (torch.zeros(batch, heads, m, d), torch.zeros(batch, heads, m))
        return bidirectional_linear_attention(phi_q, phi_k, v, key_mask, eps=eps), empty

    monkeypatch.setattr(modeling, "causal_linear_attention", leaking)
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--length", "48", "--prefix", "10", "--steps", "12"]
    assert check_decoder.main(argv) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FAILED") and "causal: max logit change" in out
