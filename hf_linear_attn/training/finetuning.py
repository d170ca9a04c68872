"""Fine-tuning with the Transformers Trainer at run_glue.py's conventions: --do_train / --do_eval / --do_predict,
train / validation / test files or a Hub dataset, the four paper tasks (SST-2, QNLI, QQP, IMDB) as presets or any
text and label columns (classification with any number of labels, or regression); results files as Transformers'
examples write them, predictions, model card, Hub push (checked before training). `--task_type
token_classification` trains a label per word instead, at run_ner.py's conventions (CoNLL-style rows: a list of
words and a list of labels; entity precision / recall / F1); `question_answering` extractive answers at run_qa.py's
(SQuAD-format rows, windows over long contexts, answers read back from start / end logits; SQuAD exact match and
F1); `multiple_choice` the right ending of SWAG-style rows at run_swag.py's (accuracy).

`run_finetuning` reads as its steps: the checks made before any data is read (finetuning_arguments.py, the Hub
target, the checkpoint to resume from: trainer_checkpoints.py), the data, task and model (finetuning_setup.py), the
encoded splits, then Trainer's training, evaluation and prediction, and the card.
"""

import json
import platform
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from datasets import DatasetDict
from transformers import (
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    EvalPrediction,
    TrainingArguments,
    set_seed,
)
from transformers.training_args import ParallelMode

import hf_linear_attn  # noqa: F401  (registers the package's models with the Auto classes)

from .checkpoints import disk_full_error, is_disk_full
from .data.choice_tasks import ChoiceCollator, ChoiceTask, encode_choice_task, load_choice_data, read_choice_files
from .data.files import refuse_sources_inside, require_split_sources
from .data.qa_tasks import check_window_room, encode_qa_split, load_qa_data, read_qa_files, require_offsets
from .data.tasks import encode_task, get_task, load_task_data, read_task_files, source_lengths
from .data.token_tasks import (
    TokenTask, encode_token_task, load_token_data, prepare_tokenizer_for_words, read_token_files,
)
from .errors import UsageError
from .finetuning_arguments import FinetuneArguments, check_arguments, check_task_type, qa_setting
from .finetuning_setup import (  # noqa: F401  (subset, require_token_head: their old address)
    load_tokenizer_and_config, require_fine_tuned_head, require_head, require_token_head, resolve_choice,
    resolve_qa_task, resolve_task, resolve_token_task, subset,
)
from .fsdp import refuse_fsdp1_without_gpus, trainer_checkpoint_layout
from .hub import check_push_target, push_folder
from .metrics import load_task_metric
from .metrics.entities import has_entity_scheme
from .model_cards import write_model_card
from .task_distillation import DistillingTrainer, check_distillation_arguments, load_teacher
from .qa_postprocessing import QASplit, qa_metric_function, write_answers
from .trainer_checkpoints import AtomicCheckpointTrainer, resolve_resume  # noqa: F401  (their old address)


def occupied(output_dir: Path, args: FinetuneArguments, training: TrainingArguments) -> bool:
    """Whether output_dir holds another run to replace (an error unless --overwrite_output_dir)."""
    if not output_dir.exists() or not any(output_dir.iterdir()) or training.resume_from_checkpoint:
        return False
    if not args.overwrite_output_dir:
        raise UsageError(f"{output_dir} is not empty (it holds another run): pass --overwrite_output_dir to "
                            "replace it, --resume_from_checkpoint to continue it, or choose another --output_dir")
    refuse_sources_inside(output_dir, {"--model_name_or_path": args.model_name_or_path,
                                       "--tokenizer_name_or_path": args.tokenizer_name_or_path,
                                       "--train_file": args.train_file, "--validation_file": args.validation_file,
                                       "--test_file": args.test_file,
                                       "--model_card_template": args.model_card_template})
    return True


