"""The conversion script's run: convert, optionally distill the new parts and extend the length, then save."""

import copy
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hf_linear_attn import family_of
from hf_linear_attn.training.checkpoints import disk_full_error, is_disk_full
from hf_linear_attn.training.data import load_text_corpus, pack_corpus
from hf_linear_attn.training.errors import UsageError
from hf_linear_attn.training.hub import HubArguments, hub_repo_id, push_folder, write_conversion_card
from hf_linear_attn.families import MODEL_FAMILIES, max_model_length

from .convert import (check_source, check_target, convert, extend_max_length, load_source, load_source_config,
                      load_source_tokenizer, save_converted)
from .distill import (DistillationRows, calibrate_window_factors, distill, distillation_distance, distillation_mode,
                      language_model_quality, output_agreement)

FAMILY_OPTIONS = ("linformer_k", "linformer_sharing", "linformer_init", "linformer_normalize_rows",
                  "linformer_drop_unreached_rows", "linformer_block_size", "feature_map", "num_random_features",
                  "learned_feature_dim", "attention_window", "attention_window_factor_init", "state_decay",
                  "layer_types")


@dataclass
class ConvertArguments(HubArguments):
    """Arguments of scripts/convert.py; the --push_to_hub flags come from HubArguments."""

    model_name_or_path: str = field(metadata={"help": "RoBERTa- or BERT-layout encoder (roberta, bert, MiniLM) or "
                                                      "GPT-2: Hub id or local folder"})
    target: str = field(metadata={"help": "linformer | linear_roberta (from encoders), linear_gpt2 | linformer_gpt2"})
    output_dir: str = field(metadata={"help": "where the converted checkpoint is written"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "the source's tokenizer (Hub id or folder) "
                                                                      "when --model_name_or_path holds none"})
    head: str = field(default="auto", metadata={"help": "auto (the source's own) or masked-lm, causal-lm, "
                                                        "sequence-classification, ..., base"})
    linformer_k: int | None = field(default=None, metadata={"help": "Linformer projected length k"})
    linformer_sharing: str | None = field(default=None, metadata={"help": "none | headwise | key-value | layerwise"})
    linformer_init: str | None = field(default=None, metadata={"help": "xavier_uniform | normal | pooling | "
                                                                      "multiscale"})
    linformer_normalize_rows: bool | None = field(default=None, metadata={"help": "encoder Linformer: keep rows of "
                                                                                  "E / F summing to 1"})
    linformer_drop_unreached_rows: bool | None = field(default=None, metadata={
        "help": "encoder Linformer with a pooling or multiscale init: leave rows an input does not reach out of the "
                "softmax"})
    linformer_block_size: int | None = field(default=None, metadata={"help": "causal Linformer block size"})
    feature_map: str | None = field(default=None, metadata={"help": "elu | relu | favor | hedgehog (learnable: "
                                                                    "the one distillation trains)"})
    num_random_features: int | None = field(default=None, metadata={"help": "FAVOR+ features"})
    learned_feature_dim: int | None = field(default=None, metadata={"help": "hedgehog width"})
    attention_window: int | None = field(default=None, metadata={"help": "linear_gpt2 / linear_roberta: exact "
                                                                         "softmax over the last W keys (its factor "
                                                                         "is distilled)"})
    attention_window_factor_init: float | None = field(default=None, metadata={
        "help": "with --attention_window: the window factor's start theta (g = exp(theta)); log(m) starts the "
                "window's keys even with those beyond it for elu + 1 (m the feature width); default 0"})
    state_decay: str | None = field(default=None, metadata={"help": "linear_gpt2: fixed (RetNet) | gated (GLA; "
                                                                    "the gate is distilled)"})
    layer_types: list[str] | None = field(default=None, metadata={"help": "linear_gpt2 / linear_roberta: one of "
                                                                          "linear_attention / full_attention per layer "
                                                                          "(a hybrid; full layers keep the source's "
                                                                          "softmax attention exactly)"})
    distill_steps: int = field(default=0, metadata={"help": "attention-distillation steps (0: convert only)"})
    distill_batch_size: int = field(default=8)
    distill_lr: float | None = field(default=None, metadata={"help": "default 1e-2 for feature maps, 1e-3 for E / F"})
    distill_max_length: int = field(default=128, metadata={"help": "tokens per distillation row"})
    distill_output_steps: int = field(default=0, metadata={
        "help": "after --distill_steps: N more steps training the same new parts against the teacher's last hidden "
                "state, end to end (each layer on the student's own inputs, so it learns to correct the layers "
                "below); 0: none"})
    calibrate_window_factor: bool = field(default=True, metadata={
        "help": "with a window and distillation: before distilling, set each head's window factor to the value whose "
                "attention is nearest the teacher's on the first batch (a grid search); False starts from "
                "--attention_window_factor_init"})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub text dataset for distillation"})
    dataset_config_name: str | None = field(default=None)
    train_file: str | None = field(default=None, metadata={
        "help": "local text / json / parquet / csv / tsv for distillation"})
    validation_file: str | None = field(default=None)
    text_column: str = field(default="text")
    text_pair_column: str | None = field(default=None, metadata={
        "help": "encoders: distil on sentence pairs, the second text in this column beside --text_column (e.g. a GLUE "
                "TSV's question / sentence): each row is one pair framed as a classifier reads it, [CLS] a [SEP] b "
                "[SEP] with token types, up to --distill_max_length tokens (padded, not packed)"})
    validation_split_percentage: float = field(default=5.0)
    eval_rows: int = field(default=64, metadata={"help": "validation rows for the before / after figures"})
    extend_max_length: int | None = field(default=None, metadata={"help": "new maximum input length (encoders)"})
    seed: int = field(default=42)
    overwrite_output_dir: bool = field(default=False)


