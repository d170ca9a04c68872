"""The stages of a reproduction: planning, running each as a subprocess, reusing finished ones, and records.

A stage is one run of scripts/pretrain.py or scripts/finetune.py writing its own folder. A stage whose folder holds
its finished result and a stage.json with the same arguments and inputs (a digest of the config files, models and
tokenizer it read) is reused; one finished with other arguments or inputs is an error, never silently mixed in.
records.json keeps every finished stage's record, so a later run elsewhere can take them instead of running them.
"""

import hashlib
import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.measuring import describe_hardware, describe_machine
from hf_linear_attn.training.data import load_text_corpus, train_bpe_tokenizer

from .preset import (
    TASK_TITLES, ReproductionError, _flags, _merged_config, _read_json, finetune_seeds, project_root, resolve, slug,
)


def recorded_project(record: dict) -> str | None:
    """The root of the checkout a stage record was written in: its "project", or for a record written before that
    was kept, the folder above the scripts/ folder its command ran. Without it a record's paths inside that checkout
    (the checkpoint installed in its .venv) matched only a checkout at the same path, so a run from a clone elsewhere
    (a git worktree, CI's clone) took none of the committed records and could not rewrite their table."""
    if record.get("project"):
        return record["project"]
    try:
        words = shlex.split(record.get("command", ""))
    except ValueError:
        return None
    scripts = [Path(word) for word in words if word.endswith(".py") and Path(word).parent.name == "scripts"]
    return str(scripts[0].parent.parent) if scripts and scripts[0].is_absolute() else None


@dataclass
class Stage:
    """One subprocess of the reproduction: `script` with `argv`, finished when `folder / marker` exists. `root` is
    the run's output folder, `project` the project root that the script and the argument paths are relative to."""

    name: str
    script: str
    folder: Path
    argv: list[str]
    marker: str
    root: Path
    project: Path
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

    def portable(self, argv: list[str], root: str | None = None, project: str | None = None) -> list[str]:
        """argv with the run's output folder written as $OUTPUT_DIR, then the project root as $PROJECT (an installed
        checkpoint inside the project's .venv, say): a moved results folder or checkout is still reused. `project`:
        the root of the checkout a record was written in, where it is not this one's (`recorded_project`)."""
        root = str(root or self.root)
        projects = [str(self.project)] + ([str(project)] if project and str(project) != str(self.project) else [])
        portable = []
        for arg in argv:
            arg = arg.replace(root, "$OUTPUT_DIR")
            for folder in projects:
                arg = arg.replace(folder, "$PROJECT")
            portable.append(arg)
        return portable

    def ran_with_these_arguments(self, record: dict) -> bool:
        """Whether a stage record (or launch record) was written for this stage's arguments, wherever its output
        folder and checkout were."""
        recorded = self.portable(record.get("argv", []), record.get("output_dir"), recorded_project(record))
        return recorded == self.portable(self.argv)

    def inputs(self, known: dict[str, str] | None = None) -> dict[str, str]:
        """A digest of every file the arguments name, keyed by the portable argument: config files, and the
        weights and tokenizer of a model / tokenizer folder. A config edited in place or an upstream model trained
        again changes it, so the stage is no longer taken as finished. `known` gives the digest of model folders
        that this run knows only from the records of an earlier one (portable folder -> digest)."""
        digests = {}
        for arg, key in zip(self.argv, self.portable(self.argv)):
            path = resolve(arg, self.project)
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
        if not self.ran_with_these_arguments(record):
            return None
        return record if record.get("inputs") == self.inputs(known) else None

    def finished(self) -> dict | None:
        """The stage's record when it has finished with these arguments and inputs; an error when with others."""
        if not (self.folder / self.marker).is_file():
            return None
        if not self.record_path.is_file():
            self.adopt()
        record = _read_json(self.record_path, "the stage record")
        if not self.ran_with_these_arguments(record):
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
        if pending is None or not self.ran_with_these_arguments(pending):
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


