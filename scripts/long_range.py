"""Long-range evidence (issue 26): ListOps and byte-level Text in the shape of LRA Table 1, training speed and
memory at n = 1K-4K in the shape of LRA Table 2, and the copy task of "Transformers are RNNs" (Figure 2), for this
package's Linformer / linear attention against Transformers' RoBERTa, Longformer, BigBird, Nystromformer, Reformer.

    python scripts/long_range.py --preset smoke --output_dir /tmp/lr-smoke            # every model, under 2 min
    nohup nice -n 10 python scripts/long_range.py --preset cpu --output_dir results/long_range/cpu &  # ~6 h, resumable
    python scripts/long_range.py --preset cpu --output_dir results/long_range/cpu --report_only   # tables so far
    python scripts/long_range.py --preset paper --dry_run                              # LRA sizes, for GPUs
    python scripts/long_range.py --preset cpu --profile 4096 --models linear_favor     # where a step's time goes
    nohup nice -n 10 python scripts/long_range.py --preset copy-paper --output_dir results/long_range/copy-paper \
        > outputs/copy-paper.log 2>&1 &          # the paper's copy task: checkpoints, a rerun resumes mid-stage
    python scripts/long_range.py --preset copy-paper --output_dir results/long_range/copy-paper --report_only \
        --eval_running                                                                # score the running checkpoints
    python scripts/long_range.py --preset copy-paper --time_steps 10 --time_lengths 128 --models gpt2_sdpa linear_gpt2

Presets are configs/long_range/NAME.json (or a path). Rerunning the same command reuses finished stages.
"""

import argparse
import sys
from pathlib import Path

import _checkout  # noqa: F401  (experiments/ is beside scripts/, outside the package)

from experiments import find_preset
from experiments.long_range import profile, run, time_copy_steps
from hf_linear_attn.training.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smoke", help="smoke, cpu, paper, or a preset JSON file")
    parser.add_argument("--output_dir", help="default: outputs/long_range/PRESET")
    parser.add_argument("--tasks", nargs="+", metavar="TASK", help="only these tasks: listops text copy efficiency")
    parser.add_argument("--models", nargs="+", metavar="NAME", help="only these models (names as in the preset)")
    parser.add_argument("--device", default="cpu",
                        help="where the copy stages train (and --eval_running scores their checkpoints): cpu "
                             "(default) or cuda (with --tasks copy); the record names the GPU")
    parser.add_argument("--lengths", nargs="+", type=int, metavar="N",
                        help="only the stages at these sequence lengths (copy settings, efficiency lengths, ListOps / "
                             "Text length)")
    parser.add_argument("--dataset", choices=["local", "hub"], default="local",
                        help="Text: local = DATA_DIR/imdb/train.jsonl with a seeded held-out split; hub = "
                             "stanfordnlp/imdb and its test split")
    parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                        help="folder holding imdb/train.jsonl (default: ../shared/data)")
    parser.add_argument("--seed", type=int, help="replace the preset's seed (initialisation, batch order, ListOps "
                                                  "generation, IMDB's held-out split); use its own --output_dir")
    parser.add_argument("--dry_run", action="store_true", help="print every stage and its arguments, run nothing")
    parser.add_argument("--report_only", action="store_true",
                        help="run nothing: write results.md / results.json / plots from the stages finished so far")
    parser.add_argument("--eval_running", action="store_true",
                        help="with --report_only: also score each running copy stage's checkpoint as the finished "
                             "stage will be scored (float32, its 4 held-out batches; seconds a stage) and report it")
    parser.add_argument("--profile", type=int, metavar="N",
                        help="run nothing else: print torch.profiler's top operators of one training step of each "
                             "efficiency model (or --models) at length N")
    parser.add_argument("--time_steps", type=int, metavar="N",
                        help="run nothing else: time N training steps of each copy model (or --models) in float32 and "
                             "under bf16 autocast, and print steps/s and the hours the preset's steps would take")
    parser.add_argument("--time_lengths", type=int, nargs="+", metavar="N",
                        help="with --time_steps: only these copy lengths")
    args = parser.parse_args(argv)
    try:
        preset = find_preset(args.preset, REPO / "configs" / "long_range")
        if args.profile:
            profile(preset, args.models, args.profile, log=lambda s: print(s, flush=True))
            return
        if args.time_steps:
            time_copy_steps(preset, args.models, args.time_steps, args.time_lengths, log=lambda s: print(s, flush=True))
            return
        if args.eval_running and not args.report_only:
            raise UsageError("--eval_running scores the checkpoints of running stages for a report: add --report_only "
                             "(a run scores each stage when it finishes)")
        output_dir = Path(args.output_dir or f"outputs/long_range/{preset.stem}")
        run(preset, output_dir, args.tasks, args.models, args.dataset, Path(args.data_dir), args.dry_run,
            args.report_only, argv=sys.argv[1:] if argv is None else argv, log=lambda s: print(s, flush=True),
            seed=args.seed, eval_running=args.eval_running, lengths=args.lengths, device=args.device)
    except UsageError as error:
        sys.exit(f"error: {error}")
    if not args.dry_run:
        print(f"wrote {output_dir}/results.md, results.json and the plots of its tasks")


if __name__ == "__main__":
    main()
