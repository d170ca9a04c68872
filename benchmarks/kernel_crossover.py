"""Crossover suite (``scripts/benchmark.py --only crossover``): where each causal linear-attention form overtakes
softmax, and which form is fastest at each length.

One fresh process per (batch, dtype, forward or training, n) times, side by side on the same inputs, causal softmax
(``scaled_dot_product_attention(is_causal=True)``, PyTorch's fused kernel) and every causal form of this project:
"scan" and "parallel" (see ``causal_linear_attention``) at several chunk sizes, plus "auto", the form
:data:`~hf_linear_attn.linear_attention.CAUSAL_FORM_TABLE` picks today. Shapes are the kernel rows' (H 12, d 64,
feature map elu + 1 timed with the linear forms, since a layer pays for it), at batch 1 and 16. Training = forward +
backward of a fixed cotangent. bfloat16 is measured where the hardware computes it natively (``--dtype bfloat16``
forces it); there the linear forms run twice, with float32 products (``precision="float32"``) and with bf16 products
(``precision="bfloat16"``).

Reported in results.md:
- the crossover table: the shortest n at which each form beats softmax and stays ahead at every longer n measured;
- the fastest explicit form of every row, in CAUSAL_FORM_TABLE's terms: runs of (fewest positions, form, chunk),
  positions = batch x heads x n, per series, beside the table the code holds now.

Softmax stops being timed in a series once every form has beaten it at two lengths in a row (its cost grows as n^2,
theirs as n): at batch 16 and n 8,192 one training step of it takes minutes on 2 CPU cores.
"""

import statistics

import torch

from .measuring import timed_call

SUITES = ("crossover",)
FORMS = (("scan", 64), ("scan", 128), ("scan", 256), ("parallel", 64), ("parallel", 128), ("parallel", 256))
SOFTMAX = "softmax (SDPA)"

PRESETS = {
    "smoke": dict(n=[64], batches=[1], train_modes=[False, True], forms=(("scan", 32), ("parallel", 32)), heads=2,
                  head_dim=16, repeats=2, budget=5),
    "quick": dict(n=[64, 128, 256, 512, 1024, 2048, 4096, 8192], batches=[1, 16], train_modes=[False, True],
                  forms=FORMS, heads=12, head_dim=64, repeats=7, budget=40),
    "full": dict(n=[32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384], batches=[1, 16], train_modes=[False, True],
                 forms=FORMS + (("scan", 512), ("parallel", 512)), heads=12, head_dim=64, repeats=9, budget=90),
}


def configurations(preset_name: str, dtype: str) -> list[dict]:
    """One configuration per (dtype, training or not, batch, n) of the suites.py preset of this name (none for a
    preset not named here); float32 always, plus bfloat16 where the suites run in it (native bf16 hardware, or
    --dtype bfloat16)."""
    sizes = PRESETS.get(preset_name)
    if sizes is None:
        return []
    specs = []
    for kind_dtype in dict.fromkeys(("float32", dtype)):
        for train in sizes["train_modes"]:
            for batch in sizes["batches"]:
                series = f"{kind_dtype} {'fwd+bwd' if train else 'fwd'} batch {batch}"
                for n in sizes["n"]:
                    specs.append({"kind": "crossover", "series": series, "method": series, "n": n, "batch": batch,
                                  "dtype": kind_dtype, "train": train, "forms": [list(f) for f in sizes["forms"]],
                                  "heads": sizes["heads"], "head_dim": sizes["head_dim"],
                                  "repeats": sizes["repeats"], "budget": sizes["budget"]})
    return specs


def softmax_settled(spec: dict, earlier: list[dict]) -> int | None:
    """The n from which every form has beaten softmax at two measured lengths in a row in spec's series (then
    softmax is not timed again in that series: it only falls further behind), or None."""
    rows = sorted((r for r in earlier if r.get("kind") == "crossover" and r.get("series") == spec["series"]
                   and r["n"] < spec["n"]), key=lambda r: r["n"])
    streak = []
    for row in rows:
        if row.get("softmax_settled_since") is not None:
            return row["softmax_settled_since"]
        seconds = row.get("seconds", {})
        soft = seconds.get(SOFTMAX)
        linear = [s for name, s in seconds.items() if name != SOFTMAX]
        ahead = soft is not None and linear and all(s < soft for s in linear)
        streak = streak + [row["n"]] if ahead else []
        if len(streak) >= 2:
            return streak[0]
    return None


# ------------------------------------------------------------------------------------------ one configuration


