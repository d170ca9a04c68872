"""Recall (issue 42): multi-query associative recall (MQAR, Zoology's definition) for softmax GPT-2, linear_gpt2
with each feature map, the causal block Linformer and Reformer, against the bytes of each model's decoding state;
and passkey retrieval in WikiText-2 text (Landmark Attention's test) after pretraining and a short fine-tune; and
the capacity probe: how many of MQAR's pairs one layer's state holds when nothing else must be learned.

    python scripts/recall.py --preset smoke --output_dir /tmp/recall-smoke        # every model, about a minute
    nohup nice -n 10 python scripts/recall.py --preset cpu --output_dir results/recall/cpu &   # hours, resumable
    python scripts/recall.py --preset cpu --output_dir results/recall/cpu --report_only          # tables so far
    python scripts/recall.py --preset cpu --output_dir results/recall/cpu --models linear_gpt2 --pairs 64  # a slice
    python scripts/recall.py --preset cpu --output_dir results/recall/cpu --widths 128      # a slice by model width
    python scripts/recall.py --preset delta-n64-lr3e-3 --seed 1 --output_dir results/recall/delta-n64-lr3e-3-seed1
    python scripts/recall.py --combine results/recall/delta-n64 results/recall/delta-n64-seed1 \
        results/recall/delta-n64-seed2 --output_dir results/recall/delta-n64-seeds   # one table across the seeds
    python scripts/recall.py --preset passkey-smoke --output_dir /tmp/passkey-smoke    # passkey, every code path
    python scripts/recall.py --preset passkey-cpu --estimate      # a probe of a few steps: the preset's hours here
    python scripts/recall.py --preset capacity --output_dir results/recall/capacity   # the state alone, ~1 h
    python scripts/recall.py --preset based-n256 --output_dir results/recall/based-n256 --probe_saved  # saved models
    python scripts/recall.py --preset delta-n64-lr3e-3 --models linear_gpt2_kda_long_conv --pairs 8 --trace_gates \
        --output_dir results/recall/gate-traces    # a stage's training retraced, its gate read every 100 steps

Presets are configs/recall/NAME.json (or a path); a preset with "task": "passkey" runs passkey retrieval, one with
"task": "capacity" the capacity probe (--models then names its memories), any other MQAR. Rerunning the same command
reuses finished stages, and an MQAR preset with "checkpoint_every" resumes the stage it was in from its last checkpoint
(keep the same OMP_NUM_THREADS to continue it bit for bit).
"""

import argparse
import sys
from pathlib import Path

import _checkout  # noqa: F401  (experiments/ is beside scripts/, outside the package)

