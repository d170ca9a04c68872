"""GPU benchmark rows, side by side in one run (issue 40): what a lent H100 / H200 measures in one short call.

Sections, in the default order (``--sections`` gives another; each row is appended to results.json as soon as it is
measured, so a run stopped by its deadline keeps what it finished; sections that would start after the deadline are
recorded as skipped):
- ``machine``: the GPU, the software, and the two ceilings measured here (an 8192^3 bf16 matmul, a device copy);
- ``compile``: which functions the causal kernel reaches eagerly and under torch.compile, and each one's error
  against float64 (at the first kernel n, batch 1);
- ``kernel``: causal linear attention forward and forward + backward in bf16, H 12, d 64, elu + 1 features, at n 4K-64K:
  this package's default (``precision="auto"``: fla's Triton chunk kernel when installed, see
  ``causal_linear_attention``), its torch forms, fla's ``chunk_linear_attn`` called directly in its own layout and
  normalisation, and causal SDPA (flash) on the raw q, k, v; error of each against float64 at the first n;
- ``encoder``: forward of a 12 x 768 encoder in bf16 at batch 1, n 4K-64K: RoBERTa (Transformers' own, SDPA),
  Linformer (k 128, key-value sharing) and linear attention (elu + 1);
- ``images``: whole 784- and 3,072-token sequences sampled with ``generate()`` from a 1-token start (vocabulary 256,
  width 256, 8 heads, 8 / 16 layers: "Transformers are RNNs" Tables 1-2's shape), images / s at the largest batch
  tried that fits: GPT-2 (SDPA, its key/value cache) against linear_gpt2;
- ``train``: one training step (forward + backward, bf16 autocast) of 12 x 768 decoders at batch 8, n 4,096;
- ``decode``: tokens / s of greedy decoding after a 4,096-token prompt at batch 1-256, 12 x 768 decoders.

Run it through ``bash scripts/gpu_check.sh`` (which installs the carried wheels and runs the CUDA tests first), or
``python scripts/gpu_benchmark.py --output_dir DIR`` on a machine that has the packages. ``--report_only`` rewrites
results.md from results.json.
"""

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

