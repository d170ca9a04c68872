"""Reproduction presets: read and check a preset (configs/reproduce/*.json), its merged configs, its models and seeds.

Paths in a preset (config files, data files) are relative to the project root: the folder that holds the preset's
`configs/` folder when the preset lies in one, else the working directory; `root` overrides it.
"""

import json
import re
from pathlib import Path

from hf_linear_attn.training.errors import UsageError

TASKS = ("sst2", "imdb", "qnli", "qqp")  # Table 2's column order
TASK_TITLES = {"sst2": "SST-2", "imdb": "IMDB", "qnli": "QNLI", "qqp": "QQP",
               # not tasks of these presets (TASKS): experiments/pretrained's tasks built from WikiText-2, titled
               # here because its fine-tune stages are this module's (stages.finetune_stage names them)
               "cloze_qa": "Cloze QA (WikiText-2)", "next_sentence": "Next sentence (WikiText-2)"}
PRESET_KEYS = {"description", "output_dir", "launcher", "seeds", "pretrain", "encoders",
               "baseline", "finetune", "decoder_pretrain", "decoders", "decoder_baseline", "mask_lstrip",
               "decoder_conversions"}
# A decoder conversion: one of the preset's decoders after its pretraining ("from", the teacher) converted by
# scripts/convert.py with "args" (target, variant, distillation), then, where "train" is given, trained further as a
# whole with the decoders' pretraining recipe and those overrides (LoLCATs' second step, without LoRA).
CONVERSION_KEYS = {"from", "args", "train"}


class ReproductionError(UsageError):
    """A preset, a stage or a result that cannot be used; the message says what to change."""


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _flags(overrides: dict) -> list[str]:
    flags = []
    for key, value in overrides.items():
        flags += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return flags


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ReproductionError(f"cannot read {what} {path}: {error}") from error


def default_root(preset_path) -> Path:
    """The project root of a preset: the folder holding its `configs/` folder (configs/reproduce/NAME.json), else
    the working directory."""
    folder = Path(preset_path).resolve().parent
    return folder.parents[1] if folder.parent.name == "configs" else Path.cwd()


def resolve(path, root) -> Path:
    """A preset's path: absolute, or relative to the project root."""
    return Path(path) if Path(path).is_absolute() else Path(root) / path


def project_root(preset: dict) -> Path:
    """The folder a preset's relative paths are read against (the working directory for a preset built in code)."""
    return Path(preset.get("root") or Path.cwd())


