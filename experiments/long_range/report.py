"""results.json, results.md (LRA Table 1 and Table 2 shapes, the copy task) and PNG plots from the stage records."""

import json
from pathlib import Path

from .efficiency import CONTENDED_BELOW, PROBE_SIZE, best_probe, contended, memory_bytes
from .models import LABELS, OURS
from .preset import TASKS as ALL_TASKS  # a report's sections and plots follow the preset's tasks
from .stages import write_atomic

# Long Range Arena (Tay et al. 2021), Table 1 (accuracy, %) and Table 2 (steps / s at 1K-4K, peak memory at 4K, GB),
# the figures the issue quotes; BigBird's per-task accuracies are not quoted there, only its LRA average.
LRA_TABLE1 = {"Transformer": (36.37, 64.27), "Linformer": (35.70, 53.94), "Performer": (18.01, 65.40),
              "Linear Trans.": (16.13, 65.90), "Reformer": (37.27, 56.10)}
LRA_TABLE2 = {"Transformer": ([8.1, 4.9, 2.3, 1.4], 9.48), "Linformer": ([9.3, 9.1, 8.5, 7.7], 0.99)}
PUBLISHED_NAME = {"roberta_sdpa": "Transformer", "linear_favor": "Performer", "linear_elu": "Linear Trans.",
                  "reformer": "Reformer", "linformer_k128": "Linformer", "linformer_k256": "Linformer",
                  "linformer_k128_rows": "Linformer", "linformer_k256_rows": "Linformer"}
BASELINE = "roberta_sdpa"
STOCK_EFFICIENT = ("longformer", "bigbird", "nystromformer", "reformer")


def _fmt(value, spec=".2f", missing="-"):
    return missing if value is None else format(value, spec)


def collect(records: dict) -> dict:
    """Accuracy by model and task, efficiency by model and n, copy curves by setting and model. Each efficiency
    measurement is judged `contended` against the best availability probe among all of them."""
    accuracy, efficiency, copy, notes = {}, {}, {}, {}
    best = best_probe(records)
    for record in records.values():
        a, m = record["args"], record["metrics"]
        if record["kind"] == "classify":
            accuracy.setdefault(a["model"], {})[a["task"]] = 100 * m["eval_accuracy"]
            if "bigbird_attention" in m:
                notes[f"bigbird {a['task']}"] = m["bigbird_attention"]
        elif record["kind"] == "efficiency":
            efficiency.setdefault(a["model"], {})[a["n"]] = {**m, "contended": contended(m, best)}
        elif record["kind"] == "copy":
            copy.setdefault(a["length"], {})[a["model"]] = m
    return {"accuracy": accuracy, "efficiency": efficiency, "copy": copy, "notes": notes}


def speed(result: dict) -> float | None:
    """Steps per second for the tables: of the fastest timed step where recorded (a shared CPU's median wall time
    varies several times with other jobs' load), else of the median step."""
    return result.get("best_steps_per_second", result.get("steps_per_second"))


