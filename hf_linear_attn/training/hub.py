"""Model cards and Hub uploads for fine-tuned checkpoints."""

import json
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from jinja2 import TemplateError
from jinja2.sandbox import SandboxedEnvironment

from hf_linear_attn import MODEL_FAMILIES, family_of

from .errors import UsageError

DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "model_card_template.md"  # package data
# never uploaded: Trainer checkpoints, TensorBoard runs, optimizer state, pickled training arguments
PUSH_IGNORE = ["checkpoint-*", "checkpoint-*/**", "runs/**", "*.pt", "*.bin", "*.pkl", ".partial-*"]

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


def write_model_card(output_dir: Path, *, repo_id: str, config, base_model: str, task, metrics: dict,
                     eval_split: str, dataset_id: str, command: str, data_description: str, truncation_rule: str,
                     max_seq_length: int, hyperparameters: dict, machine: str, template: Path = DEFAULT_TEMPLATE):
    """README.md with `model-index` results (one EvalResult per metric) from the template (default: model_card_template.md in this package)."""
    if not Path(template).is_file():
        raise UsageError(f"model card template not found: {template}")
    names = [k for k in ("accuracy", "f1") if f"eval_{k}" in metrics]
    task_title = {"sst2": "GLUE SST-2", "qnli": "GLUE QNLI", "qqp": "GLUE QQP", "imdb": "IMDB"}[task.name]
    results = [EvalResult(task_type="text-classification", dataset_type=dataset_id, dataset_name=task_title,
                          dataset_config=task.hub_config, dataset_split=eval_split, metric_type=name,
                          metric_value=round(float(metrics[f"eval_{name}"]), 4)) for name in names]
    card_data = ModelCardData(model_name=repo_id.split("/")[-1], base_model=None, library_name="transformers",
                              license="apache-2.0", language="en", tags=["hf-linear-attn", config.model_type,
                                                                         "text-classification"],
                              datasets=[dataset_id], metrics=names, pipeline_tag="text-classification",
                              eval_results=results)
    architecture, attention = describe_architecture(config)
    example = '"a gripping, beautifully acted film"' if len(task.text_columns) == 1 else (
        '{"text": "How do I learn Python?", "text_pair": "What is the best way to learn Python?"}')
    card = render_card(
        template, card_data, model_name=repo_id.split("/")[-1], repo_id=repo_id,
        architecture=architecture, attention_description=attention, base_model=base_model, task_title=task_title,
        eval_split=eval_split, eval_samples=metrics.get("eval_samples", "?"), metric_names=" | ".join(names),
        metric_values=" | ".join(f"{100 * metrics[f'eval_{n}']:.2f}" for n in names), machine=machine,
        example_input=example, command=command, data_description=data_description, truncation_rule=truncation_rule,
        max_seq_length=max_seq_length, hyperparameters=", ".join(f"{k} {v}" for k, v in hyperparameters.items()),
        limitations=("Trained and evaluated at the scale recorded above; figures from a small CPU-scale run are not "
                     "comparable with published full-scale results (hf-linear-attn's results/reproduction "
                     "compares each architecture with softmax attention at one equal budget). Inputs longer than "
                     "the model's maximum length must be truncated (the rule above)."),
    )
    card.save(output_dir / "README.md")
    return card


def check_push_folder(folder: Path) -> list[str]:
    """The files a checkpoint needs on the Hub (config, weights, model code, card); raise naming any missing one."""
    if not (folder / "config.json").is_file():
        raise UsageError(f"{folder} has no config.json: not a checkpoint")
    config = json.loads((folder / "config.json").read_text())
    needed = ["config.json", "README.md"]
    weights = [p.name for p in folder.glob("model*.safetensors")]
    if not weights:
        raise UsageError(f"{folder} has no model*.safetensors weights")
    for reference in config.get("auto_map", {}).values():
        module = reference.split("--")[-1].rsplit(".", 1)[0] + ".py"
        needed.append(module)
    missing = sorted({n for n in needed if not (folder / n).is_file()})
    if missing:
        raise UsageError(f"{folder} lacks {missing}: the Hub checkpoint would not load; save it again")
    return sorted(set(needed) | set(weights))


def push_folder(folder: Path, repo_id: str, token: str | None = None, private: bool | None = None,
                commit_message: str = "Upload fine-tuned model, code and model card") -> str:
    """Create the Hub repo if needed and upload the checkpoint folder in one commit; returns the commit URL."""
    check_push_folder(folder)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                               ignore_patterns=PUSH_IGNORE, repo_type="model")
    return str(getattr(commit, "commit_url", commit))
