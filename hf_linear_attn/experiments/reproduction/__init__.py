"""The Linformer paper's Table 2 comparison, reproduced end to end at a chosen scale (scripts/reproduce.py).

A preset (configs/reproduce/*.json) names the encoders and decoders to compare, the pretraining and fine-tuning
configs they share, and per-preset overrides. The run is a list of stages, each an ordinary subprocess of
scripts/pretrain.py or scripts/finetune.py (under `python` or `accelerate launch`) writing its own folder:

    tokenizer-mlm/, tokenizer-clm/     one byte-level BPE per objective, trained once, shared by every model
    pretrain/<model>/                  masked-LM pretraining of each encoder (identical data, steps, seed)
    finetune/<model>/<task>-seed<S>/   each pretrained encoder fine-tuned on SST-2, IMDB, QNLI, QQP
    decoders/<model>/                  causal-LM pretraining of each decoder (validation perplexity)
    logs/<stage>.log                   each stage's full output
    results.json, results.md, results.png

A stage whose folder holds its finished result (train_results.json / eval_results.json) and a stage.json with the
same arguments and inputs (a digest of the config files, models and tokenizer it read) is reused, so a rerun only
does what is missing; a finished stage run with other arguments or inputs is an error, never silently mixed into the
table. An interrupted pretraining resumes from its newest checkpoint.
"""

import hashlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hf_linear_attn.experiments.benchmarks import describe_machine
from hf_linear_attn.training.errors import UsageError
from hf_linear_attn.training.data import get_task, load_task_data, load_text_corpus, train_bpe_tokenizer

REPO = Path(__file__).resolve().parents[3]
TASKS = ("sst2", "imdb", "qnli", "qqp")  # Table 2's column order
TASK_TITLES = {"sst2": "SST-2", "imdb": "IMDB", "qnli": "QNLI", "qqp": "QQP"}
# Linformer paper (Wang et al. 2020), Table 2: dev accuracy (%), RoBERTa-base size, n = 512, 250k pretraining updates
# on BookCorpus + Wikipedia. Only the figures checked against the paper are listed (see ../shared/DESIGN.md).
PAPER_TABLE2 = {
    "RoBERTa-base (Liu et al. 2019)": {"sst2": 93.1, "imdb": 94.1, "qnli": 90.9, "qqp": 90.9, "average": 92.25},
    "Linformer k = 128": {"average": 91.75},
    "Linformer k = 256, shared kv, layerwise": {"average": 92.30},
}
PRESET_KEYS = {"description", "output_dir", "launcher", "seeds", "pretrain", "encoders",
               "baseline", "finetune", "decoder_pretrain", "decoders", "decoder_baseline"}


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


def _repo_path(path: str) -> Path:
    """Paths in presets are relative to the repository root (as in configs/*), or absolute."""
    return Path(path) if Path(path).is_absolute() else REPO / path


def load_preset(path) -> dict:
    """Read and check a preset: known keys, existing config files, known tasks, baselines among the models."""
    preset = _read_json(Path(path), "the preset")
    unknown = sorted(set(preset) - PRESET_KEYS)
    if unknown:
        raise ReproductionError(f"{path}: unknown keys {unknown}; a preset has {sorted(PRESET_KEYS)}")
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
            if not _repo_path(file).is_file():
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
    if len({slug(name) for name in preset.get("encoders", {})}) != len(preset.get("encoders", {})):
        raise ReproductionError(f"{path}: two encoder names give the same folder name")
    return preset


