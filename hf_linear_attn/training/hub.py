"""Model cards and Hub uploads for fine-tuned checkpoints."""

import json
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
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
    names = [k for k in ("accuracy", "f1", "mse", "pearson") if f"eval_{k}" in metrics]
    task_title = {"sst2": "GLUE SST-2", "qnli": "GLUE QNLI", "qqp": "GLUE QQP", "imdb": "IMDB"}.get(task.name,
                                                                                                     task.name)
    results = [EvalResult(task_type="text-classification", dataset_type=dataset_id or "local", dataset_name=task_title,
                          dataset_config=task.hub_config, dataset_split=eval_split, metric_type=name,
                          metric_value=round(float(metrics[f"eval_{name}"]), 4)) for name in names]
    card_data = ModelCardData(model_name=repo_id.split("/")[-1], base_model=hub_base_model(base_model),
                              library_name="transformers", license="apache-2.0", language="en",
                              tags=["hf-linear-attn", config.model_type, "text-classification"],
                              datasets=[dataset_id] if dataset_id else None, metrics=names,
                              pipeline_tag="text-classification", eval_results=results or None)
    architecture, attention = describe_architecture(config)
    example = '"a gripping, beautifully acted film"' if len(task.text_columns) == 1 else (
        '{"text": "How do I learn Python?", "text_pair": "What is the best way to learn Python?"}')
    card = render_card(
        template, card_data, model_name=repo_id.split("/")[-1], repo_id=repo_id,
        architecture=architecture, attention_description=attention, base_model=base_model, task_title=task_title,
        eval_split=eval_split, eval_samples=metrics.get("eval_samples", "?"), metric_names=" | ".join(names),
        metric_values=" | ".join(f"{100 * metrics[f'eval_{n}']:.2f}" if n in ("accuracy", "f1") else
                                f"{metrics[f'eval_{n}']:.4f}" for n in names), machine=machine,
        example_input=example, command=command, data_description=data_description, truncation_rule=truncation_rule,
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


def check_push_target(repo_id: str, token: str | None) -> str:
    """Before any training: the repo name is valid, a token is there, the Hub answers and accepts it with write
    access. Returns the full repo id (a bare name goes under the token's user). Each failure is a UsageError."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise UsageError(f"--hub_model_id {repo_id!r} is not a valid Hub repo name ({error}); use user/name or a "
                         "bare name with letters, digits, '-', '_' and '.'") from error
    token = token or get_token()
    if not token:
        raise UsageError("--push_to_hub needs a Hub token with write access: pass --hub_token, set HF_TOKEN or run "
                         "`hf auth login` (checked before training, so nothing is lost)")
    try:
        me = HfApi(token=token).whoami()
    except Exception as error:
        raise UsageError(f"--push_to_hub: the Hub does not accept this token or cannot be reached "
                         f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); check the "
                         "token and the network (HF_HUB_OFFLINE=1 blocks the Hub), or leave out --push_to_hub") from error
    role = (me.get("auth") or {}).get("accessToken", {}).get("role")
    if role == "read":
        raise UsageError("--push_to_hub: the token is read-only; create one with write access")
    if "/" not in repo_id:
        repo_id = f"{me['name']}/{repo_id}"
    return repo_id


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
