"""Model cards for the three scripts: fine-tuned (finetune.py), pretrained (pretrain.py) and converted (convert.py)
checkpoints. One rendering path (`render_card`, sandboxed Jinja) serves all three; the card's command repeats the
run without its Hub token. Uploading them is hub.py's."""

import json
import shlex
from collections import Counter
from dataclasses import MISSING, fields
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from jinja2 import TemplateError
from jinja2.sandbox import SandboxedEnvironment

from hf_linear_attn import MODEL_FAMILIES, family_of
from hf_linear_attn.families import max_model_length

from .arguments import SECRET_ARGUMENTS
from .errors import UsageError


DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "model_card_template.md"  # package data


# cards of checkpoints that are not fine-tuned on a task: pretrained (pretrain.py) and converted (convert.py)
CHECKPOINT_TEMPLATE = Path(__file__).resolve().parent / "checkpoint_card_template.md"


# a sentence on the attention of each model type a card can describe: this package's families, and the baselines
ATTENTION = {
    **{model_type: family.description for model_type, family in MODEL_FAMILIES.items()},
    "roberta": "Standard softmax self-attention (the baseline the efficient variants are compared with).",
    "gpt2": "Standard causal softmax self-attention (the baseline the efficient variants are compared with).",
}


def describe_architecture(config) -> tuple[str, str]:
    """A one-line name of the model (type, size, attention settings) and a sentence on its attention."""
    size = (f"{getattr(config, 'num_hidden_layers', getattr(config, 'n_layer', '?'))} layers x "
            f"{getattr(config, 'hidden_size', getattr(config, 'n_embd', '?'))}")
    extras = []
    for name in ("linformer_k", "linformer_sharing", "feature_map", "linformer_block_size"):
        if hasattr(config, name):
            extras.append(f"{name.replace('linformer_', '')} = {getattr(config, name)}")
    family = family_of(config)
    kind = family.kind if family else ("decoder" if "gpt2" in config.model_type else "encoder")
    label = f"{config.model_type} {kind} ({', '.join([size, *extras])})"
    return label, ATTENTION.get(config.model_type, "")


def check_template(template: Path) -> None:
    """An error, before any training, for a card template that does not parse."""
    try:
        SandboxedEnvironment().parse(Path(template).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, TemplateError) as error:
        raise UsageError(f"cannot read the model card template {template} (--model_card_template): "
                         f"{type(error).__name__}: {error}") from error


def render_card(template: Path, card_data: ModelCardData, **variables) -> ModelCard:
    """ModelCard.from_template's rendering (the card data's fields and `card_data` as YAML, then `variables`), in
    a sandboxed Jinja2 environment: a template, which a --config file can name, cannot reach Python internals
    (`cycler.__init__.__globals__.os.popen(...)` runs shell commands under from_template's plain jinja2.Template)."""
    try:
        source = Path(template).read_text(encoding="utf-8")
        compiled = SandboxedEnvironment().from_string(source)
        content = compiled.render(card_data=card_data.to_yaml(), **{**card_data.to_dict(), **variables})
    except (OSError, UnicodeDecodeError, TemplateError) as error:  # SecurityError is a TemplateError
        raise UsageError(f"cannot render the model card template {template} (--model_card_template): "
                         f"{type(error).__name__}: {error}") from error
    return ModelCard(content)


PERCENT_METRICS = ("accuracy", "f1", "precision", "recall")  # shown as percentages in the card's table
# question answering reports SQuAD's exact match and F1 in percent already (as the squad metric and run_qa.py do)
PERCENT_ALREADY = {"question-answering": ("exact_match", "f1")}