SECTIONS = ("machine", "compile", "kernel", "encoder", "images", "decode", "train")  # the default order
GPT2_SMALL = dict(vocab_size=50257, n_embd=768, n_head=12, n_inner=3072, n_layer=12)
ROBERTA_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    vocab_size=50265)
PRESETS = {
    # what one device call of ~5 minutes measures
    "gpu": dict(kernel_n=[4096, 8192, 16384, 32768, 65536], kernel_batch=4, kernel_heads=12, kernel_head_dim=64,
                encoder_n=[4096, 8192, 16384, 32768, 65536], encoder_dims=ROBERTA_BASE, linformer_k=128,
                image_lengths={784: 8, 3072: 16}, image_dims=dict(n_embd=256, n_head=8, n_inner=1024),
                # batches tried per length, smallest first until one fails: GPT-2's key/value cache at 3,072 tokens
                # and batch 512 is 26 GB (16 layers, bf16), and its steps slow as the cache grows; linear_gpt2's
                # state is 0.5 MB a sequence, so its batch is bounded here by time, not memory
                image_batches={784: {"gpt2": [512, 2048], "linear_gpt2": [4096, 16384]},
                               3072: {"gpt2": [512], "linear_gpt2": [16384]}},
                decoder_dims=GPT2_SMALL, linformer_block=256, train_batch=8, train_n=4096,
                decode_batches=[1, 16, 64, 256], decode_context=4096, decode_steps=32),
    # a short second call: the kernel rows and linear_gpt2's image rows again (after a fix)
    "gpu-recheck": dict(kernel_n=[4096, 65536], kernel_batch=4, kernel_heads=12, kernel_head_dim=64,
                        kernel_forms=[("parallel", 64)], image_lengths={784: 8, 3072: 16},
                        image_dims=dict(n_embd=256, n_head=8, n_inner=1024),
                        image_batches={784: {"linear_gpt2": [4096, 16384]}, 3072: {"linear_gpt2": [16384]}}),
    # one 15-minute lease (its start and the CUDA tests included): every section, the torch fallback as the one torch
    # form beside the default, and each image run stopped after image_seconds_cap seconds of generation and
    # extrapolated to the whole image (the first GPU run spent 94 s on GPT-2's 784-token rows alone)
    "lease": dict(kernel_n=[4096, 8192, 16384, 32768, 65536], kernel_batch=4, kernel_heads=12, kernel_head_dim=64,
                  kernel_forms=[("parallel", 64)], kernel_profile=True,
                  encoder_n=[4096, 16384, 65536], encoder_dims=ROBERTA_BASE, linformer_k=128,
                  image_lengths={784: 8, 3072: 16}, image_dims=dict(n_embd=256, n_head=8, n_inner=1024),
                  image_batches={784: {"gpt2": [2048], "linear_gpt2": [4096, 16384]},
                                 3072: {"gpt2": [512], "linear_gpt2": [16384, 65536]}},
                  image_seconds_cap=15.0, image_profile=True,
                  decoder_dims=GPT2_SMALL, linformer_block=256, train_batch=8, train_n=4096,
                  decode_batches=[1, 16, 64, 256], decode_context=4096, decode_steps=32),
    # a seconds-long run of every code path (CPU or GPU): what the tests run
    "smoke": dict(kernel_n=[64, 128], kernel_batch=1, kernel_heads=2, kernel_head_dim=16, encoder_n=[64],
                  encoder_dims=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    vocab_size=300), linformer_k=8,
                  image_lengths={16: 2}, image_dims=dict(n_embd=32, n_head=2, n_inner=64),
                  image_batches={16: {"gpt2": [2, 4], "linear_gpt2": [2, 4]}}, image_seconds_cap=None,
                  kernel_profile=True, image_profile=True,
                  decoder_dims=dict(vocab_size=300, n_embd=32, n_head=2, n_inner=64, n_layer=2), linformer_block=16,
                  train_batch=1, train_n=64, decode_batches=[1, 2], decode_context=16, decode_steps=4),
}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, min_seconds=0.3, max_repeats=20, warmup=2):
    """Median seconds of fn() after ``warmup`` calls (compilation, autotuning, caches), repeated until min_seconds or
    max_repeats; CUDA events time the device work on CUDA."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    while len(times) < max_repeats and (sum(times) < min_seconds or len(times) < 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def peak_memory(fn, device):
    """Peak bytes allocated on the device while fn() runs (None on CPU)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def failure(error: BaseException) -> str:
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def free_memory(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------------------- machine

def machine(device, preset):
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    for name in ("transformers", "triton", "fla"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "present")
        except Exception as error:  # noqa: BLE001  (recorded: a missing peer is a fact of the machine)
            info[name] = f"absent ({type(error).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    size = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    seconds = timed(lambda: a @ b, device)
    info["bf16_matmul_tflops"] = 2 * size**3 / seconds / 1e12
    x = torch.randn(2**28 if device.type == "cuda" else 2**22, device=device)
    y = torch.empty_like(x)
    seconds = timed(lambda: y.copy_(x), device)
    info["copy_gb_per_s"] = 2 * x.numel() * 4 / seconds / 1e9  # bytes read plus bytes written
    return [info]


# --------------------------------------------------------------------------------------------------------- kernel

def kernel_methods(device, forms=(("parallel", 64), ("parallel", 128), ("scan", 64))):
    """name -> fn(phi_q, phi_k, v, q, k) -> output, the inputs in (B, H, n, d) except where the method's own layout
    is prepared for it outside the timed call (fla's (B, T, H, K))."""
    from hf_linear_attn.linear_attention import causal_linear_attention, fla_chunk_kernel

    methods = {"ours: default (auto)": lambda a, b, c, **_: causal_linear_attention(a, b, c)[0],
               # the layout the models hand over: (B, H, n, d) views of (B, n, H, d) projections, which is fla's own
               # layout, so the dispatch's transposes copy nothing
               "ours: default, model layout": lambda a, b, c, fla_inputs, **_: causal_linear_attention(
                   *(x.transpose(1, 2) for x in fla_inputs))[0]}
    for form, chunk in forms:
        methods[f"ours: torch {form} C{chunk}"] = (
            lambda f, ch: lambda a, b, c, **_: causal_linear_attention(a, b, c, form=f, chunk_size=ch,
                                                                       precision="bfloat16")[0])(form, chunk)
    if fla_chunk_kernel(device.type) is not None:
        kernel = fla_chunk_kernel(device.type)
        methods[FLA_TWICE] = fla_normalised_by_fla(kernel)
        # fla used as its users call it: inputs already in its layout, its own normalisation
        methods["fla chunk_linear_attn (own layout, normalize=True)"] = (
            lambda a, b, c, fla_inputs, **_: kernel(*fla_inputs, scale=1.0, normalize=True)[0])
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(a, b, c, q, k, **_):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, c, is_causal=True)

        methods["SDPA flash (softmax, causal)"] = flash
    else:
        methods["SDPA (softmax, causal)"] = lambda a, b, c, q, k, **_: F.scaled_dot_product_attention(q, k, c,
                                                                                                     is_causal=True)
    return methods


FLA_TWICE = "candidate: fla numerator + fla normaliser (V = ones)"