def _framing_tokenizer(tokenizer):
    """The tokenizer to pack distillation rows with: BERT's WordPiece tokenizers frame a text as [CLS] ... [SEP] and
    have no bos / eos, which packing reads, so a copy uses [CLS] / [SEP] as both (the saved tokenizer is unchanged)."""
    if tokenizer.bos_token_id is None and tokenizer.eos_token_id is None and tokenizer.cls_token_id is not None \
            and tokenizer.sep_token_id is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.bos_token, tokenizer.eos_token = tokenizer.cls_token, tokenizer.sep_token
    return tokenizer


def _rows(args, tokenizer, objective: str):
    """(train rows, validation rows, where the validation text came from): rows of distill_max_length tokens
    packed from the distillation corpus."""
    if args.dataset_name is None and args.train_file is None:
        raise UsageError("Distillation needs text: pass --train_file (e.g. WikiText-2) or --dataset_name.")
    corpus, validation_source = load_text_corpus(args.dataset_name, args.dataset_config_name, args.train_file,
                                                 args.validation_file, args.text_column,
                                                 args.validation_split_percentage, args.seed, args.text_pair_column)
    if args.text_pair_column:
        train, validation = (_pair_rows(corpus[split], tokenizer, args.distill_max_length)
                             for split in ("train", "validation"))
    else:
        packed = pack_corpus(corpus, _framing_tokenizer(tokenizer), args.distill_max_length, objective)
        train, validation = (DistillationRows(packed[split].with_format("torch")[:]["input_ids"])
                             for split in ("train", "validation"))
    return train, validation[: args.eval_rows], validation_source


def _pair_rows(pairs, tokenizer, max_length: int) -> DistillationRows:
    """One row per sentence pair, framed as sequence classification frames it (the tokenizer's pair template: BERT's
    [CLS] a [SEP] b [SEP] with token types 0 / 1), cut to max_length (longest first) and padded on the right. Why
    pairs: attention distilled on packed prose never sees a question attend to its passage across [SEP], which is
    what QNLI's classifier reads (docs/pretrained.md)."""
    encoded = tokenizer(list(pairs["text"]), list(pairs["text_pair"]), truncation="longest_first",
                        max_length=max_length, padding="max_length", padding_side="right", return_tensors="pt",
                        verbose=False)
    return DistillationRows(encoded["input_ids"], encoded["attention_mask"], encoded.get("token_type_ids"))


