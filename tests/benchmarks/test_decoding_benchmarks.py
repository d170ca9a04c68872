"""The decoding benchmark suites (images, assisted, compiled_step) at their smallest: configurations, the draft
counting against the generated length, the stop guard, the data check, and one smoke run of the three suites through
scripts/benchmark.py. No test asserts a speed: they check the bookkeeping, the tables, the JSON and the plots."""

import json
import re

import pytest
import torch
from helpers import SHARED_DATA, causal_lm, needs_data, random_ids

from benchmarks import decoding, suites
from benchmarks.decoding import (
    PAPER_IMAGES,
    SUITES,
    GenerationGuard,
    configurations,
    counting_drafts,
    image_ratios,
)

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_preset_runs_the_three_suites_at_the_sizes_the_issue_names(tmp_path):
    assert set(SUITES) <= set(suites.KINDS)  # scripts/benchmark.py --only images assisted compiled_step
    # gpt2-small times generation alone (GPT-2 small's depth): no decoding suites
    assert set(suites.PRESETS) - {"gpt2-small"} == set(decoding.PRESETS)
    assert configurations("gpt2-small", "float32", SHARED_DATA, tmp_path) == []
    small = suites.configurations("gpt2-small", "bfloat16", SHARED_DATA, tmp_path)
    assert {s["kind"] for s in small} == {"generation"} and {s["context"] for s in small} == {1024, 16384}
    assert {s["dims"]["n_layer"] for s in small} == {12} and len(small) == 2 * (2 + len(suites.GENERATION_VARIANTS))
    for name in decoding.PRESETS:
        specs = configurations(name, "float32", SHARED_DATA, tmp_path)
        assert {s["kind"] for s in specs} == set(SUITES), name
        # suites.configurations runs them after its own suites
        assert [c for c in suites.configurations(name, "float32", SHARED_DATA, tmp_path)
                if c["kind"] in SUITES] == specs
        images = [s for s in specs if s["kind"] == "images"]
        assert {s["vocab_size"] for s in images} == {256}
        assert {s["model"] for s in images} == {"gpt2", "linear_gpt2", "linformer_gpt2"}
        batches = [s["batch"] for s in specs if s["kind"] == "compiled_step"]
        assert batches[0] == 1 and max(batches) > 1
        assisted = [s for s in specs if s["kind"] == "assisted"]
        # room for the longest prompt, the new tokens and the candidates proposed past the last one (a quick run
        # at 4,096 failed with "Position 4166 is beyond this model's position table (n_positions = 4160)")
        room = max(s["context"] for s in assisted) + assisted[0]["new_tokens"] + max(
            assisted[0]["assistant"]["num_assistant_tokens"], assisted[0]["prompt_lookup_num_tokens"])
        assert assisted[0]["target"]["n_positions"] >= room and assisted[0]["draft"]["n_positions"] >= room
        assert assisted[0]["draft"]["n_layer"] < assisted[0]["target"]["n_layer"]
        if name != "smoke":
            assert sorted({s["n"] for s in images}) == sorted(PAPER_IMAGES) == [784, 3072]
            assert [s["context"] for s in assisted] == [256, 4096]
            assert (assisted[0]["target"]["n_layer"], assisted[0]["draft"]["n_layer"]) == (12, 2)


def test_without_wikitext_the_assisted_rows_say_why_and_main_refuses_before_any_work(tmp_path, capsys):
    specs = configurations("smoke", "float32", tmp_path / "nowhere", tmp_path)
    reasons = {s.get("skipped") for s in specs if s["kind"] == "assisted"}
    assert len(reasons) == 1 and "--data_dir" in reasons.pop()
    assert not [s for s in specs if s["kind"] != "assisted" and "skipped" in s]
    assisted = next(s for s in specs if s["kind"] == "assisted")
    assert decoding.KINDS["assisted"](assisted, "cpu") == {"skipped": assisted["skipped"]}
    with pytest.raises(SystemExit):
        suites.main(["--preset", "smoke", "--only", "assisted", "--data_dir", str(tmp_path / "nowhere"),
                         "--output_dir", str(tmp_path / "out")])
    assert "WikiText-2 not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_draft_counts_add_up_to_the_generated_length():
    """generate() adds the accepted drafts plus one token of the target's per verifying forward: the counts must
    rebuild the number of new tokens exactly, for a model draft and for prompt lookup."""
    model, draft = causal_lm("linear-elu"), causal_lm("linear-elu", seed=1, n_layer=1)
    new = 20
    for prompt, extra in ((random_ids(1, 9), {"assistant_model": draft}),
                          (random_ids(1, 8).repeat(1, 3), {"prompt_lookup_num_tokens": 4})):
        with counting_drafts(model) as counts:
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=1,
                                 **extra)
        assert out.shape[1] - prompt.shape[1] == new
        assert counts["accepted"] + counts["verifications"] == new, counts
        assert 0 <= counts["accepted"] <= counts["proposed"] and counts["verifications"] > 0
    assert counts["accepted"] > 0  # the repeated prompt gives the lookup tokens to find
    assert "_get_candidate_generator" not in vars(model)  # the wrapper is gone afterwards
    with counting_drafts(model) as counts:
        model.generate(random_ids(1, 9), max_new_tokens=5, do_sample=False, pad_token_id=1)
    assert counts == {"proposed": 0, "accepted": 0, "verifications": 0}  # plain greedy drafts nothing


