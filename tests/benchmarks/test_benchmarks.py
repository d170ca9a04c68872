"""The benchmark script at its smallest ("smoke" preset: tiny dimensions, the suites' real code paths). No test
asserts a speed: they check the measurements' bookkeeping and the tables' shape."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

from benchmarks.measuring import PeakMemory
from benchmarks.suites import PRESETS, configurations, linear_attention_flops


def test_peak_memory_sees_a_known_allocation():
    """In a fresh process, as the benchmarks measure (one configuration per process). In a suite worker the test once
    read 0 extra bytes (full suite, 2026-11-27) and passed alone and after the benchmark and recall tests in one
    process. The likely cause, not shown: memory freed during the block by threads other tests left running."""
    code = ("import torch; from benchmarks.measuring import PeakMemory\n"
            "with PeakMemory('cpu') as memory:\n"
            "    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched\n"
            "    del block\n"
            "print(memory.extra)")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    extra = int(done.stdout.split()[-1])
    assert 60 * 2**20 <= extra <= 200 * 2**20, extra


def test_flop_counts_match_a_hand_count():
    # bidirectional: phi(K)^T V and phi(Q) S, each n d d multiply-adds per head
    assert linear_attention_flops("bidirectional", n=10, heads=2, d=4, chunk=8) == 2 * 2 * (2 * 10 * 4 * 4)
    # causal, 2 chunks of 8: per chunk QK^T and AV (C C d each) + Q S and the K^T V update (C d d each)
    assert linear_attention_flops("causal", n=16, heads=1, d=4, chunk=8) == 2 * (2 * (8 * 8 * 4 * 2) + 2 * (8 * 4 * 4 * 2))


@pytest.mark.slow
def test_smoke_preset_writes_complete_tables_json_and_plots(tmp_path):
    # the decoding suites (images, assisted, compiled_step) run at this preset in test_decoding_benchmarks.py
    suites = ["encoder", "decoder_train", "generation", "kernel"]
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "benchmark.py"), "--preset", "smoke",
                           "--output_dir", str(tmp_path), "--only", *suites], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    results = report["results"]
    assert len(results) == len([c for c in configurations("smoke") if c["kind"] in suites])
    assert not [r for r in results if "failed" in r], [r for r in results if "failed" in r]
    assert "cores" in report["machine"] and report["preset"] == "smoke"
    markdown = (tmp_path / "results.md").read_text()
    for title in ("seconds per forward", "activation memory", "time saved against roberta eager",
                  "memory saved against roberta sdpa", "Decoder training step", "Generation", "matmul peak",
                  "tensor peak (MB, torch.profiler", "| tensor peak MB |"):
        assert title in markdown, title
    for result in results:  # every configuration has its row
        assert f"| {result.get('n', result.get('context'))} |" in markdown
    for name in ("encoder.png", "decoder_train.png", "generation.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    generation = {(r["method"], r["context"]): r for r in results if r["kind"] == "generation"}
    new = PRESETS["smoke"]["new_tokens"]
    dims = PRESETS["smoke"]["decoder_dims"]
    # the linear decoder's state does not grow with the context; GPT-2's cache holds every position's k and v in
    # the model's dtype (auto: bfloat16 on CPUs with native bf16, else float32)
    assert report["dtype"] in ("float32", "bfloat16") and f"Models in {report['dtype']}" in markdown
    assert {r["dtype"] for r in results if r["kind"] != "kernel"} == {report["dtype"]}
    element = torch.finfo(getattr(torch, report["dtype"])).bits // 8
    assert generation[("linear attention (state)", 32)]["cache_bytes"] == generation[
        ("linear attention (state)", 96)]["cache_bytes"]
    for row in generation.values():  # the output layer alone is part of each step, so it takes less time
        assert 0 < row["output_layer_seconds"] < row["seconds_per_token"]
    assert "| of which the output layer, ms |" in markdown
    for context in (32, 96):
        assert generation[("gpt2 (key/value cache)", context)]["cache_bytes"] == (
            dims["n_layer"] * 2 * (context + new) * dims["n_embd"] * element)
    for result in results:
        if result["kind"] == "kernel" and "skipped" not in result:  # a peer that is not installed says why
            assert 0 < result["fraction_of_peak"] and result["matmul_peak_gflops"] > 0
            if "linear-attention-transformer" not in result["method"]:  # that peer is approximate: its error is shown
                assert result["error_vs_float64"] < 1e-2
        elif result["kind"] == "kernel":
            assert result.get("peer") and result["skipped"] and result["skipped"] in markdown


def test_memory_probes_grow_monotonically_with_a_known_allocation_series():
    """Both probes (resident set, profiler) read 16, 32, 64, 128 MiB allocations in order and within their margins."""
    from benchmarks.measuring import probes_disagree, profiler_peak_bytes, release_freed_memory_at_once

    release_freed_memory_at_once("cpu")
    readings = []
    for mib in (16, 32, 64, 128):
        def allocate(mib=mib):
            block = torch.ones(mib * 2**20 // 4)
            return float(block[-1])

        with PeakMemory("cpu") as memory:
            allocate()
        tensors = profiler_peak_bytes(allocate)
        assert probes_disagree(memory.extra, tensors) is None, (mib, memory.extra, tensors)
        assert mib * 2**20 <= tensors <= mib * 2**20 + 2**20
        readings.append((memory.extra, tensors))
    for probe in (0, 1):
        values = [r[probe] for r in readings]
        assert values == sorted(values) and values[-1] > 6 * values[0], readings


def test_a_nonsense_memory_reading_fails_its_row():
    """The committed n = 1,024 linear-attention row read 4,096 bytes next to 10 MB at 512: such a reading must be
    refused when the profiler saw tensors of megabytes, and the table must say so instead of printing a figure."""
    from benchmarks.measuring import probes_disagree
    from benchmarks.suites import tables

    reason = probes_disagree(4096, 30 * 2**20)
    assert reason and "disagree" in reason
    assert probes_disagree(4096, 2**20) is None  # under the noise floor: nothing to contradict
    row = {"kind": "encoder", "method": "linear attention", "n": 1024, "seconds": 0.2,
           "activation_bytes_failed": reason}
    assert "memory probes disagree" in tables([row])


def _crossover_row(n, seconds, series="float32 fwd batch 1", batch=1, train=False):
    return {"kind": "crossover", "series": series, "method": series, "n": n, "batch": batch, "dtype": "float32",
            "train": train, "seconds": seconds, "device": "cpu"}


def test_crossover_is_the_first_length_from_which_a_form_stays_ahead_of_softmax():
    from benchmarks.kernel_crossover import SOFTMAX, crossovers

    rows = [_crossover_row(64, {SOFTMAX: 1.0, "scan C=64": 0.5, "parallel C=64": 2.0}),  # scan ahead, then behind
            _crossover_row(128, {SOFTMAX: 1.0, "scan C=64": 1.5, "parallel C=64": 0.9}),
            _crossover_row(256, {SOFTMAX: 3.0, "scan C=64": 2.0, "parallel C=64": 4.0}),
            _crossover_row(512, {SOFTMAX: 9.0, "scan C=64": 4.0, "parallel C=64": 5.0})]
    cross = crossovers(rows)
    assert cross[("float32 fwd batch 1", "scan C=64")] == "256"  # ahead at 64, behind at 128: counts from 256
    assert cross[("float32 fwd batch 1", "parallel C=64")] == "512"
    rows[-1]["seconds"]["parallel C=64"] = 10.0
    assert crossovers(rows)[("float32 fwd batch 1", "parallel C=64")] == "not by 512"


def test_the_fastest_form_at_each_length_merges_into_form_table_rows():
    from benchmarks.kernel_crossover import SOFTMAX, fastest_forms

    rows = [{**_crossover_row(n, {SOFTMAX: 1.0, "scan C=64": s, "parallel C=64": p, "parallel C=128": p2,
                                  "auto": 0.0}), "heads": 2}
            for n, s, p, p2 in ((64, 3, 1, 2), (128, 3, 1, 2), (256, 1, 2, 3), (512, 1, 3, 2), (1024, 3, 2, 1))]
    # "auto" (the current table's pick) is never a candidate, however fast, and softmax is not a form; a run starts
    # at its positions, batch (1) x heads (2) x n, the quantity CAUSAL_FORM_TABLE's rows count
    assert fastest_forms(rows) == [(0, "parallel", 64), (512, "scan", 64), (2048, "parallel", 128)]


def test_softmax_is_no_longer_timed_once_every_form_beat_it_at_two_lengths_in_a_row():
    from benchmarks.kernel_crossover import SOFTMAX, softmax_settled

    rows = [_crossover_row(64, {SOFTMAX: 1.0, "scan C=64": 0.5, "parallel C=64": 2.0}),
            _crossover_row(128, {SOFTMAX: 2.0, "scan C=64": 1.5, "parallel C=64": 1.9}),
            _crossover_row(256, {SOFTMAX: 8.0, "scan C=64": 2.0, "parallel C=64": 3.0}),
            _crossover_row(64, {SOFTMAX: 1.0, "scan C=64": 0.1}, series="float32 fwd batch 16")]
    spec = {"series": "float32 fwd batch 1", "n": 256}
    assert softmax_settled(spec, rows) is None  # only one length (128) with every form ahead before 256
    assert softmax_settled({**spec, "n": 512}, rows) == 128
    assert softmax_settled({**spec, "n": 1024}, rows + [{**_crossover_row(512, {"scan C=64": 1.0}),
                                                         "softmax_settled_since": 128}]) == 128


def test_a_crossover_configuration_times_softmax_and_every_form_side_by_side():
    from benchmarks.kernel_crossover import PRESETS as SIZES
    from benchmarks.kernel_crossover import SOFTMAX, measure, tables

    specs = [c for c in configurations("smoke") if c["kind"] == "crossover"]
    assert {(c["train"], c["dtype"]) for c in specs} == {(False, "float32"), (True, "float32")}
    spec = next(c for c in specs if c["train"])
    result = measure(spec, "cpu")
    forms = [f"{form} C={chunk}" for form, chunk in SIZES["smoke"]["forms"]]
    assert set(result["seconds"]) == {SOFTMAX, "auto", *forms}
    assert all(s > 0 for s in result["seconds"].values())
    settled = measure({**spec, "softmax_settled_since": 32}, "cpu")
    assert SOFTMAX not in settled["seconds"] and set(settled["seconds"]) == {"auto", *forms}
    markdown = tables([{**spec, **result}, {**spec, "n": 128, "softmax_settled_since": 32, **settled}])
    assert "not timed (every form ahead since n=32)" in markdown and "CAUSAL_FORM_TABLE" in markdown


def test_candidates_are_timed_in_rounds_of_rotating_order_after_one_warm_up_each():
    from benchmarks.kernel_crossover import interleaved_medians

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    medians = interleaved_medians(fns, repeats=4, budget=60.0, device="cpu")
    assert medians.pop("_rounds") == 4 and set(medians) == {"a", "b", "c"}
    assert calls == list("abc") + list("abc") + list("bca") + list("cab") + list("abc")


def test_every_suite_runs_in_the_dtype_asked_for_and_kernels_in_theirs():
    # a loop over the kernel dtypes once left `dtype` at "bfloat16" for the suites listed after it
    for dtype in ("float32", "bfloat16"):
        specs = configurations("quick", dtype)
        assert {c["dtype"] for c in specs if c["kind"] == "kernel"} == {"float32", "bfloat16"}
        assert {c["dtype"] for c in specs if c["kind"] == "crossover"} == {"float32", dtype}
        assert {c["dtype"] for c in specs if c["kind"] in ("encoder", "decoder_train", "generation", "images")} == {
            dtype}


def test_a_stopped_run_keeps_what_it_measured(tmp_path, monkeypatch):
    from benchmarks import suites

    measured = []

    def fake_isolated(module, spec, timeout):  # the second (last) configuration never returns: the run is killed there
        if len(measured) == 1:
            raise KeyboardInterrupt
        measured.append(spec)
        return {"seconds": {"softmax (SDPA)": 1.0, "scan C=32": 0.5}}

    monkeypatch.setattr(suites, "run_isolated", fake_isolated)
    with pytest.raises(KeyboardInterrupt):
        suites.run_suite("smoke", tmp_path, only=["crossover"], dtype="float32")
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["complete"] is False and [r["n"] for r in report["results"]] == [m["n"] for m in measured]
    assert not list(tmp_path.glob("*.partial"))
    suites.rewrite_report(tmp_path)  # renders the partial run, and says it is one
    assert "stopped before its last configuration" in (tmp_path / "results.md").read_text()


def test_every_peer_names_the_package_that_brings_it():
    from benchmarks.suites import PEER_PACKAGES, PEERS, peer_missing

    assert set(PEER_PACKAGES) == set(PEERS)
    for peer in PEERS:
        reason = peer_missing(peer)
        assert reason is None or reason.startswith("not installed: pip install ")


def test_the_generation_suite_times_each_linear_variant_with_its_own_config():
    """quick / full time issue 41's variants beside GPT-2 and plain linear attention; the model each row builds
    carries that variant's fields (smoke leaves them out: its subject is the suite)."""
    from benchmarks.measuring import decoder_model
    from benchmarks.suites import GENERATION_VARIANTS

    for preset in ("quick", "full"):
        rows = [c for c in configurations(preset) if c["kind"] == "generation"]
        methods = {c["method"] for c in rows}
        assert {f"linear attention, {name} (state)" for name in GENERATION_VARIANTS} < methods
    assert not [c for c in configurations("smoke") if c.get("config")]
    spec = next(c for c in configurations("quick") if c["method"] == "linear attention, gated (state)")
    tiny = {**spec, "dims": dict(n_embd=32, n_layer=1, n_head=2, n_inner=64), "vocab_size": 50}
    assert decoder_model(tiny, "cpu", 64).config.state_decay == "gated"
