"""Pretrain an encoder (masked LM) or a decoder (causal LM) of this package, or stock RoBERTa / GPT-2, with accelerate.

    python scripts/pretrain.py --config configs/pretrain/cpu-mlm.json \
        --model_config configs/models/cpu/linformer-k32.json --output_dir outputs/pretrain/linformer-k32
    accelerate launch --num_processes 2 scripts/pretrain.py ...        # several processes / GPUs (CPU: gloo)
    python scripts/pretrain.py ... --resume                            # continue after a crash, exactly

Every argument is a --flag (see --help); --config FILE.json gives defaults that later flags override. Data comes
from a Hub dataset (--dataset_name) or local text / json / parquet files (--train_file, --validation_file).
"""

from hf_linear_attn.training.arguments import parse_arguments
from hf_linear_attn.training.checkpoints import script_errors
from hf_linear_attn.training.launch import ensure_requested_processes
from hf_linear_attn.training.pretraining import run_pretraining
from hf_linear_attn.training.pretraining_arguments import PretrainArguments


def main(argv=None):
    args = None
    with script_errors(lambda: args.output_dir if args is not None else None):
        if argv is None:  # run as a command: `accelerate launch --num_processes N` must start N processes
            ensure_requested_processes(__file__)
        args, _ = parse_arguments((PretrainArguments,), argv)
        run_pretraining(args)


if __name__ == "__main__":
    main()
