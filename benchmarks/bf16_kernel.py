"""bf16 causal linear attention on a CPU with native bf16 (issue 37's goal), side by side in one run.

Forward + backward (and forward) at H 12, d 64, elu + 1 features, batch 1, for: this package's default call
(``causal_linear_attention(phi_q, phi_k, v)`` on bf16 inputs: "auto" precision and form), the float32 path on the same
inputs (``precision="float32"``), and flash-linear-attention's torch chunk form (``naive_chunk_linear_attn``, its
exact torch implementation, loaded by path so that its Triton imports are not needed). Methods interleaved, median of
``--repeats`` after a warm-up; the float32 and bf16 matmul peaks measured in the same run; each method's error against
float64 at the longest n; the CPU's model and instruction-set flags recorded.

    python scripts/bf16_kernel_check.py --output_dir results/benchmarks/bf16-kernel-<machine>
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_linear_attn.linear_attention import causal_linear_attention, native_bf16

H, D = 12, 64


def cpu_description() -> dict:
    """Model name and the instruction-set flags that decide bf16 speed."""  # noqa: D401
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "unknown", platform.processor()):
                model = line.partition(":")[2].strip()
            if line.startswith("flags"):
                flags.update(line.partition(":")[2].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": model, "flags": [f for f in wanted if f in flags], "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def matmul_peak(dtype, size=2048, repeats=5) -> float:
    """GFLOP/s of the best of ``repeats`` size^3 products."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = min(timed_once(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def timed_once(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def fla_torch_chunk():
    """fla's torch chunk form, or None with the reason."""
    from benchmarks.suites import load_fla_naive

    try:
        return load_fla_naive("linear_attn").naive_chunk_linear_attn, None
    except ImportError as error:
        return None, str(error)


def causal_flops(n: int, mode: str) -> float:
    """Matmul FLOPs of the chunked causal forms at C = m = d = 64, H 12: four n x 64 x 64 products per head forward
    (scores, chunk states, within-chunk and across-chunk outputs), twice as many backward."""
    forward = 4 * 2 * n * D * D * H
    return forward * (3 if mode == "fwd+bwd" else 1)


def profile_default(phi_q, phi_k, v, fn, calls=3) -> dict:
    """Self CPU time by op over ``calls`` forward + backward calls of ``fn``: {"ms_per_call", "ops": [[op, ms, share]]}."""
    from torch.profiler import ProfilerActivity, profile

    def run():
        leaves = [x.detach().clone().requires_grad_(True) for x in (phi_q, phi_k, v)]
        fn(*leaves).float().sum().backward()

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
    events = [(e.key, e.self_cpu_time_total / 1e3 / calls) for e in prof.key_averages()]
    total = sum(ms for _, ms in events)
    ops = sorted(((key, ms, ms / total) for key, ms in events if ms > 0), key=lambda e: -e[1])
    return {"n": phi_q.shape[2], "ms_per_call": total, "ops": [list(op) for op in ops[:15]]}


