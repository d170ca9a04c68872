"""The gate trace (scripts/recall.py --trace_gates): it retraces a stage exactly, its gradient reading is the loss's
derivative (float64 finite differences), the tie makes KDA's decays one per head, the per-feature reading counts
features on their own, and bad requests are refused before any training."""

import json
import math

import pytest
import torch
from helpers import REPO_ROOT

from experiments.long_range.models import Dims
from experiments.long_range.stages import Stage
from experiments.recall.gate_trace import GateReader, check_trace, read_decays, trace_gates
from experiments.recall.models import build_recall_model
from experiments.recall.runner import run_mqar_stage
from experiments.recall.tasks import mqar_batch, mqar_vocab_size
from hf_linear_attn.training.errors import UsageError

TASK = {"length": 32, "pairs": 4, "num_keys": 16, "num_values": 16}


def stage_args(model: str, **changes) -> dict:
    return {"model": model, **TASK, "width": 32,
            "dims": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "steps": 6, "batch_size": 4, "seed": 3, "log_every": 3, "eval_batches": 1,
            "optimizer": {"lr": 0.05, "weight_decay": 0.1, "warmup_fraction": 0.1}, **changes}


def test_the_trace_retraces_its_stage_step_for_step():
    """Same start, batches, optimizer and schedule: the trace's losses are the stage's curve and its score the
    stage's score, exactly; readings at the start and after every `every` steps."""
    args = stage_args("linear_gpt2_kda_long_conv")
    metrics = run_mqar_stage(Stage("mqar-n32-p4-w32/linear_gpt2_kda_long_conv", "mqar", args))
    trace = trace_gates(args, log=lambda s: None)
    assert [[p["step"], p["loss"]] for p in trace["points"][1:]] == metrics["loss_curve"]
    assert trace["score"] == {k: metrics[k] for k in ("eval_loss", "eval_accuracy", "eval_queries")}
    assert [p["step"] for p in trace["points"]] == [0, 3, 6] and trace["points"][0]["pushes"] is None
    # its start's reading is the stage's memory_init (the same batch), its end's the stage's trained reading
    for point, record in ((trace["points"][0], metrics["memory_init"]), (trace["points"][-1], metrics["memory"])):
        for layer, heads in zip(point["layers"], record["layers"]):
            assert layer["kept"] == pytest.approx([h["kept"] for h in heads], rel=1e-5)
            assert layer["features_kept"] == pytest.approx([h["features_kept"] for h in heads])
    part = trace_gates(args, steps=4, every=2, log=lambda s: None)
    assert [p["step"] for p in part["points"]] == [0, 2, 4] and "score" not in part


