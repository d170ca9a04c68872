"""The gate trace (scripts/recall.py --trace_gates): an MQAR stage's training retraced step for step (the stage's
start, batches, optimizer and schedule, so its loss and score are the stage's own), with the delta rule's gate read
along the way. Issue 42 asked why KDA's per-feature decays "close" in training where Gated DeltaNet's per-head gate
opens; the stage records read only the end points, and only as each head's geometric mean over its features.

At every `every` steps, for each gated layer:

* ``kept``: per head, the share of a write kept across the context's pairs, the head's decays averaged in the log
  (`memory_spans`' reading, the one the reports show);
* ``features_kept`` / ``features_forgotten`` (KDA's gate): the share of the head's key features that keep at least half
  of a write across the pairs, and at most 5%, each feature read on its own. The geometric mean is ruled by the
  features that forget: a head with a third of its features at 0 and the rest near 1 reads as "keeps nothing";
* ``pushed_to_close``: the share of the layer's decays (per head, or per head and feature) whose loss gradient,
  summed over the window's batches and tokens, is positive, so that a descent step lowers log alpha (forgets more);
  ``agreement`` (KDA's gate): per head, |sum over features| / sum of |.| of those gradients: 1 where every feature is
  pushed the same way, near 0 where they disagree (which a per-head gate, their sum, cannot follow);
  ``steadiness``: per decay, |its gradient summed over the window's steps| / the sum of the steps' sizes, averaged:
  1 where every step pushes it the same way. Adam moves a weight about lr a step where its gradient's sign holds and
  far less where it flips, so this, not the gradient's size, sets how fast a decay can move; for KDA also
  ``head_steadiness``, the same of each head's sum over its features (what one decay per head would get).

With ``tie_features`` KDA's per-feature decays are replaced in the forward by their mean over the head's features: a
per-head gate with KDA's parameters (projection, biases, start) otherwise unchanged, the ablation that asks whether
the per-feature freedom is what lets the decays fall. It is a probe, not a model family: the trace's json says so.
"""

import json
import shlex
import time
from pathlib import Path

import torch

from experiments.long_range.stages import write_atomic
from experiments.long_range.training import _step, make_optimizer
from hf_linear_attn.training.errors import UsageError

from .models import LABELS, LINEAR_VARIANTS
from .tasks import mqar_batch
from .training import FORGETS, memory_spans


def delta_gates(model) -> list:
    """Each layer's delta-rule gate (`DeltaRuleGate`), or None for a layer without one."""
    return [getattr(block.attn, "delta_gate", None) for block in model.transformer.h]


