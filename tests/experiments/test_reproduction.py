"""scripts/reproduce.py: presets, the stage plan, reuse of finished stages, and the table against each stage's files."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT as REPO
from helpers import data_missing
from transformers import AutoConfig

import hf_linear_attn  # noqa: F401  (registers the model types read below)
from experiments.reproduction import TASKS, ReproductionError, Stage, load_preset, plan, reproduce
from experiments.reproduction.preset import _merged_config, finetune_seeds, select_models
from experiments.reproduction.report import collect, describe_seeds, render_markdown
from experiments.reproduction.stages import with_outcome

DATA = REPO.parent / "shared" / "data"
PRESETS = sorted((REPO / "configs" / "reproduce").glob("*.json"))
DIMENSIONS = {"encoders": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size", "max_position_embeddings"),
              "decoders": ("n_embd", "n_layer", "n_head", "n_inner", "vocab_size")}


def test_presets_exist_and_compare_like_with_like():
    assert {p.stem for p in PRESETS} >= {"demo", "cpu", "paper"}
    for path in PRESETS:
        preset = load_preset(path)
        for group, keys in DIMENSIONS.items():
            if group not in preset:  # a preset may compare encoders only (the demo)
                continue
            configs = [AutoConfig.from_pretrained(REPO / file) for file in preset[group].values()]
            for key in keys:  # identical dimensions inside a comparison: only the attention differs
                assert len({getattr(c, key) for c in configs}) == 1, (path.name, group, key)
    # the main command's preset compares with seeds, so the table can call a difference noise
    demo = load_preset(REPO / "configs" / "reproduce" / "demo.json")
    assert len(demo["encoders"]) == 2 and len(finetune_seeds(demo)["sst2"]) >= 3
    cpu = load_preset(REPO / "configs" / "reproduce" / "cpu.json")
    types = [AutoConfig.from_pretrained(REPO / file) for file in cpu["encoders"].values()]
    assert set(cpu["finetune"]) == set(TASKS)
    assert {c.model_type for c in types} == {"roberta", "linformer", "linear_roberta"}
    sharing = {c.linformer_sharing for c in types if c.model_type == "linformer"}
    assert sharing == {"headwise", "key-value", "layerwise"} and len({c.linformer_k for c in types
                                                                      if c.model_type == "linformer"}) == 2
    assert {AutoConfig.from_pretrained(REPO / f).model_type for f in cpu["decoders"].values()} == {
        "gpt2", "linear_gpt2", "linformer_gpt2"}
    paper = load_preset(REPO / "configs" / "reproduce" / "paper.json")
    assert paper["launcher"].startswith("accelerate launch")
    assert AutoConfig.from_pretrained(REPO / paper["encoders"][paper["baseline"]]).hidden_size == 768


def test_plan_orders_stages_and_dry_run_prints_them(tmp_path, capsys):
    preset = load_preset(REPO / "configs" / "reproduce" / "cpu.json")
    stages = plan(preset, tmp_path, [1, 2], {"mlm": "TOK"})
    kinds = [s.info["kind"] for s in stages]
    encoders = len(preset["encoders"])  # six of the paper's kind, and four of them again with rows summing to 1
    assert encoders == 10
    assert kinds.count("pretrain") == encoders and kinds.count("finetune") == encoders * 4 * 2
    assert kinds.count("decoder") == 3
    for i, stage in enumerate(stages):  # each fine-tune comes after the pretraining it starts from
        if stage.info["kind"] == "finetune":
            source = stage.argv[stage.argv.index("--model_name_or_path") + 1]
            assert any(s.info["kind"] == "pretrain" and str(s.folder) == source for s in stages[:i])
    assert len({s.folder for s in stages}) == len(stages)
    # without --seeds each task keeps the preset's seeds: more of them where one fine-tune is too noisy to read
    own = [s.info for s in plan(preset, tmp_path) if s.info["kind"] == "finetune"]
    for task, entry in preset["finetune"].items():
        seeds = entry.get("seeds", preset["seeds"])
        assert [i["seed"] for i in own if i["task"] == task] == seeds * encoders
    assert {task for task, entry in preset["finetune"].items() if len(entry.get("seeds", [])) > 1} == {"imdb", "qqp"}
    pre = stages[0].argv
    assert pre[pre.index("--tokenizer_name_or_path") + 1] == "TOK" and "--max_steps" in pre
    reproduce(REPO / "configs" / "reproduce" / "paper.json", output_dir=tmp_path, dry_run=True)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 6 * 5 + 3 and all(line.startswith("accelerate launch scripts/") for line in printed)
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_models_option_runs_a_subset_with_its_baseline_in_the_full_runs_folders(tmp_path, capsys):
    """--models keeps the named models plus their group's baseline, drops a group with none named, and plans the
    very stages (folders, arguments) of the full run, so a later full run reuses them."""
    preset = load_preset(REPO / "configs" / "reproduce" / "cpu.json")
    subset = select_models(preset, ["Linformer k = 64"])
    assert list(subset["encoders"]) == ["RoBERTa (softmax)", "Linformer k = 64"] and "decoders" not in subset
    full = {s.folder: s.argv for s in plan(preset, tmp_path)}
    for stage in plan(subset, tmp_path):
        assert full[stage.folder] == stage.argv
    assert list(select_models(preset, ["GPT-2 (softmax)"])["decoders"]) == ["GPT-2 (softmax)"]
    assert "encoders" not in select_models(preset, ["GPT-2 (softmax)"])
    with pytest.raises(ReproductionError, match=r"\['Linformer k = 999'\] are not models of this preset"):
        select_models(preset, ["Linformer k = 999"])
    from reproduce import main

    main(["--preset", "cpu", "--output_dir", str(tmp_path), "--dry_run", "--models", "Linear attention (elu + 1)"])
    printed = capsys.readouterr().out.splitlines()
    # the name is an encoder's and a decoder's: both run, each with its baseline (1 pretraining + 8 fine-tunes
    # per encoder: seeds 42 on SST-2 / QNLI, 42, 1, 2 on IMDB / QQP)
    folders = sorted({line.split("--output_dir ")[1].split()[0].split(str(tmp_path))[1].split("/")[2]
                      for line in printed})
    assert len(printed) == 2 * (1 + 8) + 2 and folders == ["gpt-2-softmax", "linear-attention-elu-1", "roberta-softmax"]


@pytest.mark.parametrize("change, message", [
    ({"unknown_key": 1}, "unknown keys"),
    ({"baseline": "nobody"}, "'baseline' must name one of the encoders"),
    ({"finetune": {"mnli": {"config": "configs/finetune/cpu-sst2.json"}}}, "'finetune' needs tasks"),
    ({"encoders": {"a": "configs/models/cpu/missing.json"}, "baseline": "a"}, "does not exist"),
    ({"seeds": []}, "'seeds' of the preset must be a non-empty list"),
    ({"finetune": {"sst2": {"config": "configs/finetune/cpu-sst2.json", "seeds": [1, 1]}}},
     "'seeds' of finetune 'sst2' must be a non-empty list of distinct integers"),
])
def test_bad_presets_are_refused(tmp_path, change, message):
    preset = {**json.loads((REPO / "configs" / "reproduce" / "demo.json").read_text()), **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(preset))
    with pytest.raises(ReproductionError, match=message):
        load_preset(path)


def test_a_decoder_conversion_is_planned_after_its_teacher_selected_with_it_and_checked(tmp_path):
    preset = load_preset(REPO / "configs" / "reproduce" / "decoders-n512.json")
    name, entry = next(iter(preset["decoder_conversions"].items()))
    stages = plan(preset, tmp_path, tokenizers={"clm": "TOK"})
    teacher = next(s for s in stages if s.info == {"kind": "decoder", "model": entry["from"]})
    convert, train = [s for s in stages if s.info["model"] == name]
    assert convert.info["kind"] == "conversion" and train.info["kind"] == "conversion_train"
    assert convert.argv[convert.argv.index("--model_name_or_path") + 1] == str(teacher.folder)
    assert train.argv[train.argv.index("--model_name_or_path") + 1] == str(convert.folder)
    assert train.argv[train.argv.index("--max_steps") + 1] == str(entry["train"]["max_steps"])  # the override wins
    # naming the conversion brings its teacher (the decoders' baseline here); naming a decoder brings no conversion
    assert list(select_models(preset, [name])["decoders"]) == [entry["from"]]
    assert "decoder_conversions" not in select_models(preset, ["Linear attention (elu + 1)"])
    for change, message in (({"from": "GPT-5"}, "needs \"from\""), ({"args": None}, "needs \"from\""),
                            ({"lr": 1}, "unknown keys \\['lr'\\]"),
                            ({"args": {"target": "linear_gpt2", "output_dir": "x"}}, "must not set")):
        bad = {**json.loads((REPO / "configs" / "reproduce" / "decoders-n512.json").read_text()),
               "decoder_conversions": {name: {**entry, **change}}}
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ReproductionError, match=message):
            load_preset(tmp_path / "bad.json", REPO)


@pytest.mark.slow
@pytest.mark.skipif(data_missing(DATA / "wikitext-2"), reason="needs ../shared/data (WikiText-2)")
def test_a_decoder_conversion_runs_distills_trains_further_and_reports_against_its_teacher(tmp_path):
    """The real scripts in subprocesses: GPT-2 pretrained for a few steps, converted into hedgehog + a softmax
    window, distilled, trained further; the table's figures are the ones the scripts wrote."""
    text = _wikitext_slice(tmp_path)
    small = {"max_seq_length": 32, "eval_steps": 2, "save_steps": 100, "max_eval_samples": 8,
             "per_device_train_batch_size": 4, **text}
    preset = {"description": "test", "decoder_pretrain": {"config": "configs/pretrain/cpu-clm.json",
                                                          "args": {"max_steps": 3, **small}},
              "decoders": {"GPT-2 (softmax)": "configs/models/cpu/gpt2-softmax.json"},
              "decoder_baseline": "GPT-2 (softmax)",
              "decoder_conversions": {"hedgehog + window 8": {
                  "from": "GPT-2 (softmax)",
                  "args": {"target": "linear_gpt2", "feature_map": "hedgehog", "attention_window": 8,
                           "distill_steps": 2, "distill_batch_size": 2, "distill_max_length": 32, "eval_rows": 4,
                           **{key: text[key] for key in ("train_file", "validation_file")}},
                  "train": {"max_steps": 2}}}}
    path, out = tmp_path / "convert.json", tmp_path / "run"
    path.write_text(json.dumps(preset))
    run = _run(path, out)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["stages_done"] == report["meta"]["stages"] == 3
    entry = report["conversions"]["hedgehog + window 8"]
    written = json.loads((out / "converted" / "hedgehog-window-8" / "conversion_report.json").read_text())
    distillation = written["distillation"]
    assert distillation["steps"] == 2 and written["new_parameters"] > 0  # the hedgehog maps are new and distilled
    assert entry["convert"]["teacher"] == distillation["teacher"]["perplexity"]
    assert entry["convert"]["distilled"] == distillation["distilled"]["perplexity"]
    assert entry["distilled_vs_teacher"] == pytest.approx(distillation["distilled"]["perplexity"]
                                                          / distillation["teacher"]["perplexity"])
    trained = json.loads((out / "converted" / "hedgehog-window-8-trained" / "train_results.json").read_text())
    assert trained["steps"] == 2 and entry["train"]["perplexity"] == trained["perplexity"]
    teacher = json.loads((out / "decoders" / "gpt-2-softmax" / "train_results.json").read_text())
    assert entry["trained_vs_teacher"] == pytest.approx(trained["perplexity"] / teacher["perplexity"])
    config = json.loads((out / "converted" / "hedgehog-window-8-trained" / "config.json").read_text())
    assert config["feature_map"] == "hedgehog" and config["attention_window"] == 8  # trained as converted
    table = (out / "results.md").read_text()
    assert "| hedgehog + window 8 | GPT-2 (softmax) | 2 steps x 2 rows of 32 tokens" in table
    assert f"{trained['perplexity']:.2f} (2 steps)" in table