def goals(summary: dict, tasks=ALL_TASKS) -> list[str]:
    """The issue's goals, each met or missed by how much, from what has finished (of the preset's `tasks`)."""
    acc, eff = summary["accuracy"], summary["efficiency"]
    lines = []
    base = acc.get(BASELINE, {})
    for task in [t for t in ("listops", "text") if t in tasks]:
        if task not in base:
            lines.append(f"- {task}: softmax baseline not finished yet; no accuracy goal can be judged.")
            continue
        ours = {m: v[task] for m, v in acc.items() if m in OURS and task in v}
        if not ours:
            continue
        best = max(ours, key=ours.get)
        gap = base[task] - ours[best]
        verdict = "met" if gap <= 2 else f"missed by {gap - 2:.2f} points"
        lines.append(f"- {task}: within 2 points of softmax ({base[task]:.2f}): best of ours {LABELS[best]} "
                     f"{ours[best]:.2f} (gap {gap:+.2f}): {verdict}. Every one of ours: "
                     + ", ".join(f"{m} {v - base[task]:+.2f}" for m, v in sorted(ours.items())))
    lines += copy_goals(summary.get("copy", {}))
    if "efficiency" not in tasks:
        return lines
    n = max((n for v in eff.values() for n in v), default=None)
    if n is None or BASELINE not in eff or n not in eff[BASELINE] or "steps_per_second" not in eff[BASELINE][n]:
        lines.append("- efficiency: softmax at the longest length not measured yet.")
        return lines
    soft = eff[BASELINE][n]
    if soft.get("contended"):
        lines.append(f"- efficiency at n = {n}: softmax was measured under contention (marked *): no ratio judged.")
        return lines
    stock = [speed(eff[m][n]) for m in STOCK_EFFICIENT if n in eff.get(m, {}) and "steps_per_second" in eff[m][n]]
    stock_contended = [m for m in STOCK_EFFICIENT if eff.get(m, {}).get(n, {}).get("contended")]
    if stock_contended:
        lines.append(f"- at n = {n}, {', '.join(stock_contended)} measured under contention (*): its speed is too low.")
    for model in sorted(m for m in eff if m in OURS and n in eff[m] and "steps_per_second" in eff[m][n]
                        and not eff[m][n].get("contended")):
        r = eff[model][n]
        ratio = speed(r) / speed(soft)
        memory = memory_bytes(r) / memory_bytes(soft) if memory_bytes(soft) else float("nan")
        beats = all(speed(r) >= s for s in stock)
        lines.append(f"- {model} at n = {n}: {ratio:.2f}x softmax steps/s (goal 4x: "
                     f"{'met' if ratio >= 4 else f'missed by {4 - ratio:.2f}x'}); "
                     f"{'faster than' if beats else 'not faster than'} every stock efficient encoder measured "
                     f"({len(stock)}); peak memory {memory:.2f} of softmax (goal <= 0.25: "
                     f"{'met' if memory <= 0.25 else 'missed'}).")
    return lines


def copy_goals(copy: dict) -> list[str]:
    """Issue 42's copy goal on the paper's task: linear_gpt2's final loss within 10% of softmax's or below it
    (judged on the eval loss, separator and copy scored as in training); the loss on the copy alone beside it."""
    lines = []
    for length in sorted(copy):
        soft, linear = copy[length].get("gpt2_sdpa"), copy[length].get("linear_gpt2")
        if not soft or not linear or "eval_copy_loss" not in soft:
            continue
        ratio = linear["eval_loss"] / soft["eval_loss"]
        verdict = "met" if ratio <= 1.1 else f"missed by {ratio - 1.1:.2f}x"
        if soft["eval_copy_accuracy"] < 0.9:  # two models at chance are "within 10%" of each other
            verdict = f"not judged: softmax copies only {100 * soft['eval_copy_accuracy']:.1f}% of the tokens"
        lines.append(f"- copy n = {length} (the paper's task): linear_gpt2 eval loss {linear['eval_loss']:.4f} against "
                     f"softmax's {soft['eval_loss']:.4f} ({ratio:.2f}x; goal: within 10% or below: {verdict}). "
                     f"On the copy alone {linear['eval_copy_loss']:.4f} against "
                     f"{soft['eval_copy_loss']:.4f} (token accuracy {100 * linear['eval_copy_accuracy']:.2f}% against "
                     f"{100 * soft['eval_copy_accuracy']:.2f}%).")
    return lines