from experiments import find_preset
from experiments.recall import capacity_runner, gate_trace, passkey_runner, preset_task, runner, seeds
from hf_linear_attn.training.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smoke", help="smoke, cpu, or a preset JSON file")
    parser.add_argument("--output_dir", help="default: outputs/recall/PRESET")
    parser.add_argument("--models", nargs="+", metavar="NAME", help="only these models (names as in the preset)")
    parser.add_argument("--pairs", nargs="+", type=int, metavar="N", help="MQAR: only these pair counts (of the "
                                                                           "preset's); the report still covers every "
                                                                           "finished stage")
    parser.add_argument("--widths", nargs="+", type=int, metavar="W", help="MQAR: only these model widths (of the "
                                                                            "preset's)")
    parser.add_argument("--seed", type=int, help="MQAR presets: train and score at this seed instead of the preset's "
                        "(other initial weights and training sequences); give each seed its own --output_dir")
    parser.add_argument("--combine", nargs="+", metavar="DIR", help="run nothing: one table of the MQAR runs in these "
                        "folders (one seed each, --seed) into --output_dir: each setting's accuracy per seed, mean, "
                        "spread, and how many seeds learnt the lookup")
    parser.add_argument("--device", default="cpu", help="MQAR presets: where the stages train, cpu (default) or cuda; "
                        "the record names the GPU")
    parser.add_argument("--dry_run", action="store_true", help="print every stage and its arguments, run nothing")
    parser.add_argument("--report_only", action="store_true", help="run nothing: write the report from the stages "
                                                                   "finished so far")
    parser.add_argument("--probe_saved", action="store_true", help="MQAR presets: run nothing; read where each "
                        "saved model (<output_dir>/models/, this machine's) looks up and how long its states keep what "
                        "they hold, into probes.json and probes.md")
    parser.add_argument("--trace_gates", action="store_true", help="MQAR presets: run no stage; retrace the training "
                        "of each named model's stages (--models, a gated delta rule: Gated DeltaNet or KDA) step for "
                        "step and read its gate every --trace_every steps, into <output_dir>/gate_traces/ and "
                        "gate_traces.md")
    parser.add_argument("--trace_steps", type=int, help="--trace_gates: only the first N steps of each stage "
                        "(default all, and then the stage's score too)")
    parser.add_argument("--trace_every", type=int, help="--trace_gates: read the gates every N steps (default the "
                        "preset's log_every)")
    parser.add_argument("--tie_gate_features", action="store_true", help="--trace_gates with KDA: replace its "
                        "per-feature decays in the forward by their mean over each head's features (a probe: does the "
                        "per-feature freedom let the decays fall?)")
    parser.add_argument("--estimate", action="store_true", help="passkey presets: time a few steps of each model "
                                                                "and project the preset's hours on this machine")
    args = parser.parse_args(argv)
    try:
        if args.combine:
            if not args.output_dir:
                raise UsageError("--combine writes its table into --output_dir: name one (a folder of its own)")
            seeds.run([Path(d) for d in args.combine], Path(args.output_dir), sys.argv[1:] if argv is None else argv)
            print(f"wrote {args.output_dir}/results.md, results.json")
            return
        preset = find_preset(args.preset, REPO / "configs" / "recall")
        task = preset_task(preset)
        if args.estimate:
            if task != "passkey":
                raise UsageError("--estimate projects a passkey preset's time; MQAR presets state theirs in their "
                                 "description")
            passkey_runner.estimate(preset, args.models, log=lambda s: print(s, flush=True))
            return
        output_dir = Path(args.output_dir or f"outputs/recall/{preset.stem}")
        if args.probe_saved:
            if task != "mqar":
                raise UsageError("--probe_saved reads the models an MQAR preset's stages saved; this preset is "
                                 f"{task}")
            runner.probe_saved(preset, output_dir, args.models, log=lambda s: print(s, flush=True))
            print(f"wrote {output_dir}/probes.json, probes.md")
            return
        if (args.trace_steps or args.trace_every or args.tie_gate_features) and not args.trace_gates:
            raise UsageError("--trace_steps, --trace_every and --tie_gate_features shape --trace_gates: add it")
        if args.trace_gates:
            if task != "mqar":
                raise UsageError(f"--trace_gates retraces MQAR stages; this preset is {task}")
            if not args.models:
                raise UsageError("--trace_gates traces the models named with --models (Gated DeltaNet or KDA forms, "
                                 "e.g. --models linear_gpt2_kda_long_conv): name them")
            if args.device != "cpu":
                raise UsageError("--trace_gates retraces a stage on the CPU (its stages' records are CPU runs): leave "
                                 "--device out")
            stages, _ = runner.plan(runner.at_seed(runner.load_preset(preset), args.seed), args.models, args.pairs,
                                    args.widths)
            gate_trace.run(stages, output_dir, args.trace_steps, args.trace_every, args.tie_gate_features,
                           sys.argv[1:] if argv is None else argv, log=lambda s: print(s, flush=True))
            print(f"wrote {output_dir}/gate_traces.md, gate_traces/")
            return
        if args.device != "cpu" and task != "mqar":
            raise UsageError(f"--device applies to MQAR presets only: leave it out for this {task} preset")
        if args.seed is not None and task != "mqar":
            raise UsageError(f"--seed applies to MQAR presets only: a {task} preset names its seed in its file")
        if (args.pairs or args.widths) and task != "mqar":
            raise UsageError("--pairs and --widths choose MQAR settings; a passkey or capacity preset has neither "
                             "(use --models)")
        {"passkey": passkey_runner, "capacity": capacity_runner}.get(task, runner).run(
            preset, output_dir, args.models, args.dry_run, args.report_only,
            argv=sys.argv[1:] if argv is None else argv, log=lambda s: print(s, flush=True),
            **({"pairs": args.pairs, "widths": args.widths, "device": args.device, "seed": args.seed}
               if task == "mqar" else {}))
    except UsageError as error:
        sys.exit(f"error: {error}")
    if not args.dry_run:
        losses = ", mqar_loss.png" if task == "mqar" and (Path(output_dir) / "mqar_loss.png").is_file() else ""
        print(f"wrote {output_dir}/results.md, results.json, {task}.png{losses}")


if __name__ == "__main__":
    main()
