"""The reproduction's runner (scripts/reproduce.py): plan the preset's stages, run or reuse them, then write
results.json, results.md, results.png and records.json (`reproduce`)."""

import json
import shlex
import signal
import statistics
import sys
from pathlib import Path

from benchmarks.measuring import describe_machine, hardware_of_records

from .preset import _merged_config, finetune_seeds, load_preset, project_root, select_models
from .report import PAPER_TABLE2, collect, majority_share, plot, render_markdown
from .stages import load_records, plan, run_stages, shared_tokenizers, write_records



def reproduce(preset_path, output_dir=None, seeds=None, launcher=None, dry_run=False, report_only=False,
              argv=None, models=None, records_file=None, root=None) -> dict:
    """Run (or reuse) every stage of the preset (or of the `models` named, with their baselines), taking finished
    stages from `records_file` (an earlier run's records.json) where they match, then write results.json /
    results.md / results.png and records.json. Paths in the preset are relative to `root` (see `load_preset`)."""
    full_preset = load_preset(preset_path, root)
    preset = select_models(full_preset, models)
    preset_name = Path(preset_path).stem
    output_dir = Path(output_dir or preset.get("output_dir") or f"outputs/reproduce/{preset_name}")
    output_dir = output_dir if output_dir.is_absolute() else Path.cwd() / output_dir
    seeds = list(seeds) if seeds else None  # None: each task's seeds from the preset
    launcher_text = launcher or preset.get("launcher", "python")
    launcher = [sys.executable] if launcher_text == "python" else shlex.split(launcher_text)
    root = project_root(preset)
    # the seed of the pretrainings: the encoders' config's, else (a preset of decoders only) the decoders'
    part = "pretrain" if "pretrain" in preset else "decoder_pretrain"
    pretrain_seed = _merged_config(preset[part], root).get("seed", 42) if part in preset else None

    if dry_run:
        for stage in plan(preset, output_dir, seeds, shared_tokenizers(preset, output_dir, train=False)):
            print(shlex.join([*launcher, stage.script, *stage.argv]))
        return {}

    archive = load_records(records_file) if records_file else {}  # read before anything is written
    earlier = load_records(output_dir / "records.json") if (output_dir / "records.json").is_file() else {}
    output_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM stops the run like Ctrl-C: the running stage's child is stopped and its time so far recorded
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("reproduction stopped (SIGTERM); rerun to continue"))
    # with records, the tokenizers are trained even for a report: the records' inputs are checked against them
    tokenizers = shared_tokenizers(preset, output_dir, train=not report_only or records_file is not None)
    stages = plan(preset, output_dir, seeds, tokenizers)
    # records of the preset's other stages (outside --models) are kept: from this folder's records.json, else
    # from --records, so that running the models one group at a time never loses what the others finished
    planned = {stage.key for stage in stages}
    others = {stage.key for stage in plan(full_preset, output_dir, seeds, tokenizers)} - planned
    carried = {key: record for key, record in {**archive, **earlier}.items() if key in others}
    records = run_stages(stages, launcher, output_dir, archive, report_only, carried)

    results = collect(preset, stages, records)
    task_seeds = finetune_seeds(preset, seeds)
    majority = {}
    for task, entry in preset.get("finetune", {}).items():
        # held-out rows can follow the seed
        shares = [majority_share(entry, seed, root) for seed in task_seeds[task]]
        majority[task] = {"share": statistics.fmean(share for share, _ in shares), "rows": shares[0][1]}
    machines = sorted({r["machine"] for r in records.values() if r.get("machine")})
    meta = {"preset": preset_name, "preset_file": str(preset_path), "machine": describe_machine(),
            "stage_machines": machines,
            # each stage's instruction sets and matmul peaks (none in records made before they were recorded)
            **({"hardware": hw} if (hw := hardware_of_records(records.values())) else {}),
            "command": "python scripts/reproduce.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "seeds": task_seeds, "pretrain_seed": pretrain_seed, "majority": majority,
            "seconds": sum(r["seconds"] for r in records.values()), "stages": len(stages),
            "stages_done": len(records)}
    report = {"meta": meta, "paper_table2": PAPER_TABLE2, **results}
    (output_dir / "results.json").write_text(json.dumps(report, indent=2))
    write_records(stages, records, output_dir, carried)
    markdown = render_markdown(preset_name, preset, results, meta)
    (output_dir / "results.md").write_text(markdown + "\n")
    plot(preset, results, meta, output_dir / "results.png")
    print(markdown)
    print(f"Wrote {output_dir / 'results.json'}, results.md and results.png")
    return report