def fla_normalised_by_fla(kernel, ones_width=16, eps=1e-6):
    """A candidate for the CUDA dispatch, timed beside it (issue 40's goal: within 1.2x of fla): numerator and
    normaliser both from fla's kernel, in its layout. phi(q_t) . sum_{j<=t} phi(k_j) is the numerator with V = 1, so a
    second call on a block of ones gives it (16 columns: fla's tiles; the first is used). fla rounds each to bf16 once
    (its own normalize=True sums the keys in bf16 instead); no float32 normaliser in torch around it. Returns
    (B, H, n, d_v) as the other methods do (a transposed view)."""
    def call(a, b, c, fla_inputs, **_):
        q, k, v = fla_inputs
        numerator = kernel(q, k, v, scale=1.0, normalize=False)[0]
        normaliser = kernel(q, k, v.new_ones(*v.shape[:-1], ones_width), scale=1.0, normalize=False)[0]
        return (numerator / (normaliser[..., :1].float() + eps)).transpose(1, 2)

    return call


def compile_dispatch(device, preset):
    """Which path the causal kernel takes eagerly and under torch.compile (backend "eager": tracing only), and the
    error of each against float64: the first lease on an H100 saw a compiled call reach neither fla's kernel nor the
    bf16 path (tests/attention/test_causal_math.py::test_torch_compile_takes_the_path_the_eager_call_takes)."""
    import hf_linear_attn.linear_attention as la

    n, heads, head_dim = preset["kernel_n"][0], preset["kernel_heads"], preset["kernel_head_dim"]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, device=device, generator=g) for _ in range(3))
    phi_q, phi_k = (F.elu(t).add_(1).bfloat16() for t in (q, k))
    v = v.bfloat16()
    reference = la.causal_linear_attention(phi_q.double(), phi_k.double(), v.double())[0]
    # each function the dispatch goes through, with what the two deciding ones returned (a bool, kernel found or not)
    seen, originals = [], {name: getattr(la, name) for name in ("_bf16_compute", "fla_chunk_kernel", "_causal_bf16",
                                                               "_causal_fla")}

    def recording(name, fn):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            if name == "_bf16_compute":
                seen.append(f"{name} -> {bool(result)}")
            elif name == "fla_chunk_kernel":
                seen.append(f"{name} -> {'found' if result is not None else 'None'}")
            else:
                seen.append(name)
            return result
        return call

    for name, fn in originals.items():
        setattr(la, name, recording(name, fn))
    row = {"n": n, "heads": heads, "head_dim": head_dim, "paths": {}, "relative_error": {}}
    try:
        torch._dynamo.reset()
        def attend(a, b, c):
            return la.causal_linear_attention(a, b, c)[0]

        for mode, call in {"eager": attend, "compiled": torch.compile(attend, backend="eager")}.items():
            seen.clear()
            out = call(phi_q, phi_k, v)
            row["paths"][mode] = list(seen)
            row["relative_error"][mode] = ((out.double() - reference).norm() / reference.norm()).item()
    finally:
        for name, fn in originals.items():
            setattr(la, name, fn)
    yield row


def kernel(device, preset):
    from hf_linear_attn.linear_attention import causal_linear_attention

    rows = []
    methods = kernel_methods(device, *([preset["kernel_forms"]] if "kernel_forms" in preset else []))
    batch, heads, head_dim = preset["kernel_batch"], preset["kernel_heads"], preset["kernel_head_dim"]
    for n in preset["kernel_n"]:
        g = torch.Generator(device=device).manual_seed(n)
        q, k, v = (torch.randn(batch, heads, n, head_dim, device=device, generator=g, dtype=torch.bfloat16) for _ in range(3))
        phi_q, phi_k = (F.elu(t.float()).add_(1).bfloat16() for t in (q, k))
        fla_inputs = tuple(t.transpose(1, 2).contiguous() for t in (phi_q, phi_k, v))
        reference = None
        if n == preset["kernel_n"][0]:
            reference = causal_linear_attention(phi_q.double(), phi_k.double(), v.double(), form="parallel",
                                                chunk_size=64)[0]
        for train in (False, True):
            row = {"section": "kernel", "n": n, "batch": batch, "heads": heads, "head_dim": head_dim,
                   "mode": "fwd+bwd" if train else "fwd", "seconds": {}, "errors": {}, "failed": {}}
            for name, fn in methods.items():
                leaves = [t.detach().clone().requires_grad_(train) for t in (phi_q, phi_k, v)]
                raw = [t.detach().clone().requires_grad_(train) for t in (q, k)]
                fl = tuple(t.detach().clone().requires_grad_(train) for t in fla_inputs)

                def call():
                    if train:
                        out = fn(*leaves, q=raw[0], k=raw[1], fla_inputs=fl)
                        out.backward(torch.ones_like(out))
                    else:
                        with torch.no_grad():
                            return fn(*leaves, q=raw[0], k=raw[1], fla_inputs=fl)

                try:
                    row["seconds"][name] = timed(call, device)
                    if reference is not None and not train and "SDPA" not in name:
                        with torch.no_grad():
                            out = fn(*leaves, q=raw[0], k=raw[1], fla_inputs=fl)
                        if "fla chunk_linear_attn" in name:
                            out = out.transpose(1, 2)
                        row["errors"][name] = ((out.double() - reference).norm() / reference.norm()).item()
                except Exception as error:  # noqa: BLE001  (a method that fails is a row of the table)
                    row["failed"][name] = failure(error)
                if (preset.get("kernel_profile") and n == preset["kernel_n"][0] and name == "ours: default (auto)"
                        and name in row["seconds"]):
                    try:
                        row["profile"] = profile_ops(call, device)
                    except Exception as error:  # noqa: BLE001  (a profiler that fails must not cost the timings)
                        row["profile_failed"] = failure(error)
                free_memory(device)
            rows.append(row)
            yield row