def profile_markdown(profile: dict, command: str, machine: dict) -> str:
    lines = ["# Where the default call's time goes (forward + backward)", "", f"Command: `{command}`.", "",
             f"Machine: {machine['cpu']}, flags {' '.join(machine['flags'])}, {machine['threads']} threads. "
             f"n {profile['n']:,}, H {H}, d {D}, batch 1, bf16 inputs; torch.profiler's self CPU time per call "
             f"({profile['ms_per_call']:.1f} ms in all), the 15 largest ops.", "",
             "| op | ms per call | share |", "|---|---:|---:|"]
    lines += [f"| {op} | {ms:.2f} | {100 * share:.1f}% |" for op, ms, share in profile["ops"]]
    product_ms = sum(ms for op, ms, _ in profile["ops"] if op in ("aten::bmm", "aten::mm"))
    flops, peak = causal_flops(profile["n"], "fwd+bwd"), machine["peak_gflops_before"]["bfloat16"]
    if product_ms:
        lines += ["", f"The products alone: {flops / 1e9:.2f} GFLOP in {product_ms:.1f} ms, "
                  f"{flops / product_ms / 1e6:.0f} GFLOP/s ({100 * flops / product_ms / 1e6 / peak:.0f}% of the "
                  f"{peak:.0f} GFLOP/s bf16 peak measured before the timings); the rest of the call is memory-bound "
                  "work: dtype conversions and copies (copy_), elementwise operations and sums (add, mul, div, sum)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--forms", nargs="*", default=[], metavar="FORM:CHUNK",
                        help="explicit bf16 forms timed beside the default, e.g. scan:64 parallel:128 (what "
                             "CAUSAL_FORM_TABLE's CPU bf16 rows are chosen from)")
    parser.add_argument("--compile", action="store_true",
                        help="also time the default call under torch.compile (inductor's CPU backend; one compile "
                             "per n and mode, its time recorded apart)")
    parser.add_argument("--profile", action="store_true",
                        help="write profile.md: torch.profiler's self time by op of the default call, forward + "
                             "backward at the longest n (where the time goes, against the matmul peak)")
    args = parser.parse_args(argv)
    if not native_bf16("cpu"):
        parser.error("this CPU has no native bf16 products (oneDNN reports none: no AVX512-BF16 / AMX); the bf16 "
                     "path would be emulated, thousands of times slower. Run this on such a CPU.")
    fla, why = fla_torch_chunk()
    if fla is None:
        parser.error(f"{why}: it is the peer this check compares with")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    machine = cpu_description()
    machine["peak_gflops_before"] = {"float32": matmul_peak(torch.float32), "bfloat16": matmul_peak(torch.bfloat16)}

    def t(x):  # fla's (B, T, H, K) layout
        return x.transpose(1, 2).contiguous()

    methods = {
        "default (auto)": lambda a, b, c: causal_linear_attention(a, b, c)[0],
        "float32 path": lambda a, b, c: causal_linear_attention(a, b, c, precision="float32")[0],
        "fla torch chunk": lambda a, b, c: fla(t(a), t(b), t(c), normalize=True).transpose(1, 2),
    }
    for form, chunk in (tuple(f.split(":")) for f in args.forms):  # the explicit bf16 forms: CAUSAL_FORM_TABLE's rows
        methods[f"bf16 {form} C{chunk}"] = (lambda f, c_: lambda a, b, c: causal_linear_attention(
            a, b, c, precision="bfloat16", form=f, chunk_size=c_)[0])(form, int(chunk))
    compile_seconds = {}
    if args.compile:
        methods["default, torch.compile"] = torch.compile(methods["default (auto)"], dynamic=False)
    rows = []
    for n in args.n:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, H, n, D, generator=g).bfloat16() for _ in range(3))
        phi_q, phi_k = (F.elu(x.float()).add(1).bfloat16() for x in (q, k))
        for train in (False, True):
            def call(fn):
                leaves = [x.detach().clone().requires_grad_(train) for x in (phi_q, phi_k, v)]
                began = time.perf_counter()
                if train:
                    fn(*leaves).float().sum().backward()
                else:
                    with torch.no_grad():
                        fn(*leaves)
                return time.perf_counter() - began

            for name, fn in methods.items():
                seconds = call(fn)  # warm-up (and, for torch.compile, the compile)
                if name == "default, torch.compile":
                    compile_seconds[f"{n} {'fwd+bwd' if train else 'fwd'}"] = seconds
            times = {name: [] for name in methods}
            for _ in range(args.repeats):  # interleaved: a disturbance hits every method alike
                for name, fn in methods.items():
                    times[name].append(call(fn))
            row = {"n": n, "mode": "fwd+bwd" if train else "fwd",
                   "seconds": {name: statistics.median(ts) for name, ts in times.items()}}
            if n == max(args.n) and not train:
                reference = causal_linear_attention(phi_q.double(), phi_k.double(), v.double())[0]
                row["errors"] = {}
                for name, fn in methods.items():
                    with torch.no_grad():
                        got = fn(phi_q, phi_k, v).double()
                    row["errors"][name] = ((got - reference).norm() / reference.norm()).item()
            rows.append(row)
            print(json.dumps(row), flush=True)
    profile = profile_default(phi_q, phi_k, v, methods["default (auto)"]) if args.profile else None
    machine["peak_gflops_after"] = {"float32": matmul_peak(torch.float32), "bfloat16": matmul_peak(torch.bfloat16)}
    command = "python scripts/bf16_kernel_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "results.json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows,
                                                  "compile_seconds": compile_seconds, "profile": profile}, indent=1))
    lines = ["# bf16 causal linear attention on a native-bf16 CPU", "", f"Command: `{command}`.", "",
             f"Machine: {machine['cpu']}, flags {' '.join(machine['flags'])}, {machine['threads']} threads, torch "
             f"{machine['torch']}. Matmul peak (GFLOP/s) before / after the timings: float32 "
             f"{machine['peak_gflops_before']['float32']:.0f} / {machine['peak_gflops_after']['float32']:.0f}, "
             f"bfloat16 {machine['peak_gflops_before']['bfloat16']:.0f} / "
             f"{machine['peak_gflops_after']['bfloat16']:.0f} (a lower second figure: the cores were shared).", "",
             f"H {H}, d {D}, batch 1, elu + 1 features; milliseconds, median of {args.repeats}, methods interleaved.", "",
             "| mode | n | " + " | ".join(methods) + " | fla / default |", "|---" * (len(methods) + 3) + "|"]
    for row in rows:
        s = row["seconds"]
        lines.append(f"| {row['mode']} | {row['n']:,} | " + " | ".join(f"{1e3 * s[m]:.1f}" for m in methods)
                     + f" | {s['fla torch chunk'] / s['default (auto)']:.2f}x |")
    lines += ["", "default (auto) = `causal_linear_attention(phi_q, phi_k, v)` on bf16 inputs: the bf16 path where the "
              "CPU computes bf16 natively, with CAUSAL_FORM_TABLE's form; float32 path = `precision=\"float32\"`."]
    for row in rows:
        if "errors" in row:
            lines += ["", f"Relative L2 error of the forward against float64 at n = {row['n']:,}: "
                      + "; ".join(f"{m} {e:.2e}" for m, e in row["errors"].items()) + "."]
    if compile_seconds:
        lines += ["", "default, torch.compile = the default call under `torch.compile(dynamic=False)`; its first call "
                  "(compile included) took " + "; ".join(f"{k} {v:.1f} s" for k, v in compile_seconds.items()) + "."]
    flops = {row["n"]: causal_flops(row["n"], "fwd+bwd") for row in rows}
    peak = machine["peak_gflops_before"]["bfloat16"]
    shares = [f"{name}, n {row['n']:,}: {100 * flops[row['n']] / row['seconds'][name] / 1e9 / peak:.0f}%"
              for row in rows if row["mode"] == "fwd+bwd"
              for name in ("default (auto)", "default, torch.compile") if name in row["seconds"]]
    lines += ["", f"Forward + backward, the share of the bf16 matmul peak ({peak:.0f} GFLOP/s, before the timings) "
              "that the matmul work reaches (4 products of n x 64 x 64 per head forward, 8 backward): "
              + "; ".join(shares) + "."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if profile is not None:
        (out / "profile.md").write_text(profile_markdown(profile, command, machine))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
