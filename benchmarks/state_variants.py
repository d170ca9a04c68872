"""The causal attention kernels of the linear decoder's variants side by side (issue 41, item 4): plain linear
attention, a sliding window + linear, a fixed decay (RetNet), a per-feature gate (GLA), the delta rule (DeltaNet),
Gated DeltaNet (the delta rule with a decay per head and token), Kimi Delta Attention (the delta rule with a decay per
key feature), and softmax (SDPA, causal).

One attention call on heads (B 1, H 12, d 64, elu + 1 features), float32, forward and forward + backward, at each n:
median of ``--repeats`` after a warm-up, methods interleaved per n; the float32 matmul peak and the CPU's model and
instruction sets recorded in the same run, so the seconds read against the machine. The question: do the window and
the decays keep the chunked form linear in n (time per position flat), and what does each cost beside plain linear
attention and softmax?

    python scripts/state_variants_benchmark.py --output_dir results/benchmarks/state-variants-<machine>
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.measuring import describe_hardware, describe_machine, hardware_text, median_seconds, write_json
from hf_linear_attn.decayed_linear_attention import causal_decayed_linear_attention
from hf_linear_attn.delta_rule import causal_delta_rule, delta_rule_gate_init, delta_rule_qk
from hf_linear_attn.linear_attention import causal_linear_attention
from hf_linear_attn.sliding_window_attention import causal_sliding_window_attention

H, D, WINDOW = 12, 64, 64
METHODS = ("softmax (SDPA)", "linear", "window 64 + linear", "fixed decay", "gated (per feature)", "delta rule",
           "gated delta rule", "KDA (delta rule, per feature)")
# the decayed kernels' two forms side by side (the columns above call form "auto": choose_decayed_form's pick)
FORM_METHODS = ("fixed decay, all chunks", "fixed decay, scan", "gated, all chunks", "gated, scan")


def inputs(n: int, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for _ in range(3))
    log_rates = torch.log(1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float32))).view(1, H, 1, 1)
    gate = F.logsigmoid(torch.randn(1, H, n, D, generator=g)) / 16
    # the delta rule's writing strength beta in (0, 1) and Gated DeltaNet's decay (one per head and token)
    beta = torch.sigmoid(torch.randn(1, H, n, generator=g))
    head_gate = F.logsigmoid(torch.randn(1, H, n, generator=g) + 4)
    # KDA's decay per key feature as its gate starts (Mamba-2's A and dt): up to e^-1.6 a token, so some chunks of 64
    # decay past one matmul split and take the blocks
    a_log, dt_bias = delta_rule_gate_init(H, g, features=D)
    logits = dt_bias.view(1, 1, H, D) + 0.5 * torch.randn(1, n, H, D, generator=g)
    feature_gate = (-a_log.exp().view(1, 1, H, 1) * F.softplus(logits)).transpose(1, 2)  # (1, H, n, D)
    leaves = [q, k, v, gate, beta, head_gate, feature_gate]
    return [t.requires_grad_(grad) for t in leaves], log_rates


def call(method: str, q, k, v, gate, beta, head_gate, feature_gate, log_rates):
    """One attention call; features (elu + 1; the delta rule's SiLU and unit length) inside, as the model computes
    them."""
    if method == "softmax (SDPA)":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if method in ("delta rule", "gated delta rule", "KDA (delta rule, per feature)"):
        q_unit, k_unit = delta_rule_qk(q, k)
        log_decay = {"gated delta rule": head_gate, "delta rule": None}.get(method, feature_gate)
        return causal_delta_rule(q_unit, k_unit, v, beta, log_decay=log_decay)[0]
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    if method == "linear":
        return causal_linear_attention(phi_q, phi_k, v)[0]
    if method == "window 64 + linear":
        theta = torch.zeros(H)
        return causal_sliding_window_attention(q, k, v, phi_q, phi_k, WINDOW, None, theta, 1e-6, 64, None)[0]
    form = {"all chunks": "chunks", "scan": "scan"}.get(method.rpartition(", ")[2], "auto")
    if method.startswith("fixed decay"):
        return causal_decayed_linear_attention(phi_q, phi_k, v, log_rates.expand(1, H, q.shape[2], 1), form=form)[0]
    return causal_decayed_linear_attention(phi_q, phi_k, v, gate, form=form)[0]


def measure(n: int, method: str, backward: bool, repeats: int) -> float:
    (q, k, v, gate, beta, head_gate, feature_gate), log_rates = inputs(n, backward)

    def run():
        out = call(method, q, k, v, gate, beta, head_gate, feature_gate, log_rates)
        if backward:
            out.sum().backward()
    if not backward:
        with torch.no_grad():
            return median_seconds(run, repeats, "cpu")
    return median_seconds(run, repeats, "cpu")


def render(result: dict) -> str:
    lines = [
        "# Causal attention of the linear decoder's variants, one call (issue 41)",
        "",
        f"Machine: {result['machine']}; {hardware_text(result['hardware'])}. B 1, H 12, d 64, float32, elu + 1 "
        f"features; window {WINDOW}; fixed decay RetNet's rates; gate GLA's form (one per feature, log sigmoid / 16); "
        f"the delta rule on SiLU'd unit-length q, k (no normaliser), beta a sigmoid, Gated DeltaNet's decay one per "
        f"head and token, KDA's one per key feature as its gate starts (Mamba-2's A and dt). "
        f"Median of {result['repeats']} after a warm-up. Command: `{result['command']}`.",
        "",
    ]
    for mode in ("forward", "forward + backward"):
        methods = [m for m in (*METHODS, *FORM_METHODS) if any(m in row for row in result["seconds"][mode].values())]
        lines += [f"## {mode}: ms per call (microseconds per position)", "",
                  "| n | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for n in result["n"]:
            cells = []
            for method in methods:
                seconds = result["seconds"][mode][str(n)].get(method)
                cells.append("-" if seconds is None else f"{seconds * 1e3:.1f} ({seconds / n * 1e6:.2f})")
            lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--softmax_up_to", type=int, default=16384, help="skip SDPA above this n")
    parser.add_argument("--forms", action="store_true", help="also time each decayed kernel's two forms explicitly")
    args = parser.parse_args(argv)
    import sys

    result = {"machine": describe_machine(), "hardware": describe_hardware("cpu"), "n": args.n,
              "repeats": args.repeats, "command": "python scripts/state_variants_benchmark.py " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "seconds": {"forward": {}, "forward + backward": {}}}
    for n in args.n:
        for mode, backward in (("forward", False), ("forward + backward", True)):
            row = result["seconds"][mode].setdefault(str(n), {})
            for method in (*METHODS, *(FORM_METHODS if args.forms else ())):
                if method.startswith("softmax") and n > args.softmax_up_to:
                    continue
                row[method] = measure(n, method, backward, args.repeats)
                print(f"n {n} {mode} {method}: {row[method] * 1e3:.1f} ms", flush=True)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.output_dir / "results.json", result)
    (args.output_dir / "README.md").write_text(render(result) + "\n")
    print(json.dumps(result["hardware"]))
    return 0