def profile_ops(fn, device, top=12):
    """Where one call's device time goes (torch.profiler, after the timed runs warmed it up): the ops with the most
    self time on the device (CPU time on a CPU), with their share of the total, in ms per call."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    repeats = 5
    with profile(activities=[activity]) as prof:
        for _ in range(repeats):
            fn()
        synchronize(device)
    attribute = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attribute, 0) > 0]
    total = sum(getattr(e, attribute) for e in events)
    events.sort(key=lambda e: getattr(e, attribute), reverse=True)
    return {"total_ms": total / 1e3 / repeats,
            "ops": [{"op": e.key[:90], "ms": getattr(e, attribute) / 1e3 / repeats, "calls": e.count // repeats,
                     "share": getattr(e, attribute) / total} for e in events[:top]]}


# -------------------------------------------------------------------------------------------------------- encoder

ENCODERS = ("roberta (SDPA)", "linformer (key-value)", "linear elu+1")


def encoder_model(name, n, device, preset):
    from transformers import AutoConfig, AutoModel, RobertaConfig

    import hf_linear_attn  # noqa: F401

    dims = dict(**preset["encoder_dims"], max_position_embeddings=n + 2, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    with torch.device(device):
        if name == "roberta (SDPA)":
            model = AutoModel.from_config(RobertaConfig(**dims), attn_implementation="sdpa")
        elif name == "linformer (key-value)":
            model = AutoModel.from_config(AutoConfig.for_model("linformer", linformer_k=preset["linformer_k"],
                                                               linformer_sharing="key-value", **dims))
        else:
            model = AutoModel.from_config(AutoConfig.for_model("linear_roberta", feature_map="elu", **dims))
    return model.to(dtype=torch.bfloat16).eval()


def encoder(device, preset):
    """Each model built once for the longest n (Linformer slices E and F to shorter inputs, as the paper's code
    does), then timed at every n; rows are yielded once every model has run, so a row holds all three."""
    lengths = preset["encoder_n"]
    rows = {n: {"section": "encoder", "n": n, "batch": 1, "linformer_k": preset["linformer_k"], "seconds": {},
                "peak_bytes": {}, "failed": {}} for n in lengths}
    for name in ENCODERS:
        try:
            model = encoder_model(name, max(lengths), device, preset)
        except Exception as error:  # noqa: BLE001
            for row in rows.values():
                row["failed"][name] = failure(error)
            continue
        for n in lengths:
            row = rows[n]
            ids = torch.randint(5, preset["encoder_dims"]["vocab_size"], (1, n), device=device)
            try:
                def call():
                    with torch.no_grad():
                        model(input_ids=ids)

                row["seconds"][name] = timed(call, device, min_seconds=0.5, max_repeats=10)
                row["peak_bytes"][name] = peak_memory(call, device)
            except Exception as error:  # noqa: BLE001
                row["failed"][name] = failure(error)
            free_memory(device)
        model = None
        free_memory(device)
    yield from rows.values()


# --------------------------------------------------------------------------------------------------------- images

def decoder(name, device, n_positions, dtype=torch.bfloat16, **dims):
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_linear_attn  # noqa: F401

    config = AutoConfig.for_model(name, n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  **dims)
    kwargs = {"attn_implementation": "sdpa"} if name == "gpt2" else {}
    with torch.device(device):  # initialised where it runs: seconds saved per model on a GPU
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.to(dtype=dtype).eval()


def projected_cache_bytes(name, batch, n, layers, n_embd, element_size=2):
    """GPT-2's key/value cache after a whole n-token image (a key and a value row per token, layer and sequence); the
    recurrent decoders' state does not grow with n (None)."""
    return 2 * layers * batch * n * n_embd * element_size if name == "gpt2" else None