def _finished(stages, scores: dict) -> dict:
    """Result files for the pretrainings and for the fine-tunes in ``scores`` ({(model, task, seed): accuracy %}),
    and their records as a run reads them; the other fine-tunes stay pending."""
    records = {}
    for stage in stages:
        info = stage.info
        stage.folder.mkdir(parents=True)
        if info["kind"] == "pretrain":
            (stage.folder / "train_results.json").write_text(json.dumps({"perplexity": 9.0}))
        elif (info["model"], info["task"], info["seed"]) in scores:
            split = "dev.tsv" if info["task"] == "sst2" else f"10% of train.jsonl held out (seed {info['seed']})"
            (stage.folder / "eval_results.json").write_text(json.dumps(
                {"eval_accuracy": scores[info["model"], info["task"], info["seed"]] / 100, "eval_split": split}))
        else:
            continue
        records[stage.name] = with_outcome(stage, {"seconds": 10.0})
    return records


def test_a_task_averages_its_seeds_once_all_have_finished(tmp_path):
    preset = {"baseline": "A", "encoders": {"A": "a.json", "B": "b.json"}, "pretrain": {"config": "p.json"},
              "finetune": {"sst2": {"config": "s.json"}, "imdb": {"config": "i.json", "seeds": [42, 1, 2]}}}
    stages = plan(preset, tmp_path, tokenizers={})
    scores = {("A", "sst2", 42): 80.0, ("A", "imdb", 42): 72.0, ("A", "imdb", 1): 75.0, ("A", "imdb", 2): 78.0,
              ("B", "sst2", 42): 81.0, ("B", "imdb", 42): 60.0, ("B", "imdb", 1): 75.0}  # B's IMDB seed 2: pending
    results = collect(preset, stages, _finished(stages, scores))
    a, b = results["encoders"]["A"], results["encoders"]["B"]
    assert a["tasks"]["imdb"]["accuracy"] == pytest.approx(75.0)  # (72 + 75 + 78) / 3
    assert a["tasks"]["imdb"]["std"] == pytest.approx(3.0)  # sample std: sqrt((9 + 0 + 9) / (3 - 1))
    assert a["average"] == pytest.approx((80.0 + 75.0) / 2) and a["vs_baseline"] == 0.0
    assert set(b["tasks"]["imdb"]["per_seed"]) == {"42", "1"}
    assert b["tasks"]["imdb"]["accuracy"] is None and b["average"] is None and b["vs_baseline"] is None
    assert results["tasks"]["imdb"]["split"] == "10% of train.jsonl held out (a split per fine-tuning seed: 42, 1, 2)"
    assert results["tasks"]["sst2"]["split"] == "dev.tsv"
    assert describe_seeds({"sst2": [42], "imdb": [42, 1, 2]}) == "42 (SST-2); 42, 1, 2 (IMDB)"
    assert describe_seeds({"sst2": [7], "imdb": [7]}) == "7"


