"""Long-range evidence (scripts/long_range.py): the tasks against independent references, the model builder, the
stage records, the errors for bad input, and the smoke preset end to end."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, SHARED_DATA

from experiments.long_range import load_preset, plan, profile, run, select
from experiments.long_range.models import (
    DECODER_FEATURE_MAPS, DECODERS, ENCODERS, Dims, build_decoder, build_encoder, check_length, model_dims,
    pool_by_mean,
)
from experiments.long_range.stages import Stage, run_stages, whole_command
from experiments.long_range.tasks import (
    LISTOPS_VOCAB, copy_batch, decode_bytes, encode_bytes, encode_listops, generate_listops, generate_listops_sized,
)
from hf_linear_attn.training.errors import UsageError

PRESETS = REPO_ROOT / "configs" / "long_range"
IMDB = SHARED_DATA / "imdb" / "train.jsonl"
needs_imdb = pytest.mark.skipif(not IMDB.is_file() and not os.environ.get("CI"),
                                reason=f"IMDB not found at {IMDB} (see ../shared/data/README.md)")
SMALL = Dims(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def reference_value(tokens):
    """Value of a ListOps expression by rewriting it into a Python expression and evaluating that."""
    import statistics

    functions = {"MAX": lambda *a: max(a), "MIN": lambda *a: min(a), "SM": lambda *a: sum(a) % 10,
                 "MED": lambda *a: int(statistics.median(a))}
    text = []
    for token in tokens:
        if token.startswith("["):
            text.append(f"{token[1:]}(")
        elif token == "]":
            text.append("),")
        else:
            text.append(f"{int(token)},")
    return eval("".join(text).rstrip(","), {"__builtins__": {}}, functions)  # noqa: S307 - our own tokens


@pytest.mark.parametrize("generate", [generate_listops, generate_listops_sized])
def test_generated_listops_labels_equal_an_independent_evaluator_and_lengths_stay_in_the_window(generate):
    examples = generate(40, seed=3, min_length=60, max_length=120)
    assert all(60 <= len(tokens) <= 120 for tokens, _ in examples)
    assert [label for _, label in examples] == [reference_value(tokens) for tokens, _ in examples]
    assert any(tokens.count("[MED") for tokens, _ in examples) and any(tokens.count("[SM") for tokens, _ in examples)
    assert generate(5, seed=3, min_length=60, max_length=120) == examples[:5]  # seeded


def test_listops_encoding_maps_every_symbol_to_its_own_id_between_bos_and_eos():
    tokens, _ = generate_listops_sized(1, seed=0, min_length=50, max_length=60)[0]
    ids = encode_listops(tokens)
    assert ids[0] == 0 and ids[-1] == 2 and len(ids) == len(tokens) + 2
    inverse = {v: k for k, v in LISTOPS_VOCAB.items()}
    assert [inverse[i] for i in ids[1:-1]] == tokens


def test_the_cpu_preset_keeps_listops_inputs_of_at_least_1000_tokens_and_text_at_1024_bytes():
    cpu, paper = load_preset(PRESETS / "cpu.json"), load_preset(PRESETS / "paper.json")
    assert cpu["tasks"]["listops"]["min_tokens"] >= 1000 and cpu["tasks"]["text"]["length"] == 1024
    assert paper["tasks"]["text"]["length"] == 4096
    assert cpu["tasks"]["efficiency"]["lengths"] == [1024, 2048, 3072, 4096]
    assert set(cpu["tasks"]["listops"]["models"]) == set(ENCODERS) == set(cpu["tasks"]["text"]["models"])
    # every decoder but those added with the copy-paper preset (linear_gpt2's other feature maps)
    assert set(cpu["tasks"]["copy"]["models"]) == set(DECODERS) - set(DECODER_FEATURE_MAPS)
    assert 128 in [s["length"] for s in cpu["tasks"]["copy"]["settings"]]
    # `--tasks efficiency` alone plans the same measurements: the dims it borrows from Text come along
    alone = [s for s in plan(select(cpu, ["efficiency"])) if s.kind == "efficiency"]
    assert [s.args for s in alone] == [s.args for s in plan(cpu) if s.kind == "efficiency"] and len(alone) == 48


def test_a_lengths_slice_keeps_the_stages_at_those_lengths_and_the_report_names_the_whole_command():
    cpu, paper = load_preset(PRESETS / "cpu.json"), load_preset(PRESETS / "copy-paper.json")
    short = plan(select(paper, lengths=[128]))
    assert {s.args["length"] for s in short} == {128} and len(short) == len(paper["tasks"]["copy"]["models"])
    assert [s.args for s in short] == [s.args for s in plan(paper) if s.args["length"] == 128]
    at_1024 = plan(select(cpu, lengths=[1024]))
    assert {s.kind for s in at_1024} == {"efficiency", "classify"}  # ListOps and Text; the copy task has no 1,024
    assert {s.args["task"] for s in at_1024 if s.kind == "classify"} == {"listops", "text"}
    assert {s.args.get("n", s.args.get("length")) for s in at_1024} == {1024}
    assert [s.args for s in plan(select(cpu, ["copy"], ["gpt2_sdpa"], [512]))] == [
        s.args for s in plan(cpu) if s.key == "copy-n512/gpt2_sdpa"]
    with pytest.raises(UsageError, match="--lengths 256: no stage .* the preset's lengths are 128, 512"):
        select(paper, lengths=[256])
    argv = ["--preset", "copy-paper", "--lengths", "128", "--models", "linear_gpt2", "--report_only", "--eval_running",
            "--output_dir", "x"]
    assert whole_command(argv, ("--models", "--tasks", "--lengths")) == ["--preset", "copy-paper", "--output_dir", "x"]


def test_bytes_round_trip_including_multibyte_characters_and_truncate_to_a_byte_prefix():
    text = "Ein großartiger Film — 10/10 ★ ça va"
    ids = encode_bytes(text, 1024)
    assert ids[0] == 0 and ids[-1] == 2 and all(3 <= i < 259 for i in ids[1:-1])
    assert decode_bytes(ids) == text
    assert bytes(i - 3 for i in ids[1:-1]) == text.encode("utf-8")
    short = encode_bytes(text * 10, 32)
    assert len(short) == 32 and bytes(i - 3 for i in short[1:-1]) == (text * 10).encode("utf-8")[:30]


def test_the_copy_tasks_targets_are_the_inputs_on_the_copied_half():
    ids, labels = copy_batch(3, 20, torch.Generator().manual_seed(0))
    half = 9
    assert ids.shape == labels.shape == (3, 20)
    assert torch.equal(ids[:, 1 : 1 + half], ids[:, 2 + half :])  # the sequence, then the same again
    assert (ids[:, 0] == 0).all() and (ids[:, 1 + half] == 0).all()  # separators
    kept = labels != -100
    assert torch.equal(labels[kept], ids[kept]) and kept[:, 2 + half :].all() and not kept[:, : 2 + half].any()


def test_every_model_of_a_task_has_the_same_width_and_depth_and_bigbird_really_runs_block_sparse():
    for name in ENCODERS:
        model = build_encoder(name, SMALL, 256, 20, 10)
        assert model_dims(model) == (32, 2), name
    for name in DECODERS:
        assert model_dims(build_decoder(name, SMALL, 64, 13)) == (32, 2), name
    for n in (256, 1024):  # the smoke and cpu lengths: no silent fallback to full attention
        model = build_encoder("bigbird", SMALL, n, 20, 10).eval()
        with torch.no_grad():
            model(input_ids=torch.randint(3, 20, (1, n)))
        assert model.bert.attention_type == "block_sparse"


def test_the_issue_41_encoders_are_linear_roberta_with_a_band_of_64_or_a_last_softmax_layer():
    """Issue 41's encoder variants: exact softmax over |i - j| < 64, the named feature map beyond (the band never
    exceeds the length), or the hybrid: RoBERTa's softmax attention in the last layer only. A padded batch stays
    finite."""
    from experiments.long_range.models import encoder_settings

    assert encoder_settings("linear_elu_window", 1024) == {"feature_map": "elu", "attention_window": 64}
    assert encoder_settings("linear_hedgehog_window", 32) == {"feature_map": "hedgehog", "attention_window": 32}
    assert encoder_settings("linear_hedgehog", 1024) == {"feature_map": "hedgehog"}  # the plain rows stay as run
    ids = torch.randint(3, 20, (2, 256))
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0
    for name in ("linear_elu_window", "linear_hedgehog_window"):
        model = build_encoder(name, SMALL, 256, 20, 2).eval()
        assert (model.config.attention_window, model.config.feature_map) == (64, name.split("_")[1])
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()
    hybrid = build_encoder("linear_elu_hybrid", Dims(32, 3, 4, 64), 256, 20, 2).eval()
    assert hybrid.config.layer_types == ["linear_attention", "linear_attention", "full_attention"]
    assert [layer.attention.self.full_attention for layer in hybrid.roberta.encoder.layer] == [False, False, True]
    with torch.no_grad():
        assert torch.isfinite(hybrid(input_ids=ids, attention_mask=mask).logits).all()


def test_padding_does_not_break_stock_nystromformer_with_landmarks():
    model = build_encoder("nystromformer", SMALL, 256, 20, 2).eval()
    ids = torch.randint(3, 20, (2, 256))
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()


def test_mean_pooling_hands_every_stock_head_the_mean_of_the_real_tokens_final_states():
    """Each family's own head, applied by hand to the masked mean of the states it would have read, gives the logits
    of the pooled model; pad positions count for nothing, so the logits differ from first-token pooling."""
    ids = torch.randint(3, 20, (2, 256))
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0
    for name in ENCODERS:
        torch.manual_seed(0)
        model = build_encoder(name, SMALL, 256, 20, 3).eval()
        seen = {}
        model.classifier.register_forward_pre_hook(lambda module, args: seen.update(states=args[0]))
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask).logits
            hooks = pool_by_mean(model)
            pooled = model(input_ids=ids, attention_mask=mask).logits
            for hook in hooks:
                hook.remove()
            states, weights = seen["states"], mask[:, :, None].float()
            by_hand = model.classifier((states * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True))
        torch.testing.assert_close(pooled, by_hand, msg=name)
        assert not torch.allclose(pooled, first), name


@pytest.mark.parametrize("call, message", [
    (lambda p: select(p, tasks=["pathfinder"]), "unknown task 'pathfinder'"),
    (lambda p: select(p, models=["performer"]), "unknown model 'performer'"),
    (lambda p: check_length("roberta_sdpa", 4096, 2048), "beyond the position table"),
    (lambda p: check_length("linformer_k256", 128, None), "exceeds the length"),
    (lambda p: build_encoder("gpt2_sdpa", SMALL, 64, 13, 2), "is a decoder"),
    (lambda p: profile(PRESETS / "smoke.json", None, 300), r"lengths are \[256, 512\]"),
    (lambda p: profile(PRESETS / "smoke.json", ["gpt2_sdpa"], 256), "no efficiency task with the models"),
])
def test_bad_input_gets_a_usage_error_naming_the_fix(call, message):
    preset = load_preset(PRESETS / "smoke.json")
    with pytest.raises(UsageError, match=message):
        call(preset)


def test_profile_prints_the_operators_of_one_training_step_of_each_chosen_model():
    printed = []
    profile(PRESETS / "smoke.json", ["linear_elu", "roberta_sdpa"], 256, log=printed.append, rows=1000)  # all ops
    tables = dict(zip(printed[::2], printed[1::2]))
    assert sorted(tables) == ["## linear_elu at n = 256: one training step, batch 1",
                              "## roberta_sdpa at n = 256: one training step, batch 1"]
    elu, softmax = (tables[f"## {m} at n = 256: one training step, batch 1"] for m in ("linear_elu", "roberta_sdpa"))
    assert "aten::elu" in elu and "aten::elu" not in softmax  # each table is its own model's step
    assert "aten::mm" in softmax and "Self CPU time total" in softmax


def test_a_preset_that_mixes_dimensions_or_a_missing_data_folder_is_refused(tmp_path):
    preset = json.loads((PRESETS / "smoke.json").read_text())
    preset["tasks"]["listops"]["models"][0] = {"name": "roberta_sdpa", "hidden_size": 128}
    (tmp_path / "mixed.json").write_text(json.dumps(preset))
    with pytest.raises(UsageError, match="mixes dimensions"):
        load_preset(tmp_path / "mixed.json")
    with pytest.raises(UsageError, match="--data_dir"):
        run(PRESETS / "smoke.json", tmp_path / "out", tasks=["text"], data_dir=tmp_path / "nowhere")
    for task, pooling in (("text", "max"), ("copy", "mean")):
        preset = json.loads((PRESETS / "smoke.json").read_text())
        preset["tasks"][task]["pooling"] = pooling
        (tmp_path / "pooling.json").write_text(json.dumps(preset))
        with pytest.raises(UsageError, match=f"task '{task}': 'pooling' '{pooling}' is not allowed"):
            load_preset(tmp_path / "pooling.json")
    with pytest.raises(UsageError, match="unknown pooling 'max'"):
        build_encoder("roberta_sdpa", SMALL, 64, 20, 2, pooling="max")


def test_stages_are_recorded_reused_and_refused_with_other_arguments(tmp_path):
    calls = []

    def fake(stage):
        calls.append(stage.key)
        return {"value": len(calls)}

    stages = [Stage("a/x", "copy", {"steps": 1}), Stage("b/y", "copy", {"steps": 2})]
    run_stages(stages, fake, tmp_path, "test machine", log=lambda s: None)
    records = run_stages(stages, fake, tmp_path, "test machine", log=lambda s: None)
    assert calls == ["a/x", "b/y"] and records["b/y"]["metrics"] == {"value": 2}
    assert json.loads((tmp_path / "records.json").read_text()).keys() == {"a/x", "b/y"}
    with pytest.raises(UsageError, match="other arguments"):
        run_stages([Stage("a/x", "copy", {"steps": 5})], fake, tmp_path, "test machine", log=lambda s: None)


def test_stages_another_process_finishes_meanwhile_stay_in_the_records_and_the_report(tmp_path):
    """Two runs of different stages into one folder: each one's records (records.json and what it returns for its
    report) hold the stages the other finished while it ran, not only those on disk when it started."""
    other = Stage("b/other", "copy", {"steps": 2})

    def slow(stage):  # while this stage runs, another process finishes its own stage in the same folder
        run_stages([other], lambda s: {"value": 2}, tmp_path, "other machine", log=lambda s: None)
        return {"value": 1}

    records = run_stages([Stage("a/mine", "copy", {"steps": 1})], slow, tmp_path, "test machine", log=lambda s: None)
    assert records.keys() == {"a/mine", "b/other"} and records["b/other"]["machine"] == "other machine"
    assert json.loads((tmp_path / "records.json").read_text()).keys() == {"a/mine", "b/other"}


def test_a_stage_records_the_hardware_it_ran_on_and_the_report_says_it_only_where_recorded(tmp_path):
    from benchmarks.measuring import hardware_text
    from experiments.long_range.report import render_markdown

    hardware = {"instruction_sets": ["avx2"], "cores": 2, "torch": "2.13.0+cpu",
                "matmul_peak_gflops": {"float32": 150.0, "bfloat16": 0.4}}
    records = run_stages([Stage("a/x", "copy", {"steps": 1})], lambda stage: {"value": 1}, tmp_path, "test machine",
                         log=lambda s: None, hardware=hardware)
    assert records["a/x"]["hardware"] == hardware
    meta = {"preset": "p", "machine": "m", "command": "c", "date": "d", "finished": 1, "total": 1,
            "task_notes": "t", "encoders": [], "decoders": []}
    summary = {"accuracy": {}, "efficiency": {}, "copy": {}, "notes": {}}
    before = render_markdown(meta, summary)
    assert "hardware" not in before  # records made before the field existed: the report as it was
    after = render_markdown({**meta, "hardware": [hardware_text(hardware)]}, summary)
    assert after.replace(f"- hardware of the stages: {hardware_text(hardware)}\n", "") == before


def test_a_slice_reports_every_finished_stage_of_the_preset_under_the_whole_command(tmp_path):
    """`--models` / `--tasks` run a slice; the report then covers every finished stage of the preset (the folder's
    table gains the slice's rows instead of losing the others'), under the command that runs the whole preset."""
    smoke = load_preset(PRESETS / "smoke.json")
    for models, accuracy in ((["roberta_sdpa"], 0.4), (["linear_elu"], 0.2)):
        run_stages(plan(select(smoke, ["listops"], models)), lambda stage: {"eval_accuracy": accuracy}, tmp_path,
                   "test machine", log=lambda s: None)
    argv = ["--preset", "smoke", "--output_dir", str(tmp_path), "--tasks", "listops", "--models", "linear_elu",
            "--report_only"]
    run(PRESETS / "smoke.json", tmp_path, tasks=["listops"], models=["linear_elu"], report_only=True, argv=argv,
        log=lambda s: None)
    markdown = (tmp_path / "results.md").read_text()
    assert "| Transformer (RoBERTa, SDPA) | 40.00 |" in markdown and "| Linear attention (elu+1) | 20.00 |" in markdown
    assert f"- command: `python scripts/long_range.py --preset smoke --output_dir {tmp_path}`" in markdown
    assert f"- stages finished: 2 of {len(plan(smoke))} (partial" in markdown
    assert "| Longformer |" not in markdown  # neither finished nor in the slice: no row


def test_the_committed_cpu_report_renders_again_from_its_records_but_for_the_date(tmp_path, monkeypatch):
    """`--report_only` on the committed folder, on a machine described as its stages' was: every line as committed
    but the date (the report's, today)."""
    import benchmarks.measuring

    committed = REPO_ROOT / "results" / "long_range" / "cpu"
    folder = tmp_path / "results" / "long_range" / "cpu"
    shutil.copytree(committed, folder)
    monkeypatch.chdir(tmp_path)
    recorded = json.loads((committed / "results.json").read_text())["machine"]
    monkeypatch.setattr(benchmarks.measuring, "describe_machine", lambda: recorded)
    run(PRESETS / "cpu.json", Path("results/long_range/cpu"), report_only=True, log=lambda s: None,
        argv=["--preset", "cpu", "--output_dir", "results/long_range/cpu", "--report_only"])

    def lines(path):
        return [line for line in path.read_text().splitlines() if not line.startswith("- date:")]

    assert lines(folder / "results.md") == lines(committed / "results.md")


def test_a_measurement_recorded_as_contended_is_taken_again_on_the_next_run(tmp_path):
    results = iter([{"steps_per_second": 1.0, "contended": True}, {"steps_per_second": 3.0}])
    stage = [Stage("efficiency/x-n8", "efficiency", {"n": 8})]
    run_stages(stage, lambda s: next(results), tmp_path, "m", log=lambda s: None)
    records = run_stages(stage, lambda s: next(results), tmp_path, "m", log=lambda s: None)
    assert records["efficiency/x-n8"]["metrics"] == {"steps_per_second": 3.0}


def test_an_efficiency_measurement_counts_as_contended_when_its_matmul_probe_fell_under_the_best_on_record():
    from experiments.long_range.efficiency import CONTENDED_BELOW, best_probe, contended
    from experiments.long_range.report import collect, goals

    def record(model, probes, steps):
        metrics = {"steps_per_second": steps, "best_steps_per_second": steps, "profiler_bytes": 1000,
                   **({"probe_gflops": probes} if probes else {})}
        return {"kind": "efficiency", "args": {"model": model, "n": 8}, "metrics": metrics}

    records = {"soft": record("roberta_sdpa", [100.0, 97.0], 1.0),
               "quiet": record("linear_elu", [99.0, 100.0], 5.0),
               "shared": record("linformer_k128", [100.0, 50.0], 2.0),  # the lower probe counts: shared at the end
               "unchecked": record("linear_hedgehog", None, 9.0)}
    assert best_probe(records) == 99.0  # the best measurement's lower probe
    assert [contended(r["metrics"], 99.0) for r in records.values()] == [False, False, True, True]
    assert not contended({"failed": "out of memory (killed)"}, 100.0)  # a failure is a finding, not a disturbance
    assert contended({"probe_gflops": [CONTENDED_BELOW * 100 - 1] * 2}, 100.0)
    efficiency = collect(records)["efficiency"]
    assert [efficiency[m][8]["contended"] for m in ("roberta_sdpa", "linear_elu", "linformer_k128",
                                                    "linear_hedgehog")] == [False, False, True, True]
    judged = goals({"accuracy": {}, "efficiency": efficiency})
    assert any(line.startswith("- linear_elu at n = 8: 5.00x") for line in judged)
    assert not any("linformer_k128 at" in line or "linear_hedgehog at" in line for line in judged)


def test_a_stage_file_finished_after_records_json_wins_and_retake_measures_again(tmp_path):
    from experiments.long_range.stages import load_records, stage_file

    stage = [Stage("efficiency/x-n8", "efficiency", {"n": 8})]
    values = iter([1.0, 2.0, 3.0])
    run_stages(stage, lambda s: {"steps_per_second": next(values)}, tmp_path, "m", log=lambda s: None)
    taken = run_stages(stage, lambda s: {"steps_per_second": next(values)}, tmp_path, "m", log=lambda s: None,
                       retake=lambda r: r["metrics"]["steps_per_second"] < 1.5)
    assert taken["efficiency/x-n8"]["metrics"] == {"steps_per_second": 2.0}
    # another process (or a run killed between the two writes) leaves a newer stage file than records.json's entry
    newer = {**taken["efficiency/x-n8"], "metrics": {"steps_per_second": 3.0}, "finished": "2999-01-01 00:00:00"}
    stage_file(tmp_path, "efficiency/x-n8").write_text(json.dumps(newer))
    assert load_records(tmp_path)["efficiency/x-n8"]["metrics"] == {"steps_per_second": 3.0}


def test_seed_replaces_the_presets_seed_in_every_stage_and_a_finished_stage_refuses_another(tmp_path):
    printed = []
    run(PRESETS / "smoke.json", tmp_path, tasks=["listops"], dry_run=True, log=printed.append, seed=7)
    planned = [json.loads(line.split(": ", 1)[1]) for line in printed[:-1]]
    assert planned and all(args["seed"] == 7 for args in planned)
    stage = Stage("listops/x", "classify", {"seed": 0})
    run_stages([stage], lambda s: {"eval_accuracy": 0.5}, tmp_path, "m", log=lambda s: None)
    with pytest.raises(UsageError, match="changed: seed"):
        run_stages([Stage("listops/x", "classify", {"seed": 7})], lambda s: {}, tmp_path, "m", log=lambda s: None)


def test_the_paper_preset_plans_every_stage_without_running_any():
    paper = load_preset(PRESETS / "paper.json")
    stages = plan(paper)
    assert len(stages) == 4 * len(ENCODERS) + 2 * len(paper["tasks"]["copy"]["models"]) + 2 * len(ENCODERS)
    assert {s.args["dims"]["hidden_size"] for s in stages if s.args.get("task") == "text"} == {256}


@pytest.mark.slow
@needs_imdb
def test_the_smoke_preset_runs_every_model_end_to_end_and_writes_every_table_and_plot(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "long_range.py"), "--preset", "smoke",
                           "--output_dir", str(tmp_path), "--data_dir", str(SHARED_DATA)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["finished"] == report["total"] == len(plan(load_preset(PRESETS / "smoke.json")))
    smoke = load_preset(PRESETS / "smoke.json")
    assert set(smoke["tasks"]["listops"]["models"]) == set(ENCODERS)  # every encoder trains and is evaluated
    for task in ("listops", "text"):
        assert set(m for m, v in report["accuracy"].items() if task in v) == set(smoke["tasks"][task]["models"])
    assert set().union(*(v.keys() for v in report["copy"].values())) == set(DECODERS)
    for by_length in report["efficiency"].values():  # every measurement carries its two availability probes
        assert all(len(m["probe_gflops"]) == 2 and min(m["probe_gflops"]) > 0 for m in by_length.values())
    markdown = (tmp_path / "results.md").read_text()
    for heading in ("## Accuracy", "## Training efficiency", "## Copy task", "## Goals", "- machine:", "- command:",
                    "- hardware of the stages: instruction sets"):
        assert heading in markdown
    for png in ("accuracy.png", "efficiency.png", "copy_task.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    # a stage file finished after records.json (another process took the stage again) is folded in by the report
    retaken = tmp_path / "stages" / "efficiency__linear_elu-n256.json"
    record = json.loads(retaken.read_text())
    retaken.write_text(json.dumps({**record, "finished": "2999-01-01 00:00:00"}))
    again = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "long_range.py"), "--preset", "smoke",
                            "--output_dir", str(tmp_path), "--report_only"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert again.returncode == 0 and "running" not in again.stdout
    folded = json.loads((tmp_path / "records.json").read_text())["efficiency/linear_elu-n256"]
    assert folded["finished"] == "2999-01-01 00:00:00"


def test_the_reformer_encoder_trains_the_same_from_the_same_seed():
    """transformers' Reformer reseeds torch from the operating system in every training forward; built here it draws
    those seeds from torch's generator, so two runs from one seed give the same losses (dropout and LSH included)."""
    import torch

    from experiments.long_range.models import Dims, build_encoder

    def losses():
        torch.manual_seed(0)
        model = build_encoder("reformer", Dims(32, 2, 2, 64), 64, 20, 3, dropout=0.1).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(3, 20, (4, 64), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=torch.tensor([0, 1, 2, 0])).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    assert losses() == losses()