def shared_tokenizers(preset: dict, output_dir: Path, train: bool) -> dict:
    """{"mlm": folder, "clm": folder} for each objective whose config names no tokenizer: a byte-level BPE trained
    once on that config's corpus (when `train`), shared by every model of the objective. Configs that name a
    tokenizer (the paper preset: RoBERTa's / GPT-2's) pass it themselves.

    The preset's "mask_lstrip" (default true) is passed to `train_bpe_tokenizer`: false keeps `<mask>` without
    RoBERTa's lstrip, the tokenizer that the committed records of the cpu and demo presets were made with. It is no
    stage argument: only the tokenizer it gives enters the stages' inputs (its folder digest), and with false that
    tokenizer.json is byte for byte the one the records hold, so they stay valid. A tokenizer folder already trained
    with the other setting is refused rather than silently kept."""
    mask_lstrip = preset.get("mask_lstrip", True)
    tokenizers = {}
    for key, part, models, style in (("mlm", "pretrain", "encoders", "roberta"),
                                     ("clm", "decoder_pretrain", "decoders", "gpt2")):
        if not preset.get(models):
            continue
        merged = _merged_config(preset[part], project_root(preset))
        if merged.get("tokenizer_name_or_path"):
            continue
        folder = output_dir / f"tokenizer-{key}"
        tokenizers[key] = str(folder)
        if (folder / "tokenizer.json").is_file():
            if style == "roberta":
                _check_mask_lstrip(folder, mask_lstrip)
            continue
        if not train:
            continue
        corpus, _ = load_text_corpus(merged.get("dataset_name"), merged.get("dataset_config_name"),
                                     merged.get("train_file"), merged.get("validation_file"),
                                     merged.get("text_column", "text"),
                                     merged.get("validation_split_percentage", 5.0), merged.get("seed", 42))
        tokenizer = train_bpe_tokenizer(corpus["train"]["text"], merged.get("tokenizer_vocab_size", 8000), style,
                                        merged.get("max_seq_length", 128), mask_lstrip=mask_lstrip)
        partial = folder.with_name(folder.name + ".partial")
        tokenizer.save_pretrained(partial)
        partial.replace(folder)
    return tokenizers


def _check_mask_lstrip(folder: Path, wanted: bool) -> None:
    """An error when the tokenizer already in `folder` declares `<mask>` with the other lstrip than the preset's
    "mask_lstrip" (e.g. a folder trained before the option, run again with a preset that leaves it at true)."""
    added = _read_json(folder / "tokenizer.json", "the shared tokenizer").get("added_tokens", [])
    found = next((token.get("lstrip", False) for token in added if token.get("content") == "<mask>"), None)
    if found is not None and found != wanted:
        raise ReproductionError(
            f"{folder} holds a tokenizer whose <mask> has lstrip={str(found).lower()}, but the preset asks for "
            f"\"mask_lstrip\": {str(wanted).lower()}; set \"mask_lstrip\": {str(found).lower()} in the preset to "
            "go on with the stages trained on it, or remove the folder and the stages that used it (or use another "
            "--output_dir) to train them again")


def finetune_stage(name: str, task: str, entry: dict, model_folder: Path, seed: int, output_dir: Path,
                   project: Path) -> Stage:
    """The stage that fine-tunes model `name` (its checkpoint in `model_folder`) on `task` with `seed`, as the preset's
    finetune `entry` says (its config file and argument overrides), into finetune/<model>/<task>-seed<S>/."""
    tuned = output_dir / "finetune" / slug(name) / f"{task}-seed{seed}"
    argv = ["--config", entry["config"], "--model_name_or_path", str(model_folder), "--output_dir", str(tuned),
            "--seed", str(seed), *_flags(entry.get("args", {}))]
    return Stage(f"fine-tune {name} on {TASK_TITLES[task]} (seed {seed})", "scripts/finetune.py", tuned, argv,
                 "eval_results.json", output_dir, project, {"kind": "finetune", "model": name, "task": task, "seed": seed})