def usage_example(pipeline_tag: str, repo_id: str, text_columns) -> str:
    """The card's Python example of using the model for its task."""
    load = f'"{pipeline_tag}", model="{repo_id}", trust_remote_code=True'
    if pipeline_tag == "question-answering":  # Transformers 5 has no question-answering pipeline any more
        return ("import torch\nfrom transformers import AutoModelForQuestionAnswering, AutoTokenizer\n\n"
                f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
                f'model = AutoModelForQuestionAnswering.from_pretrained("{repo_id}", trust_remote_code=True)\n'
                'question = "Where does the European lobster live?"\n'
                'context = "The European lobster lives in the eastern Atlantic Ocean and the Mediterranean Sea."\n'
                "inputs = tokenizer(question, context, return_offsets_mapping=True, return_tensors=\"pt\")\n"
                "offsets = inputs.pop(\"offset_mapping\")[0]\n"
                "outside = torch.tensor([s != 1 for s in inputs.sequence_ids(0)])  # question, special tokens\n"
                "with torch.no_grad():\n"
                "    output = model(**inputs)\n"
                "start = output.start_logits[0].masked_fill(outside, -1e9).argmax()\n"
                "end = start + output.end_logits[0, start:].masked_fill(outside[start:], -1e9).argmax()\n"
                "print(context[offsets[start][0]:offsets[end][1]])")
    if pipeline_tag == "multiple-choice":  # no pipeline: score each (context, ending) pair, take the best
        return ("import torch\nfrom transformers import AutoModelForMultipleChoice, AutoTokenizer\n\n"
                f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
                f'model = AutoModelForMultipleChoice.from_pretrained("{repo_id}", trust_remote_code=True)\n'
                'context = "The lobster was cooked."\n'
                'endings = ["It turned red.", "It sang a song.", "It won the election.", "It rained."]\n'
                "inputs = tokenizer([context] * len(endings), endings, return_tensors=\"pt\", padding=True)\n"
                "with torch.no_grad():\n"
                "    scores = model(**{k: v.unsqueeze(0) for k, v in inputs.items()}).logits\n"
                "print(endings[scores.argmax().item()])")
    return (f"from transformers import pipeline\n\nclassifier = pipeline({load})\n"
            f"classifier({example_input(pipeline_tag, text_columns)})")


def example_input(pipeline_tag: str, text_columns) -> str:
    """The input of a classification pipeline in the card's example: a text, a pair, or a sentence to label."""
    if pipeline_tag == "token-classification":
        return '"Ada Lovelace wrote the first program in London."'  # a pipeline takes text, not word lists
    return '"a gripping, beautifully acted film"' if len(text_columns) == 1 else (
        '{"text": "How do I learn Python?", "text_pair": "What is the best way to learn Python?"}')


def write_model_card(output_dir: Path, *, repo_id: str, config, base_model: str, task, metrics: dict,
                     eval_split: str, dataset_id: str, command: str, data_description: str, truncation_rule: str,
                     max_seq_length: int, hyperparameters: dict, machine: str, template: Path = DEFAULT_TEMPLATE,
                     pipeline_tag: str = "text-classification"):
    """README.md with `model-index` results (one EvalResult per metric) from the template (default: model_card_template.md in this package).

    `pipeline_tag`: "text-classification" (a label or score per text), "token-classification" (a label per
    word), "question-answering" (extractive answers) or "multiple-choice": the card's task type, tags and usage
    example."""
    if not Path(template).is_file():
        raise UsageError(f"model card template not found: {template}")
    names = [k for k in ("exact_match", "accuracy", "f1", "mse", "pearson", "precision", "recall")
             if f"eval_{k}" in metrics]
    task_title = {"sst2": "GLUE SST-2", "qnli": "GLUE QNLI", "qqp": "GLUE QQP", "imdb": "IMDB"}.get(task.name,
                                                                                                     task.name)
    results = [EvalResult(task_type=pipeline_tag, dataset_type=dataset_id or "local", dataset_name=task_title,
                          dataset_config=task.hub_config, dataset_split=eval_split, metric_type=name,
                          metric_value=round(float(metrics[f"eval_{name}"]), 4)) for name in names]
    card_data = ModelCardData(model_name=repo_id.split("/")[-1], base_model=hub_base_model(base_model),
                              library_name="transformers", license="apache-2.0", language="en",
                              tags=["hf-linear-attn", config.model_type, pipeline_tag],
                              datasets=[dataset_id] if dataset_id else None, metrics=names,
                              # multiple choice has no Transformers pipeline (HEAD_PIPELINES), so no Hub widget
                              pipeline_tag=None if pipeline_tag == "multiple-choice" else pipeline_tag,
                              eval_results=results or None)
    architecture, attention = describe_architecture(config)
    as_percent = [n for n in PERCENT_METRICS if n not in PERCENT_ALREADY.get(pipeline_tag, ())]
    card = render_card(
        template, card_data, model_name=repo_id.split("/")[-1], repo_id=repo_id,
        architecture=architecture, attention_description=attention, base_model=base_model, task_title=task_title,
        eval_split=eval_split, eval_samples=metrics.get("eval_samples", "?"), metric_names=" | ".join(names),
        metric_values=" | ".join(f"{100 * metrics[f'eval_{n}']:.2f}" if n in as_percent else
                                 f"{metrics[f'eval_{n}']:.2f}" if n in PERCENT_ALREADY.get(pipeline_tag, ()) else
                                 f"{metrics[f'eval_{n}']:.4f}" for n in names), machine=machine,
        example_input=example_input(pipeline_tag, task.text_columns),
        usage_code=usage_example(pipeline_tag, repo_id, task.text_columns),
        command=without_token(command), data_description=data_description,
        truncation_rule=truncation_rule,
        max_seq_length=max_seq_length, hyperparameters=", ".join(f"{k} {v}" for k, v in hyperparameters.items()),
        limitations=("Trained and evaluated at the scale recorded above; figures from a small CPU-scale run are not "
                     "comparable with published full-scale results (hf-linear-attn's results/reproduction "
                     "compares each architecture with softmax attention at one equal budget). Inputs longer than "
                     "the model's maximum length must be truncated (the rule above)."),
    )
    card.save(output_dir / "README.md")
    return card


