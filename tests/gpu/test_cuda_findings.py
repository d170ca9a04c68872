"""What the first GPU run found, pinned where the CPU can check it."""

import pytest
import torch
from helpers import causal_lm
from transformers import CompileConfig, GenerationConfig


@pytest.mark.parametrize("variant", ["linear-elu", "linear-window", "linear-hybrid", "linformer-headwise"])
def test_generate_compiles_the_recurrent_decoders_only_when_asked_and_never_with_cuda_graphs(variant, monkeypatch):
    """On CUDA, transformers compiles the decoding step by itself for a compileable cache, with CUDA graphs, whose next
    replay overwrites the state these caches keep between steps (an H200 run failed with "accessing tensor output of
    CUDAGraphs that has been overwritten"). Here: no compile_config, no compilation, even where transformers' own
    rule would say yes (as it does on CUDA); on CUDA a CUDA-graph mode is refused with the fix; generate() runs."""
    from transformers import GenerationMixin

    from hf_linear_attn.modeling_gpt2_style import check_compile_config

    model = causal_lm(variant)
    cache = model.transformer.new_cache()
    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", lambda self, kwargs, config: True)
    assert not model._valid_auto_compile_criteria({"past_key_values": cache}, GenerationConfig())
    assert model._valid_auto_compile_criteria({"past_key_values": cache},
                                              GenerationConfig(compile_config=CompileConfig(mode="default")))
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match="mode='default'"):
            check_compile_config(CompileConfig(mode=mode))
    with pytest.raises(ValueError, match="CUDA graphs"):
        check_compile_config(CompileConfig(mode="default", options={"triton.cudagraphs": True}))
    check_compile_config(CompileConfig(mode="default"))
    monkeypatch.undo()
    ids = torch.tensor([[0, 5, 7, 9]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=1)
    assert out.shape == (1, 9)


def test_the_bf16_normaliser_is_a_prefix_sum_exact_to_float32_at_any_chunking():
    """The two-level prefix sum that replaced one cumsum over n (a sequential walk on GPUs): against float64, at
    lengths that are and are not multiples of the chunk, with and without a starting z, and its final z."""
    from hf_linear_attn.linear_attention import _float32_normaliser

    g = torch.Generator().manual_seed(0)
    for n, c in ((1, 64), (63, 64), (64, 64), (200, 16), (1000, 64)):
        phi_q, phi_k = (torch.rand(2, 3, n, 8, generator=g).bfloat16() for _ in range(2))
        z0 = torch.rand(2, 3, 8, generator=g)
        got, z_n = _float32_normaliser(phi_q, phi_k, z0, c)
        z_t = z0.double().unsqueeze(2) + torch.cumsum(phi_k.double(), dim=2)
        want = (phi_q.double() * z_t).sum(-1, keepdim=True)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
        torch.testing.assert_close(z_n.double(), z_t[:, :, -1], rtol=1e-6, atol=0)
