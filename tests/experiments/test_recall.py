"""Recall (issue 42): the MQAR generator against its independent checker, refusals, the state each decoder carries,
learnability, and the runner end to end."""

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

from experiments.long_range.models import Dims
from experiments.recall.models import build_recall_model, decoding_state_bytes
from benchmarks.measuring import describe_machine
from experiments.long_range.stages import checkpoint_file, stage_file
from experiments.recall import training as recall_training
from experiments.recall.runner import (load_preset, lookup_began, plan, plot_losses, render_lookup_began,
                                      render_thresholds, run, state_threshold)
from experiments.recall.tasks import check_mqar_batch, mqar_batch, mqar_vocab_size
from hf_linear_attn.training.errors import UsageError


@pytest.mark.parametrize("length, pairs", [(16, 4), (64, 8), (256, 64), (101, 20)])
def test_generated_batches_pass_the_independent_check_and_are_seeded(length, pairs):
    for seed in range(5):
        ids, labels = mqar_batch(8, length, pairs, 64, 32, torch.Generator().manual_seed(seed))
        assert ids.shape == labels.shape == (8, length)
        check_mqar_batch(ids, labels, pairs)
        again, again_labels = mqar_batch(8, length, pairs, 64, 32, torch.Generator().manual_seed(seed))
        assert torch.equal(ids, again) and torch.equal(labels, again_labels)
        assert ids.min() >= 3 and ids.max() < mqar_vocab_size(64, 32)  # never <s> / <pad>


def test_the_checker_catches_a_wrong_value_a_missing_query_and_a_repeated_key():
    ids, labels = mqar_batch(4, 64, 8, 64, 32, torch.Generator().manual_seed(0))
    bad = labels.clone()
    t = (bad[2] != -100).nonzero()[0].item()
    bad[2, t] = 3 + 64 + (bad[2, t] - 3 - 64 + 1) % 32  # another value
    with pytest.raises(AssertionError, match="row 2"):
        check_mqar_batch(ids, bad, 8)
    dropped = labels.clone()
    dropped[1, (dropped[1] != -100).nonzero()[0].item()] = -100
    with pytest.raises(AssertionError, match="row 1: 7 labelled positions"):
        check_mqar_batch(ids, dropped, 8)
    repeated = ids.clone()
    repeated[3, 2] = repeated[3, 0]
    with pytest.raises(AssertionError, match="row 3"):
        check_mqar_batch(repeated, labels, 8)


def test_queries_reach_every_part_of_the_sequence():
    """Uniform query slots: over many rows, queries land in the first and in the last quarter after the context."""
    ids, labels = mqar_batch(200, 256, 8, 64, 64, torch.Generator().manual_seed(1))
    positions = (labels != -100).nonzero()[:, 1]
    assert positions.min() < 16 + 60 and positions.max() > 256 - 60


def test_impossible_settings_are_refused_with_the_fix():
    g = torch.Generator()
    with pytest.raises(UsageError, match="needs at least 64 tokens"):
        mqar_batch(1, 63, 16, 64, 64, g)
    with pytest.raises(UsageError, match="raise num_keys"):
        mqar_batch(1, 256, 16, 8, 64, g)
    with pytest.raises(UsageError, match="at least one key-value pair"):
        mqar_batch(1, 256, 0, 8, 64, g)


def test_presets_are_checked_and_pairs_that_do_not_fit_are_left_out(tmp_path):
    preset = json.loads((REPO_ROOT / "configs" / "recall" / "cpu.json").read_text())
    load_preset(REPO_ROOT / "configs" / "recall" / "cpu.json")
    for change, message in (({"speed": 1}, "unknown keys"), ({"models": ["gpt5"]}, "unknown recall model"),
                            ({"checkpoint_every": 0}, "'checkpoint_every' must be a positive number"),
                            ({"precision": "fp8"}, "unknown precision 'fp8'"),
                            ({"widths": [80]}, "not a multiple of head_size"), ({"num_keys": 4}, "raise num_keys")):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({**preset, **change}))
        with pytest.raises(UsageError, match=message):
            load_preset(path)
    stages, left_out = plan({**preset, "lengths": [64, 256], "pairs": [8, 32]})
    assert left_out == ["n = 64, 32 pairs (needs n >= 128)"]
    assert len(stages) == 3 * len(preset["widths"]) * len(preset["models"])
    assert len({s.key for s in stages}) == len(stages)