@dataclass
class Stage:
    """One subprocess of the reproduction: `script` with `argv`, finished when `folder / marker` exists."""

    name: str
    script: str
    folder: Path
    argv: list[str]
    marker: str
    root: Path
    info: dict = field(default_factory=dict)

    @property
    def record_path(self) -> Path:
        return self.folder / "stage.json"

    def log_file(self, suffix: str) -> Path:
        """logs/<stage><suffix>: its output (.log), the seconds its launches took (.seconds), and the record of a
        launched stage until it has finished (.pending.json; the stage's own folder must stay empty for its script)."""
        return self.root / "logs" / f"{slug(self.name)}{suffix}"

    @property
    def pending_path(self) -> Path:
        return self.log_file(".pending.json")

    def portable(self, argv: list[str], root: str | None = None) -> list[str]:
        """argv with the run's output folder written as $OUTPUT_DIR: a moved results folder is still reused."""
        root = str(root or self.root)
        return [arg.replace(root, "$OUTPUT_DIR") for arg in argv]

    def inputs(self, known: dict[str, str] | None = None) -> dict[str, str]:
        """A digest of every file the arguments name, keyed by the portable argument: config files, and the
        weights and tokenizer of a model / tokenizer folder. A config edited in place or an upstream model trained
        again changes it, so the stage is no longer taken as finished. `known` gives the digest of model folders
        that this run knows only from the records of an earlier one (portable folder -> digest)."""
        digests = {}
        for arg, key in zip(self.argv, self.portable(self.argv)):
            path = _repo_path(arg)
            if arg.startswith("--") or path == self.folder:
                continue
            if known and key in known and not any(path.glob("*.safetensors")):
                digests[key] = known[key]
            elif path.is_file() or path.is_dir():
                digests[key] = folder_digest(path)
        return digests

    @property
    def key(self) -> str:
        """The stage's folder as a portable path: its name in a records file."""
        return self.portable([str(self.folder)])[0]

    def recorded(self, records: dict, known: dict[str, str]) -> dict | None:
        """This stage's record among the records of an earlier run when it ran with this run's arguments and
        inputs (None otherwise: the stage then runs here)."""
        record = records.get(self.key)
        if record is None or "result" not in record:
            return None
        if self.portable(record.get("argv", []), record.get("output_dir")) != self.portable(self.argv):
            return None
        return record if record.get("inputs") == self.inputs(known) else None

    def finished(self) -> dict | None:
        """The stage's record when it has finished with these arguments and inputs; an error when with others."""
        if not (self.folder / self.marker).is_file():
            return None
        if not self.record_path.is_file():
            self.adopt()
        record = _read_json(self.record_path, "the stage record")
        if self.portable(record.get("argv", []), record.get("output_dir")) != self.portable(self.argv):
            raise ReproductionError(
                f"{self.folder} holds a finished run with other arguments than this preset's stage '{self.name}' "
                f"(recorded: {shlex.join(record.get('argv', ['<none>']))}; now: {shlex.join(self.argv)}); remove "
                "the folder to rerun it, or use another --output_dir")
        recorded = record.get("inputs", {})  # records written before inputs were kept have none
        now = self.inputs() if recorded else {}
        changed = sorted(key for key, digest in recorded.items() if now.get(key) != digest)
        if changed:
            raise ReproductionError(
                f"{self.folder} holds a finished run of stage '{self.name}' whose inputs have changed since: "
                f"{', '.join(changed)} (a config edited, or an upstream model trained again); remove the folder "
                "(and those of the stages that use it) to rerun it, or use another --output_dir")
        return record

    def adopt(self) -> None:
        """Write stage.json for a result that this stage's script wrote but the run never recorded (the run was
        stopped between the two, or the script failed after writing it), from the record kept when it was launched.
        Without one nothing says what arguments made the result: an error."""
        pending = _read_json(self.pending_path, "the launch record") if self.pending_path.is_file() else None
        if pending is None or self.portable(pending["argv"], pending["output_dir"]) != self.portable(self.argv):
            raise ReproductionError(
                f"{self.folder} holds a result ({self.marker}) but no record of the stage that wrote it (stage.json), "
                f"and no launch record of stage '{self.name}' with these arguments; remove the folder to rerun the "
                "stage, or use another --output_dir")
        spent = self.log_file(".seconds")  # written when the launch ended
        done = (self.folder / self.marker).stat().st_mtime
        seconds = float(spent.read_text()) if spent.is_file() else done - self.pending_path.stat().st_mtime
        pending.update(seconds=round(seconds, 1), finished=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(done)))
        _write_json(self.record_path, with_outcome(self, pending))
        self.pending_path.unlink()


def _write_json(path: Path, data: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2))
    partial.replace(path)


