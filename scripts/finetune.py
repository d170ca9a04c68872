"""Fine-tune, evaluate and predict with the Transformers Trainer, at run_glue.py's conventions: a preset task
(SST-2, QNLI, QQP, IMDB) or any CSV / TSV / JSON / parquet files or Hub dataset with --text_columns / --label_column;
token classification (run_ner.py's conventions) with --task_type token_classification, extractive question
answering (run_qa.py's) with --task_type question_answering, multiple choice (run_swag.py's) with --task_type
multiple_choice.

    python scripts/finetune.py --config configs/finetune/cpu-sst2.json \
        --model_name_or_path outputs/pretrain/linformer-k32 --output_dir outputs/finetune/linformer-k32-sst2
    python scripts/finetune.py --do_train --do_eval --train_file train.csv --validation_file dev.csv \
        --text_columns review --label_column stars --model_name_or_path ... --output_dir ...
    python scripts/finetune.py --do_predict --task_name sst2 --test_file test.tsv \
        --model_name_or_path outputs/finetune/linformer-k32-sst2 --output_dir outputs/predict/sst2
    python scripts/finetune.py --task_name sst2 --dataset_name nyu-mll/glue --model_name_or_path ... \
        --output_dir ... --push_to_hub --hub_model_id me/linformer-sst2
    python scripts/finetune.py --task_type token_classification --train_file train.jsonl \
        --validation_file dev.jsonl --model_name_or_path ... --output_dir ...   # "tokens" / "ner_tags" per row
    python scripts/finetune.py --task_type question_answering --train_file train.jsonl \
        --validation_file dev.jsonl --model_name_or_path ... --output_dir ...   # SQuAD: id, question, context, answers
    python scripts/finetune.py --task_type multiple_choice --train_file train.csv \
        --validation_file dev.csv --model_name_or_path ... --output_dir ...     # SWAG: sent1, sent2, ending0.., label

--do_train / --do_eval / --do_predict choose what runs; without any of them the script trains and evaluates.
Arguments: this package's (see --help) and every TrainingArguments flag; --config FILE.json gives defaults that
later flags override. Writes train_results.json, eval_results.json, predict_results.json, all_results.json,
trainer_state.json, predict_results.txt (question answering: eval_ / predict_predictions.json), the model (weights,
config, model code, tokenizer) and a model card README.md with model-index results; --push_to_hub (checked before
training) uploads them in one commit.
"""


from transformers import TrainingArguments

from hf_linear_attn.training.arguments import flags_given, parse_arguments
from hf_linear_attn.training.checkpoints import script_errors
from hf_linear_attn.training.errors import UsageError
from hf_linear_attn.training.finetuning import run_finetuning
from hf_linear_attn.training.finetuning_arguments import FinetuneArguments
from hf_linear_attn.training.launch import ensure_requested_processes, use_cpu_for_several_processes


def main(argv=None):
    training = None
    with script_errors(lambda: training.output_dir if training is not None else None):
        if argv is None:  # run as a command: `accelerate launch --num_processes N` must start N processes
            ensure_requested_processes(__file__)
        use_cpu_for_several_processes()  # before TrainingArguments sets up the processes
        args, training, config_path = parse_arguments((FinetuneArguments, TrainingArguments), argv)
        if training.output_dir is None:
            raise UsageError("pass --output_dir")
        modes_given = bool({"do_train", "do_eval", "do_predict"} & flags_given(argv, config_path))
        metrics = run_finetuning(args, training, argv, modes_given=modes_given)
    print({k: v for k, v in metrics.items() if k.startswith(("eval_", "predict_"))})
    return metrics


if __name__ == "__main__":
    main()