def test_the_table_calls_a_difference_inside_the_seeds_noise_noise_and_flags_unlearned_tasks(tmp_path):
    preset = {"baseline": "A", "encoders": {"A": "a.json", "B": "b.json", "C": "c.json"},
              "pretrain": {"config": "p.json"}, "seeds": [1, 2],
              "finetune": {"sst2": {"config": "s.json"}, "imdb": {"config": "i.json"}}}
    stages = plan(preset, tmp_path, tokenizers={})
    scores = {"A": {"sst2": (80.0, 82.0), "imdb": (70.0, 74.0)},   # average 76.5
              "B": {"sst2": (81.0, 83.0), "imdb": (71.0, 73.0)},   # 77.0: +0.5
              "C": {"sst2": (90.0, 90.0), "imdb": (51.0, 51.0)}}   # 70.5: -6.0; IMDB at the majority class
    per_seed = {(model, task, seed): values[seed - 1] for model, tasks in scores.items()
                for task, values in tasks.items() for seed in (1, 2)}
    records = _finished(stages, per_seed)
    results = collect(preset, stages, records)
    # by hand: sample variances A (2, 8), B (2, 2), C (0, 0); two seeds each; four task terms over two tasks
    noise_b = 2 * ((2 / 2 + 8 / 2 + 2 / 2 + 2 / 2) ** 0.5) / 2
    assert results["encoders"]["B"]["noise"] == pytest.approx(noise_b)  # sqrt(7) = 2.65 > 0.5: within
    assert results["encoders"]["C"]["noise"] == pytest.approx(2 * ((2 / 2 + 8 / 2) ** 0.5) / 2)
    meta = {"command": "x", "machine": "m", "seeds": {"sst2": [1, 2], "imdb": [1, 2]}, "pretrain_seed": 42,
            "seconds": 60, "stages_done": len(records), "stages": len(stages),
            "majority": {"sst2": {"share": 0.509}, "imdb": {"share": 0.505}}}
    table = render_markdown("t", preset, results, meta)
    assert f"| +0.50 pt (within seed noise ±{noise_b:.2f}) |" in table
    assert "| -6.00 pt (beyond seed noise ±2.24) |" in table
    assert "| 51.0 ± 0.0 † |" in table and "† less than 2 points above the majority class" in table
    assert "| 90.0 ± 0.0 |" in table  # far above the majority: no mark
    assert "Hardware" not in table  # a run whose records carry no hardware record: the header as it always was
    hardware = ["instruction sets avx2; matmul peak 150.0 GFLOP/s float32, 0.4 GFLOP/s bfloat16"]
    with_hardware = render_markdown("t", preset, results, {**meta, "hardware": hardware})
    assert with_hardware.replace(f"Hardware of the stages: {hardware[0]}  \n", "") == table


