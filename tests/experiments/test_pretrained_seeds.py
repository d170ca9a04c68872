"""Seeds of one pretrained preset run in several folders (scripts/pretrained.py --combine): joined into one table per
task whose figures are checked against the scores the runs were given, and refused where they cannot be joined."""

import json
import statistics
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, needs_data

sys.path.insert(0, str(REPO_ROOT))  # experiments/ lives beside scripts/, outside the package
import experiments.pretrained as pretrained  # noqa: E402
from experiments.pretrained.seeds import combine  # noqa: E402
from hf_linear_attn.training.errors import UsageError  # noqa: E402

PRESET = REPO_ROOT / "configs" / "pretrained" / "cpu.json"
LINFORMER = "Linformer k = 64, rows sum to 1"


def two_model_preset(tmp_path) -> dict:
    """The cpu preset cut to SST-2, MiniLM and one Linformer, its source a stand-in folder; written to p.json."""
    source = tmp_path / "minilm"
    source.mkdir()
    (source / "config.json").write_text("{}")
    preset = json.loads(PRESET.read_text())
    preset.update(source={"path": str(source)}, seeds=[42], finetune={"sst2": preset["finetune"]["sst2"]},
                  models={name: preset["models"][name] for name in (preset["baseline"], LINFORMER)})
    (tmp_path / "p.json").write_text(json.dumps(preset))
    return preset


def run_seeds(tmp_path, monkeypatch, folder, seeds, accuracy, machine, hardware=None):
    """The preset's stages at `seeds` into `folder` (its results folder), each fine-tune scoring `accuracy[model,
    seed]`: the real runner and report, the stage's subprocess replaced by what a finished stage leaves (recorded on
    `machine`, with `hardware` where given)."""

    def fake_run_stage(stage, launcher):
        result = ({"new_parameters": 10, "copied_parameters": 100} if stage.info["kind"] == "convert"
                  else {"eval_accuracy": accuracy[stage.info["model"], stage.info["seed"]]})
        stage.folder.mkdir(parents=True, exist_ok=True)
        (stage.folder / stage.marker).write_text(json.dumps(result))
        record = {"argv": stage.argv, "output_dir": str(stage.root), "seconds": 1.0, "result": result,
                  "machine": machine, **({"hardware": hardware} if hardware else {})}
        stage.record_path.write_text(json.dumps(record))
        return record, False

    monkeypatch.setattr(pretrained, "run_stage", fake_run_stage)
    pretrained.run(tmp_path / "p.json", REPO_ROOT, seeds=seeds, output_dir=tmp_path / f"{folder}-stages",
                   results_dir=tmp_path / folder, argv=["--seeds", *map(str, seeds)])
    return tmp_path / folder