def test_the_guard_stops_a_generation_over_its_budget_and_says_why():
    from transformers import StoppingCriteriaList

    model = causal_lm("linear-elu")
    guard = GenerationGuard(budget=0.0, memory_cap=None, device="cpu")
    out = model.generate(random_ids(2, 4), max_new_tokens=30, do_sample=False, pad_token_id=1,
                         stopping_criteria=StoppingCriteriaList([guard]))
    assert out.shape[1] == 5 and guard.stopped == "over the 0 s budget"
    guard = GenerationGuard(budget=60.0, memory_cap=1, device="cpu")  # 1 byte: any process is over it
    model.generate(random_ids(1, 4), max_new_tokens=30, do_sample=False, pad_token_id=1,
                   stopping_criteria=StoppingCriteriaList([guard]))
    assert guard.stopped.startswith("resident set over")


def test_the_guard_stops_a_run_whose_pace_projects_past_the_budget_and_no_other():
    ticks = iter(range(10_000))  # a clock advancing 1 s per reading
    ids, scores = torch.zeros(2, 1, dtype=torch.long), None
    guard = GenerationGuard(budget=100.0, memory_cap=None, device="cpu", new_tokens=1000, clock=lambda: next(ticks))
    stops = [bool(guard(ids, scores).all()) for _ in range(60)]
    # 1 s a token for 1,000 tokens: projected 1,000 s from the 50th token (5%) on, not before
    assert stops.index(True) == 49 and guard.stopped.startswith("projected 1000 s at the pace of its first 50 tokens")
    ticks = iter(range(10_000))
    guard = GenerationGuard(budget=2000.0, memory_cap=None, device="cpu", new_tokens=1000, clock=lambda: next(ticks))
    assert not any(bool(guard(ids, scores).all()) for _ in range(999)) and guard.stopped is None  # it fits: no stop


def test_image_ratios_are_each_models_images_per_second_over_gpt2s_at_the_same_length():
    rows = [{"kind": "images", "n": 784, "model": "gpt2", "method": "g", "images_per_second": 2.0},
            {"kind": "images", "n": 784, "model": "linear_gpt2", "method": "l", "images_per_second": 5.0},
            {"kind": "images", "n": 3072, "model": "linear_gpt2", "method": "l", "images_per_second": 1.0},
            {"kind": "images", "n": 3072, "model": "gpt2", "method": "g", "failed": "batch 1 did not fit: ..."}]
    assert image_ratios(rows) == {(784, "g"): 1.0, (784, "l"): 2.5}  # no GPT-2 figure at 3072: no ratio


@pytest.mark.slow
@needs_data
def test_smoke_run_of_the_three_suites_writes_complete_sane_tables_json_and_plots(tmp_path):
    """suites.run_suite at the smoke preset, each configuration in its own process as a real run measures it
    (forked from the measuring server, which has done the imports once)."""
    suites.run_suite("smoke", tmp_path, only=list(SUITES), dtype="float32", data_dir=str(SHARED_DATA))
    check_smoke_outputs(tmp_path)