@pytest.mark.parametrize("name", ["cpu", "demo"])  # cpu-unseeded: written at e3ec64a, by that day's code
def test_the_committed_reports_render_again_byte_for_byte_from_their_results_json(name):
    folder = REPO / "results" / "reproduction" / name
    report = json.loads((folder / "results.json").read_text())
    meta = report.pop("meta")
    report.pop("paper_table2")
    preset = load_preset(REPO / "configs" / "reproduce" / f"{meta['preset']}.json")
    assert render_markdown(meta["preset"], preset, report, meta) + "\n" == (folder / "results.md").read_text()


def test_a_result_the_run_did_not_record_is_adopted_from_its_launch_record_or_refused(tmp_path):
    """A stage's script can write its result and the run stop before writing stage.json (stopped in between, or
    the script failed after its result): the launch record kept beside the logs says what made it."""
    folder = tmp_path / "finetune" / "a" / "sst2-seed42"
    argv = ["--config", "configs/finetune/cpu-sst2.json", "--output_dir", str(folder), "--seed", "42"]
    stage = Stage("fine-tune A on SST-2 (seed 42)", "scripts/finetune.py", folder, argv, "eval_results.json", tmp_path, REPO)
    assert stage.finished() is None  # nothing there yet
    folder.mkdir(parents=True)
    (folder / "eval_results.json").write_text(json.dumps({"eval_accuracy": 0.75}))
    with pytest.raises(ReproductionError, match="no record of the stage that wrote it"):
        stage.finished()
    stage.pending_path.parent.mkdir()
    stage.pending_path.write_text(json.dumps({"argv": [*argv[:-1], "43"], "inputs": {}, "output_dir": str(tmp_path)}))
    with pytest.raises(ReproductionError, match="no launch record of stage .* with these arguments"):
        stage.finished()  # the launch record of another run of the folder does not vouch for this result
    stage.pending_path.write_text(json.dumps({"argv": argv, "inputs": stage.inputs(), "output_dir": str(tmp_path)}))
    stage.pending_path.with_name("fine-tune-a-on-sst-2-seed-42.seconds").write_text("12.5")
    record = stage.finished()
    assert record["result"] == {"eval_accuracy": 0.75} and record["seconds"] == 12.5
    assert json.loads(stage.record_path.read_text()) == record and not stage.pending_path.exists()
    assert stage.finished() == record  # from stage.json now