def render_markdown(meta: dict, summary: dict) -> str:
    acc, eff, copy = summary["accuracy"], summary["efficiency"], summary["copy"]
    out = [f"# Long-range evidence: preset `{meta['preset']}`", "",
           f"- machine: {meta['machine']}",
           *([f"- hardware of the stages: {'; and '.join(meta['hardware'])}"] if meta.get("hardware") else []),
           f"- command: `{meta['command']}`" + (" (this report rewritten from the finished stages with `--report_only`)"
                                                 if meta.get("report_only") else ""), f"- date: {meta['date']}",
           f"- stages finished: {meta['finished']} of {meta['total']}" + (" (partial: rerun the command to go on)"
                                                                          if meta["finished"] < meta["total"] else ""),
           f"- tasks: {meta['task_notes']}", ""]
    tasks = set(meta.get("tasks", ALL_TASKS))
    out += (["## Accuracy (LRA Table 1 shape; %, held-out)", "",
             "| model | ListOps | Text | avg | gap to softmax (ListOps / Text) | LRA ListOps | LRA Text |",
             "|---|---|---|---|---|---|---|"] if tasks & {"listops", "text"} else [])
    base = acc.get(BASELINE, {})
    for model in meta["encoders"] if tasks & {"listops", "text"} else []:
        row = acc.get(model, {})
        lo, tx = row.get("listops"), row.get("text")
        avg = (lo + tx) / 2 if lo is not None and tx is not None else None
        gap = " / ".join(_fmt(row[t] - base[t], "+.2f") if t in row and t in base else "-" for t in ("listops", "text"))
        pub = LRA_TABLE1.get(PUBLISHED_NAME.get(model, ""), (None, None))
        pub_text = (_fmt(pub[0]), _fmt(pub[1])) if model != "bigbird" else ("-", "- (LRA average 55.01)")
        out.append(f"| {LABELS[model]} | {_fmt(lo)} | {_fmt(tx)} | {_fmt(avg)} | {gap} | {pub_text[0]} | {pub_text[1]} |")
    if summary["notes"]:
        out += ["", "BigBird's attention as run: " + ", ".join(f"{k}: {v}" for k, v in summary["notes"].items())]
    lengths = sorted({n for v in eff.values() for n in v})
    if lengths:
        out += ["", "## Training efficiency (LRA Table 2 shape)", "",
                "Training steps per second (forward, backward, AdamW step) on full-length random byte inputs (on CPU: of the "
                "fastest timed step after a warm-up, since other jobs on a shared machine inflate the median by up to "
                "several times; medians and CPU seconds are in results.json), and the "
                "peak memory of one step above the weights and optimizer state, each (model, n) in a fresh process "
                "(`benchmarks.measured`; memory: the profiler's tensor peak where it was measured, else the "
                "resident-set peak; CPU timings on a machine shared with other jobs vary by 2x or more).",
                "", "| model | " + " | ".join(f"steps/s n={n}" for n in lengths) + " | "
                + " | ".join(f"peak MB n={n}" for n in lengths) + f" | speed vs softmax n={lengths[-1]} | "
                f"memory vs softmax n={lengths[-1]} |", "|---" * (2 * len(lengths) + 3) + "|"]
        soft = eff.get(BASELINE, {}).get(lengths[-1], {})
        for model in meta.get("efficiency_models", meta["encoders"]):
            row = eff.get(model, {})
            speeds = [_fmt(speed(row[n]), ".3f", row[n].get("failed", "-")) + (" *" if row[n].get("contended") else "")
                      if n in row else "-" for n in lengths]
            mems = [_fmt(memory_bytes(row[n]) / 2**20, ".1f") if n in row and memory_bytes(row[n]) is not None
                    else "-" for n in lengths]
            last = row.get(lengths[-1], {})
            rel_s = (f"{speed(last) / speed(soft):.2f}x"
                     if "steps_per_second" in last and "steps_per_second" in soft else "-")
            rel_m = (f"{memory_bytes(last) / memory_bytes(soft):.2f}"
                     if memory_bytes(last) is not None and memory_bytes(soft) else "-")
            out.append(f"| {LABELS[model]} | " + " | ".join(speeds + mems) + f" | {rel_s} | {rel_m} |")
        out += ["", "LRA Table 2 (TPU v3, batch as in LRA; steps/s at 1K / 2K / 3K / 4K, peak memory at 4K): "
                + "; ".join(f"{k} {' / '.join(map(str, v[0]))} steps/s, {v[1]} GB" for k, v in LRA_TABLE2.items()),
                "", f"\\* measured while other jobs shared the cores (a {PROBE_SIZE} x {PROBE_SIZE} float32 matmul timed "
                f"before and after the steps ran under {CONTENDED_BELOW:.0%} of the best such probe among these "
                "measurements, or was not taken): not comparable, left out of the goals. Rerun the command to measure "
                "them again."]
    if copy:
        out += ["", "## Copy task (\"Transformers are RNNs\" 4.1; loss curves in copy_task.png, Figure 2's shape)", "",
                "Steps/s here is the stage's wall clock, with no check that the cores were free (some stages shared "
                "them with other jobs): compare speed " + ("in the efficiency table above" if "efficiency" in tasks
                                                           else "with `--time_steps`") + ", not here.", "",
                "| length | model | final train loss | eval loss | eval token accuracy (copied half) | steps/s |",
                "|---|---|---|---|---|---|"]
        for length in sorted(copy):
            for model in meta["decoders"]:
                m = copy[length].get(model)
                if m:
                    where = f" ({m['device']})" if m.get("device") else ""  # a GPU stage; CPU records name none
                    out.append(f"| {length} | {LABELS[model]} | {m['loss_curve'][-1][1]:.4f} | {m['eval_loss']:.4f} | "
                               f"{100 * m['eval_token_accuracy']:.2f} | {m['steps_per_second']:.2f}{where} |")
        paper = {length: {k: m for k, m in by_model.items() if "eval_copy_loss" in m}
                 for length, by_model in copy.items()}
        if any(paper.values()):
            out += ["", ("The paper's task (random lengths): the loss and accuracy above score the separator and the "
                         "copy, as the training loss does (the separator only where it falls, so it costs nothing to a "
                         "model that predicts it after every symbol of the first half); the copy alone, and its "
                         f"token accuracy {BREAKDOWN}:"), "",
                    ("| length | model | eval loss on the copy alone | token accuracy on the copy alone | copy "
                     "accuracy by m (%) | by place in the copy (%) | resumed at steps |"),
                    "|---|---|---|---|---|---|---|"]
            for length in sorted(paper):
                for model in meta["decoders"]:
                    m = paper[length].get(model)
                    if m:
                        out.append(f"| {length} | {LABELS[model]} | {m['eval_copy_loss']:.4f} | "
                                   f"{100 * m['eval_copy_accuracy']:.2f} | {_breakdown(m)} | "
                                   f"{', '.join(map(str, m.get('resumed_at', []))) or '-'} |")
            histories = [(length, model, paper[length][model]["eval_history"]) for length in sorted(paper)
                         for model in meta["decoders"] if paper[length].get(model, {}).get("eval_history")]
            if histories:
                out += ["", "Eval loss (and copy token accuracy, %) at the checkpoints scored while the stage ran "
                        "(`--eval_running`), then at its end (dotted in copy_task.png):", ""]
                out += [f"- n = {length}, {LABELS[model]}: {_history_text(history)}"
                        for length, model, history in histories]
    out += in_progress_lines(meta.get("in_progress") or {})
    out += ["", "## Goals (from the finished stages)", ""] + (goals(summary, tasks) or [
        "- none can be judged yet: each goal needs the finished stages it compares (softmax's and ours)."])
    drawn = [name for name, needs in (("accuracy.png", {"listops", "text"}), ("efficiency.png", {"efficiency"}),
                                      ("copy_task.png", {"copy"})) if tasks & needs]
    out += ["", f"Plots: {', '.join(drawn)}. Records of every stage: records.json."]
    return "\n".join(out) + "\n"


