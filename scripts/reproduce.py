"""Reproduce the Linformer paper's SST-2 / IMDB / QNLI / QQP comparison (Table 2) and a causal-LM comparison.

Pretrains a softmax RoBERTa, Linformer variants and the linear-attention encoder with identical dimensions, data
(WikiText-2) and budget, fine-tunes each on SST-2, IMDB, QNLI and QQP, pretrains softmax / linear / causal-Linformer
decoders, and writes results.md (Table 2's shape, the paper's figures beside), results.json and results.png.

    python scripts/reproduce.py                          # the demo preset (about 6 minutes on 2 CPU cores)
    python scripts/reproduce.py --preset cpu             # every variant and task (93 stages, ~12 h on 2 cores)
    python scripts/reproduce.py --preset cpu --records results/reproduction/cpu/records.json  # go on
    python scripts/reproduce.py --preset paper           # RoBERTa-base size, n = 512: under `accelerate launch`
    python scripts/reproduce.py --preset cpu --dry_run   # print every stage's command, run nothing

Presets are configs/reproduce/NAME.json (or give a path). Every stage is a subprocess of scripts/pretrain.py or
scripts/finetune.py; rerunning the same command reuses the finished stages and resumes an interrupted pretraining.
"""

import argparse
import sys
from pathlib import Path

import _checkout  # noqa: F401  (experiments/ is beside scripts/, outside the package)

from experiments import find_preset
from experiments.reproduction import reproduce
from hf_linear_attn.training.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]  # the checkout: presets' paths are relative to it


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", help="demo, cpu, paper, or a preset JSON file")
    parser.add_argument("--output_dir", help="default: the preset's (outputs/reproduce/NAME)")
    parser.add_argument("--seeds", type=int, nargs="+", help="fine-tuning seeds for every task (default: each "
                        "task's 'seeds' in the preset, else the preset's 'seeds')")
    parser.add_argument("--launcher", help="'python' or e.g. 'accelerate launch --num_processes 8' (default: the "
                                           "preset's)")
    parser.add_argument("--models", nargs="+", metavar="NAME",
                        help="run only these encoders / decoders of the preset (names as in its JSON; a name in both "
                             "groups selects both; each group's baseline is kept); their stages are the full run's, "
                             "so a later full run reuses them")
    parser.add_argument("--records", metavar="FILE",
                        help="records.json of an earlier run (e.g. results/reproduction/cpu/records.json): its "
                             "finished stages whose arguments and inputs match are taken instead of run")
    parser.add_argument("--dry_run", action="store_true", help="print the stages' commands and stop")
    parser.add_argument("--report_only", action="store_true",
                        help="run nothing: write the table from the stages finished so far")
    args = parser.parse_args(argv)
    try:
        preset = find_preset(args.preset, ROOT / "configs" / "reproduce")
        reproduce(preset, args.output_dir, args.seeds, args.launcher, args.dry_run, args.report_only,
                  argv=sys.argv[1:] if argv is None else argv, models=args.models,
                  records_file=args.records, root=ROOT)
    except UsageError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
