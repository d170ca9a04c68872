"""One place that builds every model of a task from one spec: width, depth, heads, feed-forward width, length.

Encoders (ListOps, Text, efficiency): this package's Linformer and linear-attention encoders, and Transformers'
stock RoBERTa (SDPA), Longformer, BigBird (block sparse), Nystromformer and Reformer (LSH), each from its config
(random init, no pretrained weights) with its usual settings for the length. Decoders (copy task): GPT-2 (SDPA),
Reformer (causal LSH) and this package's linear_gpt2 (elu + 1, and with its other feature maps) and linformer_gpt2.

All models share the token convention of `tasks` (<s> = 0, <pad> = 1) and classify with their own stock
classification head, from the first token (LRA's "CLS" pooling) or, with `pooling="mean"`, from the mean of the
real tokens' final states.
"""

import math
from dataclasses import dataclass

from hf_linear_attn.training.errors import UsageError

ENCODERS = (
    "roberta_sdpa", "longformer", "bigbird", "nystromformer", "reformer",
    "linformer_k128", "linformer_k128_rows", "linformer_k256", "linformer_k256_rows",
    "linear_elu", "linear_favor", "linear_hedgehog", "linear_elu_window", "linear_hedgehog_window", "linear_elu_hybrid",
    "linear_elu_window_even",
)
DECODERS = ("gpt2_sdpa", "reformer_lsh", "linear_gpt2", "linear_gpt2_window", "linformer_gpt2",
            "linear_gpt2_relu", "linear_gpt2_favor", "linear_gpt2_hedgehog")
# linear_gpt2 with the decoder's other feature maps (elu + 1 is linear_gpt2 itself)
DECODER_FEATURE_MAPS = {"linear_gpt2_relu": "relu", "linear_gpt2_favor": "favor", "linear_gpt2_hedgehog": "hedgehog"}
OURS = {"linformer_k128", "linformer_k128_rows", "linformer_k256", "linformer_k256_rows", "linear_elu",
        "linear_favor", "linear_hedgehog", "linear_elu_window", "linear_hedgehog_window", "linear_elu_hybrid",
        "linear_elu_window_even", "linear_gpt2", "linear_gpt2_window", "linformer_gpt2", *DECODER_FEATURE_MAPS}

LABELS = {
    "roberta_sdpa": "Transformer (RoBERTa, SDPA)", "longformer": "Longformer", "bigbird": "BigBird (block sparse)",
    "nystromformer": "Nystromformer", "reformer": "Reformer (LSH)",
    "linformer_k128": "Linformer k=128", "linformer_k128_rows": "Linformer k=128, rows sum to 1",
    "linformer_k256": "Linformer k=256", "linformer_k256_rows": "Linformer k=256, rows sum to 1",
    "linear_elu": "Linear attention (elu+1)", "linear_favor": "Linear attention (FAVOR+)",
    "linear_hedgehog": "Linear attention (hedgehog)",
    "linear_elu_window": "Linear attention (elu+1) + softmax band 64",
    "linear_hedgehog_window": "Linear attention (hedgehog) + softmax band 64",
    "linear_elu_hybrid": "Hybrid: linear attention (elu+1), last layer softmax",
    "linear_elu_window_even": "Linear attention (elu+1) + softmax band 64, band started even (g = head size)",
    "gpt2_sdpa": "GPT-2 (softmax, SDPA)", "reformer_lsh": "Reformer (causal LSH)",
    "linear_gpt2": "linear_gpt2 (elu+1)", "linear_gpt2_window": "linear_gpt2 (elu+1, softmax window 64)",
    "linformer_gpt2": "linformer_gpt2 (causal block Linformer)",
    "linear_gpt2_relu": "linear_gpt2 (ReLU)", "linear_gpt2_favor": "linear_gpt2 (FAVOR+, 256 features)",
    "linear_gpt2_hedgehog": "linear_gpt2 (hedgehog)",
}