BREAKDOWN = ("by the sequence's number of symbols m, and by place in the copy: quarter 1 holds the first symbols "
             "copied, quarter 4 the last, written when the state has taken in the most tokens (every copied symbol "
             "was read m + 1 tokens before)")


def _history_text(history: list) -> str:
    """Scored checkpoints ([step, eval loss, copy accuracy]) as one line of text."""
    return "; ".join(f"step {step} {loss:.4f} ({100 * acc:.2f})" for step, loss, acc in history)


def _breakdown(scores: dict) -> str:
    """The copy's token accuracy by the sequence's number of symbols and by place in the copy, as two table cells."""
    cells = []
    for part in ("length", "place"):
        table = scores.get(f"eval_copy_accuracy_by_{part}") or {}
        cells.append(" / ".join(f"{name}: {100 * acc:.2f}" for name, acc in table.items()) or "-")
    return " | ".join(cells)


def in_progress_lines(running: dict) -> list[str]:
    """The copy stages still running (from their checkpoints): where each stands, and the training losses of the
    models of one length at the last step that all of them have logged, so that a run of many sittings can be read
    before it ends. Training losses (dropout on, the separator scored), not the eval losses the goals judge."""
    if not running:
        return []
    out = ["", "## Copy task in progress (from the running stages' checkpoints; not in the tables or goals above)", "",
           ("Dashed in copy_task.png. Training loss averaged over the logged window, with dropout, separator and copy "
            "scored as in training; the eval loss and accuracy come when a stage finishes."), "",
           "| length | model | step | of | last logged training loss | training hours so far | resumed at steps |",
           "|---|---|---|---|---|---|---|"]
    for key, m in sorted(running.items(), key=lambda kv: (kv[1]["length"], kv[0])):
        last = f"{m['curve'][-1][1]:.4f} (step {m['curve'][-1][0]})" if m["curve"] else "-"
        out.append(f"| {m['length']} | {LABELS[m['model']]} | {m['step']} | {m['steps']} | {last} | "
                   f"{m['seconds'] / 3600:.2f} | {', '.join(map(str, m['resumed_at'])) or '-'} |")
    scored = sorted(((key, m) for key, m in running.items() if "eval" in m), key=lambda kv: (kv[1]["length"], kv[0]))
    if scored:
        out += ["", ("Held-out scores of these checkpoints (`--report_only --eval_running`: float32, the 4 batches a "
                     "finished stage is scored on; the paper's task scores the separator and the copy, each also "
                     "alone):"), "",
                ("| length | model | step | eval loss | token accuracy | copy alone: loss | copy alone: accuracy | "
                 "separator alone: loss | separator alone: accuracy |"), "|---|---|---|---|---|---|---|---|---|"]
        for _, m in scored:
            e, parts = m["eval"], []
            for part in ("copy", "separator"):
                parts += ([f"{e[f'eval_{part}_loss']:.4f}", f"{100 * e[f'eval_{part}_accuracy']:.2f}"]
                          if f"eval_{part}_loss" in e else ["-", "-"])
            out.append(f"| {m['length']} | {LABELS[m['model']]} | {m['step']} | {e['eval_loss']:.4f} | "
                       f"{100 * e['eval_token_accuracy']:.2f} | {' | '.join(parts)} |")
        out += ["", f"Where the copy goes wrong in these checkpoints: token accuracy (%) {BREAKDOWN}.", "",
                "| length | model | step | by m | by place |", "|---|---|---|---|---|"]
        out += [f"| {m['length']} | {LABELS[m['model']]} | {m['step']} | {_breakdown(m['eval'])} |" for _, m in scored]
    histories = sorted(((key, m) for key, m in running.items() if len(m.get("eval_history", [])) > 1),
                       key=lambda kv: (kv[1]["length"], kv[0]))
    if histories:
        out += ["", "Eval loss (and copy token accuracy, %) at every checkpoint scored so far (dotted in "
                "copy_task.png):", ""]
        out += [f"- n = {m['length']}, {LABELS[m['model']]}: {_history_text(m['eval_history'])}"
                for _, m in histories]
    for length in sorted({m["length"] for m in running.values()}):
        curves = {m["model"]: dict(m["curve"]) for m in running.values() if m["length"] == length and m["curve"]}
        common = set.intersection(*(set(c) for c in curves.values())) if len(curves) > 1 else set()
        if common:
            step = max(common)
            out += ["", f"n = {length}, step {step}, the last step every running model has logged: "
                    + "; ".join(f"{LABELS[model]} {curve[step]:.4f}" for model, curve in sorted(curves.items()))
                    + " (training loss)."]
    return out