def images(device, preset, deadline):
    """Images / s at each batch of the preset, smallest first, until one fails. With ``image_seconds_cap`` a run that
    has not finished its image by then is stopped (generate's ``max_time``) and its seconds per token extrapolated to
    the whole image: exact in expectation for the recurrent decoders, whose step costs the same at every position, and
    an upper bound on GPT-2's images / s, whose later steps read a longer cache (so a ratio against it is a lower
    bound). A batch whose whole-image cache would not fit in 90% of the device's memory is not tried."""
    cap = preset.get("image_seconds_cap")
    total_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for n, layers in preset["image_lengths"].items():
        for name in preset["image_batches"][n]:
            row = {"section": "images", "n": n, "model": name, "layers": layers, **preset["image_dims"], "runs": []}
            model = decoder(name, device, n, vocab_size=256, **preset["image_dims"], n_layer=layers,
                            bos_token_id=None, eos_token_id=None, pad_token_id=0)
            for batch in preset["image_batches"][n][name]:
                if time.time() > deadline:
                    row["runs"].append({"batch": batch, "stopped": "run deadline"})
                    break
                cache = projected_cache_bytes(name, batch, n, layers, preset["image_dims"]["n_embd"])
                if cache and total_memory and cache > 0.9 * total_memory:
                    row["runs"].append({"batch": batch, "stopped": f"its whole-image cache would take "
                                        f"{cache / 2**30:.0f} GiB of the device's {total_memory / 2**30:.0f}"})
                    break
                start = torch.zeros((batch, 1), dtype=torch.long, device=device)
                kwargs = dict(attention_mask=torch.ones_like(start), do_sample=True, top_k=0, pad_token_id=0,
                              min_new_tokens=n - 1, max_new_tokens=n - 1)
                if cap is not None:
                    kwargs["max_time"] = cap
                try:
                    with torch.no_grad():
                        model.generate(start, **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})  # warm-up
                        synchronize(device)
                        began = time.perf_counter()
                        out = model.generate(start, **kwargs)
                        synchronize(device)
                    seconds = time.perf_counter() - began
                    steps = out.shape[1] - 1
                    assert out.shape[0] == batch and 1 <= steps <= n - 1, out.shape
                    run = {"batch": batch, "seconds": seconds, "tokens": steps, "whole": steps == n - 1}
                    if cache:
                        run["projected_cache_bytes"] = cache
                    image_seconds = seconds if run["whole"] else seconds / steps * (n - 1)
                    run.update(image_seconds=image_seconds, images_per_second=batch / image_seconds)
                    row["runs"].append(run)
                except Exception as error:  # noqa: BLE001
                    row["runs"].append({"batch": batch, "stopped": failure(error)})
                    free_memory(device)
                    break
                free_memory(device)
            fitted = [r for r in row["runs"] if "images_per_second" in r]
            if fitted:
                row.update(largest_batch=fitted[-1]["batch"], images_per_second=fitted[-1]["images_per_second"],
                           whole=fitted[-1]["whole"])
                if preset.get("image_profile") and time.time() < deadline:
                    try:
                        row["step_profile"] = profile_step(model, fitted[-1]["batch"], device,
                                                           prompt=max(1, min(16, n - 12)))
                    except Exception as error:  # noqa: BLE001  (a profiler that fails must not cost the row)
                        row["step_profile_failed"] = failure(error)
                    free_memory(device)
            model = None
            free_memory(device)
            yield row