def load_preset(path, root=None) -> dict:
    """Read and check a preset: known keys, existing config files, known tasks, baselines among the models. The
    preset keeps its project root (see `default_root`) under "root": its paths are read against it."""
    preset = _read_json(Path(path), "the preset")
    unknown = sorted(set(preset) - PRESET_KEYS)
    if unknown:
        raise ReproductionError(f"{path}: unknown keys {unknown}; a preset has {sorted(PRESET_KEYS)}")
    preset["root"] = str(Path(root).resolve() if root else default_root(path))
    for part, models, baseline in (("pretrain", "encoders", "baseline"),
                                   ("decoder_pretrain", "decoders", "decoder_baseline")):
        if not preset.get(models):
            continue
        if part not in preset:
            raise ReproductionError(f"{path}: '{models}' needs a '{part}' entry (its pretraining config)")
        if preset.get(baseline) not in preset[models]:
            raise ReproductionError(f"{path}: '{baseline}' must name one of the {models}: {list(preset[models])}")
        files = [preset[part]["config"], *preset[models].values()]
        if models == "encoders":
            unknown_tasks = sorted(set(preset.get("finetune", {})) - set(TASKS))
            if unknown_tasks or not preset.get("finetune"):
                raise ReproductionError(f"{path}: 'finetune' needs tasks among {list(TASKS)} (got "
                                        f"{unknown_tasks or 'none'})")
            files += [entry["config"] for entry in preset["finetune"].values()]
        for file in files:
            if not resolve(file, preset["root"]).is_file():
                raise ReproductionError(f"{path}: config file {file} does not exist")
    if not preset.get("encoders") and not preset.get("decoders"):
        raise ReproductionError(f"{path}: nothing to run: give 'encoders' and/or 'decoders'")
    for where, entry in [("the preset", preset), *((f"finetune '{task}'", entry)
                                                  for task, entry in preset.get("finetune", {}).items())]:
        seeds = entry.get("seeds")
        if seeds is not None and (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
                                  or not all(isinstance(seed, int) for seed in seeds)):
            raise ReproductionError(f"{path}: 'seeds' of {where} must be a non-empty list of distinct integers "
                                    f"(got {seeds!r})")
    if not isinstance(preset.get("mask_lstrip", True), bool):
        raise ReproductionError(f"{path}: 'mask_lstrip' must be true or false (got {preset['mask_lstrip']!r}): "
                                "false keeps the shared tokenizer's <mask> without RoBERTa's lstrip, as recorded "
                                "runs were made")
    for name, entry in preset.get("decoder_conversions", {}).items():
        unknown = sorted(set(entry) - CONVERSION_KEYS) if isinstance(entry, dict) else ["(not an object)"]
        if unknown or entry.get("from") not in preset.get("decoders", {}) or not isinstance(entry.get("args"), dict):
            extra = f"; unknown keys {unknown}" if unknown else ""
            raise ReproductionError(
                f"{path}: decoder conversion '{name}' needs \"from\" (one of the decoders: "
                f"{list(preset.get('decoders', {}))}) and \"args\" (scripts/convert.py's, e.g. "
                f"{{\"target\": \"linear_gpt2\"}}), optionally \"train\"{extra}")
        if name in preset.get("decoders", {}) or "model_name_or_path" in entry["args"] or "output_dir" in entry["args"]:
            raise ReproductionError(f"{path}: decoder conversion '{name}': its name must differ from the decoders' and "
                                    "its args must not set model_name_or_path / output_dir (the stage sets them)")
    if len({slug(name) for name in preset.get("encoders", {})}) != len(preset.get("encoders", {})):
        raise ReproductionError(f"{path}: two encoder names give the same folder name")
    return preset


DATA_PATH_KEYS = ("train_file", "validation_file")


def _merged_config(entry: dict, root) -> dict:
    """A preset entry's config file with its overrides; data paths resolved against the project root, where
    the stages' subprocesses run, so that the run's own reads (tokenizer corpus, majority class) find the same
    files from any working directory."""
    merged = {**_read_json(resolve(entry["config"], root), "the config"), **entry.get("args", {})}
    return {key: str(resolve(value, root)) if key in DATA_PATH_KEYS and isinstance(value, str) else value
            for key, value in merged.items()}


def select_models(preset: dict, names: list[str] | None) -> dict:
    """The preset restricted to the named encoders / decoders (None: all of them). A group's baseline stays in
    whenever one of its models is named, since every row of the table is read against it; a group with none named
    is left out."""
    if not names:
        return preset
    conversions = preset.get("decoder_conversions", {})
    known = [*preset.get("encoders", {}), *preset.get("decoders", {}), *conversions]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ReproductionError(f"--models: {unknown} are not models of this preset; it has {known}")
    selected = dict(preset)
    # a named conversion brings the decoder it converts; a named decoder no conversion
    names = [*names, *(conversions[name]["from"] for name in names if name in conversions)]
    chosen_conversions = {name: entry for name, entry in conversions.items() if name in names}
    if chosen_conversions:
        selected["decoder_conversions"] = chosen_conversions
    else:
        selected.pop("decoder_conversions", None)
    for models, baseline in (("encoders", "baseline"), ("decoders", "decoder_baseline")):
        chosen = {name: config for name, config in preset.get(models, {}).items()
                  if name in names or (name == preset.get(baseline) and set(names) & set(preset[models]))}
        if chosen:
            selected[models] = chosen
        else:
            selected.pop(models, None)
    return selected


def finetune_seeds(preset: dict, seeds: list[int] | None = None) -> dict[str, list[int]]:
    """The fine-tuning seeds of each task: `seeds` (the command line's --seeds) for every task where given, else
    the task's own "seeds" (more seeds where one run is too noisy to read), else the preset's, else [42]."""
    if seeds and len(set(seeds)) != len(seeds):
        raise ReproductionError(f"--seeds must be distinct (got {list(seeds)}): a repeated seed names the same run")
    return {task: list(seeds or entry.get("seeds") or preset.get("seeds") or [42])
            for task, entry in preset.get("finetune", {}).items()}