@dataclass(frozen=True)
class Dims:
    """The one width / depth / heads / feed-forward width of every model of a task."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int

    @classmethod
    def from_preset(cls, entry: dict, where: str) -> "Dims":
        keys = {"hidden_size", "num_layers", "num_heads", "intermediate_size"}
        if set(entry) != keys:
            raise UsageError(f"{where}: dims must give exactly {sorted(keys)}, got {sorted(entry)}: fix the preset")
        dims = cls(**entry)
        if dims.hidden_size % dims.num_heads:
            raise UsageError(f"{where}: hidden_size {dims.hidden_size} is not a multiple of num_heads {dims.num_heads}")
        return dims


def check_model_names(names, task_kind: str) -> None:
    """Refuse a model that does not exist, or that does not fit the task (encoder vs decoder)."""
    known = DECODERS if task_kind == "copy" else ENCODERS
    for name in names:
        if name not in known:
            other = "an encoder (ListOps / Text)" if name in ENCODERS else "a decoder (copy task)" if name in DECODERS else None
            hint = f"{name!r} is {other}" if other else f"unknown model {name!r}"
            raise UsageError(f"{hint}; the {task_kind} task takes: {', '.join(known)}")


def _axial_shape(n: int) -> tuple[int, int]:
    """Two factors of n, as close to sqrt(n) as possible (Reformer's axial position table)."""
    a = int(math.isqrt(n))
    while n % a:
        a -= 1
    return a, n // a


def encoder_settings(name: str, n: int) -> dict:
    """The attention settings of a model at length n (recorded with every result)."""
    if name == "longformer":
        return {"attention_window": min(512, max(2, n // 4))}  # Longformer-base: 512 at 4,096
    if name == "bigbird":
        # bigbird-roberta-base: blocks of 64, 3 random blocks; below 1,024 tokens smaller blocks keep it sparse
        block = 64 if n >= 1024 else 16
        return {"block_size": block, "num_random_blocks": 3 if n >= 1024 else 2}
    if name == "nystromformer":
        return {"num_landmarks": 64 if n >= 512 else 16, "segment_means_seq_len": n, "conv_kernel_size": 65 if n >= 512 else 9}
    if name in ("reformer", "reformer_lsh"):
        chunk = 64 if n >= 1024 else 32
        return {"lsh_attn_chunk_length": chunk, "num_buckets": max(2, 2 * n // chunk), "num_hashes": 1,
                "axial_pos_shape": list(_axial_shape(n))}
    if name.startswith("linformer_k"):
        return {"linformer_k": int(name.split("_")[1][1:]), "linformer_normalize_rows": name.endswith("_rows")}
    if name.startswith("linear_") and "_window" in name:
        # issue 41: exact softmax over the band |i - j| < 64 (LoLCATs' window, both sides), the feature map beyond;
        # "_even": the band's factor started at log(head size) (_build_encoder), so its keys weigh as the others
        return {"feature_map": name.split("_")[1], "attention_window": min(64, n)}
    if name.startswith("linear_") and name != "linear_gpt2":
        return {"feature_map": name.split("_")[1]}
    return {}


def check_length(name: str, n: int, position_table: int | None) -> None:
    """Refuse a length the model's position table (or its projection) cannot hold, naming the fix."""
    if position_table is not None and n > position_table:
        raise UsageError(f"length {n} is beyond the position table of {name} ({position_table} positions): raise "
                         "'position_table' in the preset or shorten the task's length")
    if name.startswith("linformer_k") and encoder_settings(name, n)["linformer_k"] > n:
        raise UsageError(f"{name}: k = {encoder_settings(name, n)['linformer_k']} exceeds the length {n}: "
                         "use a smaller k or a longer task")
    if name == "reformer" and n % encoder_settings(name, n)["lsh_attn_chunk_length"]:
        raise UsageError(f"reformer: length {n} must be a multiple of its LSH chunk length: choose such a length")
    if name == "nystromformer" and n % encoder_settings(name, n)["num_landmarks"]:
        raise UsageError(f"nystromformer: length {n} must be a multiple of num_landmarks: choose such a length")


def _one_mask_row(module, args):
    """Nystromformer in transformers 5.23 adds the (b, 1, n, n) padding mask to its (b, h, landmarks, n) scores and
    fails on any padded batch; a padding mask is the same for every query, so hand it one row, (b, 1, 1, n)."""
    if len(args) > 1 and args[1] is not None and args[1].dim() == 4 and args[1].shape[-2] > 1:
        return (args[0], args[1][:, :, :1, :], *args[2:])
    return None


# what a classifier reads, and how the report says it
POOLINGS = {"first": "classified from the first token", "mean": "classified from the mean of the real tokens"}


def pool_by_mean(model) -> list:
    """Make a stock sequence classifier read the mean of its real tokens' final states instead of the first token's.

    Every family's head (RoBERTa's, Longformer's, BigBird's, Nystromformer's, Reformer's, ours) takes the final
    states (batch, n, width) and reads position 0; a pre-hook on the head hands it the masked mean as that one
    position, so each model keeps its own head (dense, tanh, projection). The mask comes from the model's
    `attention_mask` keyword (all tokens when absent). Returns the hook handles.
    """
    import torch

    seen = {}

    def keep_mask(module, args, kwargs):
        seen["mask"] = kwargs.get("attention_mask")

    def mean_of_real_tokens(module, args):
        hidden, mask = args[0], seen.get("mask")
        weights = torch.ones(hidden.shape[:2], device=hidden.device) if mask is None else mask[:, : hidden.shape[1]]
        weights = weights.to(hidden.dtype)[..., None]
        pooled = (hidden * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True).clamp(min=1)
        return (pooled, *args[1:])

    return [model.register_forward_pre_hook(keep_mask, with_kwargs=True),
            model.classifier.register_forward_pre_hook(mean_of_real_tokens)]


def build_encoder(name: str, dims: Dims, n: int, vocab_size: int, num_labels: int, dropout: float = 0.1,
                  position_table: int | None = None, extra: dict | None = None, pooling: str = "first"):
    """A randomly initialised sequence classifier `name` of the given dims for inputs of n tokens, classifying from
    the first token or (pooling="mean") the mean of the real tokens."""
    if pooling not in POOLINGS:
        raise UsageError(f"unknown pooling {pooling!r}: use one of {', '.join(POOLINGS)}")
    model = _build_encoder(name, dims, n, vocab_size, num_labels, dropout, position_table, extra)
    if pooling == "mean":
        pool_by_mean(model)
    return model


def _build_encoder(name: str, dims: Dims, n: int, vocab_size: int, num_labels: int, dropout: float,
                   position_table: int | None, extra: dict | None):
    import transformers as tf

    import hf_linear_attn as ours

    check_model_names([name], "encoder")
    check_length(name, n, position_table)
    table = position_table or n
    s = encoder_settings(name, n)
    extra = dict(extra or {})
    common = dict(vocab_size=vocab_size, hidden_size=dims.hidden_size, num_hidden_layers=dims.num_layers,
                  num_attention_heads=dims.num_heads, intermediate_size=dims.intermediate_size,
                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0, num_labels=num_labels,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2)
    if name == "roberta_sdpa":
        config = tf.RobertaConfig(**common, max_position_embeddings=table + 2, type_vocab_size=1)
        return tf.RobertaForSequenceClassification._from_config(config, attn_implementation="sdpa")
    if name == "longformer":
        config = tf.LongformerConfig(**common, max_position_embeddings=table + 2, type_vocab_size=1,
                                     attention_window=s["attention_window"])
        return tf.LongformerForSequenceClassification(config)
    if name == "bigbird":
        config = tf.BigBirdConfig(**common, max_position_embeddings=table, type_vocab_size=1,
                                  attention_type="block_sparse", sep_token_id=2, **s)
        return tf.BigBirdForSequenceClassification(config)
    if name == "nystromformer":
        config = tf.NystromformerConfig(**common, max_position_embeddings=table + 2, type_vocab_size=1, **s)
        model = tf.NystromformerForSequenceClassification(config)
        for layer in model.nystromformer.encoder.layer:
            layer.attention.self.register_forward_pre_hook(_one_mask_row)
        return model
    if name == "reformer":
        head = dims.hidden_size // dims.num_heads
        config = tf.ReformerConfig(
            vocab_size=vocab_size, hidden_size=dims.hidden_size, num_attention_heads=dims.num_heads,
            attention_head_size=head, feed_forward_size=dims.intermediate_size, attn_layers=["lsh"] * dims.num_layers,
            axial_pos_embds=True, axial_pos_shape=s["axial_pos_shape"],
            axial_pos_embds_dim=[dims.hidden_size // 2, dims.hidden_size - dims.hidden_size // 2],
            max_position_embeddings=n, lsh_attn_chunk_length=s["lsh_attn_chunk_length"], num_buckets=s["num_buckets"],
            num_hashes=s["num_hashes"], hidden_dropout_prob=dropout, lsh_attention_probs_dropout_prob=0.0,
            is_decoder=False, num_labels=num_labels, pad_token_id=1, eos_token_id=2, hidden_act="gelu")
        return seeded_from_torch(tf.ReformerForSequenceClassification(config))
    if name.startswith("linformer_k"):
        config = ours.LinformerConfig(**common, max_position_embeddings=table + 2, type_vocab_size=1, **s, **extra)
        return ours.LinformerForSequenceClassification(config)
    if name == "linear_elu_window_even":  # elu + 1's feature width m is the head size
        s["attention_window_factor_init"] = math.log(dims.hidden_size // dims.num_heads)
    if name == "linear_elu_hybrid":  # issue 41: the last layer RoBERTa's softmax attention, the others linear
        s["layer_types"] = ["linear_attention"] * (dims.num_layers - 1) + ["full_attention"]
    config = ours.LinearRobertaConfig(**common, max_position_embeddings=table + 2, type_vocab_size=1, **s, **extra)
    return ours.LinearRobertaForSequenceClassification(config)


def decoder_settings(name: str, n: int) -> dict:
    """The attention settings of a decoder at length n."""
    if name == "reformer_lsh":
        return encoder_settings("reformer_lsh", n)
    if name == "linformer_gpt2":
        block = max(16, n // 4)
        return {"linformer_block_size": block, "linformer_k": block // 4}
    if name == "linear_gpt2":
        return {"feature_map": "elu", "linear_attention_chunk_size": min(64, n)}
    if name in DECODER_FEATURE_MAPS:  # the config's defaults otherwise (FAVOR+: 256 random features per head)
        return {"feature_map": DECODER_FEATURE_MAPS[name], "linear_attention_chunk_size": min(64, n)}
    if name == "linear_gpt2_window":  # issue 41: exact softmax over the last 64 keys (LoLCATs' window), elu + 1 beyond
        return {"feature_map": "elu", "linear_attention_chunk_size": min(64, n), "attention_window": min(64, n)}
    return {}


# The GPT-2-style decoders' feed-forward activations: GPT-2's own "gelu_new" (tanh-approximated GELU in seven
# elementwise ops, the default) and "gelu_pytorch_tanh", the same function as one fused kernel (transformers'
# GELUTanh; equal up to rounding). In the copy-paper decoder's bf16 step the seven ops and their backward took about a
# quarter of the step on one CPU thread (profiled 2026-11-28, docs/long_range.md).
DECODER_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


# GPT-2's attention here: transformers' SDPA attention, except that on a CPU, bf16 queries, keys and values (under bf16
# autocast) go to the kernel in float32 and the output back to bf16. Why: PyTorch's CPU flash-attention kernel is
# slower in bf16 than in float32 at the copy-paper preset's shapes (8 heads of 32, n = 128): GPT-2's bf16 training
# step took 1.106 s with the bf16 kernel and 0.836 s with this (one thread of the AVX512-BF16 EPYC, 2026-11-28,
# docs/long_range.md). Float32 is the more exact of the two, so the softmax baseline loses nothing; float32 runs and
# other devices call transformers' SDPA function unchanged. Registered under its own name with SDPA's mask function,
# so padding masks and the causal fast path (no mask, is_causal) are SDPA's own.
GPT2_ATTENTION = "sdpa_float32_on_cpu"


def _sdpa_float32_on_cpu(module, query, key, value, attention_mask, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or query.dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                 **kwargs)
    return output.to(query.dtype), weights


def _register_gpt2_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GPT2_ATTENTION, _sdpa_float32_on_cpu)
    AttentionMaskInterface.register(GPT2_ATTENTION, sdpa_mask)


def build_decoder(name: str, dims: Dims, n: int, vocab_size: int, dropout: float = 0.0, activation: str | None = None):
    """A randomly initialised causal LM `name` of the given dims for sequences of n tokens. `activation` (one of
    DECODER_ACTIVATIONS) sets the GPT-2-style decoders' feed-forward activation (GPT-2's "gelu_new" when None);
    Reformer keeps its exact GELU either way."""
    import transformers as tf

    import hf_linear_attn as ours

    check_model_names([name], "copy")
    if activation is not None and activation not in DECODER_ACTIVATIONS:
        raise UsageError(f"unknown activation {activation!r}: use one of {', '.join(DECODER_ACTIVATIONS)}")
    s = decoder_settings(name, n)
    gpt = dict(vocab_size=vocab_size, n_positions=n, n_embd=dims.hidden_size, n_layer=dims.num_layers,
               n_head=dims.num_heads, n_inner=dims.intermediate_size, resid_pdrop=dropout, embd_pdrop=dropout,
               attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1,
               **({"activation_function": activation} if activation else {}))
    if name == "gpt2_sdpa":
        _register_gpt2_attention()
        return tf.GPT2LMHeadModel._from_config(tf.GPT2Config(**gpt), attn_implementation=GPT2_ATTENTION)
    if name in ("linear_gpt2", "linear_gpt2_window", *DECODER_FEATURE_MAPS):
        return ours.LinearGPT2ForCausalLM(ours.LinearGPT2Config(**gpt, **s))
    if name == "linformer_gpt2":
        return ours.LinformerGPT2ForCausalLM(ours.LinformerGPT2Config(**gpt, **s))
    if n % s["lsh_attn_chunk_length"]:
        raise UsageError(f"reformer_lsh: length {n} must be a multiple of {s['lsh_attn_chunk_length']}")
    config = tf.ReformerConfig(
        vocab_size=vocab_size, hidden_size=dims.hidden_size, num_attention_heads=dims.num_heads,
        attention_head_size=dims.hidden_size // dims.num_heads, feed_forward_size=dims.intermediate_size,
        attn_layers=["lsh"] * dims.num_layers, axial_pos_embds=True, axial_pos_shape=s["axial_pos_shape"],
        axial_pos_embds_dim=[dims.hidden_size // 2, dims.hidden_size - dims.hidden_size // 2],
        max_position_embeddings=n, lsh_attn_chunk_length=s["lsh_attn_chunk_length"], num_buckets=s["num_buckets"],
        num_hashes=s["num_hashes"], hidden_dropout_prob=dropout, lsh_attention_probs_dropout_prob=0.0,
        is_decoder=True, pad_token_id=1, eos_token_id=0, hidden_act="gelu", tie_word_embeddings=False)
    return seeded_from_torch(tf.ReformerModelWithLMHead(config))


def seeded_from_torch(model):
    """Make a Reformer's training reproducible from torch's seed. In training, each Reformer layer draws a fresh seed
    for its dropout (replayed when the backward recomputes the layer) from `torch.seed()` on CPU: the operating
    system's entropy, then reseeds torch's global generator with it, so every later draw (dropout masks, LSH's random
    rotations) differs from run to run whatever the seed. Here each layer draws that seed from torch's global
    generator instead: the same fresh seed per forward and the same replay in the backward, now a function of the
    generator's state (which a checkpoint saves)."""
    import torch

    def draw(layer, name):
        def init_seed():
            seed = int(torch.randint(0, 2**62, (1,)).item())
            setattr(layer, name, seed)
            torch.manual_seed(seed)
        return init_seed

    for layer in model.reformer.encoder.layers:
        layer._init_attention_seed = draw(layer, "attention_seed")
        layer._init_feed_forward_seed = draw(layer, "feed_forward_seed")
    return model


def model_dims(model) -> tuple[int, int]:
    """(width, depth) read back from a built model's config, for the same-dims check."""
    c = model.config
    if c.model_type == "reformer":
        return c.hidden_size, len(c.attn_layers)
    return c.hidden_size, c.num_hidden_layers


def bigbird_attention_type(model) -> str:
    """The attention a BigBird model actually ran ('original_full' after its silent fallback for short inputs)."""
    return model.bert.attention_type