class GreedySteps:
    """A prefill of ``ids`` (logits of the last position only: no (B, n, vocab) tensor), then one greedy token per
    call, the cache carried along: the decoding loop that :func:`decode` times and :func:`profile_step` profiles."""

    def __init__(self, model, ids):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        self.model, self.cache, self.token = model, out.past_key_values, out.logits[:, -1:].argmax(-1)

    def __call__(self):
        out = self.model(input_ids=self.token, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache, self.token = out.past_key_values, out.logits[:, -1:].argmax(-1)


def profile_step(model, batch, device, prompt=16, steps=3):
    """Where one decoding step of an image model goes, at the batch it was timed at: a cache from a ``prompt``-token
    prompt, then ``steps`` one-token forwards (wall time), then 5 more under torch.profiler (device self time by op,
    as :func:`profile_ops`)."""
    with torch.no_grad():
        step = GreedySteps(model, torch.zeros((batch, prompt), dtype=torch.long, device=device))
        step()  # warm
        synchronize(device)
        began = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall = (time.perf_counter() - began) / steps
        profile = profile_ops(step, device)
    return {"batch": batch, "wall_ms": wall * 1e3, **profile}


# ---------------------------------------------------------------------------------------------- train and decode


def train(device, preset):
    n, batch = preset["train_n"], preset["train_batch"]
    row = {"section": "train", "n": n, "batch": batch, "seconds": {}, "peak_bytes": {}, "failed": {}}
    dims = preset["decoder_dims"]
    ids = torch.randint(0, dims["vocab_size"], (batch, n), device=device)
    for name in ("gpt2", "linear_gpt2", "linformer_gpt2"):
        try:
            extra = (dict(linformer_k=preset["linformer_k"], linformer_block_size=preset["linformer_block"])
                     if name == "linformer_gpt2" else {})
            model = decoder(name, device, n, dtype=torch.float32, **dims, **extra).train()

            def step():
                model.zero_grad(set_to_none=True)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()

            row["seconds"][name] = timed(step, device, min_seconds=1.0, max_repeats=5)
            row["peak_bytes"][name] = peak_memory(step, device)
        except Exception as error:  # noqa: BLE001
            row["failed"][name] = failure(error)
        model = None
        free_memory(device)
    yield row


def decode(device, preset, deadline):
    context, steps = preset["decode_context"], preset["decode_steps"]
    for name in ("gpt2", "linear_gpt2"):
        model = decoder(name, device, context + steps + 1, **preset["decoder_dims"])
        for batch in preset["decode_batches"]:
            row = {"section": "decode", "model": name, "batch": batch, "context": context}
            if time.time() > deadline:
                row["failed"] = "run deadline"
                yield row
                break
            try:
                ids = torch.randint(0, preset["decoder_dims"]["vocab_size"], (batch, context), device=device)
                with torch.no_grad():
                    step = GreedySteps(model, ids)
                    synchronize(device)
                    began = time.perf_counter()
                    for _ in range(steps):
                        step()
                    synchronize(device)
                seconds = (time.perf_counter() - began) / steps
                cache = step.cache
                row.update(seconds_per_step=seconds, tokens_per_second=batch / seconds)
                if hasattr(cache, "state_bytes"):
                    row["cache_bytes"] = cache.state_bytes()
                else:  # transformers' DynamicCache: a key and a value tensor per layer
                    row["cache_bytes"] = sum(t.numel() * t.element_size() for layer in cache.layers
                                             for t in (layer.keys, layer.values))
            except Exception as error:  # noqa: BLE001
                row["failed"] = failure(error)
            cache = step = None
            free_memory(device)
            yield row
        model = None
        free_memory(device)


# --------------------------------------------------------------------------------------------------------- report

def render(records: list[dict], command: str, preset: str = "gpu") -> str:
    """results.md from the records: one table per section, every figure as measured."""
    skipped = [r for r in records if r.get("skipped")]
    records = [r for r in records if not r.get("skipped")]
    lines = ["# GPU benchmark rows", "", f"Command: `{command}` (preset {preset!r}: `PRESETS` in "
             "scripts/gpu_benchmark.py gives every size).", ""]
    machine_rows = [r for r in records if r.get("section") == "machine"]
    if machine_rows:
        m = machine_rows[0]
        lines += [f"Machine: {m.get('gpu', m.get('device'))} ({m.get('multiprocessors', '?')} SMs, "
                  f"{m.get('memory_gib', '?')} GiB, compute capability {m.get('capability', '?')}); torch {m['torch']} "
                  f"(CUDA {m.get('cuda')}), transformers {m.get('transformers')}, triton {m.get('triton')}, "
                  f"fla {m.get('fla')}. Ceilings measured in this run: bf16 matmul "
                  f"{m['bf16_matmul_tflops']:.0f} TFLOP/s, device copy {m['copy_gb_per_s']:.0f} GB/s (read + written).",
                  ""]
    for r in (r for r in records if r.get("section") == "compile" and "paths" in r):
        lines += ["## The causal kernel eagerly and under torch.compile", "",
                  f"bf16 elu + 1 features, B 1, H {r['heads']}, n {r['n']:,}, d {r['head_dim']}; the functions each "
                  "call reached, and its relative L2 error against float64:", "", "| call | reached | error |",
                  "|---|---|---|"]
        for mode, reached in r["paths"].items():
            lines.append(f"| {mode} | {', '.join(reached)} | {r['relative_error'][mode]:.3g} |")
        lines.append("")
    kernel_rows = [r for r in records if r.get("section") == "kernel"]
    if kernel_rows:
        names = list(dict.fromkeys(name for r in kernel_rows for name in [*r["seconds"], *r["failed"]]))
        lines += ["## Causal attention kernel, bf16, milliseconds (median)", "",
                  f"B {kernel_rows[0]['batch']}, H {kernel_rows[0]['heads']}, d {kernel_rows[0]['head_dim']}, elu + 1 "
                  "features computed outside the timed call; fwd+bwd = forward and backward of a ones cotangent.", "",
                  "| mode | n | " + " | ".join(names) + " | default / fla | SDPA / default |", "|---" * (len(names) + 4) + "|"]
        for r in kernel_rows:
            cells = []
            for name in names:
                if name in r["seconds"]:
                    cells.append(f"{1e3 * r['seconds'][name]:.3g}")
                else:
                    cells.append(f"failed: {r['failed'].get(name, '?')}")
            own = r["seconds"].get("ours: default (auto)")
            fla = next((s for name, s in r["seconds"].items() if name.startswith("fla")), None)
            sdpa = next((s for name, s in r["seconds"].items() if name.startswith("SDPA")), None)
            ratio_fla = f"{own / fla:.2f}x" if own and fla else "-"
            ratio_sdpa = f"{sdpa / own:.2f}x" if own and sdpa else "-"
            lines.append(f"| {r['mode']} | {r['n']:,} | " + " | ".join(cells) + f" | {ratio_fla} | {ratio_sdpa} |")
        for r in (r for r in kernel_rows if r.get("profile")):
            prof = r["profile"]
            lines += ["", f"Where the default's time goes, {r['mode']} at n = {r['n']:,} (torch.profiler, device self "
                      f"time, {prof['total_ms']:.3g} ms a call in all):", "", "| op | ms / call | calls | share |",
                      "|---|---|---|---|"]
            lines += [f"| `{o['op']}` | {o['ms']:.3g} | {o['calls']} | {100 * o['share']:.0f}% |" for o in prof["ops"]]
        errors = [r for r in kernel_rows if r["errors"]]
        if errors:
            r = errors[0]
            lines += ["", f"Relative L2 error of the forward against float64 at n = {r['n']:,}: " + "; ".join(
                f"{name} {value:.2e}" for name, value in r["errors"].items()) + "."]
        lines.append("")
    encoder_rows = [r for r in records if r.get("section") == "encoder"]
    if encoder_rows:
        names = list(dict.fromkeys(name for r in encoder_rows for name in [*r["seconds"], *r["failed"]]))
        lines += [f"## Encoder forward, bf16 weights, batch 1: milliseconds (peak GB); Linformer k = "
                  f"{encoder_rows[0]['linformer_k']}", "",
                  "| n | " + " | ".join(names) + " | RoBERTa / Linformer | RoBERTa / linear |", "|---" * (len(names) + 3) + "|"]
        for r in encoder_rows:
            cells = []
            for name in names:
                if name in r["seconds"]:
                    peak = r["peak_bytes"].get(name)
                    cells.append(f"{1e3 * r['seconds'][name]:.4g}" + (f" ({peak / 1e9:.2f})" if peak else ""))
                else:
                    cells.append(f"failed: {r['failed'].get(name, '?')}")
            soft = r["seconds"].get("roberta (SDPA)")
            ratios = [f"{soft / r['seconds'][name]:.2f}x" if soft and name in r["seconds"] else "-"
                      for name in ENCODERS[1:]]
            lines.append(f"| {r['n']:,} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        lines.append("")
    image_rows = [r for r in records if r.get("section") == "images"]
    if image_rows:
        lines += ["## Image generation, \"Transformers are RNNs\" Tables 1-2 shape: images / s", "",
                  "Whole sequences sampled with `generate()` from a 1-token start, vocabulary 256, width "
                  f"{image_rows[0]['n_embd']}, {image_rows[0]['n_head']} heads, bf16 weights; each model at the largest batch tried that fitted (the batches tried are the preset's "
                  "list, not a search to the memory limit). A run marked *extrapolated* was stopped after the "
                  "preset's time cap and its seconds per token carried to the whole image: exact in expectation "
                  "for linear_gpt2 (every step costs the same), an upper bound for GPT-2 (its later steps read a "
                  "longer cache), so its x GPT-2 is a lower bound.", "",
                  "| n | model | layers | largest batch | images / s | x GPT-2 | runs |", "|---" * 7 + "|"]
        for r in image_rows:
            base = next((x.get("images_per_second") for x in image_rows if x["n"] == r["n"] and x["model"] == "gpt2"),
                        None)
            ips = r.get("images_per_second")
            runs = "; ".join(f"batch {x['batch']}: " + (
                (f"{x['images_per_second']:.3g}/s" + ("" if x.get("whole", True) else
                                                      f" ({x['tokens']:,} of {r['n'] - 1:,} tokens in "
                                                      f"{x['seconds']:.1f} s, extrapolated)"))
                if "images_per_second" in x else x["stopped"]) for x in r["runs"])
            figure = f"{ips:.3g}" if ips else "-"
            ratio = f"{ips / base:.1f}x" if ips and base else "-"
            lines.append(f"| {r['n']:,} | {r['model']} | {r['layers']} | {r.get('largest_batch', '-')} | {figure} | "
                         f"{ratio} | {runs} |")
        for r in (r for r in image_rows if r.get("step_profile")):
            prof = r["step_profile"]
            lines += ["", f"One decoding step of {r['model']} at n = {r['n']:,}, batch {prof['batch']:,}: "
                      f"{prof['wall_ms']:.3g} ms of wall time, {prof['total_ms']:.3g} ms of device time "
                      "(torch.profiler, device self time by op):", "", "| op | ms / step | calls | share |",
                      "|---|---|---|---|"]
            lines += [f"| `{o['op']}` | {o['ms']:.3g} | {o['calls']} | {100 * o['share']:.0f}% |" for o in prof["ops"]]
        lines.append("")
    for r in (r for r in records if r.get("section") == "train"):
        lines += [f"## Training step, decoders of the preset's size, batch {r['batch']}, n {r['n']:,}, bf16 autocast", "",
                  "| model | seconds / step | peak GB | x GPT-2 |", "|---|---|---|---|"]
        base = r["seconds"].get("gpt2")
        for name in [*r["seconds"], *r["failed"]]:
            if name in r["seconds"]:
                peak = r["peak_bytes"].get(name)
                peak = f"{peak / 1e9:.1f}" if peak else "-"
                ratio = f"{base / r['seconds'][name]:.2f}x" if base else "-"
                lines.append(f"| {name} | {r['seconds'][name]:.3g} | {peak} | {ratio} |")
            else:
                lines.append(f"| {name} | failed: {r['failed'][name]} | | |")
        lines.append("")
    decode_rows = [r for r in records if r.get("section") == "decode"]
    if decode_rows:
        lines += [f"## Decoding after a {decode_rows[0]['context']:,}-token prompt, bf16 weights: "
                  "tokens / s (cache MB)", "", "| batch | " + " | ".join(dict.fromkeys(r["model"] for r in decode_rows))
                  + " |", "|---" * (1 + len(dict.fromkeys(r["model"] for r in decode_rows))) + "|"]
        for batch in dict.fromkeys(r["batch"] for r in decode_rows):
            cells = []
            for model in dict.fromkeys(r["model"] for r in decode_rows):
                r = next((x for x in decode_rows if x["model"] == model and x["batch"] == batch), None)
                if r is None or "failed" in r:
                    cells.append(f"failed: {r['failed']}" if r else "-")
                else:
                    mb = f" ({r['cache_bytes'] / 1e6:.0f})" if r.get("cache_bytes") else ""
                    cells.append(f"{r['tokens_per_second']:.4g}{mb}")
            lines.append(f"| {batch} | " + " | ".join(cells) + " |")
        lines.append("")
    for r in skipped:
        lines.append(f"Section {r['section']} not run: {r['skipped']}.")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="where results.json and results.md are written")
    parser.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--deadline_s", type=float, default=300.0,
                        help="no section starts after this many seconds (rows measured so far are kept)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--report_only", action="store_true", help="rewrite results.md from results.json")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; run on a GPU machine or pass --device cpu")
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    records_path = output / "results.json"
    command = "python scripts/gpu_benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_only:
        data = json.loads(records_path.read_text())
        (output / "results.md").write_text(render(data["records"], data["command"], data["preset"]))
        return 0
    device = torch.device(args.device)
    preset = PRESETS[args.preset]
    began = time.time()
    deadline = began + args.deadline_s
    records = []

    def save():
        records_path.write_text(json.dumps({"command": command, "preset": args.preset, "records": records}, indent=1))
        (output / "results.md").write_text(render(records, command, args.preset))

    runners = {"machine": lambda: machine(device, preset), "kernel": lambda: kernel(device, preset),
               "compile": lambda: compile_dispatch(device, preset),
               "encoder": lambda: encoder(device, preset), "images": lambda: images(device, preset, deadline),
               "train": lambda: train(device, preset), "decode": lambda: decode(device, preset, deadline)}
    for section in sections:
        if time.time() > deadline:
            records.append({"section": section, "skipped": f"the run's {args.deadline_s:.0f} s deadline had passed"})
            save()
            continue
        print(f"[{time.time() - began:6.1f} s] {section}", flush=True)
        try:
            for row in runners[section]():
                row.setdefault("section", section)
                records.append(row)
                save()
                print(f"[{time.time() - began:6.1f} s]   {json.dumps(row)[:400]}", flush=True)
        except Exception as error:  # noqa: BLE001  (one section's failure must not lose the others)
            traceback.print_exc()
            records.append({"section": section, "skipped": f"failed: {failure(error)}"})
            save()
    save()
    print(render(records, command, args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