class GateReader:
    """Hooks on every delta-rule gate of a model: with `tie_features`, the forward's per-feature decays replaced by
    their mean over the head's features; and, while training, each gate's loss gradient on its log alpha summed over
    batch and tokens ((H,) per head, (H, d_k) per feature) at each backward, added up until `take()`: the sum, the
    sum of its sizes, and for a per-feature gate the same of its sum over each head's features (what one decay per
    head would get from the same gradients)."""

    def __init__(self, model, tie_features: bool = False):
        self.gates = delta_gates(model)
        self.sums = [None] * len(self.gates)
        self.hooks = []
        for i, gate in enumerate(self.gates):
            if gate is None:
                continue
            # registered first, so the capture below sees the tied decays, the ones the rule uses; a per-head gate
            # (no feature axis) has nothing to tie
            if tie_features and gate.head_dim:
                self.hooks.append(gate.register_forward_hook(
                    lambda module, inputs, out: out.mean(-1, keepdim=True).expand_as(out)))
            self.hooks.append(gate.register_forward_hook(lambda module, inputs, out, i=i: self._capture(i, out)))

    def _capture(self, i: int, log_decay: torch.Tensor) -> None:
        if log_decay.requires_grad:
            log_decay.register_hook(lambda grad: self._add(i, grad.detach().float().sum(dim=(0, 2))))

    def _add(self, i: int, grad: torch.Tensor) -> None:
        parts = {"sum": grad, "size": grad.abs()}
        if grad.dim() == 2:  # per feature: and the head's sum of them, as a per-head gate would see it
            parts.update(head_sum=grad.sum(-1), head_size=grad.sum(-1).abs())
        known = self.sums[i]
        self.sums[i] = parts if known is None else {key: known[key] + value for key, value in parts.items()}

    def take(self) -> list:
        """Per layer since the last take (None: no gate, or no backward yet), then zeroed: {"sum": the gradient's sum
        over the backward passes, "size": the sum of its sizes; per feature also "head_sum", "head_size"}."""
        sums, self.sums = self.sums, [None] * len(self.gates)
        return sums

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def read_decays(model, task: dict, batch_size: int, seed: int) -> list:
    """Per gated layer, `memory_spans`' reading on one fresh batch (the stage's own reading: the same seed), through
    the gates' hooks (the decays the rule uses): what a write keeps across the context's pairs, per head from the
    features' geometric mean (`kept`) and, for a per-feature gate, per feature (`features_kept`,
    `features_forgotten`); None for a layer without a gate."""
    reading = memory_spans(model, task, batch_size, seed)["layers"]
    keys = ("kept", "features_kept", "features_forgotten")
    return [None if gate is None else {key: [h[key] for h in heads] for key in keys if key in heads[0]}
            for gate, heads in zip(delta_gates(model), reading)]


def _steadiness(total: torch.Tensor, size: torch.Tensor) -> float:
    """|sum of a gradient over steps| / sum of its sizes, averaged over the decays: 1 where every step pushes a decay
    the same way, near 0 where the steps' pushes cancel. Adam moves a weight about lr a step where its gradient's
    sign holds, and much less where it flips, so this is what decides how fast a decay can move."""
    return (total.abs() / size.clamp(min=1e-30)).mean().item()


def _pushes(sums: dict | None) -> dict | None:
    if sums is None:
        return None
    gradient = sums["sum"]
    push = {"pushed_to_close": (gradient > 0).float().mean().item(),
            "steadiness": _steadiness(gradient, sums["size"])}
    if gradient.dim() == 2:  # per feature: do a head's features agree, and how steady is their sum?
        push["agreement"] = (gradient.sum(-1).abs() / gradient.abs().sum(-1).clamp(min=1e-30)).tolist()
        push["head_steadiness"] = _steadiness(sums["head_sum"], sums["head_size"])
    return push


def _gate_of(model_name: str) -> str | None:
    """"head", "feature" or None: the delta-rule gate a recall model is built with."""
    overrides = LINEAR_VARIANTS.get(model_name)
    if overrides is None or callable(overrides):  # those whose settings depend on the dims are no gated delta rule
        return None
    if (overrides.get("state_update"), overrides.get("state_decay")) != ("delta", "gated"):
        return None
    return overrides.get("delta_gate", "head")


def check_trace(args: dict, steps: int | None, every: int | None, tie_features: bool) -> None:
    """Refuse, before any training, a trace that cannot run: a model without a delta-rule gate, a tie of a per-head
    gate, steps beyond the stage's, a reading interval below 1."""
    gate = _gate_of(args["model"])
    if gate is None:
        raise UsageError(f"{args['model']} has no delta-rule gate to trace: name Gated DeltaNet or KDA models "
                         "(linear_gpt2_gated_delta_conv, linear_gpt2_kda_conv and their _long_ / _norm_ forms)")
    if tie_features and gate != "feature":
        raise UsageError(f"--tie_gate_features ties KDA's per-feature decays, but {args['model']}'s gate is one per "
                         "head already: leave the flag out, or name a KDA model")
    if steps is not None and not 0 < steps <= args["steps"]:
        raise UsageError(f"--trace_steps {steps}: give 1 to the stage's {args['steps']} steps")
    if every is not None and every < 1:
        raise UsageError(f"--trace_every {every}: give a positive number of steps")