def test_the_state_at_which_a_model_falls_below_90_percent_is_read_from_its_widths():
    """Issue 42: per (length, pairs), the smallest state from which every larger one holds >= 90%, and the largest
    state below it; a dip at a larger state counts (a model is said to hold only above its last fall)."""
    kib = 1024
    measured = {"rises": [(16, 0.5), (32, 0.95), (64, 0.99)], "dips": [(16, 0.95), (32, 0.85), (64, 0.99)],
                "always": [(16, 0.97), (32, 0.99)], "never": [(16, 0.1), (32, 0.2)], "once": [(16, 0.99)]}
    rows = [{"model": model, "length": 256, "pairs": 64, "width": state, "state_bytes": state * kib,
             "accuracy": accuracy} for model, points in measured.items() for state, accuracy in points]
    rows.append({"model": "rises", "length": 256, "pairs": 16, "width": 16, "state_bytes": 16 * kib, "accuracy": 1.0})
    assert state_threshold(rows, "rises", 256, 64) == (32 * kib, 16 * kib)
    assert state_threshold(rows, "dips", 256, 64) == (64 * kib, 32 * kib)
    assert state_threshold(rows, "always", 256, 64) == (16 * kib, None)
    assert state_threshold(rows, "never", 256, 64) == (None, 32 * kib)
    assert state_threshold(rows, "once", 256, 64) is None  # one state: no crossing to read
    table = "\n".join(render_thresholds(rows, list(measured)))
    assert "## n = 256, 64 pairs" in table and "16 pairs" not in table  # one width at 16 pairs: no table
    assert "| rises | 16 KiB, 32 KiB, 64 KiB | 32 KiB | 16 KiB |" in table
    assert "| never | 16 KiB, 32 KiB | none measured | 32 KiB |" in table
    assert "| once |" not in table