@pytest.mark.parametrize("kept", ["project", "command only"])
def test_a_record_written_in_a_checkout_elsewhere_is_taken_by_a_clone_at_another_path(tmp_path, kept):
    """A stage's arguments name paths inside the checkout (the checkpoint installed in its .venv): a record written in
    /work/main must be taken by a clone at another path (a worktree, CI's clone), or a slice run there takes none of
    the committed records and refuses to rewrite their table. Records written before they kept their checkout are
    read by the scripts/ folder their command ran."""
    checkouts = {}
    for name in ("main", "clone"):
        project = tmp_path / name
        model = project / ".venv" / "site-packages" / "minilm" / "model"
        model.mkdir(parents=True)
        (model / "model.safetensors").write_bytes(b"the same weights in both")
        out = project / "outputs" / "run"
        folder = out / "finetune" / "a" / "sst2-seed42"
        argv = ["--model_name_or_path", str(model), "--output_dir", str(folder), "--seed", "42"]
        checkouts[name] = Stage("fine-tune A on SST-2 (seed 42)", "scripts/finetune.py", folder, argv,
                                "eval_results.json", out, project)
    written = checkouts["main"]
    record = {"argv": written.argv, "inputs": written.inputs(), "output_dir": str(written.root),
              "command": f"python {written.project / 'scripts' / 'finetune.py'} --seed 42",
              "result": {"eval_accuracy": 0.8}}
    if kept == "project":
        record["project"] = str(written.project)
    clone = checkouts["clone"]
    assert clone.key == written.key  # the records file's name for the stage is the same in both
    assert clone.recorded({written.key: record}, {}) == record
    # what differs is still told apart: other weights, or another seed
    (clone.project / ".venv" / "site-packages" / "minilm" / "model" / "model.safetensors").write_bytes(b"others")
    assert clone.recorded({written.key: record}, {}) is None
    other = {**record, "argv": [*written.argv[:-1], "43"]}
    assert written.recorded({written.key: other}, {}) is None


@pytest.mark.parametrize("left, flags", [([], []), (["trainer_state.json"], ["--overwrite_output_dir"]),
                                          (["checkpoint-50/", "checkpoint-100/"], ["--resume_from_checkpoint", "True"])])
