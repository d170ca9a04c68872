"""Hub uploads for the three scripts: the --push_to_hub flags (`HubArguments`, finetune.py takes TrainingArguments'
own), the target checked before any work (`check_push_target`, `hub_repo_id`) and one upload at the end
(`push_folder`). The cards they upload are model_cards.py's."""

import json
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .errors import UsageError
from .model_cards import write_conversion_card  # noqa: F401  (its old address: conversion/cli.py imports it here)

# never uploaded: Trainer checkpoints, TensorBoard runs, optimizer state, pickled training arguments
PUSH_IGNORE = ["checkpoint-*", "checkpoint-*/**", "runs/**", "*.pt", "*.bin", "*.pkl", ".partial-*"]


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
                commit_message: str = "Upload fine-tuned model, code and model card", ignore: tuple = ()) -> str:
    """Create the Hub repo if needed and upload the checkpoint folder in one commit; returns the commit URL.
    `ignore`: patterns of the folder's own run state (pretraining's checkpoints/) added to PUSH_IGNORE."""
    check_push_folder(folder)
    patterns = [*PUSH_IGNORE, *ignore]
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                                   ignore_patterns=patterns, repo_type="model")
    except Exception as error:  # HTTP, network, quota: the model is saved, say how to upload it later
        excludes = " ".join(f"--exclude {shlex.quote(p)}" for p in patterns)
        raise UsageError(f"the upload to {repo_id} failed ({type(error).__name__}: {error}); the model is saved in "
                         f"{folder}: upload it with `hf upload {repo_id} {shlex.quote(str(folder))} . {excludes}`"
                         ) from error
    return str(getattr(commit, "commit_url", commit))


@dataclass(kw_only=True)
class HubArguments:
    """--push_to_hub and its options under TrainingArguments' names, for pretrain.py and convert.py (finetune.py
    takes TrainingArguments' own). Keyword-only, so the scripts' dataclasses can inherit them after their own
    required fields."""

    push_to_hub: bool = field(default=False, metadata={
        "help": "upload the model, tokenizer and model card to the Hub at the end (token and repo checked first)"})
    hub_model_id: str | None = field(default=None, metadata={
        "help": "user/name, or a bare name (under the token's user); default: the --output_dir folder's name"})
    hub_token: str | None = field(default=None, metadata={
        "help": "a Hub token with write access; default: HF_TOKEN or the `hf auth login` token"})
    hub_private_repo: bool | None = field(default=None, metadata={
        "help": "create the repo private (an existing repo keeps its visibility)"})


HUB_ARGUMENTS = tuple(f.name for f in fields(HubArguments))


def hub_repo_id(args, accelerator=None) -> str | None:
    """The repo --push_to_hub uploads to, checked (name, token, Hub, write access) before any data or model work;
    None without --push_to_hub. With several processes the main process alone asks the Hub and every process
    stops with its answer (one failing alone would leave the others waiting at the next barrier)."""
    if not args.push_to_hub:
        return None
    name = args.hub_model_id
    if not name:
        name = Path(args.output_dir).resolve().name  # Trainer's default: the output folder's name
        try:
            validate_repo_id(name)
        except HFValidationError as error:
            raise UsageError(f"--push_to_hub without --hub_model_id names the repo after the output folder, but "
                             f"{name!r} is not a valid Hub repo name; pass --hub_model_id user/name") from error
    if accelerator is None or accelerator.num_processes == 1:
        return check_push_target(name, args.hub_token)
    from accelerate.utils import broadcast_object_list

    answer = [None]
    if accelerator.is_main_process:
        try:
            answer = [(True, check_push_target(name, args.hub_token))]
        except UsageError as error:
            answer = [(False, str(error))]
    ok, value = broadcast_object_list(answer)[0]
    if not ok:
        raise UsageError(value)
    return value