def _source_tokenizer(args: ConvertArguments):
    """The tokenizer saved beside the converted model: --tokenizer_name's, else the source's. A converted folder
    without its tokenizer could not be fine-tuned or read, so a source without one is refused with the fix."""
    source = args.tokenizer_name or args.model_name_or_path
    tokenizer = load_source_tokenizer(source)
    if tokenizer is None:
        if args.tokenizer_name:
            raise UsageError(f"Cannot load a tokenizer from --tokenizer_name {args.tokenizer_name!r}: give the Hub id "
                             "or the folder of the tokenizer the source was trained with.")
        raise UsageError(
            f"{args.model_name_or_path} has no tokenizer (tokenizer.json, or vocab.txt for WordPiece / vocab.json + "
            "merges.txt for BPE, with tokenizer_config.json). Copy the source's tokenizer files into that folder, or "
            "pass --tokenizer_name with the Hub id or folder of the tokenizer it was trained with."
        )
    return tokenizer


def run_conversion(args: ConvertArguments) -> dict:
    """Convert, distill (optional), extend (optional), save with a model card and push (--push_to_hub); returns
    the report as a dict (with the Hub commit's URL as hub_commit after a push)."""
    check_target(args.target)  # before the source is loaded
    output_dir = Path(args.output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not args.overwrite_output_dir:
        raise UsageError(f"{output_dir} is not empty; choose another --output_dir or pass --overwrite_output_dir.")
    repo_id = hub_repo_id(args)  # token, Hub, repo name: before the source is loaded
    validation_source = None
    options = {name: getattr(args, name) for name in FAMILY_OPTIONS if getattr(args, name) is not None}
    # Everything that can be refused from the config and the tokenizer is, before the weights are read.
    source_config = load_source_config(args.model_name_or_path)
    check_source(source_config, args.target)
    tokenizer = _source_tokenizer(args)
    longest = max_model_length(source_config)
    if args.distill_output_steps < 0 or (args.distill_output_steps and not args.distill_steps):
        raise UsageError(f"--distill_output_steps {args.distill_output_steps} needs a positive number of steps after "
                         "--distill_steps N (the per-layer distillation runs first): pass --distill_steps, e.g. 100.")
    if args.text_pair_column is not None:
        if not args.distill_steps:
            raise UsageError(f"--text_pair_column {args.text_pair_column} reads distillation's sentence pairs, but "
                             "there is no distillation: pass --distill_steps N, or leave --text_pair_column out.")
        if args.text_pair_column == args.text_column:
            raise UsageError(f"--text_pair_column and --text_column are both {args.text_column!r}: a pair needs two "
                             "columns (e.g. --text_column question --text_pair_column sentence).")
        if MODEL_FAMILIES[args.target].kind != "encoder":
            raise UsageError(f"--text_pair_column frames sentence pairs for an encoder's classifier; {args.target} is "
                             "a decoder, which distils on packed text: leave --text_pair_column out.")
    if args.distill_steps and args.distill_max_length > longest:
        raise UsageError(f"--distill_max_length {args.distill_max_length} exceeds the teacher's longest input "
                         f"({longest} tokens, its position table); lower it to at most {longest}. The teacher cannot "
                         "read longer rows; --extend_max_length grows the student after distillation.")
    if args.extend_max_length is not None and args.extend_max_length <= longest:
        raise UsageError(f"--extend_max_length {args.extend_max_length} must exceed the source's longest input "
                         f"({longest} tokens); leave it out to keep {longest}.")
    teacher, missing = load_source(args.model_name_or_path, args.head)
    torch.manual_seed(args.seed)
    # the head weights the source drew at load time (a classifier on a base checkpoint) are new, not copied
    model, report = convert(teacher, args.target, args.head, not_in_checkpoint=missing, **options)
    print(report.summary())
    if args.distill_steps:
        objective = family_of(model).objective
        train_rows, eval_rows, validation_source = _rows(args, tokenizer, objective)
        mode = distillation_mode(model)
        lr = args.distill_lr or (1e-3 if mode == "layer_output" else 1e-2)
        started = time.time()
        before = distillation_distance(model, teacher, eval_rows)
        agreement_before = output_agreement(model, teacher, eval_rows)
        has_lm_head = report.head in ("masked-lm", "causal-lm") and not missing  # read from the checkpoint
        quality_before = language_model_quality(model, eval_rows, tokenizer) if has_lm_head else None
        calibrated = None
        if args.calibrate_window_factor and mode == "attention":
            # the first batch's rows, not drawn from distillation's generator, so its batches stay as they were
            calibrated = calibrate_window_factors(model, teacher, train_rows[: args.distill_batch_size])
        calibrated_distance = distillation_distance(model, teacher, eval_rows) if calibrated else None
        history = distill(model, teacher, report.new, train_rows, args.distill_steps, args.distill_batch_size, lr,
                          seed=args.seed)
        end_to_end = None
        if args.distill_output_steps:
            layered = distillation_distance(model, teacher, eval_rows), output_agreement(model, teacher, eval_rows)
            output_history = distill(model, teacher, report.new, train_rows, args.distill_output_steps,
                                     args.distill_batch_size, lr, seed=args.seed + 1, objective="output")
            end_to_end = {"output_steps": args.distill_output_steps, "distance_layers_only": layered[0],
                          "output_cosine_layers_only": layered[1], "output_first_loss": output_history[0],
                          "output_last_loss": output_history[-1]}
        after = distillation_distance(model, teacher, eval_rows)
        report.distillation = {
            "mode": mode, "steps": args.distill_steps, "batch_size": args.distill_batch_size,
            "lr": lr, "rows": args.distill_max_length, "train_rows": len(train_rows), "eval_rows": len(eval_rows),
            "distance_before": before,
            **({"window_factor_calibrated": calibrated, "distance_calibrated": calibrated_distance}
               if calibrated else {}),
            "distance_after": after, "output_cosine_before": agreement_before,
            "output_cosine_after": output_agreement(model, teacher, eval_rows),
            "first_loss": history[0], "last_loss": history[-1], **(end_to_end or {}),
            "seconds": round(time.time() - started, 1),
        }
        if quality_before is not None:  # the language-model head came from the checkpoint: compare LM quality too
            report.distillation.update(teacher=language_model_quality(teacher, eval_rows, tokenizer),
                                       converted=quality_before,
                                       distilled=language_model_quality(model, eval_rows, tokenizer))
        print(json.dumps(report.distillation, indent=2))
    if args.extend_max_length:
        model = extend_max_length(model, args.extend_max_length)
        report.extended_to = args.extend_max_length
        if tokenizer is not None:
            tokenizer.model_max_length = args.extend_max_length
    partial = output_dir.with_name(f".partial-{output_dir.name}")  # a crash never leaves half a checkpoint
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_converted(model, report, partial, tokenizer)
        write_conversion_card(partial, args, asdict(report), model.config, repo_id or output_dir.resolve().name,
                              validation_source)
    except Exception as error:  # a full disk, or a card that cannot be written: no half checkpoint stays
        shutil.rmtree(partial, ignore_errors=True)
        if is_disk_full(error):
            raise disk_full_error(output_dir.parent, "the converted checkpoint", error) from error
        raise
    if output_dir.exists():
        shutil.rmtree(output_dir)
    partial.rename(output_dir)
    print(f"wrote {output_dir}")
    result = asdict(report)
    if repo_id is not None:
        result["hub_commit"] = push_folder(output_dir, repo_id, token=args.hub_token, private=args.hub_private_repo,
                                           commit_message="Upload converted model, tokenizer and model card")
        print(f"pushed to {result['hub_commit']}")
    return result