def interleaved_medians(fns: dict, repeats: int, budget: float, device: str) -> dict[str, float]:
    """Median wall time of each function, timed in rounds that call every function once, in an order rotated from
    round to round, after one warm-up call of each: a slow spell of a shared machine, or a cost that drifts with
    the process's age, then falls on every candidate alike instead of on whichever was timed during it. Fewer
    rounds (at least one) where they would pass `budget` seconds."""
    for fn in fns.values():
        fn()
    names = list(fns)
    rounds = []
    while not rounds or (len(rounds) < repeats and sum(map(sum, rounds)) / len(rounds) * (len(rounds) + 1) < budget):
        shift = len(rounds) % len(names)
        order = names[shift:] + names[:shift]
        times = {name: timed_call(fns[name], device) for name in order}
        rounds.append([times[name] for name in names])
    return {name: statistics.median(r[i] for r in rounds) for i, name in enumerate(names)} | {"_rounds": len(rounds)}


def measure(spec: dict, device: str) -> dict:
    """Seconds per call of softmax and of every linear form, on the same q, k, v (and the same cotangent)."""
    from hf_linear_attn import causal_linear_attention
    from hf_linear_attn.linear_attention import choose_causal_form, native_bf16

    dtype = getattr(torch, spec["dtype"])
    shape = (spec["batch"], spec["heads"], spec["n"], spec["head_dim"])
    q, k, v = (torch.randn(shape, device=device, dtype=dtype).requires_grad_(spec["train"]) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def elu1(x):
        return torch.nn.functional.elu(x) + 1

    def softmax():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def linear(form, chunk, precision):
        def fn():
            return causal_linear_attention(elu1(q), elu1(k), v, chunk_size=chunk, form=form, precision=precision)[0]
        return fn

    precisions = ["float32"] + (["bfloat16"] if dtype == torch.bfloat16 else [])
    candidates = {}
    if spec.get("softmax_settled_since") is None:
        candidates[SOFTMAX] = softmax
    for precision in precisions:
        suffix = " bf16 products" if precision == "bfloat16" else ""
        for form, chunk in spec["forms"]:
            candidates[f"{form} C={chunk}{suffix}"] = linear(form, chunk, precision)
        candidates[f"auto{suffix}"] = linear("auto", None, precision)

    def call(fn):
        if spec["train"]:
            fn().backward(grad)
            for t in (q, k, v):
                t.grad = None
            return None
        with torch.no_grad():
            return fn()

    seconds = interleaved_medians({name: (lambda fn=fn: call(fn)) for name, fn in candidates.items()},
                                  spec["repeats"], spec["budget"], device)
    rounds = seconds.pop("_rounds")
    positions = spec["batch"] * spec["heads"] * spec["n"]
    auto_form = choose_causal_form(device, False, positions, spec["train"])
    return {"seconds": seconds, "rounds": rounds, "auto_picks": f"{auto_form[0]} C={auto_form[1]}",
            "device": device, "native_bf16": native_bf16(device)}


KINDS = {"crossover": measure}


# ------------------------------------------------------------------------------------------------- reports


def _linear_names(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(name for r in rows for name in r.get("seconds", {}) if name != SOFTMAX))


def crossovers(rows: list[dict]) -> dict[tuple[str, str], str]:
    """(series, form) -> the shortest n from which the form beats softmax at every longer n where softmax was timed,
    as text ("512"), or "not by N" where it is behind at N, the longest such n."""
    out = {}
    for series in dict.fromkeys(r["series"] for r in rows):
        measured = sorted((r for r in rows if r["series"] == series and "seconds" in r), key=lambda r: r["n"])
        timed = [r for r in measured if SOFTMAX in r["seconds"]]
        if not timed:
            continue
        for name in _linear_names(measured):
            ahead = [r["seconds"][SOFTMAX] > r["seconds"][name] for r in timed if name in r["seconds"]]
            if not ahead or not ahead[-1]:
                out[(series, name)] = f"not by {timed[-1]['n']}"
                continue
            first = len(ahead)
            while first > 0 and ahead[first - 1]:
                first -= 1
            out[(series, name)] = str(timed[first]["n"])
    return out


def fastest_forms(rows: list[dict], suffix: str = "") -> list[tuple[int, str, int]]:
    """From one series' rows: (fewest positions, form, chunk) runs of the fastest explicit form (not "auto") at
    each n, positions = batch x heads x n as CAUSAL_FORM_TABLE counts them, merged where the same form wins
    consecutive lengths; the first run starts at 0, as the table's rows do."""
    runs = []
    for r in sorted((r for r in rows if "seconds" in r), key=lambda r: r["n"]):
        # this precision's explicit forms: named "<form> C=<chunk><suffix>" (the table's pick is "auto<suffix>")
        explicit = {name: s for name, s in r["seconds"].items() if " C=" in name
                    and (name.endswith(suffix) if suffix else "bf16" not in name)}
        if not explicit:
            continue
        best = min(explicit, key=explicit.get)
        form, chunk = best.split(" C=")
        entry = (form, int(chunk.split()[0]))
        if not runs or runs[-1][1:] != entry:
            runs.append((0 if not runs else r["batch"] * r["heads"] * r["n"], *entry))
    return runs


def tables(results: list[dict]) -> str:
    rows = [r for r in results if r["kind"] == "crossover"]
    if not rows:
        return ""
    from hf_linear_attn.linear_attention import CAUSAL_FORM_TABLE

    out = ["### Causal forms against softmax: seconds per call (x = softmax / form, above 1 = faster)", "",
           "H 12, d 64 (smoke: smaller), feature map elu + 1 timed with the linear forms; softmax = "
           "`scaled_dot_product_attention(is_causal=True)`; training = forward + backward; \"auto\" = the form the "
           "code's CAUSAL_FORM_TABLE picked when the run was made (results.json: `auto_picks`), the same code as one of the explicit forms, so the gap between the two shows "
           "the row's noise. Each row is one process, its figures medians of rounds that time every method once in "
           "a rotating order (results.json: `rounds`).",
           ""]
    for series in dict.fromkeys(r["series"] for r in rows):
        series_rows = [r for r in rows if r["series"] == series]
        names = [SOFTMAX] + _linear_names(series_rows)
        out += [f"#### {series}", "", "| n | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for r in series_rows:
            seconds = r.get("seconds", {})
            soft = seconds.get(SOFTMAX)
            cells = []
            for name in names:
                if name not in seconds:
                    cells.append(r.get("failed") or (f"not timed (every form ahead since n={r['softmax_settled_since']})"
                                                     if name == SOFTMAX and r.get("softmax_settled_since") else "-"))
                elif name == SOFTMAX or soft is None:
                    cells.append(f"{seconds[name]:.4f}")
                else:
                    cells.append(f"{seconds[name]:.4f} ({soft / seconds[name]:.2f}x)")
            out.append(f"| {r['n']} | " + " | ".join(cells) + " |")
        out.append("")
    cross = crossovers(rows)
    series_names = list(dict.fromkeys(r["series"] for r in rows))
    forms = list(dict.fromkeys(name for (_, name) in cross))
    out += ["### Crossover: the shortest n from which each form beats softmax at every longer n measured", "",
            "| form | " + " | ".join(series_names) + " |", "|---" * (len(series_names) + 1) + "|"]
    for name in forms:
        out.append(f"| {name} | " + " | ".join(cross.get((s, name), "-") for s in series_names) + " |")
    device = next((r["device"] for r in rows if "device" in r), "cpu")
    out += ["", f"### The fastest form per series, as CAUSAL_FORM_TABLE rows ({device})", "",
            "Runs of (fewest positions, form, chunk), positions = batch x heads x n, where the fastest explicit form "
            "changes; differences within a row's noise (see \"auto\" against its twin above) make some runs noise.",
            "", "| series | (device, bf16 products, gradients) | measured: fastest form from | in the code now |",
            "|---|---|---|---|"]
    for series in series_names:
        mine = [r for r in rows if r["series"] == series]
        for bf16 in ([False, True] if mine[0]["dtype"] == "bfloat16" else [False]):
            key = (device, bf16, mine[0]["train"])
            measured = fastest_forms(mine, " bf16 products" if bf16 else "")
            out.append(f"| {series}{' (bf16 products)' if bf16 else ''} | {key} | {measured} | "
                       f"{CAUSAL_FORM_TABLE.get(key, '-')} |")
    return "\n".join(out) + "\n"


def plots(results: list[dict], folder):
    """crossover.png: seconds per call against n, one panel per series, one line per method."""
    rows = [r for r in results if r["kind"] == "crossover" and "seconds" in r]
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series_names = list(dict.fromkeys(r["series"] for r in rows))
    columns = min(4, len(series_names))
    lines = -(-len(series_names) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.5 * columns, 3.6 * lines), squeeze=False)
    for axis, series in zip(axes.flat, series_names):
        mine = [r for r in rows if r["series"] == series]
        for name in [SOFTMAX] + _linear_names(mine):
            points = [(r["n"], r["seconds"][name]) for r in mine if name in r["seconds"]]
            if points:
                axis.plot(*zip(*points), marker="o", markersize=3, label=name,
                          linewidth=2.5 if name == SOFTMAX else 1)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(series, fontsize=9)
        axis.set_xlabel("n")
        axis.set_ylabel("seconds / call")
        axis.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=6)
    for axis in list(axes.flat)[len(series_names):]:
        axis.set_visible(False)
    figure.tight_layout()
    path = folder / "crossover.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return [path]