def folder_digest(path: Path) -> str:
    """sha256 (16 hex digits) of a file, or of a model folder's weights and tokenizer (in chunks: a paper-size
    checkpoint is hundreds of MB)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) + sorted(path.glob("tokenizer.json"))
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


DATA_PATH_KEYS = ("train_file", "validation_file")


def _merged_config(entry: dict) -> dict:
    """A preset entry's config file with its overrides; data paths resolved against the repository root, where
    the stages' subprocesses run, so that the run's own reads (tokenizer corpus, majority class) find the same
    files from any working directory."""
    merged = {**_read_json(_repo_path(entry["config"]), "the config"), **entry.get("args", {})}
    return {key: str(_repo_path(value)) if key in DATA_PATH_KEYS and isinstance(value, str) else value
            for key, value in merged.items()}


def shared_tokenizers(preset: dict, output_dir: Path, train: bool) -> dict:
    """{"mlm": folder, "clm": folder} for each objective whose config names no tokenizer: a byte-level BPE trained
    once on that config's corpus (when `train`), shared by every model of the objective. Configs that name a
    tokenizer (the paper preset: RoBERTa's / GPT-2's) pass it themselves."""
    tokenizers = {}
    for key, part, models, style in (("mlm", "pretrain", "encoders", "roberta"),
                                     ("clm", "decoder_pretrain", "decoders", "gpt2")):
        if not preset.get(models):
            continue
        merged = _merged_config(preset[part])
        if merged.get("tokenizer_name_or_path"):
            continue
        folder = output_dir / f"tokenizer-{key}"
        tokenizers[key] = str(folder)
        if not train or (folder / "tokenizer.json").is_file():
            continue
        corpus, _ = load_text_corpus(merged.get("dataset_name"), merged.get("dataset_config_name"),
                                     merged.get("train_file"), merged.get("validation_file"),
                                     merged.get("text_column", "text"),
                                     merged.get("validation_split_percentage", 5.0), merged.get("seed", 42))
        tokenizer = train_bpe_tokenizer(corpus["train"]["text"], merged.get("tokenizer_vocab_size", 8000), style,
                                        merged.get("max_seq_length", 128))
        partial = folder.with_name(folder.name + ".partial")
        tokenizer.save_pretrained(partial)
        partial.replace(folder)
    return tokenizers


def select_models(preset: dict, names: list[str] | None) -> dict:
    """The preset restricted to the named encoders / decoders (None: all of them). A group's baseline stays in
    whenever one of its models is named, since every row of the table is read against it; a group with none named
    is left out."""
    if not names:
        return preset
    known = [*preset.get("encoders", {}), *preset.get("decoders", {})]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ReproductionError(f"--models: {unknown} are not models of this preset; it has {known}")
    selected = dict(preset)
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


def plan(preset: dict, output_dir: Path, seeds: list[int] | None = None,
         tokenizers: dict | None = None) -> list[Stage]:
    """Every stage of the preset, in running order (each encoder's pretraining before its fine-tunes); `seeds`,
    where given, replaces every task's fine-tuning seeds."""
    tokenizers = tokenizers or {}
    task_seeds = finetune_seeds(preset, seeds)
    stages = []
    for name, model_config in preset.get("encoders", {}).items():
        folder = output_dir / "pretrain" / slug(name)
        argv = ["--config", preset["pretrain"]["config"], "--model_config", model_config, "--output_dir", str(folder),
                *(["--tokenizer_name_or_path", tokenizers["mlm"]] if "mlm" in tokenizers else []),
                *_flags(preset["pretrain"].get("args", {}))]
        stages.append(Stage(f"pretrain {name}", "scripts/pretrain.py", folder, argv, "train_results.json",
                            output_dir, {"kind": "pretrain", "model": name}))
        for task, entry in preset["finetune"].items():
            for seed in task_seeds[task]:
                tuned = output_dir / "finetune" / slug(name) / f"{task}-seed{seed}"
                argv = ["--config", entry["config"], "--model_name_or_path", str(folder), "--output_dir", str(tuned),
                        "--seed", str(seed), *_flags(entry.get("args", {}))]
                stages.append(Stage(f"fine-tune {name} on {TASK_TITLES[task]} (seed {seed})", "scripts/finetune.py",
                                    tuned, argv, "eval_results.json", output_dir,
                                    {"kind": "finetune", "model": name, "task": task, "seed": seed}))
    for name, model_config in preset.get("decoders", {}).items():
        folder = output_dir / "decoders" / slug(name)
        argv = ["--config", preset["decoder_pretrain"]["config"], "--model_config", model_config,
                "--output_dir", str(folder),
                *(["--tokenizer_name_or_path", tokenizers["clm"]] if "clm" in tokenizers else []),
                *_flags(preset["decoder_pretrain"].get("args", {}))]
        stages.append(Stage(f"pretrain decoder {name}", "scripts/pretrain.py", folder, argv, "train_results.json",
                            output_dir, {"kind": "decoder", "model": name}))
    return stages


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").replace("\r", "\n").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_stage(stage: Stage, launcher: list[str]) -> tuple[dict, bool]:
    """Run the stage unless it has finished with the same arguments; returns (its record, whether it was reused)."""
    record = stage.finished()
    if record is not None:
        return record, True
    inputs = stage.inputs()
    extra = []
    if stage.folder.exists() and any(stage.folder.iterdir()):  # an interrupted run of this stage
        checkpoints = stage.folder / "checkpoints"
        resumable = stage.script.endswith("pretrain.py") and checkpoints.is_dir() and any(
            p.name.startswith("step_") for p in checkpoints.iterdir())
        extra = ["--resume"] if resumable else ["--overwrite_output_dir"]
    command = [*launcher, str(REPO / stage.script), *stage.argv, *extra]
    log = stage.log_file(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    # seconds of earlier, interrupted attempts that this one resumes count towards the stage's wall time
    spent_file = stage.log_file(".seconds")
    earlier = float(spent_file.read_text()) if "--resume" in extra and spent_file.is_file() else 0.0
    record = {"argv": stage.argv, "inputs": inputs, "output_dir": str(stage.root), "resumed": "--resume" in extra,
              "command": shlex.join(command), "machine": describe_machine()}
    _write_json(stage.pending_path, record)  # what a result found here without stage.json was made with
    started = time.perf_counter()
    try:
        with open(log, "a") as handle:
            handle.write(f"$ {shlex.join(command)}\n")
            handle.flush()
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
            code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    finally:  # also when interrupted (Ctrl-C, SIGTERM): the child is stopped and the time spent kept
        seconds = earlier + time.perf_counter() - started
        spent_file.write_text(f"{seconds:.1f}")
    if code != 0 or not (stage.folder / stage.marker).is_file():
        raise ReproductionError(f"stage '{stage.name}' failed (exit status {code}); the end of {log}:\n{_tail(log)}\n"
                                "Fix the cause and rerun the same command: finished stages are reused.")
    record = with_outcome(stage, {**record, "seconds": round(seconds, 1),
                                  "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    _write_json(stage.record_path, record)
    stage.pending_path.unlink(missing_ok=True)
    return record, False


def with_outcome(stage: Stage, record: dict) -> dict:
    """The record with what the stage produced, read from its folder where the record lacks it: the result file's
    metrics, and for a pretraining the digest of the weights it wrote and their parameter count. With these a
    records file stands for the stage in a run that does not have its folder."""
    record = dict(record)
    if "result" not in record:
        record["result"] = _read_json(stage.folder / stage.marker, "the stage's results")
    if stage.script.endswith("pretrain.py") and "output_digest" not in record:
        record["output_digest"] = folder_digest(stage.folder)
        record["parameters"] = count_parameters(stage.folder)
    return record


def load_records(path) -> dict:
    """{stage key: record} from a records.json that a run wrote (see `write_records`)."""
    records = _read_json(Path(path), "the records file")
    if not isinstance(records, dict) or not isinstance(records.get("stages"), dict):
        raise ReproductionError(f"{path} is not a records file of scripts/reproduce.py (no 'stages' mapping)")
    return records["stages"]


def write_records(stages: list[Stage], records: dict, output_dir: Path, carried: dict | None = None) -> Path:
    """output_dir/records.json: the record of every finished stage with its outcome (a few KB a stage, no weights).
    Committed beside a results table, it lets a later run on a machine without these folders take the finished
    stages from it (`--records`) instead of running them again. `carried` ({stage key: record}) are the records of
    the preset's stages outside this run (a --models run) that earlier runs left: they are kept, not dropped."""
    path = output_dir / "records.json"
    stages_out = {**(carried or {}), **{stage.key: records[stage.name] for stage in stages if stage.name in records}}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"stages": stages_out}, indent=1))
    partial.replace(path)
    return path


def count_parameters(folder: Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (tied weights are stored, and counted, once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for key in weights.keys():
                count = 1
                for size in weights.get_slice(key).get_shape():
                    count *= size
                total += count
    return total


def majority_share(entry: dict, seed: int) -> tuple[float, int]:
    """Share of the most frequent label in the evaluation rows a fine-tune of `entry` scores on, and their number."""
    merged = _merged_config(entry)
    task = get_task(merged["task_name"])
    data, _ = load_task_data(task, merged.get("dataset_name"), merged.get("dataset_config_name"),
                             merged.get("train_file"), merged.get("validation_file"),
                             merged.get("validation_split_percentage", 10.0), seed)
    rows = data["validation"]
    if merged.get("max_eval_samples") is not None:
        rows = rows.select(range(min(int(merged["max_eval_samples"]), len(rows))))
    labels = list(rows["label"])
    return max(labels.count(value) for value in set(labels)) / len(labels), len(labels)


def _accuracy(metrics: dict) -> float:
    for key in ("eval_accuracy", "accuracy"):
        if key in metrics:
            return 100.0 * metrics[key]
    raise ReproductionError(f"no accuracy among the fine-tune's metrics {sorted(metrics)}")


def collect(preset: dict, stages: list[Stage], records: dict) -> dict:
    """The results of every finished stage (missing ones stay None): the table's numbers, seeds and wall times.
    A task's accuracy is the mean over its seeds, once every planned seed has finished."""
    results = {"encoders": {}, "decoders": {}, "tasks": {}}
    planned = Counter((s.info["model"], s.info["task"]) for s in stages if s.info["kind"] == "finetune")
    splits = {}
    for stage in stages:
        record = records.get(stage.name)
        kind, model = stage.info["kind"], stage.info["model"]
        if kind in ("pretrain", "decoder"):
            group = results["encoders" if kind == "pretrain" else "decoders"]
            entry = group.setdefault(model, {"tasks": {}} if kind == "pretrain" else {})
            if record is None:
                entry["pretrain"] = None
                continue
            train = record["result"]
            entry["pretrain"] = {"perplexity": train.get("perplexity"), "eval_loss": train.get("eval_loss"),
                                 "steps": train.get("steps"), "validation": train.get("validation"),
                                 "parameters": record["parameters"], "seconds": record["seconds"],
                                 "folder": str(stage.folder)}
        else:
            task = stage.info["task"]
            runs = results["encoders"][model]["tasks"].setdefault(task, {"per_seed": {}})
            if record is None:
                continue
            metrics = record["result"]
            runs["per_seed"][str(stage.info["seed"])] = {
                "accuracy": _accuracy(metrics), "f1": 100.0 * metrics["eval_f1"] if "eval_f1" in metrics else None,
                "seconds": record["seconds"]}
            results["tasks"][task] = {"split": metrics.get("eval_split"), "eval_samples": metrics.get("eval_samples"),
                                      "train_samples": metrics.get("train_samples")}
            splits.setdefault(task, {})[metrics.get("eval_split")] = stage.info["seed"]
    for task, names in splits.items():  # rows held out with the seed: one split per seed, the same for every model
        if len(names) > 1:
            results["tasks"][task]["split"] = re.sub(r"\(seed \d+\)", "(a split per fine-tuning seed: "
                                                     + ", ".join(map(str, names.values())) + ")", next(iter(names)))
    for model, entry in results["encoders"].items():
        for task, runs in entry["tasks"].items():
            values = [run["accuracy"] for run in runs["per_seed"].values()]
            runs["accuracy"] = statistics.fmean(values) if len(values) == planned[model, task] else None
            runs["std"] = statistics.stdev(values) if len(values) > 1 and runs["accuracy"] is not None else None
        scores = [entry["tasks"].get(task, {}).get("accuracy") for task in preset["finetune"]]
        entry["average"] = statistics.fmean(scores) if scores and None not in scores else None
        finished = [run["seconds"] for runs in entry["tasks"].values() for run in runs["per_seed"].values()]
        entry["seconds"] = (entry["pretrain"] or {}).get("seconds", 0) + sum(finished)
    baseline = results["encoders"].get(preset.get("baseline"), {}).get("average")
    for entry in results["encoders"].values():
        entry["vs_baseline"] = (entry["average"] - baseline
                                if entry.get("average") is not None and baseline is not None else None)
    base_ppl = ((results["decoders"].get(preset.get("decoder_baseline")) or {}).get("pretrain") or {}).get("perplexity")
    for entry in results["decoders"].values():
        ppl = (entry.get("pretrain") or {}).get("perplexity")
        entry["vs_baseline"] = ppl / base_ppl if ppl is not None and base_ppl else None
    return results


def _cell(value, digits=1, suffix="", sign="") -> str:
    return "pending" if value is None else f"{value:{sign}.{digits}f}{suffix}"


def _minutes(seconds) -> str:
    return "pending" if not seconds else f"{seconds / 60:.1f} min"


SPLIT_NAMES = {
    "sst2": "official dev set", "qnli": "official dev set (fine-tuned on a real ~10% train subset)",
    "qqp": "QQP (train subset): 3,000 real train rows held apart (the official dev set is not offline)",
    "imdb": "IMDB has no test split offline: rows of train held out with the seed",
}


def describe_seeds(seeds: dict[str, list[int]]) -> str:
    """'42, 1, 2 (IMDB, QQP); 42 (SST-2, QNLI)', or '42' where every task has the same seeds."""
    groups = {}
    for task, values in seeds.items():
        groups.setdefault(", ".join(map(str, values)), []).append(TASK_TITLES[task])
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{values} ({', '.join(tasks)})" for values, tasks in groups.items())


def describe_machines(meta: dict) -> str:
    """This machine, or every machine the stages ran on where some came from the records of another."""
    machines = meta.get("stage_machines") or [meta["machine"]]
    return machines[0] if len(machines) == 1 else "the stages ran on " + "; ".join(machines)


def render_markdown(preset_name: str, preset: dict, results: dict, meta: dict) -> str:
    tasks = list(preset.get("finetune", {}))
    lines = [f"# Reproduction: preset `{preset_name}`", "", preset.get("description", ""), "",
             f"Command: `{meta['command']}`  ", f"Machine: {describe_machines(meta)}  ",
             f"Seeds (fine-tuning): {describe_seeds(meta['seeds'])}; pretraining seed: {meta['pretrain_seed']}  ",
             f"Wall time of the stages: {_minutes(meta['seconds'])} ({meta['stages_done']}/{meta['stages']} stages "
             "finished)", ""]
    if results["encoders"]:
        title = " | ".join(TASK_TITLES[t] for t in tasks)
        lines += ["## Encoders: accuracy (%) after fine-tuning, in the shape of the Linformer paper's Table 2", "",
                  f"| Model | params | pretrain val MLM ppl | {title} | Average | vs baseline | wall time |",
                  "|---|---:|---:|" + "---:|" * len(tasks) + "---:|---:|---:|"]
        majority = meta.get("majority", {})
        if majority:
            shares = [majority[t]["share"] * 100 for t in tasks]
            lines.append("| majority class | | | " + " | ".join(f"{s:.1f}" for s in shares)
                         + f" | {statistics.fmean(shares):.1f} | | |")
        for model, entry in results["encoders"].items():
            pre = entry.get("pretrain") or {}
            cells = []
            for task in tasks:
                runs = entry["tasks"].get(task, {})
                cell = _cell(runs.get("accuracy"))
                if runs.get("std") is not None:
                    cell += f" ± {runs['std']:.1f}"
                cells.append(cell)
            delta = entry.get("vs_baseline")
            lines.append(f"| {model} | {_cell(pre.get('parameters') and pre['parameters'] / 1e6, 2, ' M')} | "
                         f"{_cell(pre.get('perplexity'))} | "
                         + " | ".join(cells) + f" | {_cell(entry.get('average'), 2)} | "
                         + ("baseline" if model == preset["baseline"] else _cell(delta, 2, " pt", sign="+"))
                         + f" | {_minutes(entry.get('seconds'))} |")
        lines += ["", "Paper (Table 2: RoBERTa-base size, n = 512, 250k pretraining updates on BookCorpus + Wikipedia, "
                  "dev accuracy; cells not listed are in the paper):", "",
                  "| Paper model | SST-2 | IMDB | QNLI | QQP | Average |", "|---|---:|---:|---:|---:|---:|"]
        for model, row in PAPER_TABLE2.items():
            lines.append(f"| {model} | " + " | ".join(f"{row[t]:.1f}" if t in row else "" for t in TASKS)
                         + f" | {row['average']:.2f} |")
        lines += ["", "Evaluation rows:", ""]
        for task in tasks:
            info = results["tasks"].get(task, {})
            lines.append(f"- {TASK_TITLES[task]}: {SPLIT_NAMES[task]}; evaluated on "
                         f"{info.get('eval_samples', '?')} rows ({info.get('split', '?')}), trained on "
                         f"{info.get('train_samples', '?')} rows")
        lines.append("")
    if results["decoders"]:
        lines += ["## Decoders: causal-LM perplexity on WikiText-2 validation (same size, data, steps and seed)", "",
                  "| Model | params | val perplexity | vs baseline | wall time |", "|---|---:|---:|---:|---:|"]
        for model, entry in results["decoders"].items():
            pre = entry.get("pretrain") or {}
            ratio = ("baseline" if model == preset["decoder_baseline"] else _cell(entry.get("vs_baseline"), 3, "x"))
            lines.append(f"| {model} | {_cell(pre.get('parameters') and pre['parameters'] / 1e6, 2, ' M')} | "
                         f"{_cell(pre.get('perplexity'), 2)} | "
                         f"{ratio} | {_minutes(pre.get('seconds'))} |")
        lines.append("")
    return "\n".join(lines)


def plot(preset: dict, results: dict, meta: dict, path: Path) -> bool:
    """Grouped bars: accuracy per task and model (majority class dashed), and decoder perplexities."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    panels = [bool(results["encoders"]), bool(results["decoders"])]
    figure, axes = plt.subplots(1, sum(panels), figsize=(6 * sum(panels) + 2, 4.5), squeeze=False)
    axes = list(axes[0])
    if results["encoders"]:
        axis = axes.pop(0)
        columns = [*preset["finetune"], "average"]
        width = 0.8 / len(results["encoders"])
        for i, (model, entry) in enumerate(results["encoders"].items()):
            values = [entry["tasks"].get(t, {}).get("accuracy") or 0 for t in preset["finetune"]]
            values.append(entry.get("average") or 0)
            axis.bar([c + i * width for c in range(len(columns))], values, width, label=model)
        for c, task in enumerate(preset["finetune"]):
            share = meta.get("majority", {}).get(task, {}).get("share")
            if share:
                axis.hlines(share * 100, c - 0.1, c + 0.9, colors="black", linestyles="dashed")
        axis.set_xticks([c + 0.4 - width / 2 for c in range(len(columns))],
                        [TASK_TITLES.get(c, "Average") for c in columns])
        axis.set_ylim(40, 100)
        axis.set_ylabel("accuracy (%) (dashed: majority class)")
        axis.legend(fontsize=7, loc="upper right")
        axis.set_title("Fine-tuned encoders")
    if results["decoders"]:
        axis = axes.pop(0)
        names = list(results["decoders"])
        values = [((results["decoders"][n].get("pretrain") or {}).get("perplexity") or 0) for n in names]
        axis.bar(range(len(names)), values, color="tab:gray")
        axis.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
        axis.set_ylabel("validation perplexity (lower is better)")
        axis.set_title("Decoders, WikiText-2")
    figure.suptitle(f"{meta['preset']} preset — {meta['machine']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def run_stages(stages: list[Stage], launcher: list[str], output_dir: Path, archive: dict,
               report_only: bool = False, carried: dict | None = None) -> dict:
    """Run every stage that has not finished, in order; returns {stage name: record with outcome}.

    A stage is taken, not run, when its folder here holds a finished run with the same arguments and inputs, or
    when `archive` (the records.json of an earlier run) holds one. A pretraining taken from the archive has no
    weights here: its recorded weight digest stands for them in the inputs of its fine-tunes, and it runs here
    only when a fine-tune of it has to; its new weights must then have that digest, or the fine-tunes taken from
    the archive would not have started from them."""
    records, known, vouched = {}, {}, set()  # known: folder key -> digest of weights known only from the archive
    by_folder = {str(stage.folder): stage for stage in stages}
    for number, stage in enumerate(stages, 1):
        if not report_only:
            print(f"[{number}/{len(stages)}] {stage.name} ...", flush=True)
        record, source = stage.finished(), "reused"
        if record is None and archive:
            record, source = stage.recorded(archive, known), "from records"
            if record is not None:
                vouched.update(key for key in record["inputs"] if key in known)
        if record is not None:
            record = with_outcome(stage, record) if source == "reused" else record
        elif report_only:
            continue
        else:
            for upstream in [by_folder[arg] for arg in stage.argv if by_folder.get(arg) is not None]:
                if upstream.key not in known:
                    continue
                print(f"    first {upstream.name}, known here only from the records ...", flush=True)
                rerun, _ = run_stage(upstream, launcher)  # a new record has its outcome
                if upstream.key in vouched and rerun["output_digest"] != known[upstream.key]:
                    raise ReproductionError(
                        f"'{upstream.name}' ran again here and wrote other weights than in the records (digest "
                        f"{rerun['output_digest']}, recorded {known[upstream.key]}), so the fine-tunes taken from the "
                        "records did not start from these weights; rerun without --records, or on the machine kind "
                        "the records name")
                records[upstream.name] = rerun
                del known[upstream.key]
            record, source = run_stage(stage, launcher)[0], "done"
        if source == "from records" and "output_digest" in record:
            known[stage.key] = record["output_digest"]
        records[stage.name] = record
        if not report_only:
            print(f"    {source} ({record['seconds']:.0f} s)", flush=True)
            write_records(stages, records, output_dir, carried)
    return records


def reproduce(preset_path, output_dir=None, seeds=None, launcher=None, dry_run=False, report_only=False,
              argv=None, models=None, records_file=None) -> dict:
    """Run (or reuse) every stage of the preset (or of the `models` named, with their baselines), taking finished
    stages from `records_file` (an earlier run's records.json) where they match, then write results.json /
    results.md / results.png and records.json."""
    full_preset = load_preset(preset_path)
    preset = select_models(full_preset, models)
    preset_name = Path(preset_path).stem
    output_dir = Path(output_dir or preset.get("output_dir") or f"outputs/reproduce/{preset_name}")
    output_dir = output_dir if output_dir.is_absolute() else Path.cwd() / output_dir
    seeds = list(seeds) if seeds else None  # None: each task's seeds from the preset
    launcher_text = launcher or preset.get("launcher", "python")
    launcher = [sys.executable] if launcher_text == "python" else shlex.split(launcher_text)
    pretrain_seed = _merged_config(preset["pretrain"]).get("seed", 42) if "pretrain" in preset else None

    if dry_run:
        for stage in plan(preset, output_dir, seeds, shared_tokenizers(preset, output_dir, train=False)):
            print(shlex.join([*launcher, stage.script, *stage.argv]))
        return {}

    archive = load_records(records_file) if records_file else {}  # read before anything is written
    earlier = load_records(output_dir / "records.json") if (output_dir / "records.json").is_file() else {}
    output_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM stops the run like Ctrl-C: the running stage's child is stopped and its time so far recorded
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("reproduction stopped (SIGTERM); rerun to continue"))
    # with records, the tokenizers are trained even for a report: the records' inputs are checked against them
    tokenizers = shared_tokenizers(preset, output_dir, train=not report_only or records_file is not None)
    stages = plan(preset, output_dir, seeds, tokenizers)
    # records of the preset's other stages (outside --models) are kept: from this folder's records.json, else
    # from --records, so that running the models one group at a time never loses what the others finished
    planned = {stage.key for stage in stages}
    others = {stage.key for stage in plan(full_preset, output_dir, seeds, tokenizers)} - planned
    carried = {key: record for key, record in {**archive, **earlier}.items() if key in others}
    records = run_stages(stages, launcher, output_dir, archive, report_only, carried)

    results = collect(preset, stages, records)
    task_seeds = finetune_seeds(preset, seeds)
    majority = {}
    for task, entry in preset.get("finetune", {}).items():
        shares = [majority_share(entry, seed) for seed in task_seeds[task]]  # held-out rows can follow the seed
        majority[task] = {"share": statistics.fmean(share for share, _ in shares), "rows": shares[0][1]}
    machines = sorted({r["machine"] for r in records.values() if r.get("machine")})
    meta = {"preset": preset_name, "preset_file": str(preset_path), "machine": describe_machine(),
            "stage_machines": machines,
            "command": "python scripts/reproduce.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "seeds": task_seeds, "pretrain_seed": pretrain_seed, "majority": majority,
            "seconds": sum(r["seconds"] for r in records.values()), "stages": len(stages),
            "stages_done": len(records)}
    report = {"meta": meta, "paper_table2": PAPER_TABLE2, **results}
    (output_dir / "results.json").write_text(json.dumps(report, indent=2))
    write_records(stages, records, output_dir, carried)
    markdown = render_markdown(preset_name, preset, results, meta)
    (output_dir / "results.md").write_text(markdown + "\n")
    plot(preset, results, meta, output_dir / "results.png")
    print(markdown)
    print(f"Wrote {output_dir / 'results.json'}, results.md and results.png")
    return report
