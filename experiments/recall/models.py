"""The decoders compared on recall, and the bytes of each one's decoding state.

Built by the long-range suite's one decoder builder (same dims for every model), plus linear_gpt2 with each feature
map. The state a model carries while decoding is what recall is judged against (Zoology's and Based's x axis):
measured, not computed, from the cache a forward over n tokens leaves behind.
"""

import math

import torch

from experiments.long_range.models import DECODERS, Dims, build_decoder
from hf_linear_attn.training.errors import UsageError

# linear_gpt2 with other settings than the long-range suite's elu + 1: name -> config overrides (a callable of the
# dims and the length where the setting depends on them). Feature maps; a decaying state (issue 41:
# RetNet's fixed per-head decay, GLA's per-feature gate from the input); a hybrid schedule whose first layer is
# GPT-2's softmax attention (its key/value cache grows with n, the linear layers' states do not); a short causal
# convolution on q, k, v (fla's use_short_conv, width 4: the previous-token shift an induction head needs, which lets
# 2-layer models learn MQAR in Zoology / Based), on elu + 1, on hedgehog's spiky softmax-like features, on the gated
# state and on the sliding window + linear attention (Based's recipe: exact softmax over the last 64 keys, linear
# attention beyond, the convolution before both; the window's factor started at log(head size), elu + 1's feature
# width, so that its keys start with the weight of the keys beyond it: at 0 they start with about 1/m of it, issue
# 41's finding); and the same convolution
# on GPT-2's softmax attention (every layer full_attention, short_conv_on_full_attention), the equal-architecture
# baseline of the convolution models: the dims, the convolution and everything but the attention are theirs.
LINEAR_VARIANTS = {
    "linear_gpt2_relu": {"feature_map": "relu"},
    "linear_gpt2_hedgehog": {"feature_map": "hedgehog"},
    "linear_gpt2_favor": {"feature_map": "favor"},
    "linear_gpt2_decay": {"state_decay": "fixed"},
    "linear_gpt2_gated": {"state_decay": "gated"},
    "linear_gpt2_hybrid": lambda dims, n: {"layer_types": ["full_attention"]
                                                          + ["linear_attention"] * (dims.num_layers - 1)},
    "linear_gpt2_conv": {"use_short_conv": True},
    "linear_gpt2_gated_conv": {"state_decay": "gated", "use_short_conv": True},
    "linear_gpt2_hedgehog_conv": {"feature_map": "hedgehog", "use_short_conv": True},
    # hedgehog with half the features (2 x head/2: elu + 1's width, so elu + 1 + conv's state): spiky features without
    # the extra width, the control that separates the two on passkey
    "linear_gpt2_hedgehog_narrow_conv": lambda dims, n: {
        "feature_map": "hedgehog", "learned_feature_dim": dims.hidden_size // dims.num_heads // 2,
        "use_short_conv": True},
    # the delta rule (DeltaNet): the state replaces a key's value instead of adding to it; with and without the
    # convolution (DeltaNet's own layers have it); and with Gated DeltaNet's per-head gate
    "linear_gpt2_delta": {"state_update": "delta"},
    "linear_gpt2_delta_conv": {"state_update": "delta", "use_short_conv": True},
    "linear_gpt2_gated_delta_conv": {"state_update": "delta", "state_decay": "gated", "use_short_conv": True},
    # and with Kimi Delta Attention's gate, one decay per key feature
    "linear_gpt2_kda_conv": {"state_update": "delta", "state_decay": "gated", "delta_gate": "feature",
                             "use_short_conv": True},
    # both gates started near 1 (dt in [1e-4, 1e-3], per-token decays 0.984-0.9999) instead of Mamba-2's [0.001, 0.1]
    # (0.20-0.999): at Mamba-2's start a head may forget a write within a few tokens, and the lookup may never reach it
    "linear_gpt2_gated_delta_long_conv": {"state_update": "delta", "state_decay": "gated", "use_short_conv": True,
                                          "delta_gate_dt_range": [1e-4, 1e-3]},
    "linear_gpt2_kda_long_conv": {"state_update": "delta", "state_decay": "gated", "delta_gate": "feature",
                                  "use_short_conv": True, "delta_gate_dt_range": [1e-4, 1e-3]},
    # Gated DeltaNet as fla ships its layer (use_gate=True): RMSNorm per head on the rule's output, times silu(x W_g)
    "linear_gpt2_gated_delta_norm_conv": {"state_update": "delta", "state_decay": "gated", "use_short_conv": True,
                                          "delta_output_norm": "rms_gated"},
    "linear_gpt2_window_conv": lambda dims, n: {
        "attention_window": min(64, n), "linear_attention_chunk_size": min(64, n), "use_short_conv": True,
        "attention_window_factor_init": math.log(dims.hidden_size // dims.num_heads)},
    "gpt2_conv": lambda dims, n: {"layer_types": ["full_attention"] * dims.num_layers, "use_short_conv": True,
                                  "short_conv_on_full_attention": True},
    # hybrids with the convolution on every layer (the softmax layer's too, as gpt2_conv): one softmax layer among
    # linear ones, first or last. With the convolution supplying the previous-token shift, either layer could be the
    # lookup, so the two orders ask whether the place of the softmax layer matters (on passkey it does: only the
    # softmax-first order learnt it, docs/recall.md).
    "linear_gpt2_hybrid_conv": lambda dims, n: {
        "layer_types": ["full_attention"] + ["linear_attention"] * (dims.num_layers - 1), "use_short_conv": True,
        "short_conv_on_full_attention": True},
    "linear_gpt2_hybrid_last_conv": lambda dims, n: {
        "layer_types": ["linear_attention"] * (dims.num_layers - 1) + ["full_attention"], "use_short_conv": True,
        "short_conv_on_full_attention": True},
}
MODELS = (*DECODERS, *(name for name in LINEAR_VARIANTS if name not in DECODERS))  # names shared by both
LABELS = {"gpt2_sdpa": "GPT-2 (softmax)", "reformer_lsh": "Reformer (LSH)", "linear_gpt2": "linear_gpt2 (elu+1)",
          "linformer_gpt2": "causal block Linformer", "linear_gpt2_relu": "linear_gpt2 (ReLU)",
          "linear_gpt2_hedgehog": "linear_gpt2 (hedgehog)", "linear_gpt2_favor": "linear_gpt2 (FAVOR+)",
          "linear_gpt2_window": "linear_gpt2, sliding window + linear",
          "linear_gpt2_decay": "linear_gpt2, fixed decay (RetNet)", "linear_gpt2_gated": "linear_gpt2, gated (GLA)",
          "linear_gpt2_hybrid": "linear_gpt2, softmax layer 1 + linear",
          "linear_gpt2_conv": "linear_gpt2 (elu+1), short conv",
          "linear_gpt2_gated_conv": "linear_gpt2, gated (GLA), short conv",
          "linear_gpt2_hedgehog_conv": "linear_gpt2 (hedgehog), short conv",
          "linear_gpt2_hedgehog_narrow_conv": "linear_gpt2 (hedgehog, 2 x head/2 features: elu's width), short conv",
          "linear_gpt2_window_conv": "linear_gpt2, sliding window 64 + linear, short conv (Based's recipe)",
          "linear_gpt2_delta": "linear_gpt2, delta rule (DeltaNet)",
          "linear_gpt2_delta_conv": "linear_gpt2, delta rule (DeltaNet), short conv",
          "linear_gpt2_gated_delta_conv": "linear_gpt2, gated delta rule (Gated DeltaNet), short conv",
          "linear_gpt2_kda_conv": "linear_gpt2, delta rule gated per key feature (KDA), short conv",
          "linear_gpt2_gated_delta_long_conv": "linear_gpt2, Gated DeltaNet, gate started near 1, short conv",
          "linear_gpt2_kda_long_conv": "linear_gpt2, KDA, gate started near 1, short conv",
          "linear_gpt2_gated_delta_norm_conv": "linear_gpt2, Gated DeltaNet, fla's output norm and gate, short conv",
          "gpt2_conv": "GPT-2 (softmax), short conv",
          "linear_gpt2_hybrid_conv": "linear_gpt2, softmax layer 1 + linear, short conv",
          "linear_gpt2_hybrid_last_conv": "linear_gpt2, linear + softmax layer 2, short conv"}


def check_models(names) -> None:
    for name in names:
        if name not in MODELS:
            raise UsageError(f"unknown recall model {name!r}; choose from {', '.join(MODELS)}")


def build_recall_model(name: str, dims: Dims, n: int, vocab_size: int):
    """A randomly initialised causal LM for recall at length n (no dropout: a synthetic task)."""
    check_models([name])
    if "hybrid" in name and dims.num_layers < 2:
        raise UsageError(f"{name} mixes a softmax layer with linear ones, so it needs num_layers >= 2 (the preset has "
                         f"{dims.num_layers}): raise num_layers or choose another model")
    if name in LINEAR_VARIANTS:
        import hf_linear_attn as ours

        base = build_decoder("linear_gpt2", dims, n, vocab_size)
        overrides = LINEAR_VARIANTS[name]
        overrides = overrides(dims, n) if callable(overrides) else overrides
        return ours.LinearGPT2ForCausalLM(ours.LinearGPT2Config(**{**base.config.to_dict(), **overrides}))
    return build_decoder(name, dims, n, vocab_size)


@torch.no_grad()
def decoding_state_bytes(model, n: int, vocab_size: int) -> int | None:
    """Bytes of the cache one sequence leaves after a forward over n tokens (float32 weights, as trained here):
    GPT-2's keys and values, the recurrent state of the linear / block-Linformer decoders, Reformer's cached buckets
    and hidden states."""
    was_training = model.training
    model.eval()
    ids = torch.randint(3, vocab_size, (1, n), device=next(model.parameters()).device)
    out = model(input_ids=ids, use_cache=True)
    model.train(was_training)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        cache = getattr(out, "past_buckets_states", None)
    if cache is None:
        return None
    if hasattr(cache, "state_bytes"):
        return int(cache.state_bytes())
    if hasattr(cache, "layers"):  # transformers' DynamicCache
        return int(sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                       if t is not None))
    if hasattr(cache, "states_cache"):  # Reformer: the hidden states and LSH buckets of every past token
        tensors = [*cache.states_cache, *cache.buckets_cache]
        return int(sum(t.numel() * t.element_size() for t in tensors))
    raise TypeError(f"no rule for the size of a {type(cache).__name__}: add one to decoding_state_bytes")