def test_an_interrupted_fine_tune_goes_on_from_its_newest_checkpoint_or_starts_again(tmp_path, left, flags):
    """A stopped fine-tune that saved Trainer checkpoints (a preset's --save_steps) is relaunched with
    --resume_from_checkpoint True, its earlier seconds counted; one with none starts again over what it left."""
    from experiments.reproduction.stages import run_stage

    folder = tmp_path / "finetune" / "a" / "imdb-seed42"
    argv = ["--config", "configs/finetune/cpu-imdb.json", "--output_dir", str(folder), "--seed", "42"]
    stage = Stage("fine-tune A on IMDB (seed 42)", "scripts/finetune.py", folder, argv, "eval_results.json", tmp_path,
                  REPO)
    for name in left:  # what the interrupted launch left in the stage's folder
        if name.endswith("/"):
            (folder / name.rstrip("/")).mkdir(parents=True)
        else:
            folder.mkdir(parents=True)
            (folder / name).touch()
    stage.log_file(".seconds").parent.mkdir(parents=True, exist_ok=True)
    stage.log_file(".seconds").write_text("100.0")  # what the interrupted launch had spent
    fake = tmp_path / "fake_script.py"  # stands for the launched script: records its command line, writes the result
    fake.write_text("import json, sys\nfrom pathlib import Path\nargs = sys.argv[2:]\n"
                    "out = Path(args[args.index('--output_dir') + 1]); out.mkdir(parents=True, exist_ok=True)\n"
                    "(out / 'argv.json').write_text(json.dumps(args))\n"
                    "(out / 'eval_results.json').write_text(json.dumps({'eval_accuracy': 0.5}))\n")
    record, reused = run_stage(stage, [sys.executable, str(fake)])
    assert not reused and json.loads((folder / "argv.json").read_text()) == [*argv, *flags]
    assert record["resumed"] == bool(flags and flags[0] != "--overwrite_output_dir")
    assert (record["seconds"] >= 100.0) == record["resumed"]  # a resumed stage's wall time includes the first try


def test_seeds_must_be_distinct_and_data_paths_resolve_from_any_directory(tmp_path, monkeypatch):
    preset = load_preset(REPO / "configs" / "reproduce" / "cpu.json")
    with pytest.raises(ReproductionError, match="--seeds must be distinct"):
        finetune_seeds(preset, [42, 42])
    monkeypatch.chdir(tmp_path)  # the preset's data paths are relative to the repository, like its configs
    merged = _merged_config(preset["finetune"]["sst2"], preset["root"])
    assert Path(merged["train_file"]).is_absolute()
    assert Path(merged["train_file"]).resolve() == (REPO / "../shared/data/glue/sst2/train.tsv").resolve()


def _wikitext_slice(tmp_path) -> dict:
    """The first 2,000 lines of WikiText-2 train and 300 of validation as the pretraining files: the stages train 2
    steps, and tokenizing all of WikiText-2 (two shared tokenizers, four pretraining stages) was most of their time."""
    files = {}
    for key, source, lines in (("train_file", "wiki.train.tokens", 2000),
                               ("validation_file", "wiki.valid.tokens", 300)):
        with open(DATA / "wikitext-2" / source) as handle:
            files[key] = tmp_path / source
            files[key].write_text("".join(next(handle) for _ in range(lines)))
    return {key: str(path) for key, path in files.items()}


def _smoke_preset(tmp_path) -> Path:
    linformer_config = tmp_path / "linformer-k32.json"  # a copy, edited in place by the test below
    linformer_config.write_text((REPO / "configs" / "models" / "cpu" / "linformer-k32.json").read_text())
    text = _wikitext_slice(tmp_path)
    preset = {
        "description": "test", "seeds": [3],
        "pretrain": {"config": "configs/pretrain/cpu-mlm.json",
                     "args": {"max_steps": 2, "max_seq_length": 32, "eval_steps": 2, "save_steps": 100,
                              "max_eval_samples": 8, "per_device_train_batch_size": 4, **text}},
        "encoders": {"RoBERTa (softmax)": "configs/models/cpu/roberta-softmax.json",
                     "Linformer k = 32": str(linformer_config)},
        "baseline": "RoBERTa (softmax)",
        "finetune": {"sst2": {"config": "configs/finetune/cpu-sst2.json",
                              "args": {"max_train_samples": 32, "max_eval_samples": 40, "num_train_epochs": 1,
                                       "train_sampling_strategy": "group_by_length"}},
                     "qqp": {"config": "configs/finetune/cpu-qqp.json",
                             "args": {"max_train_samples": 32, "max_eval_samples": 24, "num_train_epochs": 1,
                                      "max_seq_length": 48}}},
        "decoder_pretrain": {"config": "configs/pretrain/cpu-clm.json",
                             "args": {"max_steps": 2, "max_seq_length": 32, "eval_steps": 2, "max_eval_samples": 8,
                                      "per_device_train_batch_size": 4, **text}},
        "decoders": {"GPT-2 (softmax)": "configs/models/cpu/gpt2-softmax.json",
                     "Linear attention (elu + 1)": "configs/models/cpu/linear-gpt2-elu.json"},
        "decoder_baseline": "GPT-2 (softmax)",
    }
    path = tmp_path / "smoke.json"
    path.write_text(json.dumps(preset))
    return path