def hub_base_model(name_or_path: str | None) -> str | None:
    """`base_model` for a card: a Hub id the model started from; a local folder's own card's `base_model` if it
    names one (a folder written by this package's scripts, from a Hub model); None otherwise."""
    if not name_or_path:
        return None
    folder = Path(name_or_path)
    if folder.exists():
        card = folder / "README.md"
        if card.is_file():
            try:
                found = ModelCard.load(card).data.to_dict().get("base_model")
            except Exception:  # a hand-written README without a YAML header
                found = None
            if isinstance(found, str) and not Path(found).exists():
                return found
        return None
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return None
    return name_or_path


def command_line(script: str, args, launcher: str = "python") -> str:
    """The command that repeats a run: `LAUNCHER SCRIPT` with every argument that differs from its default (a
    --config file's values written out, so the command stands alone), the Hub token left out."""
    words = []
    for spec in fields(args):
        value = getattr(args, spec.name)
        default = spec.default_factory() if spec.default_factory is not MISSING else spec.default
        if spec.name in SECRET_ARGUMENTS or (default is not MISSING and value == default):
            continue
        if value is True and default is False:
            words.append(f"--{spec.name}")
        elif isinstance(value, (list, tuple)):
            words += [f"--{spec.name}", *map(str, value)]
        else:
            words += [f"--{spec.name}", str(value)]
    return f"{launcher} {script} {shlex.join(words)}".rstrip()


def without_token(command: str) -> str:
    """`command` without --hub_token and its value: a card is public."""
    words, skip = [], False
    for word in shlex.split(command):
        if skip:
            skip = False
        elif word in ("--hub_token", "--hub-token"):
            skip = True
        elif not word.startswith(("--hub_token=", "--hub-token=")):
            words.append(word)
    return shlex.join(words)


# a head of this package's models (conversion/convert.py's HEADS) -> (Hub pipeline tag, Auto class)
HEAD_PIPELINES = {
    "masked-lm": ("fill-mask", "AutoModelForMaskedLM"),
    "causal-lm": ("text-generation", "AutoModelForCausalLM"),
    "sequence-classification": ("text-classification", "AutoModelForSequenceClassification"),
    "token-classification": ("token-classification", "AutoModelForTokenClassification"),
    "question-answering": ("question-answering", "AutoModelForQuestionAnswering"),
    "multiple-choice": (None, "AutoModelForMultipleChoice"),
    "base": ("feature-extraction", "AutoModel"),
}


ATTENTION_OPTIONS = ("linformer_k", "linformer_sharing", "linformer_init", "linformer_normalize_rows",
                     "linformer_block_size", "feature_map", "num_random_features", "learned_feature_dim")


def _first(config, *names):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


def model_summary(config, folder: Path) -> list[tuple[str, str]]:
    """(name, value) lines on a saved model: size, vocabulary, longest input, attention options, parameters."""
    lines = [("model type", f"`{config.model_type}`")]
    for label, names in (("layers", ("num_hidden_layers", "n_layer")), ("hidden size", ("hidden_size", "n_embd")),
                         ("attention heads", ("num_attention_heads", "n_head")),
                         ("feed-forward size", ("intermediate_size", "n_inner")), ("vocabulary", ("vocab_size",))):
        value = _first(config, *names)
        if value is not None:
            lines.append((label, f"{value:,}"))
    try:
        lines.append(("longest input", f"{max_model_length(config):,} tokens"))
    except (AttributeError, TypeError):  # a config without a position table
        pass
    lines += [(name, str(getattr(config, name))) for name in ATTENTION_OPTIONS
              if getattr(config, name, None) is not None]
    parameters = _saved_parameters(folder)
    if parameters:
        lines.append(("parameters", f"{parameters:,} (tied weights once)"))
    return lines


