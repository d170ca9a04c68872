"""Convert a RoBERTa-family encoder or a GPT-2 checkpoint into a Linformer / linear-attention model of this package.

    python scripts/convert.py --model_name_or_path roberta-base --target linformer --linformer_k 128 \
        --output_dir outputs/convert/roberta-linformer
    python scripts/convert.py --model_name_or_path gpt2 --target linear_gpt2 --feature_map hedgehog \
        --distill_steps 500 --train_file ../shared/data/wikitext-2/wiki.train.tokens --output_dir outputs/convert/gpt2-linear

Every shared weight is copied exactly; conversion_report.json lists what was copied, what is new (and its init)
and what was dropped. --distill_steps N trains only the new parts so the student's attention matches the
teacher's (Hedgehog-style); --extend_max_length N grows an encoder's maximum input length. The result is a normal
checkpoint: fine-tune it with scripts/finetune.py --model_name_or_path OUTPUT_DIR.
"""

import sys

from hf_linear_attn.training.arguments import parse_arguments
from hf_linear_attn.conversion.cli import ConvertArguments, run_conversion
from hf_linear_attn.training.errors import UsageError


def main(argv=None):
    try:
        args, _ = parse_arguments((ConvertArguments,), argv)
        return run_conversion(args)
    except UsageError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