def _token_metric_function(task: TokenTask, metric, entity_level: bool):
    """compute_metrics for Trainer: the words' predicted and true labels (the positions whose label is not -100:
    one per word, see `encode_token_task`) scored by the seqeval metric; run_ner.py's keys (precision, recall,
    f1, accuracy) and with `entity_level` those of each entity type. Labels without a B- / I- / E- / S- scheme
    (POS tags) are scored as one-word entities, so precision / recall / F1 count words."""
    schemed = has_entity_scheme(task.label_names)
    names = [n if schemed or n == "O" else f"B-{n}" for n in task.label_names]

    def compute_metrics(prediction):
        logits = _logits(prediction)
        guesses, labels = np.argmax(logits, axis=-1), prediction.label_ids
        kept = [row != -100 for row in labels]
        predictions = [[names[i] for i in guess[keep]] for guess, keep in zip(guesses, kept)]
        references = [[names[i] for i in label[keep]] for label, keep in zip(labels, kept)]
        scores = metric.compute(predictions=predictions, references=references)
        result = {k: float(scores[f"overall_{k}"]) for k in ("precision", "recall", "f1", "accuracy")}
        if entity_level:
            for kind, values in scores.items():
                if isinstance(values, dict):
                    result.update({f"{kind}_{k}": v for k, v in values.items()})
        return result

    return compute_metrics


def _write_token_predictions(path: Path, logits: np.ndarray, word_starts, task: TokenTask) -> None:
    """run_ner.py's predict_results.txt: for each input row one line, its words' predicted labels separated by
    spaces (the label of each word's first sub-token; words cut by --max_seq_length have none)."""
    guesses = np.argmax(logits, axis=-1)
    lines = [" ".join(task.label_names[int(guesses[row, p])] for p in starts) for row, starts in enumerate(word_starts)]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _warn_cut_rows(data, encoded, max_seq_length: int) -> None:
    """A warning naming how many evaluated / predicted rows are longer than --max_seq_length (their last words
    are neither scored nor predicted)."""
    for split in ("validation", "test"):
        if split in encoded:
            cut = sum(len(s) < len(w) for s, w in zip(encoded[split]["word_starts"], data[split]["tokens"]))
            if cut:
                print(f"warning: {cut} of {len(encoded[split])} {split} rows are longer than --max_seq_length "
                      f"{max_seq_length} tokens: their last words are neither scored nor predicted (raise "
                      "--max_seq_length)")


def _logits(output) -> np.ndarray:
    """The logits of a Trainer prediction (an EvalPrediction or predict's output): the first of a tuple of outputs."""
    return output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions


def _regression_metrics(predictions, references) -> dict:
    predictions, references = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
    pearson = float(np.corrcoef(predictions, references)[0, 1]) if len(references) > 1 else float("nan")
    return {"mse": float(np.mean((predictions - references) ** 2)), "pearson": pearson}