def plan(preset: dict, output_dir: Path, seeds: list[int] | None = None,
         tokenizers: dict | None = None) -> list[Stage]:
    """Every stage of the preset, in running order (each encoder's pretraining before its fine-tunes); `seeds`,
    where given, replaces every task's fine-tuning seeds."""
    tokenizers = tokenizers or {}
    task_seeds = finetune_seeds(preset, seeds)
    project = project_root(preset)
    stages = []
    for name, model_config in preset.get("encoders", {}).items():
        folder = output_dir / "pretrain" / slug(name)
        argv = ["--config", preset["pretrain"]["config"], "--model_config", model_config, "--output_dir", str(folder),
                *(["--tokenizer_name_or_path", tokenizers["mlm"]] if "mlm" in tokenizers else []),
                *_flags(preset["pretrain"].get("args", {}))]
        stages.append(Stage(f"pretrain {name}", "scripts/pretrain.py", folder, argv, "train_results.json",
                            output_dir, project, {"kind": "pretrain", "model": name}))
        for task, entry in preset["finetune"].items():
            for seed in task_seeds[task]:
                stages.append(finetune_stage(name, task, entry, folder, seed, output_dir, project))
    for name, model_config in preset.get("decoders", {}).items():
        folder = output_dir / "decoders" / slug(name)
        argv = ["--config", preset["decoder_pretrain"]["config"], "--model_config", model_config,
                "--output_dir", str(folder),
                *(["--tokenizer_name_or_path", tokenizers["clm"]] if "clm" in tokenizers else []),
                *_flags(preset["decoder_pretrain"].get("args", {}))]
        stages.append(Stage(f"pretrain decoder {name}", "scripts/pretrain.py", folder, argv, "train_results.json",
                            output_dir, project, {"kind": "decoder", "model": name}))
    for name, entry in preset.get("decoder_conversions", {}).items():
        teacher = output_dir / "decoders" / slug(entry["from"])
        folder = output_dir / "converted" / slug(name)
        argv = ["--model_name_or_path", str(teacher), "--output_dir", str(folder), *_flags(entry["args"])]
        stages.append(Stage(f"convert decoder {name}", "scripts/convert.py", folder, argv, "conversion_report.json",
                            output_dir, project, {"kind": "conversion", "model": name, "from": entry["from"]}))
        if "train" in entry:  # the whole converted model trained further with the decoders' recipe
            trained = output_dir / "converted" / f"{slug(name)}-trained"
            argv = ["--config", preset["decoder_pretrain"]["config"], "--model_name_or_path", str(folder),
                    "--output_dir", str(trained),
                    *_flags({**preset["decoder_pretrain"].get("args", {}), **entry["train"]})]
            stages.append(Stage(f"train converted decoder {name}", "scripts/pretrain.py", trained, argv,
                                "train_results.json", output_dir, project,
                                {"kind": "conversion_train", "model": name, "from": entry["from"]}))
    return stages


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").replace("\r", "\n").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def relaunch_flags(stage: Stage) -> list[str]:
    """What a stage's script is launched with beyond its arguments: nothing in an empty folder; in the folder of an
    interrupted run, the flag that goes on from its newest checkpoint (pretrain.py's --resume over checkpoints/step_N,
    finetune.py's --resume_from_checkpoint True over Trainer's checkpoint-N, which a fine-tune saves where its
    arguments set --save_steps), else --overwrite_output_dir: the stage starts again."""
    if not (stage.folder.exists() and any(stage.folder.iterdir())):
        return []
    if stage.script.endswith("pretrain.py"):
        checkpoints = stage.folder / "checkpoints"
        if checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir()):
            return ["--resume"]
    if stage.script.endswith("finetune.py") and any(
            p.is_dir() and p.name.startswith("checkpoint-") for p in stage.folder.iterdir()):
        return ["--resume_from_checkpoint", "True"]
    return ["--overwrite_output_dir"]


