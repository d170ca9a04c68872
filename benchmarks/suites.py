"""Benchmarks against softmax attention, behind scripts/benchmark.py: the model suites (encoder inference, decoder
training, generation, kernel efficiency) measured here, the decoding suites of decoding.py (image-length generation
throughput, assisted decoding, compiled steps) and the crossover suite of kernel_crossover.py (where each causal form
overtakes softmax; the form table's measurements), and the runner that plans, measures and reports them all.

Each configuration runs in a fresh process (`python -m benchmarks.suites --one SPEC`, through
`measuring.run_isolated`, forked from a server that has imported torch and transformers once), so one
configuration's memory never inflates another's and an out-of-memory kill costs only that configuration. How time
and memory are measured: measuring.py.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from . import decoding, kernel_crossover
from .measuring import (
    MEMORY_FLOOR, cache_bytes, decoder_model, describe_hardware, describe_machine, failure, hardware_text,
    matmul_peak, mb, measured, median_seconds, run_isolated, write_json,
)

# "smoke" is for the test suite: the smallest shapes and one of each kind of row (every configuration costs a fresh
# process, about 5 s of importing transformers on 2 cores, so it runs few rather than the full grid).
# The linear decoder's variants (issue 41) timed in the generation suite beside GPT-2 and plain linear attention.
GENERATION_VARIANTS = {"window 64": {"attention_window": 64}, "fixed decay": {"state_decay": "fixed"},
                       "gated": {"state_decay": "gated"}}

PRESETS = {
    "smoke": dict(encoder_n=[128], encoder_k=[16], decoder_n=[64], generation_context=[32, 96],
                  kernel_n=[256], encoder_dims=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=128),
                  decoder_dims=dict(n_embd=64, n_layer=2, n_head=2, n_inner=128), vocab_size=512,
                  ffn_chunk=32, new_tokens=4, repeats=2, timeout=300, kernel_dtypes=("float32",),
                  kernel_form_dtypes=("float32",), kernel_forms=(("scan", 64), ("parallel", 64)),
                  kernel_train_modes=(True,), kernel_peers=("fla chunk (torch)", "fast-transformers (C++)")),
    "quick": dict(encoder_n=[512, 1024, 2048], encoder_k=[128, 256], decoder_n=[1024, 2048],
                  generation_context=[256, 1024, 4096], generation_variants=GENERATION_VARIANTS,
                  kernel_n=[2048, 8192],
                  encoder_dims=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                    intermediate_size=3072),
                  decoder_dims=dict(n_embd=768, n_layer=2, n_head=12, n_inner=3072), vocab_size=50265,
                  ffn_chunk=512, new_tokens=16, repeats=3, budget=30, timeout=900),
    "full": dict(encoder_n=[512, 1024, 2048, 4096, 8192, 16384], encoder_k=[128, 256, 512],
                 decoder_n=[1024, 2048, 4096, 8192, 16384], generation_context=[256, 1024, 4096, 16384],
                 generation_variants=GENERATION_VARIANTS,
                 kernel_n=[1024, 4096, 8192, 16384],
                 encoder_dims=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                   intermediate_size=3072),
                 decoder_dims=dict(n_embd=768, n_layer=2, n_head=12, n_inner=3072), vocab_size=50265,
                 ffn_chunk=512, new_tokens=32, repeats=5, budget=30, timeout=3600),
    # Decoding at GPT-2 small's depth (12 x 768; the other presets' decoders have 2 layers, where the output layer is
    # most of a step): the generation suite alone, at 1K and 16K of context (issue 41: flat per-token cost and memory
    # from 1K to 16K, and the speed-up over GPT-2 at 16K). Each call prefills its context afresh.
    "gpt2-small": dict(encoder_n=[], encoder_k=[], decoder_n=[], kernel_n=[], generation_context=[1024, 16384],
                       generation_variants=GENERATION_VARIANTS,
                       encoder_dims=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                         intermediate_size=3072),
                       decoder_dims=dict(n_embd=768, n_layer=12, n_head=12, n_inner=3072), vocab_size=50265,
                       ffn_chunk=512, new_tokens=16, repeats=2, timeout=1800),
}


# ----------------------------------------------------------------------------------------- one configuration


def _with_memory(result: dict, key: str, memory: dict) -> dict:
    """result plus memory under `key` (and the profiler's figure), or the probes' disagreement under key_failed."""
    if "failed" in memory:
        return {**result, f"{key}_failed": memory["failed"], "resident_bytes": memory["resident_bytes"],
                "profiler_bytes": memory["profiler_bytes"]}
    return {**result, key: memory["bytes"], **({"profiler_bytes": memory["profiler_bytes"]}
                                                 if "profiler_bytes" in memory else {})}


def _encoder(spec, device):
    from transformers import AutoConfig, AutoModel

    import hf_linear_attn  # noqa: F401

    n = spec["n"]
    extra = {"linformer_k": spec["k"], "linformer_sharing": "layerwise"} if spec["model"] == "linformer" else {}
    config = AutoConfig.for_model(spec["model"], vocab_size=spec["vocab_size"], max_position_embeddings=n + 2,
                                  type_vocab_size=1, pad_token_id=1, chunk_size_feed_forward=spec["ffn_chunk"],
                                  **spec["dims"], **extra)
    kwargs = {"attn_implementation": spec["attn"]} if spec["model"] == "roberta" else {}
    model = AutoModel.from_config(config, **kwargs).to(device, getattr(torch, spec["dtype"])).eval()
    ids = torch.randint(3, spec["vocab_size"], (1, n), device=device)
    with torch.no_grad():
        seconds, memory = measured(lambda: model(input_ids=ids), spec["repeats"], device, spec.get("budget"))
    return _with_memory({"seconds": seconds}, "activation_bytes", memory)


def _decoder_train(spec, device):
    n = spec["n"]
    model = decoder_model(spec, device, n).train()
    ids = torch.randint(0, spec["vocab_size"], (1, n), device=device)
    mixed = spec["dtype"] != "float32"  # float32 weights under autocast, as the training scripts run

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=getattr(torch, spec["dtype"]), enabled=mixed):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    seconds, memory = measured(step, spec["repeats"], device, spec.get("budget"))  # zero_grad frees the gradients
    return _with_memory({"seconds": seconds}, "peak_bytes", memory)


def _generation(spec, device):
    context, new = spec["context"], spec["new_tokens"]
    model = decoder_model(spec, device, context + new + 1).to(getattr(torch, spec["dtype"])).eval()
    prompt = torch.randint(0, spec["vocab_size"], (1, context), device=device)
    per_token = []
    with torch.no_grad():
        for _ in range(spec["repeats"]):
            out = model(input_ids=prompt, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(new):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                if device == "cuda":
                    torch.cuda.synchronize()
                per_token.append(time.perf_counter() - start)
                cache = out.past_key_values
    seconds = statistics.median(per_token[1:])  # the first step after a prefill is the warm-up
    return {"seconds_per_token": seconds, "tokens_per_second": 1 / seconds, "cache_bytes": cache_bytes(cache),
            "output_layer_seconds": _output_layer_seconds(model, new, device)}


def _output_layer_seconds(model, repeats: int, device: str) -> float:
    """The output layer alone on one token's hidden state (median of ``repeats``): the part of a decoding step that no
    attention design changes. At batch 1 it reads every weight of a (vocabulary x width) matrix once per token, so
    its time is the floor a constant-size state leaves, and what caps a state's speed-up over a key/value cache."""
    head = model.get_output_embeddings()
    hidden = torch.randn(1, 1, head.in_features, dtype=head.weight.dtype, device=device)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            head(hidden)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def linear_attention_flops(form: str, n: int, heads: int, d: int, chunk: int) -> float:
    """Multiply-adds x 2 of the matrix products: causal (chunkwise) or bidirectional linear attention."""
    if form == "bidirectional":
        return heads * (2 * n * d * d) * 2  # phi(K)^T V, then phi(Q) S
    chunks = -(-n // chunk)
    per_chunk = 2 * chunk * chunk * d * 2 + 2 * chunk * d * d * 2  # in-chunk QK^T, AV; Q S, K^T V state update
    return heads * chunks * per_chunk


def load_fla_naive(op: str = "linear_attn"):
    """fla's torch-only reference forms of one op (``fla/ops/<op>/naive.py``: linear_attn, simple_gla, gla,
    delta_rule, gated_delta_rule, ...), loaded by path: the package's __init__ imports triton, which CPU-only installs
    lack. ImportError naming the install where fla is absent."""
    import importlib.util

    found = importlib.util.find_spec("fla")
    if found is None or not found.submodule_search_locations:
        raise ImportError("fla is not installed: pip install --no-deps fla-core einops (or the project's test extra)")
    path = Path(list(found.submodule_search_locations)[0]) / "ops" / op / "naive.py"
    module_spec = importlib.util.spec_from_file_location(f"fla_{op}_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def peer_kernel(name: str):
    """A peer's causal linear attention as fn(phi_q, phi_k, v) on (B, H, n, d) features, plus the feature maps it
    applies itself (None: it takes features), or ImportError with the reason it cannot run here."""
    if name == "fla chunk (torch)":
        naive = load_fla_naive()

        def fla_chunk(q, k, v):
            t = [x.transpose(1, 2) for x in (q, k, v)]
            return naive.naive_chunk_linear_attn(*t, scale=1.0, normalize=True).transpose(1, 2)

        return fla_chunk, None
    if name == "performer-pytorch (torch)":
        from performer_pytorch.performer_pytorch import causal_linear_attention_noncuda

        return (lambda q, k, v: causal_linear_attention_noncuda(q, k, v, chunk_size=128)), None
    if name == "linear-attention-transformer":
        from linear_attention_transformer.linear_attention_transformer import causal_linear_attn

        # its own feature maps (softmax(q) d^-1/2, exp(k)) on raw q, k; earlier buckets only, not exact
        features = (lambda q: q.softmax(-1) * q.shape[-1] ** -0.5, torch.exp)
        return (lambda q, k, v: causal_linear_attn(q, k, v, bucket_size=64)), features
    if name == "fast-transformers (C++)":
        try:
            from fast_transformers.causal_product import causal_dot_product
        except ImportError as error:
            raise ImportError("not installed: pytorch-fast-transformers' setup.py requires CUDA_HOME, it does not "
                              "build against a CPU-only torch") from error

        def fast(q, k, v):
            out = causal_dot_product(q.float(), k.float(), v.float())
            return out / ((q.float() * k.float().cumsum(2)).sum(-1, keepdim=True) + 1e-6)

        return fast, None
    raise ValueError(name)


PEERS = ("fla chunk (torch)", "fast-transformers (C++)", "performer-pytorch (torch)", "linear-attention-transformer")
# peer -> (module that must be importable, what to install); fast-transformers also needs its compiled extension
PEER_PACKAGES = {"fla chunk (torch)": ("fla", "flash-linear-attention"),
                 "fast-transformers (C++)": ("fast_transformers", "pytorch-fast-transformers (it builds only with "
                                                                  "CUDA_HOME set, not against a CPU-only torch)"),
                 "performer-pytorch (torch)": ("performer_pytorch", "performer-pytorch"),
                 "linear-attention-transformer": ("linear_attention_transformer", "linear-attention-transformer")}


def peer_missing(name: str) -> str | None:
    """Why a peer's row cannot run here (its package is not installed), found without starting a process; None
    where it is installed (it may still fail in its process, and that row says why)."""
    import importlib.util

    module, package = PEER_PACKAGES[name]
    return None if importlib.util.find_spec(module) else f"not installed: pip install {package}"


KERNEL_FORMS = (("scan", 64), ("scan", 256), ("parallel", 64), ("parallel", 256))  # (form, chunk) rows


def _kernel(spec, device):
    from hf_linear_attn import bidirectional_linear_attention, causal_linear_attention

    dtype = getattr(torch, spec["dtype"])
    n, heads, d, chunk = spec["n"], spec["heads"], spec["head_dim"], spec["chunk"]
    train = spec.get("train", False)
    raw = [torch.randn(1, heads, n, d, device=device) for _ in range(3)]
    features = (lambda x: torch.nn.functional.elu(x) + 1, lambda x: torch.nn.functional.elu(x) + 1)
    peer = spec.get("peer")
    if peer:
        try:
            kernel, own_features = peer_kernel(peer)
        except ImportError as error:
            return {"skipped": str(error)[:200]}
        features = own_features or features
    elif spec["form"] == "causal":
        form, precision = spec.get("kernel_form", "auto"), spec.get("precision", "auto")
        chunk_size = None if form == "auto" else chunk

        def kernel(q, k, v):
            return causal_linear_attention(q, k, v, chunk_size=chunk_size, form=form, precision=precision)[0]
    else:
        def kernel(q, k, v):
            return bidirectional_linear_attention(q, k, v)
    inputs = [features[0](raw[0]), features[1](raw[1]), raw[2]]
    exact_inputs = [t.to(dtype).double() for t in inputs]
    with torch.no_grad():
        exact = (causal_linear_attention(*exact_inputs, chunk_size=64, form="scan")[0] if spec["form"] == "causal"
                 else bidirectional_linear_attention(*exact_inputs))
    own = peer == "linear-attention-transformer"  # applies its feature maps itself: give it raw q, k
    args = [t.to(dtype) for t in (raw if own else inputs)]
    leaves = [t.clone().requires_grad_(train) for t in args]
    grad = torch.randn(1, heads, n, d, device=device, dtype=dtype)

    def fn():
        if train:
            kernel(*leaves).backward(grad)
            for t in leaves:
                t.grad = None
            return None
        with torch.no_grad():
            return kernel(*leaves)

    with torch.no_grad():
        out = kernel(*args)
    error = float((out.double() - exact).norm() / exact.norm())
    seconds = median_seconds(fn, spec["repeats"], device)
    flops = linear_attention_flops(spec["form"], n, heads, d, chunk) * (4 if train else 1)  # backward: 3 more scans
    gflops = flops / seconds / 1e9
    peak = matmul_peak(dtype, device)
    return {"seconds": seconds, "gflops": gflops, "matmul_peak_gflops": peak, "fraction_of_peak": gflops / peak,
            "error_vs_float64": error}


KINDS = {"encoder": _encoder, "decoder_train": _decoder_train, "generation": _generation, "kernel": _kernel,
         **decoding.KINDS,  # images, assisted, compiled_step: decoding.py
         **kernel_crossover.KINDS}  # crossover: kernel_crossover.py


def run_one(spec: dict) -> dict:
    """Measure one configuration in this process."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return KINDS[spec["kind"]](spec, device)


# --------------------------------------------------------------------------------------------------- suites


def resolve_dtype(choice: str) -> str:
    """'auto' -> bfloat16 where the hardware computes in bf16 natively (as the training scripts decide), else float32."""
    if choice != "auto":
        return choice
    from hf_linear_attn.training.pretraining import resolve_mixed_precision

    return "bfloat16" if resolve_mixed_precision("auto") == "bf16" else "float32"


def configurations(preset_name: str, dtype: str = "float32", data_dir=None, output_dir=None) -> list[dict]:
    """Every configuration of a preset, in the order they run; model suites in `dtype` (kernels: both dtypes). The
    decoding suites read WikiText-2 under data_dir and cache their trained models under output_dir."""
    preset = PRESETS[preset_name]
    decoding_specs = decoding.configurations(preset_name, dtype, data_dir, output_dir)
    common = {"repeats": preset["repeats"], "vocab_size": preset["vocab_size"], "dtype": dtype,
              "budget": preset.get("budget")}
    specs = []
    for n in preset["encoder_n"]:
        enc = {**common, "kind": "encoder", "n": n, "dims": preset["encoder_dims"], "ffn_chunk": preset["ffn_chunk"]}
        specs += [{**enc, "method": "roberta eager", "model": "roberta", "attn": "eager"},
                  {**enc, "method": "roberta sdpa", "model": "roberta", "attn": "sdpa"},
                  {**enc, "method": "linear attention", "model": "linear_roberta"}]
        specs += [{**enc, "method": f"linformer k={k}", "model": "linformer", "k": k}
                  for k in preset["encoder_k"] if k < n]
    dec = {**common, "dims": preset["decoder_dims"]}
    shortest = preset["decoder_n"][0] if preset["decoder_n"] else 0  # a preset without the training suite has none
    block, k = max(16, shortest // 4), max(4, shortest // 16)
    for n in preset["decoder_n"]:
        # Every model with its default dropout (0.1), as it trains; with attention dropout PyTorch's CPU SDPA takes
        # its math path (an n x n matrix per head), so GPT-2 also runs without dropout, where SDPA uses its flash
        # kernel: today's best softmax on the same hardware. The causal Linformer likewise: without dropout (and
        # unpadded) it takes its fused form (two flash-attention calls, memory linear in n), with dropout the
        # materialised one (n x n k / b scores per head).
        specs += [{**dec, "kind": "decoder_train", "n": n, "method": "gpt2 sdpa", "model": "gpt2"},
                  {**dec, "kind": "decoder_train", "n": n, "method": "gpt2 sdpa, no dropout", "model": "gpt2",
                   "dropout": False},
                  {**dec, "kind": "decoder_train", "n": n, "method": "linear attention", "model": "linear_gpt2"},
                  {**dec, "kind": "decoder_train", "n": n, "method": f"causal linformer k={k} b={block}",
                   "model": "linformer_gpt2", "k": k, "block": block},
                  {**dec, "kind": "decoder_train", "n": n, "method": f"causal linformer k={k} b={block}, no dropout",
                   "model": "linformer_gpt2", "k": k, "block": block, "dropout": False}]
    for context in preset["generation_context"]:
        gen = {**dec, "kind": "generation", "context": context, "new_tokens": preset["new_tokens"]}
        specs += [{**gen, "method": "gpt2 (key/value cache)", "model": "gpt2"},
                  {**gen, "method": "linear attention (state)", "model": "linear_gpt2"}]
        # issue 41's variants of the linear decoder, each with its fixed-size state (not at smoke: they add a fresh
        # process each per context, and the smoke test's subject is the suite, not the variants)
        specs += [{**gen, "method": f"linear attention, {name} (state)", "model": "linear_gpt2", "config": options}
                  for name, options in preset.get("generation_variants", {}).items()]
    heads = preset["encoder_dims"]["num_attention_heads"]
    head_dim = preset["encoder_dims"]["hidden_size"] // heads
    for n in preset["kernel_n"]:
        base = {"kind": "kernel", "repeats": preset["repeats"], "n": n, "heads": heads, "head_dim": head_dim,
                "chunk": 64}
        for form in ("causal", "bidirectional"):
            for kernel_dtype in preset.get("kernel_dtypes", ("float32", "bfloat16")):
                specs.append({**base, "form": form, "dtype": kernel_dtype, "method": f"{form} {kernel_dtype}"})
        # causal forms and peers side by side, forward and training (forward + backward), one process each
        for train in preset.get("kernel_train_modes", (False, True)):
            for kernel_dtype in preset.get("kernel_form_dtypes", ("float32", "bfloat16")):
                mode = "fwd+bwd" if train else "fwd"
                for kernel_form, chunk in preset.get("kernel_forms", KERNEL_FORMS):
                    specs.append({**base, "form": "causal", "dtype": kernel_dtype, "train": train,
                                  "kernel_form": kernel_form, "chunk": chunk,
                                  "method": f"causal {kernel_form} C={chunk} {kernel_dtype} {mode}"})
                for peer in preset.get("kernel_peers", PEERS):
                    specs.append({**base, "form": "causal", "dtype": kernel_dtype, "train": train, "peer": peer,
                                  "method": f"peer: {peer} {kernel_dtype} {mode}"})
    return specs + decoding_specs + kernel_crossover.configurations(preset_name, dtype)


def tables(results: list[dict]) -> str:
    """Markdown tables: the paper's Table 3 shape for encoders (time and memory saved), then the other suites."""
    out = []
    enc = [r for r in results if r["kind"] == "encoder"]
    if enc:
        methods = list(dict.fromkeys(r["method"] for r in enc))
        sizes = sorted({r["n"] for r in enc})
        cell = {(r["method"], r["n"]): r for r in enc}
        memory_tables = [("Encoder inference: activation memory (MB, peak minus weights)", "activation_bytes", mb)]
        if any("profiler_bytes" in r for r in enc):  # the second probe, beside the first (see `measured`)
            memory_tables.append(("Encoder inference: tensor peak (MB, torch.profiler; the second memory probe)",
                                  "profiler_bytes", mb))
        for title, key, fmt in (("Encoder inference, batch 1: seconds per forward", "seconds", lambda v: f"{v:.3f}"),
                                *memory_tables):
            out += [f"### {title}", "", "| n | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
            for n in sizes:
                row = [fmt(cell[(m, n)][key]) if (m, n) in cell and key in cell[(m, n)] else
                       failure(cell.get((m, n), {}), key) for m in methods]
                out.append(f"| {n} | " + " | ".join(row) + " |")
            out.append("")
        for base in ("roberta eager", "roberta sdpa"):
            for title, key in (("time saved", "seconds"), ("memory saved", "activation_bytes")):
                out += [f"### Encoder {title} against {base} (x = {base} / method)", "",
                        "| n | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
                for n in sizes:
                    ref = cell.get((base, n), {}).get(key)
                    floor = MEMORY_FLOOR if key == "activation_bytes" else 0
                    row = [f"{ref / cell[(m, n)][key]:.2f}x" if ref and key in cell.get((m, n), {})
                           and cell[(m, n)][key] > floor else "-" for m in methods]
                    out.append(f"| {n} | " + " | ".join(row) + " |")
                out.append("")
    for kind, title, columns in (
        ("decoder_train", "Decoder training step (forward + backward, batch 1; peak MB: above the weights, resident "
                          "set; tensor peak MB: torch.profiler, the second probe)",
         (("seconds", "s", lambda v: f"{v:.3f}"), ("peak_bytes", "peak MB", mb),
          ("profiler_bytes", "tensor peak MB", mb))),
        ("generation", "Generation, batch 1 (per token after a prompt of `context` tokens)",
         (("seconds_per_token", "ms / token", lambda v: f"{1000 * v:.2f}"),
          ("tokens_per_second", "tokens / s", lambda v: f"{v:.1f}"), ("cache_bytes", "cache MB", mb),
          ("output_layer_seconds", "of which the output layer, ms", lambda v: f"{1000 * v:.2f}"))),
        ("kernel", "Linear-attention kernels and peers (B 1, H 12, d 64; forward, or forward + backward where named; "
                   "bf16 inputs take bf16 products where the CPU has them natively, else float32), against the "
                   "matmul peak of that dtype measured in the same process; error: relative L2 against float64 on "
                   "the same inputs",
         (("seconds", "s", lambda v: f"{v:.4f}"), ("gflops", "GFLOP/s", lambda v: f"{v:.1f}"),
          ("matmul_peak_gflops", "matmul peak GFLOP/s", lambda v: f"{v:.1f}"),
          ("fraction_of_peak", "% of peak", lambda v: f"{100 * v:.1f}"),
          ("error_vs_float64", "rel. error vs float64", lambda v: f"{v:.1e}"))),
    ):
        rows = [r for r in results if r["kind"] == kind]
        if not rows:
            continue
        size = "context" if kind == "generation" else "n"
        # a column no row has (a figure newer than the run) is left out, so older runs render as they were written
        columns = [c for c in columns if any(c[0] in r or f"{c[0]}_failed" in r for r in rows)] or columns[:1]
        out += [f"### {title}", "", f"| {size} | method | " + " | ".join(c[1] for c in columns) + " |",
                "|---" * (len(columns) + 2) + "|"]
        for r in rows:
            cells = [c[2](r[c[0]]) if c[0] in r else failure(r, c[0]) for c in columns]
            out.append(f"| {r[size]} | {r['method']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out) + decoding.tables(results) + kernel_crossover.tables(results)


def plots(results: list[dict], folder: Path) -> list[Path]:
    """Log-log PNGs, one line per method: time and memory against n (encoders, decoder training), generation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for kind, size, panels in (("encoder", "n", (("seconds", "seconds / forward"), ("activation_bytes", "MB"))),
                               ("decoder_train", "n", (("seconds", "seconds / step"), ("peak_bytes", "peak MB"))),
                               ("generation", "context", (("seconds_per_token", "seconds / token"),
                                                          ("cache_bytes", "cache MB")))):
        rows = [r for r in results if r["kind"] == kind]
        if not rows:
            continue
        figure, axes = plt.subplots(1, 2, figsize=(11, 4))
        for axis, (key, label) in zip(axes, panels):
            for method in dict.fromkeys(r["method"] for r in rows):
                points = [(r[size], r[key] / (2**20 if "bytes" in key else 1)) for r in rows
                          if r["method"] == method and key in r and r[key] > 0]
                if points:
                    axis.plot(*zip(*points), marker="o", label=method)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel(size)
            axis.set_ylabel(label)
            axis.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        figure.suptitle(kind.replace("_", " "))
        figure.tight_layout()
        path = folder / f"{kind}.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written + decoding.plots(results, folder) + kernel_crossover.plots(results, folder)


def run_suite(preset_name: str, output_dir: Path, only: list[str] | None = None, dtype: str = "auto",
              data_dir: str | None = None) -> dict:
    """Run every configuration of a preset; write results.json, results.md and the plots into output_dir.
    results.json is rewritten after every configuration ("complete": false until the last), so a run that is
    stopped or killed keeps what it measured, and `--rewrite_report` renders it."""
    preset = PRESETS[preset_name]
    dtype = resolve_dtype(dtype)
    output_dir.mkdir(parents=True, exist_ok=True)
    report = {"preset": preset_name, "machine": describe_machine(), "hardware": describe_hardware(),
              "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d"), "dtype": dtype, "ffn_chunk": preset["ffn_chunk"], "complete": False,
              "results": []}
    results = report["results"]
    for spec in configurations(preset_name, dtype, data_dir, output_dir):
        if only and spec["kind"] not in only:
            continue
        if spec["kind"] == "crossover":  # softmax only falls further behind: stop timing it (see kernel_crossover)
            spec = {**spec, "softmax_settled_since": kernel_crossover.softmax_settled(spec, results)}
        missing = spec.get("peer") and peer_missing(spec["peer"])
        # an absent peer costs no process (seconds of imports each; 8 rows per peer in the quick preset)
        measured = ({"skipped": missing} if missing else
                    # the assisted suite's timeout is its own (longer: it trains its models first)
                    run_isolated("benchmarks.suites", spec, spec.get("timeout", preset["timeout"])))
        results.append({**{k: v for k, v in spec.items() if k not in ("dims",)}, **measured})
        print(f"{spec['kind']:14s} {spec.get('n', spec.get('context')):>6} {spec['method']:34s} {measured}", flush=True)
        write_json(output_dir / "results.json", report)
    report["complete"] = True
    write_report(report, output_dir)
    return report


MODEL_SUITES = ("encoder", "decoder_train", "generation", "kernel")  # the suites the header's paragraph describes


def write_report(report: dict, output_dir: Path) -> None:
    """results.json, results.md (a header saying what was run, then the tables) and the plots."""
    preset = PRESETS[report["preset"]]
    dtype = report["dtype"]
    write_json(output_dir / "results.json", report)
    model_suites_note = (
        f"Models in {dtype} (inference: weights in {dtype}; training: float32 weights under autocast to "
        f"{dtype}); every encoder, stock RoBERTa included, with `chunk_size_feed_forward={report['ffn_chunk']}`; "
        "decoders with their default dropout unless the method says otherwise. Times: median of "
        f"{preset['repeats']} calls after a warm-up"
        + (f" (fewer, at least 1, where they would exceed {preset['budget']} s)" if preset.get("budget") else "")
        + "; memory: after the timed calls, on one more call (figures under 4 MB are within the probe's noise "
        "and give no ratio).\n\n")
    # a report made before the hardware record existed has none, and renders as it did then
    hardware = hardware_text(report.get("hardware"))
    markdown = (f"Preset `{report['preset']}` on {report['machine']}{'; ' + hardware if hardware else ''} "
                f"({report['date']}), `{report['command']}`"
                + ("" if report.get("complete", True) else " (stopped before its last configuration)") + ".\n\n"
                + (f"{report['provenance']}\n\n" if report.get("provenance") else "")
                + (model_suites_note if any(r["kind"] in MODEL_SUITES for r in report["results"]) else "")
                + tables(report["results"]))
    (output_dir / "results.md").write_text(markdown)
    plots(report["results"], output_dir)


def rewrite_report(output_dir: Path) -> None:
    """results.md and the plots again from results.json (after a change to the tables), without measuring; the header
    of an existing results.md (what was run, as it was written then) is kept."""
    report = json.loads((output_dir / "results.json").read_text())
    existing = output_dir / "results.md"
    text = existing.read_text() if existing.is_file() else ""
    if "### " not in text:
        write_report(report, output_dir)
        return
    existing.write_text(text[: text.index("### ")] + tables(report["results"]))
    plots(report["results"], output_dir)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--output_dir", default="outputs/benchmarks")
    parser.add_argument("--only", nargs="*", choices=sorted(KINDS), help="run only these suites")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="model suites: inference in this dtype, training under autocast to it (auto: bfloat16 "
                             "where the hardware computes in bf16 natively, as the training scripts decide)")
    parser.add_argument("--data_dir", default=decoding.DEFAULT_DATA_DIR,
                        help="folder holding wikitext-2/ (the assisted suite pretrains its target and draft on it)")
    parser.add_argument("--rewrite_report", action="store_true",
                        help="only rewrite results.md and the plots in --output_dir from its results.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one configuration, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return None
    if args.rewrite_report:
        rewrite_report(Path(args.output_dir))
        return None
    if args.only and "assisted" in args.only and decoding.data_problem(args.data_dir):
        parser.error(decoding.data_problem(args.data_dir))  # asked for by name: refuse before any work
    report = run_suite(args.preset, Path(args.output_dir), args.only, args.dtype, args.data_dir)
    print(f"\n{tables(report['results'])}\nwrote {args.output_dir}/results.json, results.md and PNG plots")
    return report


if __name__ == "__main__":
    main()