def test_the_plateau_table_gives_the_step_each_loss_first_fell_below_ln_pairs(tmp_path):
    # curves logged every 100 steps: "late" crosses ln 64 = 4.159 between 400 and 500, "stuck" stays at ln 128
    def row(model, losses, width=64):
        return {"model": model, "length": 256, "pairs": 64, "width": width, "num_values": 128, "accuracy": 0.5,
                "loss_curve": [[100 * (i + 1), loss] for i, loss in enumerate(losses)]}

    late = row("late", [4.85, 4.8, 4.5, 4.17, 4.15, 1.0, 0.5, 0.1])
    stuck = row("stuck", [4.85] * 8)
    early = row("early", [4.85, 4.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    alone = row("alone", [4.0] * 8, width=128)  # the only model of its cell: no table for it
    expected = {"early": 200, "late": 500, "stuck": None}
    for r in (late, stuck, early):
        bar = math.log(64)
        assert lookup_began(r) == next((s for s, loss in r["loss_curve"] if loss < bar), None) == expected[r["model"]]
    text = "\n".join(render_lookup_began([stuck, late, alone, early]))
    body = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert [line.split(" | ")[0][2:] for line in body] == ["early", "late", "stuck"]  # ordered by when they began
    assert body[0].endswith("| step 200 |") and body[1].endswith("| step 500 |") and body[2].endswith("| never |")
    assert "width 128" not in text and "ln 64 = 4.16" in text
    # eight evenly spaced logged steps, each with the loss logged there
    header = next(line for line in text.splitlines() if line.startswith("| model"))
    assert header.count("| step ") == 8 and "| 4.17 |" in body[1]
    assert render_lookup_began([late]) == []
    # the plot: written for a cell of two or more, and an old one removed when no cell has two
    plot = tmp_path / "mqar_loss.png"
    assert plot_losses([late, stuck, alone], plot) and plot.stat().st_size > 1000
    assert not plot_losses([late, alone], plot) and not plot.exists()


def test_decoding_state_bytes_constant_for_recurrent_models_and_growing_for_softmax():
    dims = Dims(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    vocab = mqar_vocab_size(16, 16)
    sizes = {}
    for name in ("gpt2_sdpa", "linear_gpt2", "linear_gpt2_hedgehog", "linear_gpt2_conv", "gpt2_conv",
                 "linear_gpt2_window", "linear_gpt2_window_conv", "linear_gpt2_hedgehog_conv",
                 "linear_gpt2_hedgehog_narrow_conv", "linear_gpt2_hybrid_conv", "linear_gpt2_hybrid_last_conv",
                 "linear_gpt2_delta", "linear_gpt2_delta_conv", "linear_gpt2_gated_delta_conv",
                 "linear_gpt2_kda_conv"):
        torch.manual_seed(0)
        model = build_recall_model(name, dims, 128, vocab)
        sizes[name] = [decoding_state_bytes(model, n, vocab) for n in (32, 64, 128)]
    assert sizes["gpt2_sdpa"] == [32 * 2 * 2 * 32 * 4 * k for k in (1, 2, 4)]  # keys + values, 2 layers, float32
    assert len(set(sizes["linear_gpt2"])) == 1 and len(set(sizes["linear_gpt2_hedgehog"])) == 1
    # elu + 1: per layer and head S (m x d) and z (m), m = d = 16, float32
    assert sizes["linear_gpt2"][0] == 2 * 2 * (16 * 16 + 16) * 4
    assert build_recall_model("linear_gpt2_hedgehog", dims, 64, vocab).config.feature_map == "hedgehog"
    # short conv: elu's state plus, per layer, the last K - 1 = 3 inputs of q, k, v (3 x 32 wide), float32
    assert len(set(sizes["linear_gpt2_conv"])) == 1
    assert sizes["linear_gpt2_conv"][0] == sizes["linear_gpt2"][0] + 2 * 3 * 3 * 32 * 4
    # GPT-2 + short conv: GPT-2's keys and values, a real-token mask byte per token and layer, and the same buffers
    assert sizes["gpt2_conv"] == [size + 2 * n + 2 * 3 * 3 * 32 * 4
                                  for size, n in zip(sizes["gpt2_sdpa"], (32, 64, 128))]
    gpt2_conv = build_recall_model("gpt2_conv", dims, 64, vocab)
    assert gpt2_conv.config.layer_types == ["full_attention"] * 2 and gpt2_conv.config.short_conv_on_full_attention
    assert gpt2_conv.num_parameters() == build_recall_model("linear_gpt2_conv", dims, 64, vocab).num_parameters()
    # Based's recipe: the window's ring of keys and values (fixed, not growing with n) plus the same buffers
    assert len(set(sizes["linear_gpt2_window_conv"])) == 1
    assert sizes["linear_gpt2_window_conv"][0] == sizes["linear_gpt2_window"][0] + 2 * 3 * 3 * 32 * 4
    window_conv = build_recall_model("linear_gpt2_window_conv", dims, 128, vocab).config
    assert window_conv.attention_window == 64 and window_conv.use_short_conv and window_conv.feature_map == "elu"
    # started even (issue 41): g = exp(theta) = the head size, elu + 1's feature width
    assert window_conv.attention_window_factor_init == pytest.approx(math.log(16))
    assert build_recall_model("linear_gpt2_window_conv", dims, 32, vocab).config.attention_window == 32
    gated_conv = build_recall_model("linear_gpt2_gated_conv", dims, 64, vocab).config
    assert gated_conv.use_short_conv and gated_conv.state_decay == "gated" and gated_conv.feature_map == "elu"
    # hedgehog + conv: hedgehog's state plus the same buffers
    hedgehog_conv = build_recall_model("linear_gpt2_hedgehog_conv", dims, 64, vocab).config
    assert hedgehog_conv.use_short_conv and hedgehog_conv.feature_map == "hedgehog"
    assert sizes["linear_gpt2_hedgehog_conv"] == [size + 2 * 3 * 3 * 32 * 4 for size in sizes["linear_gpt2_hedgehog"]]
    # the narrow hedgehog: 2 x 8 features at head size 16, elu + 1's width, so elu + 1 + conv's state to the byte
    narrow = build_recall_model("linear_gpt2_hedgehog_narrow_conv", dims, 64, vocab).config
    assert (narrow.feature_map, narrow.learned_feature_dim, narrow.use_short_conv) == ("hedgehog", 8, True)
    assert sizes["linear_gpt2_hedgehog_narrow_conv"] == sizes["linear_gpt2_conv"]
    # the delta rule: S (d x d) per layer and head, no normaliser; with the convolution, the same buffers
    assert sizes["linear_gpt2_delta"] == [2 * 2 * 16 * 16 * 4] * 3
    assert sizes["linear_gpt2_delta_conv"] == [size + 2 * 3 * 3 * 32 * 4 for size in sizes["linear_gpt2_delta"]]
    assert build_recall_model("linear_gpt2_delta_conv", dims, 64, vocab).config.state_update == "delta"
    assert sizes["linear_gpt2_gated_delta_conv"] == sizes["linear_gpt2_delta_conv"]  # the gate keeps no state
    assert sizes["linear_gpt2_kda_conv"] == sizes["linear_gpt2_delta_conv"]  # KDA's gate per feature: no state either
    assert build_recall_model("linear_gpt2_kda_conv", dims, 64, vocab).config.delta_gate == "feature"
    # the hybrids: one layer of GPT-2 + conv's cache (growing with n) and one of linear + conv's state, in either order
    for name, first in (("linear_gpt2_hybrid_conv", "full_attention"),
                        ("linear_gpt2_hybrid_last_conv", "linear_attention")):
        assert sizes[name] == [(a + b) // 2 for a, b in zip(sizes["gpt2_conv"], sizes["linear_gpt2_conv"])]
        hybrid = build_recall_model(name, dims, 64, vocab).config
        assert hybrid.layer_types[0] == first and sorted(hybrid.layer_types) == ["full_attention", "linear_attention"]
        assert hybrid.use_short_conv and hybrid.short_conv_on_full_attention
        with pytest.raises(UsageError, match="needs num_layers >= 2"):  # one layer would be GPT-2 + conv, mislabelled
            build_recall_model(name, Dims(32, 1, 2, 64), 64, vocab)


class _KnownLookup(torch.nn.Module):
    """A stand-in decoder whose attention weights are written by hand, row by row in plain Python from the context's
    pairs: layer 1, head 1 puts all its weight on the queried pair's value; head 2 spreads it evenly; layer 2, head 1
    on position 0 (a key, never in a pair's span), head 2 half and half on the two positions after the value; layer 3
    (signed, as the delta rule's weights are), head 1 +1 on the value, -1 on the position after it and +2 on
    position 0, head 2 -1 on position 0 only."""

    config = type("Config", (), {"model_type": "known-lookup"})()

    def __init__(self, pairs):
        super().__init__()
        self.pairs = pairs
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, output_attentions):
        b, n = input_ids.shape
        first, second, third = (torch.zeros(b, 2, n, n) for _ in range(3))
        for row, seq in enumerate(input_ids.tolist()):
            where = {seq[2 * i]: 2 * i for i in range(self.pairs)}  # key -> its position in the context
            for t in range(n):
                first[row, 1, t, : t + 1] = 1 / (t + 1)
                second[row, 0, t, 0] = 1
                third[row, :, t, 0] = torch.tensor([2.0, -1.0])
                if t >= 2 * self.pairs and seq[t] in where:  # a query (or a random key token: weights all the same)
                    value = where[seq[t]] + 1
                    first[row, 0, t, value] = 1
                    third[row, 0, t, value] = 1
                    for after in (value + 1, value + 2):
                        if after <= t:
                            second[row, 1, t, after] += 0.5
                    if value + 1 <= t:
                        third[row, 0, t, value + 1] = -1
                else:
                    first[row, 0, t, 0] = 1
        return type("Out", (), {"attentions": (first, second, third)})()


def test_the_lookup_reading_finds_the_head_that_attends_to_the_queried_pair():
    from experiments.recall.training import lookup_attention

    task = {"length": 48, "pairs": 6, "num_keys": 16, "num_values": 16}
    reading = lookup_attention(_KnownLookup(6), task, batch_size=3, batches=2, seed=7)
    # the same batches, and what even weights put on the pair, counted independently of the reading's indexing
    generator, even, queries, halves, reached, signed, shares = torch.Generator().manual_seed(7), [], 0, [], [], [], []
    for _ in range(2):
        ids, labels = mqar_batch(3, generator=generator, **task)
        for seq, lab in zip(ids.tolist(), labels.tolist()):
            where = {seq[2 * i]: 2 * i for i in range(6)}
            for answer in (p for p, label in enumerate(lab) if label != -100):
                t, value = answer - 1, where[seq[answer - 1]] + 1
                even.append(sum(1 for x in (value, value + 1, value + 2) if x <= t) / (t + 1))
                halves.append(0.5 * sum(1 for x in (value + 1, value + 2) if x <= t))
                reached.append(1.0 if value + 1 <= t else 0.0)  # layer 2, head 2's row is all on the span, or empty
                signed.append(1.0 - reached[-1])  # +1 and -1 cancel where both are seen
                shares.append((1 + reached[-1]) / (3 + reached[-1]))  # |+1| (+ |-1|) of |+1| (+ |-1|) + |+2|
                queries += 1
    assert reading["queries"] == queries == 2 * 3 * 6
    assert reading["layers"][0] == pytest.approx([1.0, sum(even) / queries])
    assert reading["uniform"] == pytest.approx(sum(even) / queries)
    assert reading["layers"][1] == pytest.approx([0.0, sum(halves) / queries])
    assert sum(halves) / queries < 1  # some query sits right after the last pair: the span reaches past it
    # the share of the row's absolute weight: the weight itself where rows are positive and sum to 1
    assert reading["layers_abs"][0] == pytest.approx(reading["layers"][0])
    assert reading["layers_abs"][1] == pytest.approx([0.0, sum(reached) / queries])
    # signed rows: weights of both signs on the pair cancel in the sum, not in the share
    assert reading["layers"][2] == pytest.approx([sum(signed) / queries, 0.0])
    assert reading["layers_abs"][2] == pytest.approx([sum(shares) / queries, 0.0])
    assert sum(signed) < sum(shares)  # the head the sum nearly misses


def test_the_lookup_reading_of_real_decoders():
    """On the models' own attention: an untrained softmax decoder spreads its weight nearly evenly, so each head's
    reading is near the even-weights share; a model whose weights are not an n x n matrix in position order (the
    causal Linformer's, Reformer's) or that returns none (SDPA's GPT-2) gets no reading."""
    from experiments.recall.training import lookup_attention

    task = {"length": 64, "pairs": 8, "num_keys": 32, "num_values": 32}
    vocab = mqar_vocab_size(32, 32)
    torch.manual_seed(0)
    reading = lookup_attention(build_recall_model("gpt2_conv", Dims(64, 2, 2, 128), 64, vocab), task, 4, 1, seed=3)
    assert len(reading["layers"]) == 2 and all(len(heads) == 2 for heads in reading["layers"])
    for heads in reading["layers"]:
        assert heads == pytest.approx([reading["uniform"]] * 2, rel=0.3)
    for name in ("gpt2_sdpa", "linformer_gpt2", "reformer_lsh"):
        assert lookup_attention(build_recall_model(name, Dims(32, 1, 2, 64), 64, vocab), task, 2, 1, seed=3) is None


def test_the_memory_reading_gives_each_heads_decay_and_what_a_write_keeps_across_the_pairs():
    """RetNet's fixed rates, known in closed form: alpha is head h's rate 1 - 2^(-5-h) and a write keeps rate^(2 x
    pairs) across the context's pairs; a model without a decay gets no reading; Gated DeltaNet's and KDA's gates give a
    decay in (0, 1) per head, every layer."""
    from experiments.recall.training import memory_spans

    task = {"length": 64, "pairs": 8, "num_keys": 32, "num_values": 32}
    vocab = mqar_vocab_size(32, 32)
    torch.manual_seed(0)
    reading = memory_spans(build_recall_model("linear_gpt2_decay", Dims(32, 2, 2, 64), 64, vocab), task, 2, seed=1)
    assert reading["span"] == 16
    for heads in reading["layers"]:
        rates = [1 - 2.0 ** (-5 - h) for h in range(2)]
        assert [h["alpha"] for h in heads] == pytest.approx(rates)
        assert [h["kept"] for h in heads] == pytest.approx([r ** 16 for r in rates])
    assert memory_spans(build_recall_model("linear_gpt2_conv", Dims(32, 2, 2, 64), 64, vocab), task, 2, seed=1) is None
    for name in ("linear_gpt2_gated_delta_conv", "linear_gpt2_kda_conv"):
        layers = memory_spans(build_recall_model(name, Dims(32, 2, 2, 64), 64, vocab), task, 2, seed=1)["layers"]
        assert len(layers) == 2 and all(0 < h["kept"] < h["alpha"] < 1 for heads in layers for h in heads)


def test_a_stage_records_where_each_gate_started_without_changing_its_training():
    """memory_init: the decays of the model as the stage's seed builds it, read before the first step; reading them
    draws nothing, so the stage trains exactly the weights a run without the reading would (trained here beside it),
    and the start's reading differs from the trained one. The report shows both tables."""
    from experiments.long_range.stages import Stage
    from experiments.recall.runner import (initial_model, memory_reading, render_memory, run_mqar_stage, summarise,
                                          task_of)
    from experiments.recall.training import train_mqar

    args = {"model": "linear_gpt2_gated_delta_long_conv", "length": 32, "pairs": 4, "width": 32,
            "dims": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "num_keys": 16, "num_values": 16, "steps": 6, "batch_size": 4, "seed": 3, "log_every": 3,
            "eval_batches": 1, "optimizer": {"lr": 0.05, "weight_decay": 0.1, "warmup_fraction": 0.1}}
    stage = Stage("mqar-n32-p4-w32/linear_gpt2_gated_delta_long_conv", "mqar", args)
    metrics = run_mqar_stage(stage)
    start = memory_reading(initial_model(args), args)
    assert metrics["memory_init"] == start and metrics["memory_init"] != metrics["memory"]
    assert all(h["alpha"] > 0.98 for heads in start["layers"] for h in heads)  # the gate started near 1
    alone = initial_model(args)
    reference = train_mqar(alone, task_of(args), args["steps"], args["batch_size"], args["optimizer"], args["seed"],
                           args["log_every"], args["eval_batches"])
    assert reference["eval_loss"] == metrics["eval_loss"]
    row = summarise({stage.key: {"args": args, "metrics": metrics}})[0]
    text = "\n".join(render_memory([row]))
    assert "The same at the start" in text and f"{start['layers'][1][0]['alpha']:.3f}" in text


@pytest.mark.slow
def test_softmax_learns_recall_with_few_pairs_and_the_score_counts_only_queries():
    """The pipeline can learn (an honest check that a zero from another model is a finding): GPT-2, 2 layers, at
    n = 32 with 4 pairs, well above chance (1 / 16 values) after a short training. Measured: 35.5% after 400 steps,
    the loss at ln 4 (it has learnt that the answer is one of the 4 values in the context, not yet which)."""
    from experiments.recall.training import evaluate_mqar, train_mqar

    task = {"length": 32, "pairs": 4, "num_keys": 16, "num_values": 16}
    torch.manual_seed(0)
    model = build_recall_model("gpt2_sdpa", Dims(64, 2, 2, 128), 32, mqar_vocab_size(16, 16))
    optim = {"lr": 3e-3, "weight_decay": 0.0, "warmup_fraction": 0.1}
    untrained = evaluate_mqar(model, task, 32, 2, seed=5)
    assert untrained["eval_queries"] == 2 * 32 * 4 and untrained["eval_accuracy"] < 0.3
    result = train_mqar(model, task, steps=400, batch_size=32, optim=optim, seed=0, log_every=100, eval_batches=4)
    assert result["eval_accuracy"] > 0.25, result  # 4x chance
    assert result["loss_curve"][-1][1] < result["loss_curve"][0][1]


@pytest.mark.slow
def test_the_script_runs_the_smoke_preset_resumes_and_rerenders(tmp_path):
    command = [sys.executable, str(REPO_ROOT / "scripts" / "recall.py"), "--preset", "smoke", "--output_dir",
               str(tmp_path)]
    first = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["finished"] == results["meta"]["total"] == 10
    assert {r["model"] for r in results["rows"]} == {"gpt2_sdpa", "linear_gpt2", "linear_gpt2_hedgehog",
                                                     "linformer_gpt2", "reformer_lsh"}
    assert all(r["state_bytes"] > 0 for r in results["rows"])
    assert (tmp_path / "mqar.png").stat().st_size > 1000
    # where the lookup is: read for the linear decoders, whose weights are an n x n matrix; each trained model saved
    probed = {r["model"] for r in results["rows"] if r.get("lookup")}
    assert probed == {"linear_gpt2", "linear_gpt2_hedgehog"}
    assert "## Where the lookup is" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "models" / "mqar-n32-p4-w32" / "reformer_lsh" / "config.json").is_file()
    # the saved models, read again without training (--probe_saved): the same readings as the stages' own
    probe = subprocess.run(command + ["--probe_saved"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]
    probes = json.loads((tmp_path / "probes.json").read_text())
    records = json.loads((tmp_path / "records.json").read_text())
    assert set(probes) == set(records)
    for key, record in records.items():
        assert probes[key]["lookup"] == record["metrics"]["lookup"]
    assert "## Where the lookup is" in (tmp_path / "probes.md").read_text()
    again = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert again.returncode == 0 and again.stdout.count("finished earlier, reused") == 10
    report = (tmp_path / "results.md").read_text()
    rerendered = subprocess.run(command + ["--report_only"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert rerendered.returncode == 0 and (tmp_path / "results.md").read_text() == report
    refused = subprocess.run(command[:-1] + [str(tmp_path), "--models", "gpt5"], capture_output=True, text=True,
                             cwd=REPO_ROOT)
    assert refused.returncode != 0 and "unknown recall model 'gpt5'" in refused.stderr


def test_a_slice_run_reports_every_finished_stage_of_the_preset_under_the_whole_command(tmp_path):
    preset = REPO_ROOT / "configs" / "recall" / "smoke.json"
    with pytest.raises(UsageError, match="--pairs 3: not among the preset's pairs"):
        plan(load_preset(preset), pairs=[3])
    with pytest.raises(UsageError, match="--widths 64: not among the preset's widths"):
        plan(load_preset(preset), widths=[64])
    wide = {**load_preset(preset), "widths": [32, 64]}
    assert {s.args["width"] for s in plan(wide, widths=[64])[0]} == {64} and len(plan(wide)[0]) == 20
    argv = ["--preset", "smoke", "--output_dir", str(tmp_path)]
    first = run(preset, tmp_path, models=["gpt2_sdpa"], pairs=[2], argv=argv + ["--models", "gpt2_sdpa", "--pairs",
                                                                                "2"], log=lambda s: None)
    assert [(r["model"], r["pairs"]) for r in first["rows"]] == [("gpt2_sdpa", 2)]
    assert first["meta"]["finished"] == 1 and first["meta"]["total"] == 10
    second = run(preset, tmp_path, models=["linear_gpt2"], pairs=[4], argv=argv + ["--pairs", "4", "--models",
                                                                                  "linear_gpt2"], log=lambda s: None)
    # the first slice's row stays in the report beside the second's, under the command of the whole preset
    assert sorted((r["model"], r["pairs"]) for r in second["rows"]) == [("gpt2_sdpa", 2), ("linear_gpt2", 4)]
    assert second["meta"]["command"] == f"python scripts/recall.py --preset smoke --output_dir {tmp_path}"
    assert "2 of 10 stages finished" in (tmp_path / "results.md").read_text()


def test_a_device_mqar_cannot_train_on_is_refused_before_any_work(tmp_path):
    preset = REPO_ROOT / "configs" / "recall" / "smoke.json"
    with pytest.raises(UsageError, match="--device 'mps': use 'cpu'"):
        run(preset, tmp_path, device="mps", log=lambda s: None, argv=[])
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device here"):
            run(preset, tmp_path, device="cuda", log=lambda s: None, argv=[])
    assert not (tmp_path / "records.json").exists()
    passkey = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "recall.py"), "--preset", "passkey-smoke",
                              "--device", "cuda", "--dry_run"], capture_output=True, text=True, timeout=300)
    assert passkey.returncode != 0 and "--device applies to MQAR presets only" in passkey.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: scripts/gpu_check.sh runs it")
def test_an_mqar_stage_on_cuda_scores_as_on_the_cpu(tmp_path):
    """On a GPU: one smoke stage trains there (the report names the GPU), its state bytes are the CPU's, and its
    score is close to the CPU run's (the same batches; kernels round differently)."""
    preset = REPO_ROOT / "configs" / "recall" / "smoke.json"
    quiet = {"log": lambda s: None, "argv": [], "models": ["linear_gpt2"], "pairs": [2]}
    cpu = run(preset, tmp_path / "cpu", **quiet)["rows"][0]
    gpu_run = run(preset, tmp_path / "cuda", device="cuda", **quiet)
    gpu = gpu_run["rows"][0]
    assert gpu["state_bytes"] == cpu["state_bytes"] and abs(gpu["loss"] - cpu["loss"]) < 0.05 * cpu["loss"] + 0.01
    assert "Stages trained on a GPU: mqar-" in (tmp_path / "cuda" / "results.md").read_text()


class Killed(BaseException):
    """Stands for the kill of a session's end: nothing after it runs."""


def test_a_stage_killed_mid_way_resumes_from_its_checkpoint_to_the_record_of_a_run_never_stopped(tmp_path,
                                                                                                  monkeypatch):
    preset = json.loads((REPO_ROOT / "configs" / "recall" / "smoke.json").read_text())
    preset.update(pairs=[2], models=["gpt2_sdpa"], steps=6, log_every=1, checkpoint_every=2)
    (tmp_path / "tiny.json").write_text(json.dumps(preset))
    quiet = dict(log=lambda s: None, argv=[])
    key = "mqar-n32-p2-w32/gpt2_sdpa"
    run(tmp_path / "tiny.json", tmp_path / "straight", **quiet)
    real, calls = recall_training.mqar_batch, [0]

    def dying(*args, **kwargs):  # the training batch source dies when asked for the 6th batch
        calls[0] += 1
        if calls[0] > 5:
            raise Killed
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(recall_training, "mqar_batch", dying)
        with pytest.raises(Killed):
            run(tmp_path / "tiny.json", tmp_path / "resumed", **quiet)
    assert torch.load(checkpoint_file(tmp_path / "resumed", key), weights_only=True)["step"] == 4
    told = []
    run(tmp_path / "tiny.json", tmp_path / "resumed", log=told.append, argv=[])
    assert any("resuming from the checkpoint at step 4 of 6" in line for line in told), told
    assert not checkpoint_file(tmp_path / "resumed", key).is_file()  # dropped once the stage is recorded
    straight, resumed = (json.loads((tmp_path / d / "records.json").read_text())[key]["metrics"]
                         for d in ("straight", "resumed"))
    assert resumed["resumed_at"] == [4] and "resumed_at" not in straight
    for name in ("loss_curve", "eval_loss", "eval_accuracy"):
        assert resumed[name] == straight[name], name
    assert "Resumed from a checkpoint after a stop" in (tmp_path / "resumed" / "results.md").read_text()
    assert "Resumed from" not in (tmp_path / "straight" / "results.md").read_text()
    # the report names the machine the stages ran on, not the one that rewrites it
    for path in (tmp_path / "resumed" / "records.json", stage_file(tmp_path / "resumed", key)):
        text = path.read_text()
        assert text.count(describe_machine()) == 1
        path.write_text(text.replace(describe_machine(), "a faster machine, 64 cores"))
    run(tmp_path / "tiny.json", tmp_path / "resumed", report_only=True, **quiet)
    assert "Machine: a faster machine, 64 cores" in (tmp_path / "resumed" / "results.md").read_text()
    # checkpointing is an option, not an argument: the stage recorded without it is reused by a preset with it
    preset["checkpoint_every"] = 3
    (tmp_path / "tiny.json").write_text(json.dumps(preset))
    told = []
    run(tmp_path / "tiny.json", tmp_path / "straight", log=told.append, argv=[])
    assert any("finished earlier, reused" in line for line in told), told


def test_a_bf16_preset_trains_under_autocast_and_leaves_float32_stages_their_arguments(tmp_path, monkeypatch):
    preset = json.loads((REPO_ROOT / "configs" / "recall" / "smoke.json").read_text())
    preset.update(pairs=[2], models=["linear_gpt2"], steps=2)
    assert "precision" not in plan(preset)[0][0].args  # recorded float32 stages stay reusable
    preset["precision"] = "bf16"
    (tmp_path / "bf16.json").write_text(json.dumps(preset))
    assert plan(preset)[0][0].args["precision"] == "bf16"
    seen = []
    real = torch.autocast

    def spy(*args, **kwargs):
        seen.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "autocast", spy)
        result = run(tmp_path / "bf16.json", tmp_path / "bf16", log=lambda s: None, argv=[])
    assert seen[0] == torch.bfloat16  # the training forward's context (the model's own float32 islands follow)
    assert "bfloat16 autocast" in result["meta"]["notes"]
    del preset["precision"]
    (tmp_path / "float32.json").write_text(json.dumps(preset))
    run(tmp_path / "float32.json", tmp_path / "float32", log=lambda s: None, argv=[])
    (bf16,), (float32,) = (json.loads((tmp_path / d / "records.json").read_text()).values()
                           for d in ("bf16", "float32"))
    loss16, loss32 = bf16["metrics"]["loss_curve"][0][1], float32["metrics"]["loss_curve"][0][1]
    assert loss16 != loss32 and abs(loss16 - loss32) < 0.02 * loss32  # rounded differently, the same training


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO_ROOT / "configs" / "recall").glob("*.json")))
def test_every_committed_recall_preset_loads_and_plans(name):
    """Each preset of configs/recall passes its own loader's checks and plans at least one stage, whichever task
    (MQAR, passkey, the capacity probe) it names."""
    from experiments.recall import capacity_runner, passkey_runner, preset_task

    path = REPO_ROOT / "configs" / "recall" / f"{name}.json"
    if preset_task(path) == "passkey":
        stages = passkey_runner.plan(passkey_runner.load_preset(path))
    elif preset_task(path) == "capacity":
        stages = capacity_runner.plan(capacity_runner.load_preset(path))
    else:
        stages, _ = plan(load_preset(path))
    assert stages


def test_seed_runs_the_preset_grid_at_another_seed_and_is_refused_where_it_has_no_meaning(tmp_path):
    preset = REPO_ROOT / "configs" / "recall" / "smoke.json"
    lines = []
    run(preset, tmp_path, dry_run=True, seed=5, log=lines.append, argv=[])
    args = [json.loads(line.split(": ", 1)[1]) for line in lines[:-1]]
    assert len(args) == 10 and {a["seed"] for a in args} == {5} != {load_preset(preset)["seed"]}
    for bad in (-1, True, 1.5):
        with pytest.raises(UsageError, match="--seed"):
            run(preset, tmp_path, seed=bad, log=lambda s: None, argv=[])
    passkey = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "recall.py"), "--preset", "passkey-smoke",
                              "--seed", "1", "--dry_run"], capture_output=True, text=True, timeout=300)
    assert passkey.returncode != 0 and "--seed applies to MQAR presets only" in passkey.stderr