def trace_gates(args: dict, steps: int | None = None, every: int | None = None, tie_features: bool = False,
                log=print) -> dict:
    """Retrace the MQAR stage of `args` (a stage's arguments) for `steps` of its steps (default all), reading the
    gates every `every` steps (default the stage's log_every); with all its steps, the stage's score too."""
    from .runner import initial_model, task_of
    from .training import evaluate_mqar

    check_trace(args, steps, every, tie_features)
    total = args["steps"]
    steps, every = steps or total, every or args["log_every"]
    model = initial_model(args)
    task = task_of(args)
    reader = GateReader(model, tie_features)
    # the stage's optimizer and schedule over the stage's whole length, and its batches from its seed
    optimizer, scheduler = make_optimizer(model, args["optimizer"], total)
    generator = torch.Generator().manual_seed(args["seed"])
    clip = args["optimizer"].get("grad_clip", 1.0)
    reading_seed = args["seed"] + 30_000  # the stage's own memory reading's batch
    points = [{"step": 0, "loss": None, "layers": read_decays(model, task, args["batch_size"], reading_seed),
               "pushes": None}]
    window, start = [], time.perf_counter()
    try:
        for step in range(steps):
            ids, labels = mqar_batch(args["batch_size"], generator=generator, **task)
            window.append(_step(model, optimizer, scheduler, {"input_ids": ids, "labels": labels}, clip))
            if (step + 1) % every == 0 or step + 1 == steps:
                points.append({"step": step + 1, "loss": sum(window) / len(window),
                               "layers": read_decays(model, task, args["batch_size"], reading_seed),
                               "pushes": [_pushes(g) for g in reader.take()]})
                window = []
                log(f"  step {step + 1}: loss {points[-1]['loss']:.3f}")
    finally:
        reader.remove()
    trace = {"model": args["model"], "tied": tie_features, "steps": steps, "every": every, "points": points,
             "seconds": time.perf_counter() - start, "args": args}
    if steps == total:  # the stage's held-out score (the tied gate's hooks are gone: score the tie again)
        if tie_features:
            reader = GateReader(model, tie_features=True)
        try:
            trace["score"] = evaluate_mqar(model, task, args["batch_size"], args["eval_batches"], args["seed"] + 10_000)
        finally:
            reader.remove()
    return trace


def trace_file(output_dir: Path, key: str, tied: bool, seed: int) -> Path:
    return Path(output_dir) / "gate_traces" / f"{key.replace('/', '__')}{'__tied' if tied else ''}__seed{seed}.json"


