"""Fine-tune a pretrained checkpoint on SST-2, QNLI, QQP (GLUE) or IMDB with the Transformers Trainer.

    python scripts/finetune.py --config configs/finetune/cpu-sst2.json \
        --model_name_or_path outputs/pretrain/linformer-k32 --output_dir outputs/finetune/linformer-k32-sst2
    python scripts/finetune.py --task_name sst2 --dataset_name nyu-mll/glue --model_name_or_path ... \
        --output_dir ... --push_to_hub --hub_model_id me/linformer-sst2

Arguments: this package's (see --help) and every TrainingArguments flag; --config FILE.json gives defaults that
later flags override. Writes eval_results.json, the model (weights, config, model code, tokenizer) and a model card
README.md with model-index results; --push_to_hub uploads them in one commit.
"""

import sys

from transformers import TrainingArguments

from hf_linear_attn.training.arguments import parse_arguments
from hf_linear_attn.training.data import UsageError
from hf_linear_attn.training.finetuning import FinetuneArguments, run_finetuning


def main(argv=None):
    try:
        args, training, _ = parse_arguments((FinetuneArguments, TrainingArguments), argv)
        if training.output_dir is None:
            raise UsageError("pass --output_dir")
        metrics = run_finetuning(args, training, argv)
    except UsageError as error:
        sys.exit(f"error: {error}")
    print({k: v for k, v in metrics.items() if k.startswith("eval_")})
    return metrics


if __name__ == "__main__":
    main()
