"""MQAR across seeds (scripts/recall.py --combine): runs of one preset at several seeds (--seed), read back into one
table whose figures are checked against the runs' own records."""

import json
import statistics
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

from benchmarks.measuring import describe_machine
from experiments.long_range.stages import load_records, stage_file
from experiments.recall.runner import run
from experiments.recall.seeds import combine
from hf_linear_attn.training.errors import UsageError

SMOKE = REPO_ROOT / "configs" / "recall" / "smoke.json"


def test_seeds_of_one_preset_combine_into_one_row_per_setting_with_each_seeds_own_figures(tmp_path):
    folders = {seed: tmp_path / f"seed{seed}" for seed in (0, 1, 2)}
    for seed, folder in folders.items():
        run(SMOKE, folder, models=["linear_gpt2", "gpt2_sdpa", "linear_gpt2_gated_delta_conv"], pairs=[2], seed=seed,
            log=lambda s: None, argv=[])
    # another learning rate: the same cells, a row of its own
    faster = json.loads(SMOKE.read_text())
    faster["optimizer"]["lr"] = 0.01
    (tmp_path / "faster.json").write_text(json.dumps(faster))
    run(tmp_path / "faster.json", tmp_path / "faster", models=["linear_gpt2"], pairs=[2], log=lambda s: None, argv=[])
    # one seed marked as having learnt the lookup, with a loss curve that falls below ln(2) at step 4
    key = "mqar-n32-p2-w32/linear_gpt2"
    records = json.loads((folders[1] / "records.json").read_text())
    learnt = records[key]["metrics"]
    learnt["eval_accuracy"], learnt["loss_curve"] = 0.95, [[2, 3.1], [4, 0.5], [6, 0.2]]
    # and run on another machine: the report names each machine with its own instruction sets
    records[key]["machine"] = "Another CPU, 2 cores"
    records[key]["hardware"] = {"instruction_sets": ["avx2", "avx512f"],
                                "matmul_peak_gflops": {"float32": 150.0, "bfloat16": 30.0}}
    (folders[1] / "records.json").write_text(json.dumps(records))
    stage_file(folders[1], key).write_text(json.dumps(records[key]))  # the stage's own file, which load_records reads

    command = [sys.executable, str(REPO_ROOT / "scripts" / "recall.py"), "--combine", *map(str, folders.values()),
               str(tmp_path / "faster"), "--output_dir", str(tmp_path / "seeds")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "seeds" / "results.json").read_text())["rows"]
    assert [(r["model"], r["lr"], sorted(r["seeds"])) for r in rows] == [
        ("gpt2_sdpa", 0.003, ["0", "1", "2"]), ("linear_gpt2", 0.01, ["0"]), ("linear_gpt2", 0.003, ["0", "1", "2"]),
        ("linear_gpt2_gated_delta_conv", 0.003, ["0", "1", "2"])]
    for row in rows:
        for seed, got in row["seeds"].items():
            folder = tmp_path / "faster" if row["lr"] == 0.01 else folders[int(seed)]
            record = load_records(folder)[f"mqar-n32-p2-w32/{row['model']}"]
            assert record["args"]["seed"] == int(seed) and got["accuracy"] == record["metrics"]["eval_accuracy"]
            assert got["folder"] == str(folder)
    report = (tmp_path / "seeds" / "results.md").read_text()
    linear = [r for r in rows if r["model"] == "linear_gpt2" and r["lr"] == 0.003][0]
    accuracies = [linear["seeds"][s]["accuracy"] for s in ("0", "1", "2")]
    line = next(x for x in report.splitlines() if x.startswith("| linear_gpt2 (elu+1) | 0.003 |"))
    assert "95.0% (4) |" in line and "never" in line  # seed 1 began at step 4, the others never
    mean, sd = 100 * statistics.mean(accuracies), 100 * statistics.stdev(accuracies)
    assert f"| {mean:.1f} ± {sd:.1f} | 1 of 3 | 1 of 3 |" in line
    # what the cell's settings differ in gets a column
    assert "| model | optimizer.lr | seed 0 | seed 1 | seed 2 | mean ± sd | lookup began | learnt |" in report
    assert "| linear_gpt2 (elu+1) | 0.01 |" in report and "(1 seed) | 0 of 1 | 0 of 1 |" in report
    machines = report.split("Machine: ")[1].splitlines()[0]
    assert machines.startswith(describe_machine())  # the machine the stages ran on
    assert "; and on Another CPU, 2 cores; instruction sets avx2 avx512f; matmul peak 150.0 GFLOP/s float32" in machines

    # the gated rule's states: per layer, the longest-keeping head's share of a write, at the start -> trained
    gated = [line for line in report.splitlines() if line.startswith("| 32 | 2 | 32 | linear_gpt2, gated delta")]
    assert len(gated) == 3
    for seed, line in enumerate(gated):
        metrics = load_records(folders[seed])["mqar-n32-p2-w32/linear_gpt2_gated_delta_conv"]["metrics"]
        kept = [max(h["kept"] for h in metrics[key]["layers"][0]) for key in ("memory_init", "memory")]
        assert line.endswith(f"| {seed} | {100 * metrics['eval_accuracy']:.1f}% | {kept[0]:.2f} -> {kept[1]:.2f} |")
    assert "linear_gpt2 (elu+1) | 0.003 | 0 |" not in report  # no decay, no row

    with pytest.raises(UsageError, match="two or more run folders"):
        combine([folders[0]])
    with pytest.raises(UsageError, match="at seed 0 is in both"):
        combine([folders[0], folders[0]])
    with pytest.raises(UsageError, match="no finished MQAR stages"):
        combine([folders[0], tmp_path / "empty"])
    refused = subprocess.run(command[:-2], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert refused.returncode != 0 and "--combine writes its table into --output_dir" in refused.stderr