def _run(preset, out, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "reproduce.py"), "--preset", str(preset),
                           "--output_dir", str(out), *extra], capture_output=True, text=True, cwd=REPO, env=env)


def _run_here(capsys, preset, out, *extra):
    """scripts/reproduce.py's main in this process, as a CompletedProcess (its stages are still subprocesses): the
    first run of the test below is the command line itself, the later ones save a fresh interpreter each."""
    from reproduce import main

    capsys.readouterr()
    code, message = 0, ""
    try:
        main(["--preset", str(preset), "--output_dir", str(out), *map(str, extra)])
    except SystemExit as stop:
        code, message = (stop.code, "") if isinstance(stop.code, int) else (1, str(stop.code))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess([], code, captured.out, captured.err + message)


def _tsv_labels(path, column, rows):
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [row[column] for _, row in zip(range(rows), reader)]


@pytest.mark.skipif(data_missing(DATA / "glue", DATA / "wikitext-2"),
                    reason="needs ../shared/data (GLUE and WikiText-2 files)")
@pytest.mark.slow
def test_reproduction_runs_reuses_and_reports_what_the_stages_wrote(tmp_path, capsys):
    preset, out = _smoke_preset(tmp_path), tmp_path / "run"
    first = _run(preset, out)
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["stages_done"] == report["meta"]["stages"] == 2 * 3 + 2
    for model, folder in (("RoBERTa (softmax)", "roberta-softmax"), ("Linformer k = 32", "linformer-k-32")):
        entry = report["encoders"][model]
        scores = []
        for task, rows in (("sst2", 40), ("qqp", 24)):
            written = json.loads((out / "finetune" / folder / f"{task}-seed3" / "eval_results.json").read_text())
            assert written["eval_samples"] == rows
            assert entry["tasks"][task]["accuracy"] == pytest.approx(100 * written["eval_accuracy"])
            scores.append(100 * written["eval_accuracy"])
        assert entry["average"] == pytest.approx(sum(scores) / 2)
        trained = json.loads((out / "pretrain" / folder / "train_results.json").read_text())
        assert entry["pretrain"]["perplexity"] == trained["perplexity"] and trained["steps"] == 2
    base = report["encoders"]["RoBERTa (softmax)"]["average"]
    assert report["encoders"]["Linformer k = 32"]["vs_baseline"] == pytest.approx(
        report["encoders"]["Linformer k = 32"]["average"] - base)
    # majority class, counted here from the TSV files (quoting disabled) independently of the pipeline
    sst2 = _tsv_labels(DATA / "glue" / "sst2" / "dev.tsv", "label", 40)
    qqp = _tsv_labels(DATA / "glue" / "qqp" / "dev_subset.tsv", "is_duplicate", 24)
    for task, labels in (("sst2", sst2), ("qqp", qqp)):
        share = max(labels.count(v) for v in set(labels)) / len(labels)
        assert report["meta"]["majority"][task]["share"] == pytest.approx(share)
    ratio = report["decoders"]["Linear attention (elu + 1)"]["vs_baseline"]
    perplexities = [report["decoders"][m]["pretrain"]["perplexity"] for m in report["decoders"]]
    assert ratio == pytest.approx(perplexities[1] / perplexities[0])
    # every model of a comparison used the one shared tokenizer
    for folder in ("roberta-softmax", "linformer-k-32"):
        args = json.loads((out / "pretrain" / folder / "run_args.json").read_text())
        assert args["tokenizer_name_or_path"] == str(out / "tokenizer-mlm")
    table = (out / "results.md").read_text()
    assert "| Linformer k = 32 |" in table and "92.25" in table and "QQP (train subset)" in table
    assert "Hardware of the stages: instruction sets" in table  # the run's CPU, beside its model name
    delta = report["encoders"]["Linformer k = 32"]["vs_baseline"]
    # signed, so a gain never reads as a loss; one seed per task: the table does not call the difference
    assert f"| {delta:+.2f} pt (noise unknown: one seed on SST-2, QQP) |" in table
    assert (out / "results.png").stat().st_size > 10_000

    # a rerun reuses every finished stage; a stage whose result is gone (an interrupted run) is redone alone
    (out / "finetune" / "linformer-k-32" / "qqp-seed3" / "eval_results.json").unlink()
    record = out / "pretrain" / "roberta-softmax" / "stage.json"
    before = record.read_text()
    second = _run_here(capsys, preset, out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("reused") == 7 and second.stdout.count("done (") == 1
    assert record.read_text() == before
    assert (out / "finetune" / "linformer-k-32" / "qqp-seed3" / "eval_results.json").is_file()

    # the results folder can move: its stages are still recognised as finished
    moved = tmp_path / "moved"
    out.rename(moved)
    out = moved
    fourth = _run_here(capsys, preset, out)
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    assert fourth.stdout.count("reused") == 8

    # records.json stands for the finished stages where their folders are not (a later session, another machine)
    records = json.loads((out / "records.json").read_text())
    assert len(records["stages"]) == 8
    assert all("result" in r and r["inputs"] for r in records["stages"].values())
    # a --models run writes the records of the preset's other stages too (here they come from --records)
    reproduce(preset, tmp_path / "subset", records_file=out / "records.json", models=["GPT-2 (softmax)"],
              report_only=True)
    assert json.loads((tmp_path / "subset" / "records.json").read_text()) == records
    elsewhere = tmp_path / "elsewhere"
    taken = _run_here(capsys, preset, elsewhere, "--records", str(out / "records.json"))
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert taken.stdout.count("from records") == 8 and "done (" not in taken.stdout
    assert not (elsewhere / "pretrain").exists() and not (elsewhere / "finetune").exists()
    here, there = (json.loads((folder / "results.json").read_text()) for folder in (out, elsewhere))
    for model, entry in here["encoders"].items():
        assert there["encoders"][model]["tasks"] == entry["tasks"] and there["encoders"][model]["average"] == \
            entry["average"]
        assert there["encoders"][model]["pretrain"]["parameters"] == entry["pretrain"]["parameters"]
    assert there["decoders"]["GPT-2 (softmax)"]["pretrain"]["perplexity"] == \
        here["decoders"]["GPT-2 (softmax)"]["pretrain"]["perplexity"]
    # a stage missing from the records runs, after its pretraining runs again (same weights: reproducible)
    partial = json.loads(json.dumps(records))
    del partial["stages"]["$OUTPUT_DIR/finetune/linformer-k-32/qqp-seed3"]
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    completed = _run_here(capsys, preset, tmp_path / "completed", "--records", str(tmp_path / "partial.json"))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.count("from records") == 7 and completed.stdout.count("done (") == 1
    assert "first pretrain Linformer k = 32, known here only from the records" in completed.stdout
    redone = json.loads((tmp_path / "completed" / "results.json").read_text())["encoders"]["Linformer k = 32"]
    assert redone["tasks"]["qqp"]["accuracy"] == here["encoders"]["Linformer k = 32"]["tasks"]["qqp"]["accuracy"]
    # records whose pretraining does not rerun to the recorded weights are not mixed with new fine-tunes
    forged = json.loads(json.dumps(records))
    model_key = "$OUTPUT_DIR/pretrain/roberta-softmax"
    forged["stages"][model_key]["output_digest"] = "0" * 16
    for record in forged["stages"].values():
        if model_key in record["inputs"]:
            record["inputs"][model_key] = "0" * 16
    del forged["stages"]["$OUTPUT_DIR/finetune/roberta-softmax/qqp-seed3"]  # SST-2 is taken, then QQP must run
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    refused = _run_here(capsys, preset, tmp_path / "refused", "--records", str(tmp_path / "forged.json"))
    assert refused.returncode != 0 and "wrote other weights than in the records" in refused.stderr
    (tmp_path / "not-records.json").write_text("[1, 2]")
    for bad, message in (("missing.json", "cannot read the records file"), ("not-records.json", "not a records file")):
        with pytest.raises(ReproductionError, match=message):
            reproduce(preset, tmp_path / "bad", records_file=tmp_path / bad)
        assert not (tmp_path / "bad").exists()  # refused before anything is written

    # nor with a config edited in place since: the error names the changed file
    config = tmp_path / "linformer-k32.json"
    config.write_text(config.read_text().replace('"pooling"', '"xavier_uniform"'))
    edited = _run_here(capsys, preset, out)
    assert edited.returncode != 0 and edited.stdout.count("reused") == 3
    assert "inputs have changed since: linformer-k32.json" in edited.stderr.replace(str(tmp_path) + "/", "")

    # a finished stage is never mixed with a changed preset: the error names the folder
    changed = json.loads(preset.read_text())
    changed["pretrain"]["args"]["max_steps"] = 3
    preset.write_text(json.dumps(changed))
    third = _run_here(capsys, preset, out)
    assert third.returncode != 0
    assert "holds a finished run with other arguments" in third.stderr and "roberta-softmax" in third.stderr