def plots(summary: dict, meta: dict, folder: Path) -> list[Path]:
    """accuracy.png (ListOps, Text), efficiency.png and copy_task.png, each where the preset has its tasks
    (`meta["tasks"]`; all where it does not say), drawn even when empty, so a partial run shows its state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = set(meta.get("tasks", ALL_TASKS))
    written = []
    if tasks & {"listops", "text"}:
        written.append(_accuracy_plot(plt, summary, meta, folder))
    if "efficiency" in tasks:
        written.append(_efficiency_plot(plt, summary, meta, folder))
    if "copy" in tasks:
        written.append(_copy_plot(plt, summary, meta, folder))
    return written


def _accuracy_plot(plt, summary: dict, meta: dict, folder: Path) -> Path:
    acc = summary["accuracy"]
    figure, axis = plt.subplots(figsize=(10, 4))
    models = [m for m in meta["encoders"] if m in acc]
    for offset, task in ((-0.2, "listops"), (0.2, "text")):
        axis.bar([i + offset for i in range(len(models))], [acc[m].get(task, 0) for m in models], width=0.4,
                 label=task)
    axis.set_xticks(range(len(models)), [m for m in models], rotation=40, ha="right", fontsize=8)
    axis.set_ylabel("held-out accuracy (%)")
    if models:
        axis.legend()
    axis.set_title("ListOps and byte-level Text")
    figure.tight_layout()
    figure.savefig(folder / "accuracy.png", dpi=110)
    plt.close(figure)
    return folder / "accuracy.png"


def _efficiency_plot(plt, summary: dict, meta: dict, folder: Path) -> Path:
    eff = summary["efficiency"]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for model in meta["encoders"]:
        rows = sorted((n, r) for n, r in eff.get(model, {}).items() if "steps_per_second" in r)
        if rows:
            axes[0].plot([n for n, _ in rows], [speed(r) for _, r in rows], marker="o", label=model,
                         linestyle="-" if model in OURS else "--")
            axes[1].plot([n for n, _ in rows], [max(memory_bytes(r) or 1, 1) / 2**20 for _, r in rows], marker="o",
                         label=model, linestyle="-" if model in OURS else "--")
    for axis, label in zip(axes, ("training steps / s", "peak MB above weights")):
        axis.set_xlabel("n")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(folder / "efficiency.png", dpi=110)
    plt.close(figure)
    return folder / "efficiency.png"


def _copy_plot(plt, summary: dict, meta: dict, folder: Path) -> Path:
    copy = summary["copy"]
    running = [m for m in (meta.get("in_progress") or {}).values() if m["curve"]]
    lengths = sorted(set(copy) | {m["length"] for m in running}) or [None]
    figure, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4), squeeze=False)
    for axis, length in zip(axes[0], lengths):
        for model in meta["decoders"]:
            m = copy.get(length, {}).get(model)
            if m:
                axis.plot(*zip(*m["loss_curve"]), label=LABELS[model])
                _plot_eval_history(axis, m.get("eval_history"), f"{LABELS[model]} (eval loss)")
        for m in running:
            if m["length"] == length:
                axis.plot(*zip(*m["curve"]), linestyle="--", label=f"{LABELS[m['model']]} (running, step {m['step']})")
                _plot_eval_history(axis, m.get("eval_history"), f"{LABELS[m['model']]} (running, eval loss)")
        axis.set_yscale("log")
        axis.set_xlabel("gradient step")
        axis.set_ylabel("cross entropy (copied half)")
        axis.set_title(f"copy task, n = {length}")
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(folder / "copy_task.png", dpi=110)
    plt.close(figure)
    return folder / "copy_task.png"


def _plot_eval_history(axis, history, label: str) -> None:
    """The eval losses of the scored checkpoints, dotted, where there are any."""
    if history:
        axis.plot([h[0] for h in history], [h[1] for h in history], linestyle=":", marker=".", label=label)


def write_report(output_dir: Path, meta: dict, records: dict) -> dict:
    """Write results.json, results.md and the plots; returns the summary."""
    summary = collect(records)
    report = {**meta, **summary, "records": records}
    write_atomic(output_dir / "results.json", json.dumps(report, indent=1, default=str))
    write_atomic(output_dir / "results.md", render_markdown(meta, summary))
    plots(summary, meta, output_dir)
    return summary