def _write_predictions(path: Path, predictions: np.ndarray, task) -> None:
    """run_glue.py's predict_results file: a header, then `index<TAB>prediction` (a label name, a number, or the
    index of the chosen ending)."""
    lines = ["index\tprediction"]
    for index, value in enumerate(predictions):
        if isinstance(task, ChoiceTask):  # the index of the chosen ending
            lines.append(f"{index}\t{int(value)}")
        else:
            lines.append(f"{index}\t{value:3.3f}" if task.regression else f"{index}\t{task.label_names[int(value)]}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def fsdp_layout(training: TrainingArguments, do_train: bool) -> str | None:
    """The fsdp_state_dict_type of this launch's checkpoints (None without FSDP), once what cannot run is refused:
    FSDP1 without GPUs, Trainer's --fsdp in a single process, evaluation or prediction alone under FSDP."""
    refuse_fsdp1_without_gpus(training.fsdp_plugin_args)  # in one process too: accelerate's plugin fails there
    if training.fsdp_plugin_args and training.parallel_mode != ParallelMode.DISTRIBUTED:
        raise UsageError("--fsdp shards the model over several processes, and this is one (Trainer: 'Using fsdp only "
                         "works in distributed training'): start N of them with accelerate launch --num_processes N "
                         "scripts/finetune.py ... (or torchrun --nproc_per_node N)")
    layout = trainer_checkpoint_layout(training)
    if layout is not None and not do_train:
        # Trainer (transformers 5.23) prepares a model for evaluation alone with `accelerator.prepare(model)`, which
        # accelerate refuses under FSDP2 whatever the device. After training the model is prepared, so evaluation and
        # prediction then work.
        raise UsageError("--do_eval / --do_predict without --do_train under FSDP: Trainer cannot set up an FSDP2 "
                         "model without training it (accelerate: 'When using FSDP2, a model and optimizer must be "
                         "passed together to `Accelerator.prepare()`'); evaluate or predict without FSDP (python "
                         "scripts/finetune.py ..., or accelerate launch --num_processes N ...) or add --do_train")
    return layout


@dataclass
class Plan:
    """What a fine-tuning run does, settled before any data is read: its modes and splits, the Hub repo, whether it
    replaces an old run, the checkpoint it resumes from."""

    do_train: bool
    do_eval: bool
    do_predict: bool
    token_level: bool
    task_type: str
    splits: list
    repo_id: str
    replace: bool
    resume_from: str | None


def plan_run(args: FinetuneArguments, training: TrainingArguments, modes_given: bool) -> Plan:
    """The modes (without --do_train / --do_eval / --do_predict: train and evaluate) and every check that needs no
    data: arguments, the Hub target, the output folder, the checkpoint to resume from."""
    if not modes_given:
        training.do_train = training.do_eval = True
    do_train, do_eval, do_predict = training.do_train, training.do_eval, training.do_predict
    if not (do_train or do_eval or do_predict):
        raise UsageError("nothing to do: pass --do_train, --do_eval and / or --do_predict")
    token_level = args.task_type == "token_classification"
    check_task_type(args)
    if args.task_name is not None:
        get_task(args.task_name)
    check_arguments(args, training)
    check_distillation_arguments(args, do_train)
    layout = fsdp_layout(training, do_train)
    if args.task_type != "sequence_classification":
        require_head(args)
    if not do_train and args.task_type in ("question_answering", "multiple_choice"):
        require_fine_tuned_head(args)
    output_dir = Path(training.output_dir)
    repo_id = training.hub_model_id or output_dir.name
    if training.push_to_hub:
        if not do_train:
            raise UsageError("--push_to_hub uploads a fine-tuned model: add --do_train (evaluation and prediction "
                             "alone write no model)")
        repo_id = check_push_target(repo_id, training.hub_token)  # token, reachability, name: before any work
    replace = occupied(output_dir, args, training) if do_train else False
    resume_from = (resolve_resume(training.resume_from_checkpoint, output_dir, training.world_size,
                                  args.allow_inexact_resume, layout) if do_train else None)
    splits = [s for s, on in (("train", do_train), ("validation", do_eval), ("test", do_predict)) if on]
    return Plan(do_train, do_eval, do_predict, token_level, args.task_type, splits, repo_id, replace, resume_from)


def read_data(args: FinetuneArguments, training: TrainingArguments, plan: Plan):
    """(task, DatasetDict of the plan's splits, name of the evaluation split), subsets taken; training rows of a
    single label are refused."""
    hub = args.dataset_name is not None
    # evaluating without training, on a split carved from the train file (IMDB here: 10% held out by the seed), the
    # train rows are read to carve the same rows the fine-tune at that seed held out, then dropped
    carve_only = (not hub and "validation" in plan.splits and "train" not in plan.splits and args.train_file
                  and not args.validation_file)
    splits = ["train", *plan.splits] if carve_only else plan.splits
    if not hub:
        require_split_sources(splits, args.train_file, args.validation_file, args.test_file)
    preset = get_task(args.task_name) if args.task_name is not None else None
    hub_config = (args.dataset_config_name if args.dataset_config_name is not None or preset is None
                  else preset.hub_config)
    wanted = {s: f for s, f in (("train", args.train_file), ("validation", args.validation_file),
                                ("test", args.test_file)) if s in splits}
    read = {"token_classification": read_token_files, "question_answering": read_qa_files,
            "multiple_choice": read_choice_files}.get(plan.task_type, read_task_files)
    raw = read(args.dataset_name, hub_config, wanted.get("train"), wanted.get("validation"), wanted.get("test"))
    common = dict(dataset_name=args.dataset_name, train_file=args.train_file, validation_file=args.validation_file,
                  test_file=args.test_file, validation_split_percentage=args.validation_split_percentage,
                  seed=training.seed, splits=splits)
    if plan.task_type == "question_answering":
        task = resolve_qa_task(args)
        data, eval_split = load_qa_data(task, raw, **common)
    elif plan.task_type == "multiple_choice":
        task = resolve_choice(args, raw)
        data, eval_split = load_choice_data(task, raw, **common)
    elif plan.token_level:
        task = resolve_token_task(args, raw, plan.do_train)
        data, eval_split = load_token_data(task, raw, args.dataset_name, args.train_file, args.validation_file,
                                           args.test_file, args.validation_split_percentage, training.seed,
                                           splits)
    else:
        task = resolve_task(args, raw, plan.do_train)
        data, eval_split = load_task_data(task, args.dataset_name, hub_config, args.train_file, args.validation_file,
                                          args.validation_split_percentage, training.seed, test_file=args.test_file,
                                          splits=splits, raw=raw)
    if carve_only:
        del data["train"]
    for split, count in (("train", args.max_train_samples), ("validation", args.max_eval_samples),
                         ("test", args.max_predict_samples)):
        if split in data:
            data[split] = subset(data[split], count, hub, training.seed)
    if plan.do_train and not task.regression and plan.task_type in ("sequence_classification", "token_classification"):
        seen = ({i for row in data["train"]["labels"] for i in row} if plan.token_level
                else set(data["train"]["label"]))
        if len(seen) < 2:
            raise UsageError(f"every training row of {task.name} has the same label: a classifier cannot learn "
                             "from them (a local file sorted by label, cut by --max_train_samples? shuffle the file)")
    return task, data, eval_split


def load_model(args: FinetuneArguments, training: TrainingArguments, task, plan: Plan):
    """(tokenizer, model): the model with a new head for the task when training (seeded first), the fine-tuned one
    when only evaluating or predicting."""
    tokenizer, config = load_tokenizer_and_config(args, task, train=plan.do_train)
    source = args.tokenizer_name_or_path or args.model_name_or_path
    if plan.token_level:
        tokenizer = prepare_tokenizer_for_words(tokenizer, source)
    if plan.task_type == "question_answering":
        require_offsets(tokenizer, source)
    # The classification head is new: seed before it is drawn (torch's own start seed is random), so a seed
    # names one run, as in Trainer's model_init path
    set_seed(training.seed)
    auto_class = {"token_classification": AutoModelForTokenClassification,
                  "question_answering": AutoModelForQuestionAnswering,
                  "multiple_choice": AutoModelForMultipleChoice}.get(plan.task_type, AutoModelForSequenceClassification)
    try:
        model = auto_class.from_pretrained(args.model_name_or_path, config=config,
                                           trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot load {args.model_name_or_path} for {args.task_type.replace('_', ' ')}: "
                         f"{error}") from error
    return tokenizer, model


@dataclass
class AnswerReading:
    """What question answering needs beyond Trainer's outputs: each split's questions and windows (QASplit), the
    settings that read answers from logits, the squad metric, and the answers of the latest evaluation."""

    splits: dict
    n_best_size: int
    max_answer_length: int
    metric: object
    latest: dict


def encode_questions(args: FinetuneArguments, data, tokenizer, metric):
    """encode()'s answer for question answering: windows over each split's contexts, the collator, SQuAD exact
    match / F1 over the validation windows, and the AnswerReading that predictions need."""
    stride = qa_setting(args, "doc_stride")
    check_window_room(data, tokenizer, args.max_seq_length, stride)
    windows = {split: encode_qa_split(part, tokenizer, args.max_seq_length, stride, "answers" in part.column_names)
               for split, part in data.items()}
    reading = AnswerReading({split: QASplit.from_encoded(data[split], part) for split, part in windows.items()},
                            qa_setting(args, "n_best_size"), qa_setting(args, "max_answer_length"), metric, {})
    compute_metrics = (qa_metric_function(reading.splits["validation"], metric, reading.n_best_size,
                                          reading.max_answer_length, reading.latest)
                       if "validation" in reading.splits and reading.splits["validation"].answers is not None
                       else None)
    encoded = DatasetDict({split: part.remove_columns(["example_index", "offset_mapping"])
                           for split, part in windows.items()})
    return encoded, DataCollatorWithPadding(tokenizer), compute_metrics, reading


def encode(args: FinetuneArguments, task, data, tokenizer, plan: Plan):
    """(encoded splits, collator, compute_metrics, what reading predictions back needs: the test rows' word starts
    for token classification, an AnswerReading for question answering, else None)."""
    metric = None if task.regression else load_task_metric(task, args.metric_source)
    if plan.task_type == "question_answering":
        return encode_questions(args, data, tokenizer, metric)
    if plan.token_level:
        encoded = encode_token_task(data, task, tokenizer, args.max_seq_length, args.label_all_tokens)
        _warn_cut_rows(data, encoded, args.max_seq_length)
        word_starts = encoded["test"]["word_starts"] if "test" in encoded else None
        encoded = encoded.remove_columns("word_starts")  # only for reading predictions back per word
        compute_metrics = _token_metric_function(task, metric, args.return_entity_level_metrics)
        return encoded, DataCollatorForTokenClassification(tokenizer), compute_metrics, word_starts  # pads with -100
    if plan.task_type == "multiple_choice":
        encoded, collator = encode_choice_task(data, tokenizer, args.max_seq_length), ChoiceCollator(tokenizer)
    else:
        encoded = encode_task(data, task, tokenizer, args.max_seq_length, args.head_fraction)
        collator = DataCollatorWithPadding(tokenizer)

    def compute_metrics(prediction):
        logits = _logits(prediction)
        if task.regression:
            return _regression_metrics(np.squeeze(logits, -1), prediction.label_ids)
        return metric.compute(predictions=np.argmax(logits, axis=-1), references=prediction.label_ids)

    if args.eval_length_split is not None and "validation" in data:
        # lengths before truncation, read from the raw texts (encoding drops them), matched to the predictions by
        # position: AtomicCheckpointTrainer evaluates in row order even where training groups rows by length
        lengths = source_lengths(data["validation"], task, tokenizer)
        return encoded, collator, LengthSplitMetrics(compute_metrics, lengths, args.eval_length_split), None
    return encoded, collator, compute_metrics, None


class LengthSplitMetrics:
    """compute_metrics, plus the same metrics over the evaluation rows up to `split` tokens long and over those beyond
    it (`<metric>_within_<split>`, `<metric>_beyond_<split>`, `rows_within_<split>`, `rows_beyond_<split>`). `lengths`
    are the evaluation rows' lengths in row order; other rows (a test split) are scored by `compute_metrics` itself."""

    def __init__(self, compute_metrics, lengths: list[int], split: int):
        self.compute_metrics, self.lengths, self.split = compute_metrics, lengths, split

    def __call__(self, prediction) -> dict:
        metrics = self.compute_metrics(prediction)
        logits = _logits(prediction)
        if len(logits) != len(self.lengths):
            raise RuntimeError(f"--eval_length_split: {len(logits)} predictions for {len(self.lengths)} evaluation "
                               "rows; the rows' lengths no longer line up with the predictions")
        beyond = np.asarray(self.lengths) > self.split
        for name, keep in ((f"within_{self.split}", ~beyond), (f"beyond_{self.split}", beyond)):
            metrics[f"rows_{name}"] = int(keep.sum())
            if keep.any():  # a part with no rows has no score
                part = EvalPrediction(predictions=logits[keep], label_ids=np.asarray(prediction.label_ids)[keep])
                metrics.update({f"{key}_{name}": value for key, value in self.compute_metrics(part).items()})
        return metrics


def train_and_save(trainer, plan: Plan, output_dir: Path, train_rows: int) -> tuple[dict, object]:
    """Train (resuming where the plan says), save the model and the train results; (metrics, Trainer's result)."""
    if plan.resume_from is not None and trainer.is_world_process_zero():
        print(f"resuming from {plan.resume_from}")  # Trainer says so only at INFO level
    train_result = trainer.train(resume_from_checkpoint=plan.resume_from)
    try:
        trainer.save_model(str(output_dir))  # weights, config, model code (save_pretrained) and tokenizer
    except Exception as error:  # noqa: BLE001  (safetensors raises SafetensorError, no OSError)
        if is_disk_full(error):
            raise disk_full_error(output_dir, "the fine-tuned model", error) from error
        raise
    train_metrics = {**train_result.metrics, "train_samples": train_rows}
    trainer.log_metrics("train", train_metrics)
    trainer.save_metrics("train", train_metrics)  # train_results.json and all_results.json
    trainer.save_state()  # trainer_state.json: log_history, steps, best checkpoint
    return train_metrics, train_result


def predict_answers(trainer, test, reading: AnswerReading, output_dir: Path) -> dict:
    """Question answering: the answers of the test questions into predict_predictions.json and
    predict_nbest_predictions.json (run_qa.py's files), SQuAD exact match and F1 where the questions have answers."""
    questions = reading.splits["test"]
    compute_metrics, trainer.compute_metrics = trainer.compute_metrics, None  # it reads the validation windows
    try:
        output = trainer.predict(test, metric_key_prefix="predict")
    finally:
        trainer.compute_metrics = compute_metrics
    answers, n_best = questions.answers_from(output.predictions, reading.n_best_size, reading.max_answer_length)
    labelled = questions.answers is not None
    predict_metrics = {k: v for k, v in output.metrics.items() if labelled or not k.startswith("predict_loss")}
    if labelled:
        predict_metrics.update({f"predict_{k}": v for k, v in questions.score(reading.metric, answers).items()})
    predict_metrics.update(predict_samples=len(questions.ids), predict_windows=len(test))
    trainer.log_metrics("predict", predict_metrics)
    trainer.save_metrics("predict", predict_metrics)  # predict_results.json and all_results.json
    if trainer.is_world_process_zero():
        write_answers(output_dir, "predict", answers, n_best)
    return predict_metrics


def predict(trainer, test, task, plan: Plan, output_dir: Path, readback) -> dict:
    """Predictions of the test split into predict_results.txt (question answering: predict_predictions.json), and
    its metrics where it has labels."""
    if plan.task_type == "question_answering":
        return predict_answers(trainer, test, readback, output_dir)
    labelled = bool({"label", "labels"} & set(test.column_names))
    if isinstance(trainer.compute_metrics, LengthSplitMetrics):  # its lengths are the evaluation rows': whole here
        trainer.compute_metrics = trainer.compute_metrics.compute_metrics
    output = trainer.predict(test, metric_key_prefix="predict")
    logits = _logits(output)
    predict_metrics = {k: v for k, v in output.metrics.items() if labelled or not k.startswith("predict_loss")}
    predict_metrics["predict_samples"] = len(test)
    trainer.log_metrics("predict", predict_metrics)
    trainer.save_metrics("predict", predict_metrics)  # predict_results.json and all_results.json
    if trainer.is_world_process_zero() and plan.token_level:
        _write_token_predictions(output_dir / "predict_results.txt", logits, readback, task)  # word starts
    elif trainer.is_world_process_zero():
        predictions = np.squeeze(logits, -1) if task.regression else np.argmax(logits, axis=-1)
        _write_predictions(output_dir / "predict_results.txt", predictions, task)
    return predict_metrics


PIPELINE_TAGS = {"sequence_classification": "text-classification", "token_classification": "token-classification",
                 "question_answering": "question-answering", "multiple_choice": "multiple-choice"}


def write_card_and_push(args: FinetuneArguments, training: TrainingArguments, plan: Plan, task, model, metrics: dict,
                        eval_split: str | None, train_rows: int, argv, push: bool) -> None:
    """The model card (README.md) of the fine-tuned model, and the upload with --push_to_hub (main process)."""
    output_dir = Path(training.output_dir)
    data_description = (f"{task.name} from the Hub ({args.dataset_name})" if args.dataset_name else
                        f"{task.name} from {Path(args.train_file).name}") + f", {train_rows} training rows"
    single = len(task.text_columns) == 1
    rule = (f"Longer texts keep their first {args.head_fraction:.0%} of tokens and their last tokens (head + tail)."
            if single else "Longer pairs are truncated longest-first.")
    if plan.token_level:
        rule = ("Each word is labelled on its first sub-token; the words of longer sentences past the limit are cut "
                "(neither trained on nor labelled).")
    elif plan.task_type == "question_answering":
        rule = (f"Each input is the question and a window of its context; a longer context is read in windows that "
                f"share {qa_setting(args, 'doc_stride')} tokens, and the answer is the best-scoring span of any "
                f"window (at most {qa_setting(args, 'max_answer_length')} tokens).")
    elif plan.task_type == "multiple_choice":
        rule = ("Each choice is the context paired with the ending prefix and that ending; longer pairs are "
                "truncated longest-first, and the choice the model scores highest is its answer.")
    command = "python scripts/finetune.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    hyper = {"learning rate": training.learning_rate, "epochs": training.num_train_epochs,
             "batch size": training.per_device_train_batch_size * training.gradient_accumulation_steps,
             "warmup (steps, or a share of all steps if < 1)": training.warmup_steps,
             "weight decay": training.weight_decay, "seed": training.seed}
    if plan.token_level:
        hyper["label all sub-tokens"] = args.label_all_tokens
    if plan.task_type == "question_answering":
        hyper.update({f"{name.replace('_', ' ')}": qa_setting(args, name)
                      for name in ("doc_stride", "n_best_size", "max_answer_length")})
    machine = f"{platform.machine()} {'CUDA' if torch.cuda.is_available() else 'CPU'}, torch {torch.__version__}"
    dataset_id = args.dataset_name or task.hub_dataset
    write_model_card(output_dir, repo_id=plan.repo_id, config=model.config, base_model=args.model_name_or_path,
                     task=task, metrics=metrics, eval_split=eval_split or "none", dataset_id=dataset_id,
                     command=command, data_description=data_description, truncation_rule=rule,
                     max_seq_length=args.max_seq_length, hyperparameters=hyper, machine=machine,
                     template=Path(args.model_card_template),
                     pipeline_tag=PIPELINE_TAGS[plan.task_type])
    if push:  # uploads the card and the results files with the model
        metrics["hub_commit"] = push_folder(output_dir, plan.repo_id, token=training.hub_token,
                                            private=training.hub_private_repo)
        if plan.do_eval:
            results = json.loads((output_dir / "eval_results.json").read_text())
            results["hub_commit"] = metrics["hub_commit"]
            (output_dir / "eval_results.json").write_text(json.dumps(results, indent=4, sort_keys=True))