def check_smoke_outputs(folder):
    """The checks of the smoke run, on its output folder."""
    tmp_path = folder
    report = json.loads((tmp_path / "results.json").read_text())
    results = report["results"]
    specs = configurations("smoke", "float32", SHARED_DATA, tmp_path)
    assert [(r["kind"], r["method"]) for r in results] == [(s["kind"], s["method"]) for s in specs]
    assert not [r for r in results if "failed" in r or "skipped" in r or "compiled_failed" in r], results
    assert "cores" in report["machine"]
    markdown = (tmp_path / "results.md").read_text()
    for name in ("images.png", "assisted.png", "compiled_step.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG, name

    # images: figures from the rows, GPT-2's cache against a hand count, the linear state independent of the length
    images = {r["model"]: r for r in results if r["kind"] == "images"}
    assert "Largest batch that fits" in markdown and "images / s" in markdown
    for row in images.values():
        assert row["largest_batch"] == row["runs"][-1]["batch"] == max(row["batch_sizes"])
        assert row["images_per_second"] == pytest.approx(row["largest_batch"] / row["seconds"])
        assert row["images_per_second"] > 0
        assert row["matmul_peak_gflops"] > 0
    gpt2 = images["gpt2"]
    d = next(s for s in specs if s["kind"] == "images")["dims"]  # results.json leaves dims out, as for every suite
    for run in gpt2["runs"]:  # n - 1 positions of keys and values per layer (the last token is never fed back)
        assert run["cache_bytes"] == run["batch"] * d["n_layer"] * 2 * (gpt2["n"] - 1) * d["n_embd"] * 4
    head = d["n_embd"] // d["n_head"]
    for run in images["linear_gpt2"]["runs"]:  # per layer and head: S (d x d) and z (d), float32
        assert run["cache_bytes"] == run["batch"] * d["n_layer"] * d["n_head"] * (head * head + head) * 4
    ratios = image_ratios(results)
    for row in images.values():
        line = next(line for line in markdown.splitlines() if line.startswith(f"| {row['n']} | {row['method']} |"))
        assert f"| {ratios[(row['n'], row['method'])]:,.2f}x |" in line
    assert ratios[(gpt2["n"], gpt2["method"])] == 1.0

    # assisted: every method's tokens equal plain greedy's, the counts rebuild the generated length
    (assisted,) = [r for r in results if r["kind"] == "assisted"]
    methods = assisted["methods"]
    assert [m["method"].split(" ")[0] for m in methods] == ["greedy", "assisted", "assisted", "prompt"]
    for m in methods:
        assert m["tokens_equal_greedy"] and m["first_difference"] is None
        assert m["tokens_per_second"] == pytest.approx(assisted["new_tokens"] / m["seconds"])
        assert m["speedup"] == pytest.approx(m["tokens_per_second"] / methods[0]["tokens_per_second"])
        if "proposed" in m:
            assert m["accepted"] + m["verifications"] == assisted["new_tokens"] * m["calls"]
            assert m["acceptance_rate"] == pytest.approx(m["accepted"] / m["proposed"])
            assert f"| {m['accepted']} / {m['proposed']} |" in markdown
    assert methods[0]["speedup"] == 1.0
    for role in ("target", "draft"):  # trained, better than a uniform guess over the vocabulary
        record = assisted["trained"][role]
        assert record["trained_in_this_run"] and record["perplexity"] < 0.75 * assisted["training"]["vocab_size"]
        assert record["command"] in markdown
    # a second run finds both models in the cache and trains nothing
    again = decoding.trained_models(next(s for s in specs if s["kind"] == "assisted"))
    assert [again[role]["trained_in_this_run"] for role in ("target", "draft")] == [False, False]
    assert again["target"]["folder"] == assisted["trained"]["target"]["folder"]

    # compiled_step: compiled logits equal eager's, the speed-up is eager over compiled
    steps = [r for r in results if r["kind"] == "compiled_step"]
    assert [r["batch"] for r in steps] == [1, 4]
    for row in steps:
        assert row["compiled_relative_difference"] < 1e-4
        assert row["speedup"] == pytest.approx(row["eager_seconds_per_token"] / row["compiled_seconds_per_token"])
        assert row["compile_seconds"] > 0
        # the floor counts every weight once: the smoke model's parameters, counted here from its dimensions
        d, layers, inner, vocab = 32, 2, 64, 256
        per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
        positions = row["context"] + row["warmup"] + row["steps"]  # the step model's position table
        assert row["weight_bytes"] == 4 * (vocab * d + positions * d + layers * per_layer + 2 * d)
        assert row["weight_read_floor_seconds"] == pytest.approx(row["weight_bytes"] / row["read_bytes_per_second"])
        assert re.search(rf"^\| {row['context']} \| {row['batch']} \| [0-9.]+ \| [0-9.]+ \|", markdown, re.M)