def _cells(values, fmt="{:.2f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def render(traces: list[dict]) -> str:
    """gate_traces.md: per trace, a table of its points."""
    out = ["# Gate traces", "",
           "Each MQAR stage's training retraced step for step (`--trace_gates`: the stage's start, batches, optimizer "
           "and schedule), its delta-rule gate read every few steps on the stage's memory-reading batch. Per gated "
           "layer: **kept**, per head, the share of a write kept across the context's pairs with the head's decays "
           "averaged in the log (the stage reports' reading); **features >= 1/2** and **<= 5%** (KDA's per-feature "
           "gate), per head, the share of its key features that keep at least half of a write across the pairs, and "
           f"at most {FORGETS:.0%}, each feature on its own; **pushed to close**, the share of the layer's decays "
           "whose loss gradient summed over the steps since the last row would lower them; **steadiness**, per "
           "decay, |its gradient summed over those steps| / the sum of the steps' sizes, averaged (1: every step "
           "pushes it the same way; Adam moves a weight about lr a step where the sign holds, far less where it "
           "flips); **per-head steadiness** (KDA), the same of each head's sum over its features, what one decay per "
           "head would get from the same gradients; **agreement** (KDA), per head, |sum of its features' gradients| "
           "/ sum of their sizes over the window (1: all pushed one way). \"Tied\": KDA's "
           "per-feature decays replaced in the forward by their mean over the head's features (a probe, not a model).",
           ""]
    for t in traces:
        a = t["args"]
        name = LABELS.get(t["model"], t["model"]) + (", decays tied per head (probe)" if t["tied"] else "")
        score = (f"; held-out accuracy **{t['score']['eval_accuracy']:.1%}** (loss {t['score']['eval_loss']:.3f})"
                 if t.get("score") else f"; the first {t['steps']:,} of its {a['steps']:,} steps")
        out += [f"## {name}: n = {a['length']}, {a['pairs']} pairs, width {a['width']}, lr {a['optimizer']['lr']:g}, "
                f"seed {a['seed']}", "", f"Command: `{t['command']}`; {t['machine']}"
                + f" ({t.get('hardware') or 'its instruction sets not recorded: a trace from before they were'})"
                + f"; {t['seconds'] / 60:.1f} minutes{score}.",
                ""]
        layers = [i for i, layer in enumerate(t["points"][0]["layers"]) if layer is not None]
        per_feature = any("features_kept" in t["points"][0]["layers"][i] for i in layers)
        columns = ["kept"] + (["features >= 1/2", "<= 5%"] if per_feature else []) + ["pushed to close",
                                                                                     "steadiness"] + (
            ["per-head steadiness", "agreement"] if per_feature else [])
        out += ["| step | loss | " + " | ".join(f"layer {i + 1} {c}" for i in layers for c in columns) + " |",
                "|---:|---:|" + "---|" * (len(layers) * len(columns))]
        for p in t["points"]:
            cells = []
            for i in layers:
                layer, push = p["layers"][i], (p["pushes"] or [None] * (i + 1))[i]
                cells.append(_cells(layer["kept"]))
                if per_feature:
                    cells += [_cells(layer["features_kept"], "{:.0%}"), _cells(layer["features_forgotten"], "{:.0%}")]
                cells.append("-" if push is None else f"{push['pushed_to_close']:.0%}")
                cells.append("-" if push is None or "steadiness" not in push else f"{push['steadiness']:.2f}")
                if per_feature:
                    cells.append("-" if push is None or "head_steadiness" not in push
                                 else f"{push['head_steadiness']:.2f}")
                    cells.append("-" if push is None else _cells(push["agreement"]))
            loss = "-" if p["loss"] is None else f"{p['loss']:.3f}"
            out.append(f"| {p['step']:,} | {loss} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def run(stages: list, output_dir: Path, steps: int | None, every: int | None, tie_features: bool, argv: list[str],
        log=print) -> list[dict]:
    """Trace each stage (a plan's `Stage`s) into output_dir/gate_traces/, then write gate_traces.md of every trace
    there."""
    from benchmarks.measuring import describe_hardware, describe_machine, hardware_text

    if not stages:
        raise UsageError("--trace_gates found no stage to trace: name the models (--models) of the preset's")
    for stage in stages:  # every stage checked before the first trains
        check_trace(stage.args, steps, every, tie_features)
    hardware = hardware_text(describe_hardware())  # the instruction sets and matmul peaks, measured once per run
    for stage in stages:
        path = trace_file(output_dir, stage.key, tie_features, stage.args["seed"])
        log(f"{stage.key}{' (tied)' if tie_features else ''}, seed {stage.args['seed']}: tracing")
        trace = trace_gates(stage.args, steps, every, tie_features, log)
        trace.update(command="python scripts/recall.py " + shlex.join(argv), machine=describe_machine(),
                     hardware=hardware, date=time.strftime("%Y-%m-%d"))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(trace, indent=1))
    traces = [json.loads(p.read_text()) for p in sorted((Path(output_dir) / "gate_traces").glob("*.json"))]
    write_atomic(Path(output_dir) / "gate_traces.md", render(traces))
    return traces