def run_stage(stage: Stage, launcher: list[str]) -> tuple[dict, bool]:
    """Run the stage unless it has finished with the same arguments; returns (its record, whether it was reused)."""
    record = stage.finished()
    if record is not None:
        return record, True
    inputs = stage.inputs()
    extra = relaunch_flags(stage)
    resumed = bool(extra) and extra[0] != "--overwrite_output_dir"
    command = [*launcher, str(stage.project / stage.script), *stage.argv, *extra]
    log = stage.log_file(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    # seconds of earlier, interrupted attempts that this one resumes count towards the stage's wall time
    spent_file = stage.log_file(".seconds")
    earlier = float(spent_file.read_text()) if resumed and spent_file.is_file() else 0.0
    record = {"argv": stage.argv, "inputs": inputs, "output_dir": str(stage.root), "project": str(stage.project),
              "resumed": resumed, "command": shlex.join(command), "machine": describe_machine(),
              "hardware": describe_hardware()}
    _write_json(stage.pending_path, record)  # what a result found here without stage.json was made with
    started = time.perf_counter()
    try:
        with open(log, "a") as handle:
            handle.write(f"$ {shlex.join(command)}\n")
            handle.flush()
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
            code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=stage.project,
                                  env=env).returncode
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
    metrics, and for a pretraining, a conversion or a fine-tune that a later stage starts from (info "upstream") the
    digest of the weights it wrote and their parameter count. With these a records file stands for the stage in a
    run that does not have its folder."""
    record = dict(record)
    if "result" not in record:
        record["result"] = _read_json(stage.folder / stage.marker, "the stage's results")
    if "curve" not in record and (stage.folder / "trainer_state.json").is_file():
        curve = training_curve(stage.folder / "trainer_state.json")
        if len(curve) > 1:  # scored during training, not only at the end
            record["curve"] = curve
    if (stage.script.endswith(("pretrain.py", "convert.py")) or stage.info.get("upstream")) \
            and "output_digest" not in record:
        record["output_digest"] = folder_digest(stage.folder)
        record["parameters"] = count_parameters(stage.folder)
    return record


def training_curve(path: Path) -> list[dict]:
    """The evaluations a Trainer run logged (trainer_state.json's log_history): per evaluation its step and its
    eval_* metrics, without the timings. Nothing from a file that does not read as a trainer state (one a stopped launch
    left empty): the curve is an extra of the record, the stage's result is its results file."""
    try:
        history = json.loads(Path(path).read_text()).get("log_history", [])
    except (OSError, ValueError, AttributeError):
        return []
    timing = ("_runtime", "_per_second", "_model_preparation_time")
    return [{"step": entry["step"], **{key: value for key, value in entry.items()
                                        if key.startswith("eval_") and not key.endswith(timing)}}
            for entry in history if "eval_loss" in entry]


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


def rerun_upstream(upstream: Stage, launcher: list[str], known: dict, vouched: set, fix: str, run=None) -> dict:
    """Run again a stage whose weights this run knows only from an earlier run's records (`known`: its key -> the
    recorded weight digest), because a stage that reads them has to run here; returns its new record. Where records
    taken from the archive started from those weights (`vouched`), the new weights must have the recorded digest:
    else those records and the stages run here would not share a starting point, an error naming `fix`. `run` runs
    the stage (default `run_stage`)."""
    rerun, _ = (run or run_stage)(upstream, launcher)  # a new record has its outcome
    if upstream.key in vouched and rerun["output_digest"] != known[upstream.key]:
        raise ReproductionError(
            f"'{upstream.name}' ran again here and wrote other weights than in the records (digest "
            f"{rerun['output_digest']}, recorded {known[upstream.key]}), so the stages taken from the records did not "
            f"start from these weights; {fix}, or run on the machine kind the records name")
    del known[upstream.key]
    return rerun


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
                records[upstream.name] = rerun_upstream(upstream, launcher, known, vouched, "rerun without --records")
            record, source = run_stage(stage, launcher)[0], "done"
        if source == "from records" and "output_digest" in record:
            known[stage.key] = record["output_digest"]
        records[stage.name] = record
        if not report_only:
            print(f"    {source} ({record['seconds']:.0f} s)", flush=True)
            write_records(stages, records, output_dir, carried)
    return records
