"""A small in-process stage runner: each finished stage's arguments, input digests and metrics are recorded, so a
run resumes stage by stage over several sittings.

    <output_dir>/stages/<key>.json   one finished stage (written to a temp file, then renamed: never half written)
    <output_dir>/records.json        every finished stage, rewritten the same way after each stage

A rerun reuses a finished stage whose arguments are identical and refuses one finished with other arguments; a
measurement recorded as `contended` (other jobs shared the cores), or one the caller's `retake` rejects, is taken
again, and the new record replaces it.
"""

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_linear_attn.training.errors import UsageError


class StageFailed(RuntimeError):
    """A stage that could not produce a result this time (an error, not a finding): not recorded, retried next run."""


@dataclass
class Stage:
    key: str  # unique, file-name safe: "listops/roberta_sdpa", "efficiency/linear_elu-n4096", ...
    kind: str  # "classify", "copy" or "efficiency"
    args: dict  # everything the result depends on (json-serialisable)
    digests: dict = field(default_factory=dict)  # filled in when the stage's inputs are built
    options: dict = field(default_factory=dict)  # how it runs, not what it computes (checkpoint_every): not compared


def write_atomic(path: Path, text: str) -> None:
    """Write text to path through a temp file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def stage_file(output_dir: Path, key: str) -> Path:
    return output_dir / "stages" / (key.replace("/", "__") + ".json")


def checkpoint_file(output_dir: Path, key: str) -> Path:
    """Where a stage that checkpoints keeps its last checkpoint until it is recorded."""
    return output_dir / "checkpoints" / (key.replace("/", "__") + ".pt")


def checkpoint_scores_file(output_dir: Path, key: str) -> Path:
    """Where the held-out scores of a running stage's checkpoint are kept (runner.evaluate_running_copies), with
    the step they were taken at, until the stage is recorded."""
    return checkpoint_file(output_dir, key).with_suffix(".eval.json")


def stage_machines(records: dict, fallback: str) -> str:
    """The machines (measuring.describe_machine) the recorded stages ran on, joined; `fallback` where none has run."""
    return "; ".join(sorted({r["machine"] for r in records.values() if r.get("machine")})) or fallback


def load_records(output_dir: Path) -> dict:
    """Finished stages by key: records.json, where a stage file finished later wins (a stage taken again while
    records.json was not rewritten: an interrupted rewrite, or another process's run)."""
    path = output_dir / "records.json"
    records = json.loads(path.read_text()) if path.is_file() else {}
    for file in sorted((output_dir / "stages").glob("*.json")) if (output_dir / "stages").is_dir() else []:
        record = json.loads(file.read_text())
        known = records.get(record["key"])
        if known is None or record["finished"] >= known["finished"]:  # "YYYY-mm-dd HH:MM:SS" sorts by time
            records[record["key"]] = record
    return records


def check_reuse(stage: Stage, records: dict, output_dir: Path) -> dict | None:
    """The finished record of this stage if its arguments match; None if not yet run; an error if they differ."""
    record = records.get(stage.key)
    if record is None:
        return None
    if record["args"] != json.loads(json.dumps(stage.args)):
        changed = sorted(k for k in set(record["args"]) | set(stage.args)
                         if record["args"].get(k) != json.loads(json.dumps(stage.args.get(k))))
        raise UsageError(f"stage {stage.key} already finished in {output_dir} with other arguments (changed: "
                         f"{', '.join(changed)}); use another --output_dir, or delete {stage_file(output_dir, stage.key)} "
                         "and its entry in records.json to run it again")
    return record


def run_stages(stages: list[Stage], run, output_dir: Path, machine: str, log=print, retake=None,
               hardware: dict | None = None) -> dict:
    """Run each stage not yet finished with `run(stage) -> metrics`, recording it (with `machine` and, where given,
    `hardware`: measuring.describe_hardware); returns every record. A finished record is taken again when its metrics
    say `contended` or `retake(record)` is true. A stage's checkpoint (`checkpoint_file`) is deleted once its record
    is on disk, as is any left by a run killed in between."""
    records = load_records(output_dir)
    for index, stage in enumerate(stages, 1):
        earlier = check_reuse(stage, records, output_dir)
        if earlier is not None and not (earlier["metrics"].get("contended") or (retake and retake(earlier))):
            log(f"[{index}/{len(stages)}] {stage.key}: finished earlier, reused")
            continue
        if earlier is not None:  # a measurement disturbed by other jobs: measure again, the new one replaces it
            log(f"[{index}/{len(stages)}] {stage.key}: measured under contention earlier, measuring again")
        log(f"[{index}/{len(stages)}] {stage.key}: running")
        start = time.perf_counter()
        try:
            metrics = run(stage)
        except StageFailed as error:
            log(f"[{index}/{len(stages)}] {stage.key}: FAILED, not recorded (rerun to retry): {error}")
            continue
        record = {"key": stage.key, "kind": stage.kind, "args": json.loads(json.dumps(stage.args)),
                  "digests": stage.digests, "metrics": metrics, "seconds": time.perf_counter() - start,
                  "machine": machine, **({"hardware": hardware} if hardware else {}),
                  "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
        write_atomic(stage_file(output_dir, stage.key), json.dumps(record, indent=1))
        # read again from disk, stage files and all: another process running other stages of this folder may have
        # finished some since this one started, and records.json and the report must keep them (this one's stage
        # file is on disk already); a run of two slices into one folder had dropped the other's row from its report
        records = {**load_records(output_dir), stage.key: record}
        write_atomic(output_dir / "records.json", json.dumps(records, indent=1))
        checkpoint_file(output_dir, stage.key).unlink(missing_ok=True)
        checkpoint_scores_file(output_dir, stage.key).unlink(missing_ok=True)
        log(f"[{index}/{len(stages)}] {stage.key}: done in {record['seconds']:.0f} s: "
            + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float))))
    for key in records:  # a recorded stage needs its checkpoint no more (one left by a run killed in between)
        checkpoint_file(output_dir, key).unlink(missing_ok=True)
        checkpoint_scores_file(output_dir, key).unlink(missing_ok=True)
    return records


def run_or_reload(stages: list[Stage], run, output_dir: Path, report_only: bool, log=print,
                  retake=None) -> tuple[dict, str]:
    """(records, machine) for a runner's report: every finished stage, after running the unfinished ones with
    `run_stages` (this machine and its hardware recorded with each), or as recorded when `report_only`."""
    from benchmarks.measuring import describe_hardware, describe_machine

    output_dir.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    if report_only:
        return load_records(output_dir), machine
    return run_stages(stages, run, output_dir, machine, log, retake=retake, hardware=describe_hardware()), machine


def whole_command(argv: list[str], slice_flags: tuple[str, ...]) -> list[str]:
    """The arguments of the command that runs the whole preset: argv without --report_only (and --eval_running, its
    companion) and the slice flags (``--models`` and the like, with their values), which is what a report of every
    finished stage covers."""
    out, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg.split("=")[0] in slice_flags
            if skipping or arg in ("--report_only", "--eval_running"):
                continue
        if not skipping:
            out.append(arg)
    return out