def run_finetuning(args: FinetuneArguments, training: TrainingArguments, argv=None, modes_given: bool = True) -> dict:
    """Train (--do_train), evaluate (--do_eval) and predict (--do_predict), as run_glue.py does; without any of the
    three flags (modes_given False), train and evaluate. Writes {train,eval,predict}_results.json, all_results.json,
    trainer_state.json, predict_results.txt (question answering: {eval,predict}_predictions.json and
    {eval,predict}_nbest_predictions.json), and after training the model and README.md; pushes when
    --push_to_hub (checked before anything else). Returns the metrics."""
    plan = plan_run(args, training, modes_given)
    output_dir = Path(training.output_dir)
    task, data, eval_split = read_data(args, training, plan)
    tokenizer, model = load_model(args, training, task, plan)
    teacher = load_teacher(args, model) if args.distill_from is not None else None  # checked before any encoding
    encoded, collator, compute_metrics, readback = encode(args, task, data, tokenizer, plan)
    rows = {split: len(part) for split, part in data.items()}  # questions, not the windows over their contexts

    if plan.replace and training.process_index == 0:  # every input is valid: only now is the old run removed
        shutil.rmtree(output_dir)
    push = training.push_to_hub
    training.push_to_hub = False  # one upload at the end (model, code, card), not Trainer's per-save pushes
    parts = dict(model=model, args=training, train_dataset=encoded.get("train"), eval_dataset=encoded.get("validation"),
                 processing_class=tokenizer, data_collator=collator, compute_metrics=compute_metrics)
    if teacher is not None:  # the teacher's class probabilities as well as the labels
        trainer = DistillingTrainer(**parts, teacher=teacher, alpha=args.distill_alpha,
                                    temperature=args.distill_temperature)
    else:
        trainer = AtomicCheckpointTrainer(**parts)
    metrics = {}
    if plan.do_train:
        train_metrics, train_result = train_and_save(trainer, plan, output_dir, rows["train"])
        metrics.update(train_metrics)
    if plan.do_eval:
        eval_metrics = trainer.evaluate()
        eval_metrics.update({"eval_samples": rows["validation"], "eval_split": eval_split, "task": task.name})
        if plan.task_type == "question_answering":
            eval_metrics["eval_windows"] = len(encoded["validation"])
            if trainer.is_world_process_zero():
                output_dir.mkdir(parents=True, exist_ok=True)
                write_answers(output_dir, "eval", readback.latest["predictions"], readback.latest["n_best"])
        if plan.do_train:
            eval_metrics.update({"train_samples": rows["train"],
                                 "train_runtime": train_result.metrics["train_runtime"]})
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)  # eval_results.json and all_results.json
        metrics.update(eval_metrics)
    if plan.do_predict:
        metrics.update(predict(trainer, encoded["test"], task, plan, output_dir, readback))
    if plan.do_train and trainer.is_world_process_zero():
        write_card_and_push(args, training, plan, task, model, metrics, eval_split, rows["train"], argv, push)
    return metrics