def test_the_gradient_reading_is_the_losss_derivative_on_each_decay():
    """GateReader's sum is d loss / d (one shift of a head's, or a head's feature's, log alpha at every token and row),
    checked against autograd on such a shift (a leaf added to each gate's output, zero, so the model is unchanged),
    for KDA (per feature) and Gated DeltaNet (per head); sums of two backward passes add until take()."""
    for name in ("linear_gpt2_kda_long_conv", "linear_gpt2_gated_delta_conv"):
        torch.manual_seed(0)
        model = build_recall_model(name, Dims(32, 2, 2, 64), 32, mqar_vocab_size(16, 16))
        gates = [block.attn.delta_gate for block in model.transformer.h]
        shape = (2, 16) if name.startswith("linear_gpt2_kda") else (2,)
        shifts = [torch.zeros(shape, requires_grad=True) for _ in gates]
        for gate, shift in zip(gates, shifts):  # registered before the reader's: it sees the shifted decays
            gate.register_forward_hook(lambda module, inputs, out, shift=shift: out + (
                shift[None, :, None, :] if shift.dim() == 2 else shift[None, :, None]))
        reader = GateReader(model)
        generator = torch.Generator().manual_seed(1)
        steps = []  # each backward's gradient on the shifts, alone
        for _ in range(2):
            ids, labels = mqar_batch(3, generator=generator, **TASK)
            model(input_ids=ids, labels=labels).loss.backward()
            steps.append([shift.grad.clone() for shift in shifts])
            for shift in shifts:
                shift.grad = None
        gradient = reader.take()
        assert reader.take() == [None, None]
        reader.remove()
        for i, got in enumerate(gradient):
            first, second = steps[0][i], steps[1][i]
            assert got["sum"].shape == shape and first.abs().max() > 0
            torch.testing.assert_close(got["sum"], first + second, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(got["size"], first.abs() + second.abs(), rtol=1e-5, atol=1e-9)
            if len(shape) == 2:  # a per-head gate's view of the same gradients: each head's sum over its features
                torch.testing.assert_close(got["head_sum"], first.sum(-1) + second.sum(-1), rtol=1e-5, atol=1e-8)
                torch.testing.assert_close(got["head_size"], first.sum(-1).abs() + second.sum(-1).abs(), rtol=1e-5,
                                           atol=1e-8)
            else:
                assert "head_sum" not in got


def test_steadiness_is_one_for_a_steady_push_and_zero_where_the_steps_cancel():
    """The pushes' summary from GateReader's sums: the share pushed to close (a positive sum), and steadiness, the
    mean over decays of |sum over steps| / sum of the steps' sizes."""
    from experiments.recall.gate_trace import _pushes

    steps = torch.tensor([[[1.0, 2.0], [1.0, -1.0]], [[1.0, -2.0], [1.0, -3.0]]])  # two steps of (2 heads, 2 features)
    sums = {"sum": steps.sum(0), "size": steps.abs().sum(0), "head_sum": steps.sum(-1).sum(0),
            "head_size": steps.sum(-1).abs().sum(0)}
    push = _pushes(sums)
    assert push["pushed_to_close"] == 0.5  # sums 2, 0, 2, -4: two of four positive
    assert push["steadiness"] == pytest.approx((1 + 0 + 1 + 1) / 4)
    assert push["head_steadiness"] == pytest.approx((abs(3 - 1) / (3 + 1) + abs(0 - 2) / (0 + 2)) / 2)
    assert push["agreement"] == pytest.approx([2 / 2, 2 / 6])


def test_the_tie_gives_every_feature_of_a_head_its_mean_decay():
    """With the tie the decays the rule uses are one per head (their mean over the head's features, at every token):
    the per-feature reading is then all or nothing, and its kept equals the head's; the untied gate differs."""
    torch.manual_seed(0)
    model = build_recall_model("linear_gpt2_kda_conv", Dims(32, 2, 2, 64), 32, mqar_vocab_size(16, 16))
    x = torch.randn(2, 32, 32)
    gate = model.transformer.h[0].attn.delta_gate
    free = gate(x)
    reader = GateReader(model, tie_features=True)
    tied = gate(x)
    readings = read_decays(model, TASK, 4, seed=5)
    reader.remove()
    assert torch.allclose(tied, free.mean(-1, keepdim=True).expand_as(free))
    assert not torch.allclose(free, tied)
    for layer in readings:
        assert all(share in (0.0, 1.0) for share in layer["features_kept"] + layer["features_forgotten"])
        assert all(share == (k >= 0.5) for share, k in zip(layer["features_kept"], layer["kept"]))


def test_the_feature_reading_counts_features_that_the_geometric_mean_hides():
    """A KDA head whose gate keeps half its features whole (log alpha 0) and makes the other half forget at once:
    the geometric mean over features reads "keeps nothing"; the features' reading says half keep it all. The
    stage's memory reading (memory_spans) gives the same share."""
    from experiments.recall.training import memory_spans

    torch.manual_seed(0)
    model = build_recall_model("linear_gpt2_kda_conv", Dims(32, 2, 2, 64), 32, mqar_vocab_size(16, 16))
    with torch.no_grad():
        for block in model.transformer.h:
            gate = block.attn.delta_gate
            gate.f_proj[1].weight.zero_()  # no input dependence: the biases decide
            gate.A_log.zero_()
            gate.dt_bias.copy_(torch.tensor([-40.0, 10.0]).repeat(gate.dt_bias.numel() // 2))  # keep, forget, ...
    readings = read_decays(model, TASK, 4, seed=5)
    spans = memory_spans(model, TASK, 4, seed=5)
    for layer, heads in zip(readings, spans["layers"]):
        assert layer["features_kept"] == [0.5, 0.5] and layer["features_forgotten"] == [0.5, 0.5]
        assert all(k < 1e-6 for k in layer["kept"])  # exp(8 tokens x mean(0, -10)): nothing, by the mean
        assert [h["features_kept"] for h in heads] == [0.5, 0.5]
        assert [h["kept"] for h in heads] == pytest.approx(layer["kept"], abs=1e-12)
    assert math.exp(8 * -5.0) < 1e-6


def test_a_trace_that_cannot_run_is_refused_before_training(tmp_path, capsys):
    """A model without a delta-rule gate, a tie of Gated DeltaNet's per-head gate, steps beyond the stage's; and on
    the command line, the trace's options without --trace_gates, --trace_gates without --models, on a GPU, or at a
    negative seed."""
    import runpy

    with pytest.raises(UsageError, match="no delta-rule gate"):
        check_trace(stage_args("linear_gpt2_delta_conv"), None, None, False)
    with pytest.raises(UsageError, match="one per head already"):
        check_trace(stage_args("linear_gpt2_gated_delta_long_conv"), None, None, True)
    with pytest.raises(UsageError, match="give 1 to the stage's 6 steps"):
        check_trace(stage_args("linear_gpt2_kda_conv"), 7, None, False)
    main = runpy.run_path(str(REPO_ROOT / "scripts" / "recall.py"))["main"]
    for argv, message in ((["--preset", "delta-n64", "--trace_every", "5"], "add it"),
                          (["--preset", "delta-n64", "--trace_gates"], "name them"),
                          (["--preset", "delta-n64", "--trace_gates", "--models", "linear_gpt2_delta_conv"],
                           "no delta-rule gate"),
                          (["--preset", "delta-n64", "--trace_gates", "--models", "linear_gpt2_kda_conv", "--device",
                            "cuda"], "leave --device out"),
                          (["--preset", "delta-n64", "--trace_gates", "--models", "linear_gpt2_kda_conv", "--seed",
                            "-1"], "whole number >= 0")):
        with pytest.raises(SystemExit, match=message):
            main(argv + ["--output_dir", str(tmp_path)])
    assert not (tmp_path / "gate_traces").exists()


def test_a_trace_is_written_with_its_command_and_machine(tmp_path):
    """scripts/recall.py --trace_gates writes each trace's json (its command, machine, points) and gate_traces.md
    with a row per reading, the tied trace beside the free one."""
    import runpy

    preset = tmp_path / "tiny.json"
    preset.write_text(json.dumps({"seed": 3, "optimizer": {"lr": 0.05, "weight_decay": 0.1, "warmup_fraction": 0.1},
                                  "num_keys": 16, "num_values": 16, "lengths": [32], "pairs": [4], "widths": [32],
                                  "num_layers": 2, "head_size": 16, "ffn_multiple": 2, "steps": 4, "batch_size": 4,
                                  "log_every": 2, "eval_batches": 1, "models": ["linear_gpt2_kda_long_conv"]}))
    main = runpy.run_path(str(REPO_ROOT / "scripts" / "recall.py"))["main"]
    out = tmp_path / "traces"
    for tie in ([], ["--tie_gate_features"]):
        main(["--preset", str(preset), "--models", "linear_gpt2_kda_long_conv", "--trace_gates", "--output_dir",
              str(out), *tie])
    files = sorted((out / "gate_traces").glob("*.json"))
    assert [f.name for f in files] == ["mqar-n32-p4-w32__linear_gpt2_kda_long_conv__seed3.json",
                                       "mqar-n32-p4-w32__linear_gpt2_kda_long_conv__tied__seed3.json"]
    traces = [json.loads(f.read_text()) for f in files]
    assert [t["tied"] for t in traces] == [False, True]
    assert all("--trace_gates" in t["command"] and t["machine"] and len(t["points"]) == 3 for t in traces)
    assert all(t["hardware"].startswith("instruction sets ") and "matmul peak" in t["hardware"] for t in traces)
    text = (out / "gate_traces.md").read_text()
    assert text.count(f"({traces[0]['hardware']})") == 2
    assert text.count("| 4 | ") == 2 and "decays tied per head (probe)" in text and "held-out accuracy" in text