def _saved_parameters(folder: Path) -> int:
    """Parameters stored in the folder's safetensors files, read from their headers (tied copies are stored once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(folder).glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                count = 1
                for size in handle.get_slice(name).get_shape():
                    count *= size
                total += count
    return total


def _data_label(dataset_name, dataset_config_name, train_file) -> str:
    if dataset_name:
        return f"{dataset_name} ({dataset_config_name})" if dataset_config_name else dataset_name
    return Path(train_file).name if train_file else "?"


def _split_label(validation_source: str, validation_file) -> str:
    """The held-out text a metric is measured on: a local validation file's name, or the source's own words."""
    if validation_source == "validation" and validation_file:
        return Path(validation_file).name
    return validation_source


def significant(value: float, digits: int = 5) -> float:
    """`value` to `digits` significant digits: a distillation distance of 2e-5 must not round to 0."""
    return float(f"{float(value):.{digits}g}")


def write_checkpoint_card(folder: Path, *, repo_id: str, config, head: str, base_model: str | None, tags: list[str],
                          datasets: list[str] | None, results: list[dict], template: Path = CHECKPOINT_TEMPLATE,
                          **variables) -> ModelCard:
    """README.md for a pretrained or converted checkpoint from `template` (default: checkpoint_card_template.md).

    `results`: dicts with name, metric (the model-index type), value, task, data, dataset_type, split; each
    becomes one `model-index` EvalResult and one row of the card's table. `variables` fill the template's body
    (origin, training, conversion, distillation, ...; absent ones render as nothing)."""
    if not Path(template).is_file():
        raise UsageError(f"model card template not found: {template}")
    pipeline_tag, auto_class = HEAD_PIPELINES.get(head, (None, "AutoModel"))
    model_name = repo_id.split("/")[-1]
    evals = [EvalResult(task_type=r["task"], dataset_type=r["dataset_type"], dataset_name=r["data"],
                        dataset_split=r["split"], metric_type=r["metric"], metric_name=r["name"],
                        metric_value=significant(r["value"])) for r in results]
    card_data = ModelCardData(model_name=model_name, base_model=base_model, library_name="transformers",
                              tags=tags, datasets=datasets or None, pipeline_tag=pipeline_tag,
                              metrics=sorted({r["metric"] for r in results}) or None, eval_results=evals or None)
    architecture, attention = describe_architecture(config)
    table = [{**r, "value": f"{significant(r['value']):g}"} for r in results]
    card = render_card(template, card_data, model_name=model_name, repo_id=repo_id, architecture=architecture,
                       attention_description=attention, configuration=model_summary(config, folder),
                       results=table, pipeline_tag=pipeline_tag, auto_class=auto_class,
                       remote_code=bool(getattr(config, "auto_map", None)), **variables)
    card.save(Path(folder) / "README.md")
    return card


def write_pretraining_card(output_dir: Path, args, repo_id: str, template: Path = CHECKPOINT_TEMPLATE) -> ModelCard:
    """The card of a pretraining run, from its records (train_results.json, config.json) and arguments: model,
    data, steps, final validation loss and perplexity, the command; `base_model` when it continued from weights."""
    from transformers import AutoConfig

    output_dir = Path(output_dir)
    record = json.loads((output_dir / "train_results.json").read_text())
    config = AutoConfig.from_pretrained(output_dir, trust_remote_code=args.trust_remote_code)
    masked = record["objective"] == "mlm"
    data = _data_label(args.dataset_name, args.dataset_config_name, args.train_file)
    split = _split_label(record["validation"], args.validation_file)
    task = "fill-mask" if masked else "text-generation"
    unit = "masked token" if masked else "predicted token"
    results = [{"name": f"validation loss (nats per {unit})", "metric": "loss", "value": record["eval_loss"]},
               {"name": "validation perplexity", "metric": "perplexity", "value": record["perplexity"]}]
    results = [{**r, "task": task, "data": data, "dataset_type": args.dataset_name or "local", "split": split}
               for r in results if r["value"] is not None]
    objective = ("masked-LM objective (RoBERTa's dynamic masking)" if masked else "causal-LM objective")
    start = (f"continued from `{args.model_name_or_path}`" if args.model_name_or_path else "from scratch")
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * record["num_processes"]
    rows, length = record["train_rows"], args.max_seq_length
    tokenizer = (f"`{args.tokenizer_name_or_path or args.model_name_or_path}`'s" if
                 args.tokenizer_name_or_path or args.model_name_or_path else
                 f"a byte-level BPE trained on the training text ({config.vocab_size:,} tokens)")
    training = [
        (f"Data: {data}, {rows:,} rows of {length} tokens ({rows * length:,} tokens; lines joined by the "
         f"end-of-text token and packed); validation: {split}"),
        (f"Objective: masked LM, {args.mlm_probability:.0%} of tokens chosen (80% `<mask>`, 10% random, 10% kept), "
         "fresh masks every step" if masked else "Objective: causal LM (next token)"),
        (f"Steps: {record['steps']:,} optimizer steps of {batch} rows ({args.per_device_train_batch_size} per "
         f"device x {args.gradient_accumulation_steps} accumulated x {record['num_processes']} process(es)), "
         f"{record['steps'] * batch / max(rows, 1):.3g} epochs"),
        (f"Optimizer: AdamW, learning rate {args.learning_rate:g}, betas ({args.adam_beta1}, {args.adam_beta2}), "
         f"weight decay {args.weight_decay}, {args.lr_scheduler_type} schedule with {args.warmup_ratio:g} warmup, "
         f"gradient clipping at {args.max_grad_norm}; mixed precision {record['mixed_precision']}; seed {args.seed}"),
        f"Tokenizer: {tokenizer}",
    ]
    processes = record["num_processes"]
    launcher = f"accelerate launch --num_processes {processes}" if processes > 1 else "python"
    note = (f"Measured by scripts/pretrain.py at the end of training over {record['eval_tokens']:,} "
            f"{unit}s of the validation text" + (" (one fixed masking)" if masked else "")
            + "; `train_results.json` and `trainer_state.json` beside the weights hold every figure and the "
              "loss curve.")
    return write_checkpoint_card(
        output_dir, repo_id=repo_id, config=config, head="masked-lm" if masked else "causal-lm",
        base_model=hub_base_model(args.model_name_or_path), tags=["hf-linear-attn", config.model_type,
                                                                   "pretraining", task],
        datasets=[args.dataset_name] if args.dataset_name else None, results=results, template=template,
        origin=f"pretrained {start} with hf-linear-attn's `scripts/pretrain.py` ({objective}) on {data}.",
        training=training, results_note=note, command=command_line("scripts/pretrain.py", args, launcher),
        limitations=("Pretrained at the scale recorded above: a small run's perplexity is not comparable with "
                     "published full-scale models. A pretrained checkpoint is a starting point: fine-tune it on a "
                     "task (`scripts/finetune.py --model_name_or_path ...`) before using it."))


def write_conversion_card(folder: Path, args, report: dict, config, repo_id: str, validation_source: str | None,
                          template: Path = CHECKPOINT_TEMPLATE) -> ModelCard:
    """The card of a converted checkpoint: the source (`base_model` when it is a Hub id), what was copied and what
    is new, the length extension, and the distillation's figures when distillation ran."""
    source = args.model_name_or_path
    base_model = hub_base_model(source)
    head = report["head"]
    options = ", ".join(f"{name} = {getattr(args, name)}" for name in ATTENTION_OPTIONS
                        if getattr(args, name, None) is not None)
    conversion = [
        f"Source: `{source}` ({report['source_architecture']}"
        + (", a Hub model)" if base_model == source else ", a local checkpoint)")
        + f" -> {report['target_architecture']}, {head} head" + (f"; options: {options}" if options else ""),
        (f"Copied exactly: {len(report['copied'])} tensors, {report['copied_parameters']:,} parameters (every "
         "weight the two architectures share: the families keep RoBERTa's and GPT-2's parameter names)"),
        f"New: {len(report['new'])} tensors, {report['new_parameters']:,} parameters"
        + "".join(f"; {count} x {how}" for how, count in Counter(report["new"].values()).items()),
    ]
    if report["dropped"]:
        conversion.append(f"Dropped: {len(report['dropped'])} tensors"
                          + "".join(f"; {count} x {why}" for why, count in Counter(report["dropped"].values()).items()))
    if report.get("extended_to"):
        conversion.append(f"Maximum input length extended to {report['extended_to']:,} tokens (position rows "
                          "tiled, Linformer E / F stretched): fine-tune at the new length before relying on it")
    distilled = report.get("distillation")
    data = _data_label(args.dataset_name, args.dataset_config_name, args.train_file)
    results, distillation, table = [], None, None
    if distilled:
        split = _split_label(validation_source or "validation", args.validation_file)
        task = HEAD_PIPELINES.get(head, (None,))[0] or "feature-extraction"
        common = {"task": task, "data": data, "dataset_type": args.dataset_name or "local", "split": split}
        attention = distilled["mode"] == "attention"
        distance = ("attention KL divergence to the teacher (nats per row)" if attention else
                    "relative layer-output error to the teacher")
        results.append(dict(common, name=f"{distance}, after distillation",
                            metric="attention_kl" if attention else "layer_output_error",
                            value=distilled["distance_after"]))
        if "distilled" in distilled:
            quality = distilled["distilled"]
            results += [dict(common, name="loss (nats per predicted token)", metric="loss", value=quality["loss"]),
                        dict(common, name="perplexity", metric="perplexity", value=quality["perplexity"]),
                        dict(common, name="token accuracy", metric="accuracy", value=quality["accuracy"])]
            table = {"header": ["loss", "perplexity", "token accuracy"],
                     "rows": [[who, f"{distilled[key]['loss']:.4f}", f"{distilled[key]['perplexity']:.2f}",
                               f"{100 * distilled[key]['accuracy']:.1f}%"]
                              for who, key in ((f"teacher (`{source}`)", "teacher"),
                                               ("converted, before distillation", "converted"),
                                               ("distilled (this model)", "distilled"))]}
        distillation = [
            ("Trained: the new parameters only (shared weights frozen), each layer's attention rows against the "
             "teacher's softmax rows (cross-entropy; reported as KL divergence)" if attention else
             "Trained: the new parameters only (shared weights frozen), each layer's output against the teacher's "
             "(relative squared error)"),
            (f"{distilled['steps']:,} steps of {distilled['batch_size']} rows of {distilled['rows']} tokens, "
             f"learning rate {distilled['lr']:g}, on {data} ({distilled['train_rows']:,} rows), seed {args.seed}"),
            (f"Distance to the teacher on {distilled['eval_rows']} held-out rows ({split}): "
             f"{distilled['distance_before']:.4g} after conversion -> "
             + (f"{distilled['distance_calibrated']:.4g} once the window factor was calibrated (each head's start "
                "set to where its attention is nearest the teacher's) -> " if "distance_calibrated" in distilled
                else "")
             + f"{distilled['distance_after']:.4g} after distillation"),
        ]
        if "output_cosine_before" in distilled:
            distillation.append(
                f"Cosine similarity of the last hidden state to the teacher's on the same rows (mean over tokens): "
                f"{distilled['output_cosine_before']:.4f} after conversion -> {distilled['output_cosine_after']:.4f} "
                "after distillation")
    origin = (f"converted from `{source}` with hf-linear-attn's `scripts/convert.py`"
              + (f", then attention-distilled against it for {distilled['steps']:,} steps on {data}." if distilled
                 else "; its new attention parts are at their initial values (no distillation)."))
    note = ("Measured by scripts/convert.py on held-out rows after distillation; `conversion_report.json` beside "
            "the weights holds every figure.")
    return write_checkpoint_card(
        folder, repo_id=repo_id, config=config, head=head, base_model=base_model,
        tags=["hf-linear-attn", config.model_type, "conversion", *(["distillation"] if distilled else [])],
        datasets=[args.dataset_name] if distilled and args.dataset_name else None, results=results,
        template=template, origin=origin, conversion=conversion, distillation=distillation,
        distillation_table=table, results_note=note, command=command_line("scripts/convert.py", args),
        limitations=("A converted checkpoint is a starting point: its new attention parts "
                     + ("were distilled briefly" if distilled else "are untrained")
                     + f", so its outputs differ from `{source}`'s. Fine-tune it on a task (`scripts/finetune.py "
                     "--model_name_or_path ...`) before using it."))