@needs_data  # the preset's data files are checked when it is read, and the majority class is read from them
def test_seeds_of_several_folders_join_per_task_with_the_mean_noise_and_paired_gap_of_the_scores_given(
        tmp_path, monkeypatch):
    preset = two_model_preset(tmp_path)
    base = preset["baseline"]
    accuracy = {(base, 42): 0.90, (base, 1): 0.88, (base, 2): 0.87, (base, 3): 0.89,
                (LINFORMER, 42): 0.86, (LINFORMER, 1): 0.87, (LINFORMER, 2): 0.85}
    first = run_seeds(tmp_path, monkeypatch, "first", [42, 1], accuracy, "machine A, 2 cores")
    # seed 1 of MiniLM again on another machine (the same score), seeds 2 of both, and a MiniLM-only seed 3
    second = run_seeds(tmp_path, monkeypatch, "second", [1, 2], accuracy, "machine B, 2 cores",
                       {"instruction_sets": ["avx2", "avx512_bf16"], "cores": 2, "torch": "2.13.0+cpu",
                        "matmul_peak_gflops": {"float32": 100.0}})
    third = run_seeds(tmp_path, monkeypatch, "third", [3], {**accuracy, (LINFORMER, 3): 0.88}, "machine C")
    written = json.loads((third / "results.json").read_text())
    written["models"][LINFORMER]["tasks"].pop("sst2")  # as if only MiniLM ran there
    (third / "results.json").write_text(json.dumps(written))

    out = tmp_path / "joined"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "pretrained.py"), "--combine", str(first), str(second),
               str(third), "--results_dir", str(out), "--preset", str(tmp_path / "p.json")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    joined = json.loads((out / "results.json").read_text())["models"]
    expected = {base: [42, 1, 2, 3], LINFORMER: [42, 1, 2]}
    for name, seeds in expected.items():
        cell = joined[name]["tasks"]["sst2"]
        assert cell["seeds"] == seeds  # seed 1 of MiniLM once, though two folders hold it
        scores = [100 * accuracy[name, seed] for seed in seeds]
        assert cell["scores"] == pytest.approx(scores)
        assert cell["mean"] == pytest.approx(statistics.fmean(scores))
        assert cell["std"] == pytest.approx(statistics.stdev(scores))
    table = (out / "results.md").read_text()
    # the difference of means and its noise (2 x the standard error of the difference), and the paired gap over
    # the three seeds both ran, computed here from the scores given
    base_scores = [100 * accuracy[base, s] for s in expected[base]]
    lin_scores = [100 * accuracy[LINFORMER, s] for s in expected[LINFORMER]]
    delta = statistics.fmean(lin_scores) - statistics.fmean(base_scores)
    noise = 2 * (statistics.variance(lin_scores) / 3 + statistics.variance(base_scores) / 4) ** 0.5
    gaps = [100 * (accuracy[LINFORMER, s] - accuracy[base, s]) for s in (42, 1, 2)]
    row = next(line for line in table.splitlines() if line.startswith(f"| {LINFORMER} |"))
    assert f"| 42, 1, 2 | 86.0, 87.0, 85.0 | 86.0 ± 1.0 (3) | {delta:+.2f} pt (± {noise:.2f}: " in row
    assert f"| {statistics.fmean(gaps):+.2f} ± {statistics.stdev(gaps):.2f} (3 seeds) |" in row
    assert "other seeds than the baseline's" in row  # MiniLM's mean holds seed 3, the Linformer's does not
    assert "majority class 50.9" in table  # SST-2's dev set, from the runs' own majority reading
    # where each seed came from, and the agreement on the seed two machines both ran
    # each folder's machine beside its own instruction sets, from its stages' records
    assert "| machine B, 2 cores (instruction sets avx2 avx512_bf16; matmul peak 100.0 GFLOP/s float32) |" in table
    assert "| machine A, 2 cores (instruction sets not recorded) |" in table
    assert "Machine: machine B, 2 cores (instruction sets avx2 avx512_bf16; " in (second / "results.md").read_text()
    assert f"the same score again for {base}: SST-2 seed 1" in table
    assert (out / "results.png").is_file()
    # rewritten byte for byte
    subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=True)
    assert (out / "results.md").read_text() == table


@needs_data
def test_seeds_that_cannot_be_joined_are_refused_with_the_fix(tmp_path, monkeypatch):
    preset = two_model_preset(tmp_path)
    base = preset["baseline"]
    accuracy = {(base, 42): 0.90, (base, 1): 0.88, (LINFORMER, 42): 0.86, (LINFORMER, 1): 0.87}
    first = run_seeds(tmp_path, monkeypatch, "first", [42], accuracy, "machine A")
    second = run_seeds(tmp_path, monkeypatch, "second", [42, 1], {**accuracy, (base, 42): 0.91}, "machine B")
    with pytest.raises(UsageError, match=r"at seed 42: 90.00 in .*first, 91.00 in .*second. One seed has one score"):
        combine([first, second])
    with pytest.raises(UsageError, match="two or more results folders"):
        combine([first])
    with pytest.raises(UsageError, match="no results.json"):
        combine([first, tmp_path / "nowhere"])
    written = json.loads((second / "results.json").read_text())
    written["meta"]["preset"] = "qnli-linear"
    (second / "results.json").write_text(json.dumps(written))
    with pytest.raises(UsageError, match="of preset 'qnli-linear'.*combine the folders of one preset"):
        combine([first, second])
    # the joined table is never written over one of the folders it reads
    refused = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "pretrained.py"), "--combine", str(first),
                              str(first), "--results_dir", str(first)], capture_output=True, text=True, cwd=REPO_ROOT,
                             timeout=300)
    assert refused.returncode != 0 and "a folder of its own" in refused.stderr


@needs_data
def test_the_committed_joined_sst2_seeds_are_the_join_of_their_folders(tmp_path):
    """results/pretrained/cpu-seeds is what its own command writes from the committed folders: a seed added to
    one of them without rewriting the join (the figure docs/pretrained.md cites) fails here."""
    committed = REPO_ROOT / "results" / "pretrained" / "cpu-seeds"
    command = json.loads((committed / "results.json").read_text())["meta"]["command"].split()
    at = command.index("--results_dir")
    command[at + 1] = str(tmp_path / "joined")
    subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                   check=True)
    fresh = json.loads((tmp_path / "joined" / "results.json").read_text())
    assert fresh["models"] == json.loads((committed / "results.json").read_text())["models"]
